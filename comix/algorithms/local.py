"""Local: each user fine-tunes its own 2x LoRA modules on its own data; nothing leaves the device."""
from .base import Algorithm


class Local(Algorithm):
    name = "local"
    dp_refusal_reason = "it shares nothing: nothing leaves a device, so there is nothing to add noise to"
