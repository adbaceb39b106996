"""Pretrained: the base checkpoint, no training (the lower reference of CoMiGS Table 1)."""
from .base import Algorithm


class Pretrained(Algorithm):
    name = "pretrained"
    trains = False
