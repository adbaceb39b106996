"""Centralized: one model trained on every user's training data (the unrealistic upper bound,
CoMiGS Sec. 4.2). Each step draws ``batch_size`` windows from *every* user (the paper's 64 x 4),
so all users weigh equally; the one model is tested on each user's test split."""
from .base import Algorithm


class Centralized(Algorithm):
    name = "centralized"
    pooled = True
