"""Local: each user fine-tunes its own 2x LoRA modules on its own data; nothing leaves the device."""
from .base import Algorithm


class Local(Algorithm):
    name = "local"
