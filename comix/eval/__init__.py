"""Evaluation: perplexity, routing statistics, communication accounting."""
from .perplexity import perplexity, split_nll

__all__ = ["perplexity", "split_nll"]
