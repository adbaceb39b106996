"""Partition helpers below every data module (instruction sets and token corpora both use them)."""
from __future__ import annotations

import torch


def dirichlet_mixtures(n_clients: int, n_categories: int, alpha: float, rng: torch.Generator) -> torch.Tensor:
    """(clients, categories): row i ~ Dirichlet(alpha * 1_C), client i's mixture of categories."""
    concentration = torch.full((n_clients, n_categories), float(alpha), dtype=torch.float64)
    gammas = torch._standard_gamma(concentration, generator=rng).clamp_min(1e-300)
    return gammas / gammas.sum(1, keepdim=True)
