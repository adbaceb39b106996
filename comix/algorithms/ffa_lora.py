"""FFA-LoRA (Sun et al., ICLR 2024): every LoRA A is frozen at its random initialisation, which
is *the same on every client* (one seed); only B is trained and averaged (uniform FedAvg). With A
fixed and shared, averaging the Bs averages the updates dW = B A exactly (no aggregation error).
2x LoRA modules, as Local and FedAvg, to match CoMiGS-1G1S's parameter count (A included)."""
from .base import Algorithm


def _is_b(name: str) -> bool:
    return name.endswith("lora_B")


class FFALoRA(Algorithm):
    name = "ffa-lora"
    common_init = True

    def is_shared(self, name: str) -> bool:
        return _is_b(name)

    def train_params(self, model):
        return [(n, p) for n, p in super().train_params(model) if _is_b(n)]
