"""FedLEASE's layer (Wang, Bian et al., NeurIPS 2025; lei-wang-link/FedLEASE peft/tuners/lora.py,
``adaptive=True``): M LoRA experts on a frozen linear and a router with 2M - 1 outputs.

  p = softmax(W_r x)                        over 2M - 1 logits, W_r bias-free
  logits 0..M-1 are experts 0..M-1; logits M..2M-2 all stand for the client's *own* expert g
  T = top-M of p, renormalised to sum 1      (each picked logit gives its weight to its expert)
  y = W x + sum_{j} (sum_{t in T, expert(t) = j} p_t) (alpha / r) B_j A_j x

With M - 1 extra logits for its own expert, a token always picks it at least once (M picks among
2M - 1, only M - 1 of them others'), and picks between 0 and M - 1 other experts: the "adaptive
top-M" selection. With M = 1 (the warm-up) the layer is one plain LoRA, as the authors' warm-up
clients (``lora_nums=1``, a one-output router whose softmax is 1).

The number of experts M is found by the server's clustering after the warm-up, so the layer has
``slots`` expert slots (the authors' ``max_clusters``) and a router over 2 slots - 1 outputs, and
``lease_state`` = (M, g), a frozen parameter that travels with the client's adapters: slots M..
and the router outputs beyond each group are unused (masked) until then.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import nn

from .lora import LoRAWeights, linear_dims, lora_dropout


@dataclass
class LeaseConfig:
    """The authors' main.py / client.py: r 4, alpha 16 (scaling alpha / r), dropout 0.05, on the
    attention's query and value (here q_proj and v_proj), at most 4 experts."""
    targets: list[str] = field(default_factory=lambda: ["q_proj", "v_proj"])
    r: int = 4
    alpha: float = 16.0
    dropout: float = 0.05
    slots: int = 4

    @property
    def scaling(self) -> float:
        return self.alpha / self.r


class LeaseLinear(nn.Module):
    """A frozen linear (``.base``) with ``slots`` LoRA experts ``lease_experts.<j>`` (each a
    parameter pair of its own, so that a client trains its own expert and no other: AdamW's
    decay would move a frozen slice of a shared tensor), the router ``lease_router`` and
    ``lease_state`` = (M, g)."""

    def __init__(self, base: nn.Module, cfg: LeaseConfig):
        super().__init__()
        d_in, d_out = linear_dims(base)
        self.base, self.cfg, self.slots = base, cfg, cfg.slots
        for p in self.base.parameters():
            p.requires_grad_(False)
        self.lease_experts = nn.ModuleList(LoRAWeights(d_in, d_out, cfg.r) for _ in range(cfg.slots))
        self.lease_router = nn.Linear(d_in, 2 * cfg.slots - 1, bias=False)
        self.lease_state = nn.Parameter(torch.tensor([1.0, 0.0]), requires_grad=False)  # (M, g): warm-up
        self.scaling = cfg.scaling
        self.dropout = lora_dropout(cfg.dropout)
        nn.init.kaiming_uniform_(self.lease_router.weight, a=math.sqrt(5))  # the authors' reset_parameters
        self.fixed_state: tuple[int, int] | None = None

    def fix_structure(self) -> None:
        """Read (M, g) once as Python ints: ``torch.export`` cannot branch on a parameter's value
        (an on-device export of the trained layer, comix/personal/device.py); training leaves it unset."""
        self.fixed_state = (int(self.lease_state[0]), int(self.lease_state[1]))

    def _state(self) -> tuple[int, int]:
        return self.fixed_state or (int(self.lease_state[0]), int(self.lease_state[1]))

    @property
    def weight(self):
        return self.base.weight

    def expert_weights(self, x: torch.Tensor) -> torch.Tensor:
        """(..., M): each expert's summed top-M weight per token."""
        m, own = self._state()
        if m == 1:
            return torch.ones(*x.shape[:-1], 1, dtype=x.dtype, device=x.device)
        # the router outputs of an M-expert layer: experts 0..M-1, then M - 1 for the own expert
        rows = list(range(m)) + list(range(self.slots, self.slots + m - 1))
        logits = x @ self.lease_router.weight[rows].t()
        p = torch.softmax(logits.float(), dim=-1)
        top, idx = p.topk(m, dim=-1)
        top = top / top.sum(-1, keepdim=True)
        expert_of = torch.tensor(list(range(m)) + [own] * (m - 1), device=x.device)
        return torch.zeros_like(p[..., :m]).scatter_add_(-1, expert_of[idx], top).to(x.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        m = self._state()[0]
        w = self.expert_weights(x)                                        # (..., M)
        a = torch.stack([e.lora_A for e in self.lease_experts[:m]])
        b = torch.stack([e.lora_B for e in self.lease_experts[:m]])
        h = torch.einsum("...d,erd->...er", self.dropout(x), a)  # every A_j x at once
        delta = torch.einsum("...er,eor->...o", h * w[..., None], b)
        return self.base(x) + delta * self.scaling
