"""FedProx's proximal term (Li et al., "Federated Optimization in Heterogeneous Networks", MLSys
2020, eq. 2): each local step adds mu/2 ||w - w^t||^2 over the parameters the method shares, w^t
their value at the round's start (the payload), so local training stays near the server's model;
``train.prox_mu`` sets mu (0: none). Both executors use these two functions (algorithms/base.py one
client at a time, algorithms/cohort.py a cohort, one term per client)."""
from __future__ import annotations

import torch
from torch import nn

from ..runtime import at_least_fp32


def proximal_anchor(named: list[tuple[str, nn.Parameter]], is_shared) -> list[tuple[nn.Parameter, torch.Tensor]]:
    """FedProx's anchor: each trained shared parameter with a detached copy of its value now, at
    the round's start (the payload it took); private parameters (specialists, routers, personal
    LoRA) have none, so the term never reaches them."""
    return [(p, at_least_fp32(p.detach().clone())) for n, p in named if is_shared(n)]


def proximal_term(anchor: list[tuple[nn.Parameter, torch.Tensor]], mu: float, clients: int = 1) -> torch.Tensor:
    """mu/2 x the squared distance of the shared parameters from their anchor (FedProx, eq. 2); for
    a cohort (parameters stacked on a client axis) one term per client, shape (clients,)."""
    if clients > 1:
        return mu / 2 * sum((at_least_fp32(p) - a).pow(2).reshape(clients, -1).sum(1) for p, a in anchor)
    return mu / 2 * sum((at_least_fp32(p) - a).pow(2).sum() for p, a in anchor)
