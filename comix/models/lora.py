"""LoRA on a frozen linear layer (``nn.Linear`` or GPT-2's ``Conv1D``).

W = W0 + gamma * B A with gamma = alpha / sqrt(r): the rank-stabilised scaling of
Kalajdzievski (2023) that CoMiGS uses (paper App. B.1, eq. 9). A is kaiming-uniform and B is
zero, so an adapter starts as the identity edit (as in PEFT).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn
from transformers.pytorch_utils import Conv1D

from ..runtime import at_least_fp32


@dataclass
class LoRAConfig:
    r: int = 8                  # rank
    alpha: float = 16.0         # scaling numerator (alpha / sqrt(r), or alpha / r without rslora)
    dropout: float = 0.0        # dropout on the LoRA input
    # "2x LoRA modules" (CoMiGS Sec. 4.2): m summed rank-r modules == one rank m*r module with
    # the rank-r scaling, so `modules` multiplies the rank but not the scaling's sqrt(r).
    modules: int = 1
    # alpha / sqrt(r) (rank-stabilised, CoMiGS App. B.1) or alpha / r (PEFT's default, which
    # FedAMoLE's reference code and its FedIT baseline use)
    rslora: bool = True

    def __post_init__(self):
        if self.r < 1:
            raise ValueError(f"lora.r must be >= 1, got {self.r}")
        if self.modules < 1:
            raise ValueError(f"lora.modules must be >= 1, got {self.modules}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"lora.dropout must be in [0, 1), got {self.dropout}")

    @property
    def rank(self) -> int:
        return self.r * self.modules

    @property
    def scaling(self) -> float:
        return self.alpha / (math.sqrt(self.r) if self.rslora else self.r)


def linear_dims(layer: nn.Module) -> tuple[int, int]:
    """(in_features, out_features) of a Linear (or a quantised one: bitsandbytes' subclass it,
    HQQ's HQQLinear does not) or a GPT-2 Conv1D (whose weight is in x out)."""
    if isinstance(layer, nn.Linear) or type(layer).__name__ == "HQQLinear":
        return layer.in_features, layer.out_features
    if isinstance(layer, Conv1D):
        return layer.weight.shape[0], layer.weight.shape[1]
    raise TypeError(f"LoRA needs nn.Linear or Conv1D, got {type(layer).__name__}")


def client_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x @ weight.T`` where ``weight`` is one (out, in) matrix, or one per client (C, out, in)
    applied to the C equal client-major parts of ``x``'s leading axes (rows of client c times
    client c's matrix: one batched product, no loop over clients)."""
    if weight.dim() == 2:
        return x @ weight.t()
    clients = weight.shape[0]
    rows = x.reshape(clients, -1, x.shape[-1])
    return torch.bmm(rows, weight.transpose(1, 2)).reshape(*x.shape[:-1], weight.shape[1])


class LoRADropout(nn.Module):
    """Dropout on a LoRA input (PEFT's ``lora_dropout``): x * m / (1 - p), m ~ Bernoulli(1 - p),
    drawn by ``bernoulli_`` as torch's CPU dropout draws it (``at::native::dropout``: one
    ``bernoulli_`` over a tensor shaped as x from the default generator), so a run one client at a
    time draws the masks nn.Dropout drew on the CPU. In a cohort (algorithms/cohort.py) ``draws``
    holds each client's own generator and width: client c's mask is drawn from its generator at the
    shape its own batch has alone, in the same order of layers, so each client sees the masks of its
    own turn (a fused CUDA dropout would draw other numbers, and one generator for all clients would
    deal each client another's masks)."""

    def __init__(self, p: float):
        super().__init__()
        self.p = p
        self.draws: CohortDraws | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0:
            return x
        mask = torch.empty_like(x).bernoulli_(1 - self.p) if self.draws is None else self.draws.mask(x, 1 - self.p)
        return x * mask.div_(1 - self.p)

    def extra_repr(self) -> str:
        return f"p={self.p}"


@dataclass
class CohortDraws:
    """Each cohort client's dropout generator and its batch's own width (tokens a row before the
    cohort's padding), and the cohort batch's rows and width (``rows`` x ``wide``, client-major, equal
    in number per client). A layer sees the batch as (rows, wide, ...) or, a mixture's MLP, its
    tokens flattened, (rows x wide, ...): both read as (rows, wide, ...), client c's own tokens the
    first ``widths[c]`` of each of its rows; any other layout is refused, not guessed."""
    generators: list
    widths: list[int]
    rows: int = 0
    wide: int = 0

    def mask(self, x: torch.Tensor, keep: float) -> torch.Tensor:
        if tuple(x.shape[:2]) == (self.rows, self.wide):
            batch = x
        elif x.shape[0] == self.rows * self.wide:
            batch = x.view(self.rows, self.wide, *x.shape[1:])
        else:
            raise RuntimeError(f"LoRA dropout in a cohort of {self.rows} x {self.wide} tokens got an input of "
                               f"shape {tuple(x.shape)}: its rows cannot be told apart by client")
        mask = torch.ones_like(batch)
        rows = self.rows // len(self.generators)
        for c, (gen, width) in enumerate(zip(self.generators, self.widths)):
            own = torch.empty((rows, width, *batch.shape[2:]), dtype=x.dtype, device=x.device)
            mask[c * rows:(c + 1) * rows, :width] = own.bernoulli_(keep, generator=gen)
        return mask.view(x.shape)


def lora_dropout(p: float) -> nn.Module:
    return LoRADropout(p) if p > 0 else nn.Identity()


class LoRAWeights(nn.Module):
    """The two low-rank factors of one adapter: ``lora_A`` (rank x in), ``lora_B`` (out x rank)."""

    def __init__(self, in_features: int, out_features: int, rank: int):
        super().__init__()
        self.lora_A = nn.Parameter(torch.empty(rank, in_features))
        self.lora_B = nn.Parameter(torch.zeros(out_features, rank))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))
        nn.init.zeros_(self.lora_B)

    def delta(self, x: torch.Tensor, scaling: float) -> torch.Tensor:
        # factors stacked on a client axis (a cohort: models/cohort.py): each client's rows by its own factors
        return client_linear(client_linear(x, self.lora_A), self.lora_B) * scaling


