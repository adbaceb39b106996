"""Partition helpers below every data module (instruction sets and token corpora both use them)."""
from __future__ import annotations

import torch


def dirichlet_mixtures(n_clients: int, n_categories: int, alpha: float, rng: torch.Generator) -> torch.Tensor:
    """(clients, categories): row i ~ Dirichlet(alpha * 1_C), client i's mixture of categories."""
    concentration = torch.full((n_clients, n_categories), float(alpha), dtype=torch.float64)
    gammas = torch._standard_gamma(concentration, generator=rng).clamp_min(1e-300)
    return gammas / gammas.sum(1, keepdim=True)


def held_out(data, frac: float, seq_len: int, cap: int | None = None):
    """(training part, held-out part) of a client's training split: the last ``frac`` of its
    instruction examples (at most ``cap`` of them) or of its tokens (at least one window). The
    FedAMoLE authors carve this "aux" set off each client's training data (``--ratio_train_to_aux
    0.95,0.05``, capped at 200 examples in data/data_loader.py): FedAMoLE embeds it (Sec. IV-D),
    their FDLoRA fuses on it; neither trains on it."""
    if hasattr(data, "subset"):
        cut = len(data) - max(1, int(frac * len(data)))
        return data.subset(0, cut), data.subset(cut, None if cap is None else cut + cap)
    cut = len(data) - max(seq_len + 1, int(frac * len(data)))
    return data[:cut], data[cut:]
