"""FedAvg (McMahan et al. 2017) over LoRA: every adapter tensor is uploaded and averaged with
uniform weights (CoMiGS Sec. 4.2); 2x LoRA modules to match CoMiGS-1G1S's trainable size."""
from .base import Algorithm


class FedAvg(Algorithm):
    name = "fedavg"

    def is_shared(self, name: str) -> bool:
        return True
