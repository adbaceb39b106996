"""Engines: who runs the rounds (in-process by default)."""
from .inprocess import run_method

__all__ = ["run_method"]
