"""What HetLoRA and FlexLoRA share: plain LoRA whose rank differs per user (resource
heterogeneity, CoMiGS Sec. 4.3), everything uploaded, and a common start cut from the largest
user's initialisation (each user's A holds the first r_i rows of it, B starts at zero).

``ranks`` lists one rank per user for the LoRA on the MLP linears, where CoMiGS puts its
experts; the attention LoRA keeps rank r for every user, as in 1GXS and in the authors' code
(epfml/CoMiGS models/model.py: attention lora_rank=8, expert_lora_ranks on the MLP), and is
averaged uniformly like FedAvg's. The default gives everyone 2r, i.e. CoMiGS-1G1S's parameters
(two rank-r experts per MLP). Table 2's "full" matching gives, e.g., 1GXS with (2,2,4,4)
experts of rank 8 the ranks (16,16,32,32).
"""
from __future__ import annotations

from ..models import AdapterConfig, LoRAConfig, param_role
from .base import Algorithm, Tensors


def is_hetero(name: str) -> bool:
    """Whether ``name`` is a LoRA factor of heterogeneous rank (the MLP's)."""
    return param_role(name) == "mlp_lora"


def lora_pairs(tensors: Tensors) -> dict[str, tuple[str, str]]:
    """prefix -> (A name, B name) for every heterogeneous-rank (MLP) LoRA in ``tensors``."""
    return {n[:-len("lora_A")]: (n, n[:-len("lora_A")] + "lora_B") for n in tensors
            if n.endswith("lora_A") and is_hetero(n)}


def truncate(tensors: Tensors, rank: int) -> Tensors:
    """The first ``rank`` components of each MLP LoRA: rows of A (r x in), columns of B (out x r);
    the attention LoRA (rank r for everyone) as it is."""
    return {n: (t if not is_hetero(n) else t[:rank] if n.endswith("lora_A") else t[:, :rank]).clone()
            for n, t in tensors.items()}


class HeteroRank(Algorithm):
    lora_modules = 1
    # HetLoRA / FlexLoRA: each client the MLP LoRA rank its resources allow (CoMiGS Table 2: 16, 32)
    capacity = ("ranks", (8, 16, 32, 64))

    def __init__(self, lora, train, n_clients, ranks: list[int] | None = None):
        super().__init__(lora, train, n_clients)
        self.ranks = list(ranks) if ranks else [2 * lora.r] * n_clients
        if len(self.ranks) != n_clients or any(r < 1 for r in self.ranks):
            raise ValueError(f"{self.section}.ranks must list one rank >= 1 per user ({n_clients}), got {self.ranks}")

    def adapter_config(self, client: int) -> AdapterConfig:
        attention = LoRAConfig(r=self.lora.r, alpha=self.lora.alpha, dropout=self.lora.dropout)
        mlp = LoRAConfig(r=self.ranks[client], alpha=self.lora.alpha, dropout=self.lora.dropout)
        return AdapterConfig(lora=attention, mlp="lora", mlp_lora=mlp)

    def scaling(self, client: int) -> float:
        """The MLP LoRA's scaling alpha / sqrt(r_k) of client k."""
        return self.lora.alpha / self.ranks[client] ** 0.5

    def is_shared(self, name: str) -> bool:
        return True

    def server_init(self, initial: dict[int, Tensors]):
        widest = initial[max(range(self.n_clients), key=lambda c: self.ranks[c])]
        return None, {c: truncate(widest, self.ranks[c]) for c in range(self.n_clients)}

    @staticmethod
    def rank_of(tensors: Tensors) -> int:
        return next(t.shape[0] for n, t in tensors.items() if n.endswith("lora_A") and is_hetero(n))