class LoRALinear(nn.Module):
    """A frozen linear layer plus one LoRA adapter; the frozen layer stays at ``.base``.

    ``personal=True`` adds a second adapter ``lora_local`` and mixing weights (w_0, w_1) of the
    two: y = base(x) + w_0 * lora(x) + w_1 * lora_local(x) (FDLoRA's dual LoRA, FedDPA's global
    and local adapters, FedALT's rest-of-world and local LoRA). The weights are
      * ``lora_fusion``, a frozen parameter the algorithm sets (FDLoRA's black-box search), so
        they travel with the client's adapters; or, while an algorithm sets it,
      * ``instance_fusion``, not a parameter: one (w_0, w_1) for the call, per sequence (batch, 2)
        or per sequence and token (batch, tokens, 2) (FedDPA's instance-wise dynamic weighting); or
      * with ``mixer=True``, ``lora_mixer``: a bias-free linear map of the token to two logits,
        softmax per token (FedALT's adaptive mixer, lora_route in jmbian/FedALT peft/tuners/lora.py).
    ``merged=True`` adds ``lora_merged``, a frozen (out x in) matrix added to the base's output:
    what FLoRA's server merges into the global model each round (merge_and_unload in the authors'
    main.py), kept beside the base because the base is shared by every client of a process."""

    def __init__(self, base: nn.Module, cfg: LoRAConfig, personal: bool = False, mixer: bool = False,
                 merged: bool = False):
        super().__init__()
        in_f, out_f = linear_dims(base)
        self.base = base
        for p in self.base.parameters():
            p.requires_grad_(False)
        self.lora = LoRAWeights(in_f, out_f, cfg.rank)
        self.lora_local = LoRAWeights(in_f, out_f, cfg.rank) if personal else None
        self.lora_fusion = nn.Parameter(torch.ones(2), requires_grad=False) if personal and not mixer else None
        self.lora_mixer = nn.Linear(in_f, 2, bias=False) if personal and mixer else None
        if self.lora_mixer is not None:  # the authors' reset_parameters: kaiming-uniform, a = sqrt(5)
            nn.init.kaiming_uniform_(self.lora_mixer.weight, a=math.sqrt(5))
        self.lora_merged = nn.Parameter(torch.zeros(out_f, in_f), requires_grad=False) if merged else None
        self.instance_fusion: torch.Tensor | None = None
        self.scaling = cfg.scaling
        self.dropout = lora_dropout(cfg.dropout)

    @property
    def weight(self):  # some HF code reads `.weight` of projections (dtype/device checks)
        return self.base.weight

    def mixing(self, x: torch.Tensor) -> torch.Tensor:
        """(w_0, w_1) on the last axis, broadcastable against the output."""
        if self.lora_mixer is not None:  # softmax in fp32 as the authors' forward
            return torch.softmax(at_least_fp32(self.lora_mixer(x)), dim=-1).to(x.dtype)
        if self.instance_fusion is not None:  # (2,) | (batch, 2) -> (batch, 1, ..., 2) | (batch, tokens, 2)
            w = self.instance_fusion.to(x.dtype)
            return w.view(w.shape[0], *([1] * (x.dim() - 2)), 2) if w.dim() == 2 else w
        return self.lora_fusion

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xd = self.dropout(x)
        out = self.base(x)
        if self.lora_merged is not None:
            out = out + x @ self.lora_merged.t()
        if self.lora_local is None:
            return out + self.lora.delta(xd, self.scaling)
        w = self.mixing(x)
        return out + w[..., 0:1] * self.lora.delta(xd, self.scaling) + w[..., 1:2] * self.lora_local.delta(xd, self.scaling)
