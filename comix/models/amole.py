"""FedAMoLE's AMoLE module on one frozen linear layer (journal version Sec. IV-B, eq. 8-15, 19-20).

  e_j = A_j h                  expert embedding of each *assigned* domain expert j   (eq. 8)
  t   = W_t h                  token embedding, W_t: r x d                           (eq. 9)
  p_j = softmax_j(t . e_j / sqrt(d))  over the assigned experts                      (eq. 10)
  y   = W h + s B_s A_s h + sum_{j in top-k_e(p)} p_j s B_j A_j h                    (eq. 12-15)
with the LoRA scaling s = alpha / r (PEFT's LoRA, which the reference code zyc140345/FedAMoLE
model/mole/layer.py builds on; CoMiGS uses alpha / sqrt(r)). The weights p_j are the softmax
over *all* assigned experts (eq. 15); the reference renormalises them over the top-k
(``renormalize=True``). ``score_scale="r"`` divides by sqrt(r) instead of sqrt(d), as the
reference does; the paper's sqrt(d) is the default. The load balance (eq. 19-20) counts each
token's top-1 expert; the reference counts all top-k selections.

A client holds between k_e and b domain experts per module and the set changes every round
(RSEA), so the layer has ``b`` expert *slots*: stacked factors ``expert_A`` (b, r, d_in) and
``expert_B`` (b, d_out, r); ``n_active`` slots are in use and ``slot_ids`` says which global
expert (0..E-1) sits in each. The algorithm moves experts between slots and global-id names.
All active experts are computed together, never in a Python loop over experts: one matmul
gives every A_j h (stacked A), one matmul with the stacked B sums the gated corrections. A
per-expert loop (``fused=False``) is kept as the reference the tests compare against.

``router="vanilla"`` is the FedAMoLE-A ablation: a linear router over the whole pool of E
experts (d -> E logits), masked to the assigned experts before the softmax.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from ..runtime import at_least_fp32
from .lora import LoRAWeights, client_linear, linear_dims, lora_dropout
from .mixture import MixtureOfLoRA, Routing


@dataclass
class AMoLEConfig:
    """Journal Sec. V-A-4: r = 8, alpha = 16, dropout 0.05, k_e = 2, pool of 30 experts per
    module, at most b = 8 per client; AMoLE on q and v of every attention block."""
    targets: list[str] = field(default_factory=lambda: ["q_proj", "v_proj"])
    r: int = 8
    alpha: float = 16.0
    dropout: float = 0.05
    pool: int = 30              # E: domain experts per module, in total
    slots: int = 8              # b: most domain experts one client holds per module
    top_k: int = 2              # k_e
    shared: bool = True         # FedAMoLE-S ablation: False
    router: str = "amole"       # "amole" (eq. 10) | "vanilla" (FedAMoLE-A)
    score_scale: str = "d"      # "d" (paper) | "r" (reference code)
    renormalize: bool = False   # top-k weights renormalised to sum to 1 (reference code)

    def __post_init__(self):
        if self.router not in ("amole", "vanilla") or self.score_scale not in ("d", "r"):
            raise ValueError("fedamole.router must be amole|vanilla and fedamole.score_scale d|r")
        if not 1 <= self.top_k <= self.slots <= self.pool:
            raise ValueError(f"fedamole: need 1 <= k_e ({self.top_k}) <= b ({self.slots}) <= E ({self.pool})")

    @property
    def scaling(self) -> float:
        return self.alpha / self.r


class AMoLELinear(MixtureOfLoRA):
    """A frozen linear layer (kept at ``.base``) with a shared LoRA expert, a token projection
    and ``slots`` domain-expert slots of which ``n_active`` are in use."""

    def __init__(self, base: nn.Module, cfg: AMoLEConfig, fused: bool = True):
        d_in, d_out = linear_dims(base)
        super().__init__(d_in, cfg.slots, cfg.top_k, linear_router=False)
        self.base, self.cfg, self.fused = base, cfg, fused
        for p in self.base.parameters():
            p.requires_grad_(False)
        r = cfg.r
        self.shared = LoRAWeights(d_in, d_out, r) if cfg.shared else None
        self.expert_A = nn.Parameter(torch.empty(cfg.slots, r, d_in))
        self.expert_B = nn.Parameter(torch.zeros(cfg.slots, d_out, r))
        if cfg.router == "amole":
            self.token_proj = nn.Parameter(torch.empty(r, d_in))
            self.vanilla_router = None
        else:
            self.token_proj = None
            self.vanilla_router = nn.Linear(d_in, cfg.pool, bias=False)
        self.register_buffer("slot_ids", torch.full((cfg.slots,), -1, dtype=torch.long), persistent=False)
        self.held: torch.Tensor | None = None  # (C, b) in a cohort: which slots each client holds
        self.n_active = cfg.top_k
        self.scaling = cfg.scaling
        self.score_scale = math.sqrt(d_in if cfg.score_scale == "d" else r)
        self.dropout = lora_dropout(cfg.dropout)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        for a in self.expert_A:
            nn.init.kaiming_uniform_(a, a=math.sqrt(5))
        nn.init.zeros_(self.expert_B)
        if self.token_proj is not None:
            nn.init.kaiming_uniform_(self.token_proj, a=math.sqrt(5))

    @property
    def weight(self):  # HF code may read `.weight` of projections
        return self.base.weight

    def assign(self, ids: list[int]) -> None:
        """Put the global experts ``ids`` into the first slots (their factors are loaded by the caller)."""
        if not self.top_k <= len(ids) <= self.cfg.slots:
            raise ValueError(f"an AMoLE module takes {self.top_k}..{self.cfg.slots} experts, got {len(ids)}")
        if self.held is not None:
            raise RuntimeError("a cohort's AMoLE layer takes each client's experts through assign_clients")
        self.slot_ids.fill_(-1)
        self.slot_ids[:len(ids)] = torch.as_tensor(ids, dtype=torch.long)
        self.n_active = self.n_experts = len(ids)

    # -- a cohort (models/cohort.py) ----------------------------------------------------------------
    def stack(self, clients: int) -> None:
        """Give every trained tensor a leading axis of ``clients`` (this layer must be a cohort
        model's own copy: the tensors are replaced, not written)."""
        def stacked(p: torch.Tensor) -> nn.Parameter:
            return nn.Parameter(p.detach().unsqueeze(0).repeat(clients, *([1] * p.dim())))
        self.expert_A, self.expert_B = stacked(self.expert_A), stacked(self.expert_B)
        if self.token_proj is not None:
            self.token_proj = stacked(self.token_proj)
        else:
            self.vanilla_router.weight = stacked(self.vanilla_router.weight)
        self.slot_ids = torch.full((clients, self.cfg.slots), -1, dtype=torch.long, device=self.slot_ids.device)
        self.held = torch.zeros(clients, self.cfg.slots, dtype=torch.bool, device=self.slot_ids.device)
        self.n_active = self.n_experts = self.cfg.slots  # every slot computed, the empty ones masked

    def assign_clients(self, ids: list[list[int]]) -> None:
        """Client c's global experts ``ids[c]`` into its first slots (``assign``, per client)."""
        for c, held in enumerate(ids):
            if not self.top_k <= len(held) <= self.cfg.slots:
                raise ValueError(f"an AMoLE module takes {self.top_k}..{self.cfg.slots} experts, got {len(held)}")
            self.slot_ids[c].fill_(-1)
            self.slot_ids[c, :len(held)] = torch.as_tensor(held, dtype=torch.long)
            self.held[c] = torch.arange(self.cfg.slots, device=self.held.device) < len(held)

    @property
    def clients(self) -> int:
        return 1 if self.held is None else self.held.shape[0]

    def experts_of(self, client: int) -> int:
        """How many experts ``client`` holds (its gates are the first that many slots')."""
        return self.n_active if self.held is None else int(self.held[client].sum())

    # -- routing ----------------------------------------------------------------------------------
    def _active(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The occupied slots' factors: (n, r, d_in) and (n, d_out, r); in a cohort every slot's,
        with the client axis first."""
        n = self.n_active
        return self.expert_A.narrow(-3, 0, n), self.expert_B.narrow(-3, 0, n)

    def route(self, x: torch.Tensor) -> Routing:
        a, _ = self._active()
        n, r = a.shape[-3], a.shape[-2]
        if self.vanilla_router is None:
            emb = client_linear(x, a.reshape(*a.shape[:-3], n * r, -1)).reshape(-1, n, r)  # e_j = A_j h, all j
            scores = torch.einsum("tnr,tr->tn", emb, client_linear(x, self.token_proj)) / self.score_scale
        elif self.held is None:  # FedAMoLE-A: pool-wide logits, only the assigned experts' kept
            scores = self.vanilla_router(x)[:, self.slot_ids[:n]]
        else:
            logits = client_linear(x, self.vanilla_router.weight)
            logits = logits.reshape(self.clients, -1, logits.shape[-1])
            ids = self.slot_ids.clamp(min=0).unsqueeze(1).expand(-1, logits.shape[1], -1)
            scores = logits.gather(-1, ids).reshape(-1, n)
        if self.held is not None:  # a client's empty slots: no probability (its own softmax over n_active)
            scores = scores.reshape(self.clients, -1, n).masked_fill(~self.held.unsqueeze(1), float("-inf")).reshape(-1, n)
        probs = scores.softmax(-1)
        top_w, top_i = probs.topk(self.top_k, dim=-1)
        if self.cfg.renormalize:
            top_w = top_w / top_w.sum(-1, keepdim=True)
        return Routing(top_i, top_w, probs)

    # -- experts ----------------------------------------------------------------------------------
    def _experts_forward(self, x: torch.Tensor, routing: Routing) -> torch.Tensor:
        xd = self.dropout(x)
        y = self.base(x)
        if self.shared is not None:
            y = y + self.shared.delta(xd, self.scaling)
        return y + (self._fused(xd, routing) if self.fused else self._naive(xd, routing))

    def _fused(self, xd: torch.Tensor, routing: Routing) -> torch.Tensor:
        a, b = self._active()
        n, r = a.shape[-3], a.shape[-2]
        gates = routing.dense_gates(n)                                            # (T, n): p_j on top-k
        z = client_linear(xd, a.reshape(*a.shape[:-3], n * r, -1)).reshape(-1, n, r) * gates.unsqueeze(-1).to(xd.dtype)
        b_cat = b.transpose(-3, -2).reshape(*b.shape[:-3], b.shape[-2], n * r)    # (out, n*r) = [B_1 .. B_n]
        return client_linear(z.reshape(-1, n * r), b_cat) * self.scaling

    def _naive(self, xd: torch.Tensor, routing: Routing) -> torch.Tensor:
        assert self.held is None, "the per-expert reference computes one client's layer, not a cohort's"
        a, b = self._active()
        out = 0
        for j in range(a.shape[0]):
            w = (routing.topk_weight * (routing.topk_index == j)).sum(-1, keepdim=True)
            out = out + w * ((xd @ a[j].t()) @ b[j].t()) * self.scaling
        return out


def amole_load_balance(routing: Routing, n_experts: int) -> torch.Tensor:
    """Eq. 19-20 for one module: n * sum_j f_j P_j, f_j = share of tokens whose *top-1* expert is
    j, P_j = mean probability of j (the model's loss sums this over modules, weighted by beta)."""
    if routing.probs is None or n_experts < 2:
        return routing.topk_weight.new_zeros(())
    p = at_least_fp32(routing.probs)
    f = F.one_hot(routing.topk_index[:, 0], n_experts).to(p.dtype).mean(0)
    return n_experts * (f * p.mean(0)).sum()


def layer_load_balance(layer: AMoLELinear, own: torch.Tensor | None = None) -> torch.Tensor:
    """``amole_load_balance`` of ``layer``'s last forward; in a cohort one per client, shape (C,):
    f and P over the client's own tokens (``own``: (C, tokens), 0 where the cohort padded its
    batch), n its own expert count (its empty slots hold no probability and no top-1 token)."""
    routing = layer.last_routing
    if layer.held is None:
        return amole_load_balance(routing, layer.n_active)
    clients, n = layer.clients, layer.n_active
    p = at_least_fp32(routing.probs).reshape(clients, -1, n)
    f = F.one_hot(routing.topk_index[:, 0], n).to(p.dtype).reshape(clients, -1, n)
    if own is None:
        f, p = f.mean(1), p.mean(1)
    else:
        w = own.to(f.device, f.dtype).unsqueeze(-1) / own.sum(1).view(-1, 1, 1).to(f.device, f.dtype)
        f, p = (f * w).sum(1), (p * w).sum(1)
    held = layer.held.sum(1).to(f.dtype)
    return held * (f * p).sum(-1) * (held >= 2)  # one expert: no balance, as amole_load_balance
