"""What HetLoRA and FlexLoRA share: plain LoRA whose rank differs per user (resource
heterogeneity, CoMiGS Sec. 4.3), everything uploaded, and a common start cut from the largest
user's initialisation (each user's A holds the first r_i rows of it, B starts at zero).

``ranks`` lists one rank per user; the default gives everyone 2r, i.e. CoMiGS-1G1S's *active*
parameters (two rank-r experts per token). Table 2's "full" matching gives, e.g., 1GXS with
(2,2,4,4) experts of rank 8 the ranks (16,16,32,32).
"""
from __future__ import annotations

from ..models import AdapterConfig, LoRAConfig
from .base import Algorithm, Tensors


def lora_pairs(tensors: Tensors) -> dict[str, tuple[str, str]]:
    """prefix -> (A name, B name) for every LoRA in ``tensors``."""
    return {n[:-len("lora_A")]: (n, n[:-len("lora_A")] + "lora_B") for n in tensors if n.endswith("lora_A")}


def truncate(tensors: Tensors, rank: int) -> Tensors:
    """The first ``rank`` components: rows of A (r x in), columns of B (out x r)."""
    return {n: (t[:rank] if n.endswith("lora_A") else t[:, :rank]).clone() for n, t in tensors.items()}


class HeteroRank(Algorithm):
    lora_modules = 1

    def __init__(self, lora, train, n_clients, ranks: list[int] | None = None):
        super().__init__(lora, train, n_clients)
        self.ranks = list(ranks) if ranks else [2 * lora.r * lora.modules] * n_clients
        if len(self.ranks) != n_clients or any(r < 1 for r in self.ranks):
            raise ValueError(f"{self.section}.ranks must list one rank >= 1 per user ({n_clients}), got {self.ranks}")

    def adapter_config(self, client: int) -> AdapterConfig:
        lora = LoRAConfig(r=self.ranks[client], alpha=self.lora.alpha, dropout=self.lora.dropout)
        return AdapterConfig(lora=lora, mlp="lora")

    def scaling(self, client: int) -> float:
        return self.lora.alpha / self.ranks[client] ** 0.5

    def is_shared(self, name: str) -> bool:
        return True

    def server_init(self, initial: dict[int, Tensors]):
        widest = initial[max(range(self.n_clients), key=lambda c: self.ranks[c])]
        return None, {c: truncate(widest, self.ranks[c]) for c in range(self.n_clients)}

    @staticmethod
    def rank_of(tensors: Tensors) -> int:
        return next(t.shape[0] for n, t in tensors.items() if n.endswith("lora_A"))

