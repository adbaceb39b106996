"""FedSA-LoRA (Guo et al. 2024): the A matrices learn general knowledge and are averaged
(uniform FedAvg) every round; the B matrices capture client-specific knowledge and never leave
the device. Both are trained locally; 2x LoRA modules as Local and FedAvg."""
from .base import Algorithm


class FedSALoRA(Algorithm):
    name = "fedsa-lora"

    def is_shared(self, name: str) -> bool:
        return name.endswith("lora_A")
