"""CoMiGS mixture of LoRA experts on a transformer MLP (paper Sec. 3.1, eq. 1; App. C.4).

Expert j is "the block's MLP with LoRA_j on each of its linear layers"; a per-block router
(linear, no bias, d_model -> n) picks the top-k experts of each token and the block returns
sum_j p_j(x) MLP_j(x), with p a softmax over the selected logits only. Expert 0 is the
*generalist* (averaged across users when the algorithm says so), experts 1..n-1 are
*specialists*; parameter names say so: ``<block>.mlp.experts.<j>.<proj>.lora_A``.

Exact fused computation (DESIGN.md): the frozen projections are linear and shared by every
expert, so each is applied once per token; only rank-r corrections and the elementwise work are
per selected slot. Stacking every expert's A (n*r x d_in) lets one matmul serve all experts; a
one-hot block mask per slot keeps the slot's own expert, and the down-projection's corrections
are summed before a single multiply by the stacked B:

  gated (Llama): h_s = act(G x + dG_e(s) x) * (U x + dU_e(s) x)
                 y   = D (sum_s p_s h_s) + sum_s p_s dD_e(s) h_s
  plain (GPT-2): h_s = act(F x + dF_e(s) x);  y = P (sum_s p_s h_s) + sum_s p_s dP_e(s) h_s

``fused=False`` gives the textbook per-expert form (frozen MLP once per selected expert on its
routed tokens), kept as the reference the tests compare against.

The layer is a ``MixtureOfLoRA`` of a *router* and *experts*; a mixture on a single linear layer
(FedAMoLE) or of dense FFN experts (DeepFusion) subclasses the same routing/statistics code and
only supplies its own ``_experts_forward``.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..runtime import at_least_fp32
from .lora import LoRAConfig, LoRAWeights, client_linear, linear_dims, lora_dropout


@dataclass(frozen=True)
class MLPLayout:
    """Names of a HF MLP's parts. ``gate`` is None for GPT-2-style (non-gated) MLPs."""
    up: str
    down: str
    act: str
    gate: str | None = None
    out_dropout: str | None = None

    @property
    def projections(self) -> tuple[str, ...]:
        return ((self.gate,) if self.gate else ()) + (self.up, self.down)


LLAMA_MLP = MLPLayout(gate="gate_proj", up="up_proj", down="down_proj", act="act_fn")
GPT2_MLP = MLPLayout(up="c_fc", down="c_proj", act="act", out_dropout="dropout")


def detect_mlp_layout(mlp: nn.Module) -> MLPLayout:
    for layout in (LLAMA_MLP, GPT2_MLP):
        if all(hasattr(mlp, p) for p in layout.projections):
            return layout
    raise TypeError(f"unsupported MLP {type(mlp).__name__}: expected gate/up/down_proj or c_fc/c_proj")


@dataclass
class Routing:
    """One forward's routing decision for N tokens: top-k expert ids and their weights, plus the
    full softmax (for the load-balancing loss, eq. 11)."""
    topk_index: torch.Tensor    # (N, k) long
    topk_weight: torch.Tensor   # (N, k) softmax over the selected logits
    probs: torch.Tensor | None  # (N, n) softmax over all logits; None when n == 1

    def dense_gates(self, n: int) -> torch.Tensor:
        return torch.zeros(self.topk_index.shape[0], n, dtype=self.topk_weight.dtype,
                           device=self.topk_weight.device).scatter(1, self.topk_index, self.topk_weight)


def gate_entropy(gates: torch.Tensor) -> torch.Tensor:
    """Mean over tokens of each token's gate entropy in nats (``gates``: (..., tokens, experts), each
    row summing to 1 over the experts it mixes): 0 when every token takes one expert, log k at
    an even mix of k; how sharply a router has learnt to choose (CoMiGS Fig. 4 reads the gates)."""
    return -(gates * gates.clamp_min(1e-12).log()).sum(-1).mean(-1)


class MixtureOfLoRA(nn.Module):
    """Router + top-k selection + routing statistics; subclasses compute the experts."""

    def __init__(self, d_model: int, n_experts: int, top_k: int, linear_router: bool = True):
        super().__init__()
        if not 1 <= n_experts <= 64:
            raise ValueError(f"n_experts must be in 1..64, got {n_experts}")
        if top_k < 1:
            raise ValueError(f"top_k must be >= 1, got {top_k}")
        self.n_experts, self.top_k = n_experts, min(top_k, n_experts)
        # With one expert there is nothing to route: it gets weight 1 and no router exists.
        self.router = nn.Linear(d_model, n_experts, bias=False) if n_experts > 1 and linear_router else None
        self.last_routing: Routing | None = None
        self.record_stats = False
        self.stats: dict[str, torch.Tensor] = {}

    @property
    def clients(self) -> int:
        """How many clients' routers this layer holds (a cohort's: models/cohort.py), else 1."""
        return self.router.weight.shape[0] if self.router is not None and self.router.weight.dim() == 3 else 1

    def experts_of(self, client: int) -> int:
        """How many experts ``client`` routes over (its gates are the first that many)."""
        return self.n_experts

    def route(self, x: torch.Tensor) -> Routing:
        if self.router is None:
            ones = x.new_ones(x.shape[0], 1)
            return Routing(torch.zeros(x.shape[0], 1, dtype=torch.long, device=x.device), ones, None)
        w = self.router.weight  # (n, d), or (C, n, d): one router per client of a cohort (models/cohort.py)
        logits = self.router(x) if w.dim() == 2 else client_linear(x, w)
        top_logits, top_index = logits.topk(self.top_k, dim=-1)
        return Routing(top_index, top_logits.softmax(-1), logits.softmax(-1))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        shape = hidden.shape
        x = hidden.reshape(-1, shape[-1])
        routing = self.route(x)
        # Kept for the load-balancing loss, which is a function of the router's own input tokens.
        self.last_routing = routing
        if self.record_stats:
            with torch.no_grad():
                gates = at_least_fp32(routing.dense_gates(self.n_experts))
                # a cohort (models/cohort.py): one mean gate per client, over its own tokens
                clients = self.clients
                own = gates.reshape(clients, -1, self.n_experts) if clients > 1 else gates
                self.stats = {"mean_gate": own.mean(-2), "entropy": gate_entropy(own),
                              "top1": routing.topk_index[:, 0].reshape(shape[:-1]).clone()}
        return self._experts_forward(x, routing).reshape(*shape[:-1], -1)

    def _experts_forward(self, x: torch.Tensor, routing: Routing) -> torch.Tensor:
        raise NotImplementedError


# Activations the compiled path writes out itself (a compiled function must not close over a
# module instance, or every layer would compile its own copy): HF class name -> kind.
ACT_KINDS = {"SiLU": "silu", "SiLUActivation": "silu", "NewGELUActivation": "gelu_tanh",
             "GELUTanh": "gelu_tanh", "PytorchGELUTanh": "gelu_tanh", "GELUActivation": "gelu", "GELU": "gelu"}


def _activate(h: torch.Tensor, act) -> torch.Tensor:
    if act == "silu":
        return F.silu(h)
    if act == "gelu_tanh":  # NewGELUActivation's formula, term for term (transformers activations.py)
        return 0.5 * h * (1.0 + torch.tanh(0.7978845608028654 * (h + 0.044715 * torch.pow(h, 3.0))))
    if act == "gelu":
        return F.gelu(h)
    return act(h)


def slot_hidden(frozen: list[torch.Tensor], delta: list[torch.Tensor], w: torch.Tensor, act):
    """The d_ff-sized work of every slot at once: h_s = act(F x + dF_s x) [* (U x + dU_s x)] for
    the frozen outputs ``frozen`` (N, d_ff) and the slots' corrections ``delta`` (N, k, d_ff),
    and sum_s w_s h_s (one batched matmul). ``act``: an ``ACT_KINDS`` value or a callable."""
    h = _activate(delta[0] + frozen[0].unsqueeze(1), act)
    if len(frozen) == 2:  # gated (SwiGLU)
        h = h * (delta[1] + frozen[1].unsqueeze(1))
    return h, (w.unsqueeze(1) @ h).squeeze(1)


def _compiled_slot_hidden(frozen, delta, w, act):
    global _COMPILED
    if _COMPILED is None:
        _COMPILED = torch.compile(slot_hidden)
    try:
        return _COMPILED(frozen, delta, w, act)
    except Exception as e:  # no C++ compiler / Triton here: the eager form from now on, said once
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            raise  # a CUDA-graph capture that failed (algorithms/cohort.py falls back), not the compiler
        import logging
        logging.getLogger("comix").warning("torch.compile of the mixture failed (%s); running it eagerly",
                                           str(e).splitlines()[0][:200])
        _COMPILED = slot_hidden
        return slot_hidden(frozen, delta, w, act)


_COMPILED = None


def set_compiled(model: nn.Module, compiled: bool) -> nn.Module:
    """Run every mixture MLP of ``model`` through the compiled ``slot_hidden`` (torch.compile:
    the slots' add, activation, product and weighted sum fused into one kernel per pass) or the
    eager one. The result is the same function (tested); only the speed differs."""
    for m in model.modules():
        if isinstance(m, MixtureOfLoRAMLP):
            m.compiled = compiled
    return model


class MixtureOfLoRAMLP(MixtureOfLoRA):
    """CoMiGS's MLP: n LoRA experts over one frozen HF MLP module (kept at ``.base``)."""

    def __init__(self, mlp: nn.Module, d_model: int, n_experts: int, top_k: int = 2,
                 lora: LoRAConfig | None = None, fused: bool = True):
        super().__init__(d_model, n_experts, top_k)
        lora = lora or LoRAConfig()
        self.layout = detect_mlp_layout(mlp)
        self.base = mlp
        for p in self.base.parameters():
            p.requires_grad_(False)
        self.rank, self.scaling, self.fused = lora.rank, lora.scaling, fused
        dims = {p: linear_dims(getattr(mlp, p)) for p in self.layout.projections}
        self.experts = nn.ModuleList(
            nn.ModuleDict({p: LoRAWeights(*dims[p], lora.rank) for p in self.layout.projections})
            for _ in range(n_experts))
        self.dropout = lora_dropout(lora.dropout)
        self.compiled = False
        self._act_kind = ACT_KINDS.get(type(getattr(mlp, self.layout.act)).__name__)

    # -- helpers -------------------------------------------------------------------------------
    def _proj(self, name: str) -> nn.Module:
        return getattr(self.base, name)

    def _act(self, h: torch.Tensor) -> torch.Tensor:
        return getattr(self.base, self.layout.act)(h)

    def _stacked(self, proj: str) -> tuple[torch.Tensor, torch.Tensor]:
        """All experts' factors of one projection: A (n*r, in), B (out, n*r); with a leading
        client axis in a cohort (models/cohort.py)."""
        if self.n_experts == 1:
            w = self.experts[0][proj]
            return w.lora_A, w.lora_B
        return (torch.cat([e[proj].lora_A for e in self.experts], -2),
                torch.cat([e[proj].lora_B for e in self.experts], -1))

    def _finish(self, y: torch.Tensor) -> torch.Tensor:
        drop = self.layout.out_dropout
        return getattr(self.base, drop)(y) if drop else y

    # -- forward -------------------------------------------------------------------------------
    def _experts_forward(self, x: torch.Tensor, routing: Routing) -> torch.Tensor:
        if self.fused:
            return self._finish(self._fused(x, routing))
        return self._finish(self._naive(x, routing))

    def _fused(self, x: torch.Tensor, routing: Routing) -> torch.Tensor:
        """The exact fused form (module docstring) with the k slots of a token side by side, so
        every per-slot tensor is one (N, k, .) tensor: the LoRA scaling and the slot's one-hot
        expert mask act on the rank-sized factors (never on d_ff-sized tensors), and the
        d_ff-sized elementwise work of all slots is one call of ``slot_hidden`` (compiled into
        one fused kernel per pass when ``self.compiled``, see ``set_compiled``). Sorting the
        (token, slot) pairs by expert so that each expert's rank-r factors multiply only its own
        rows (a grouped GEMM, n times fewer flops in the rank-r products) was measured slower
        on the CPU (bench/layer_speed.py, SmolLM2 block at n = 8: 1.76-1.94x a LoRA against
        1.57-1.59x for this form): the argsort, gathers and index_put cost more than they save."""
        lay, s, r, n = self.layout, self.scaling, self.rank, self.n_experts
        xd = self.dropout(x)
        w = routing.topk_weight.to(x.dtype)                          # (N, k)
        # (N, k, n*r): slot k of a token keeps its expert's r columns only, times the scaling
        keep = s if n == 1 else F.one_hot(routing.topk_index, n).to(x.dtype).repeat_interleave(r, -1) * s
        frozen, delta = [], []
        for p in ((lay.gate,) if lay.gate else ()) + (lay.up,):
            a, b = self._stacked(p)
            frozen.append(self._proj(p)(x))                          # once per token, (N, d_ff)
            delta.append(client_linear(client_linear(xd, a).unsqueeze(1) * keep, b))  # all experts at once, (N, k, d_ff)
        if self.compiled and self._act_kind:
            h, hidden = _compiled_slot_hidden(frozen, delta, w, self._act_kind)
        else:  # h: (N, k, d_ff); hidden = sum_s p_s h_s, (N, d_ff)
            h, hidden = slot_hidden(frozen, delta, w, self._act)
        a_down, b_down = self._stacked(lay.down)
        z = (client_linear(self.dropout(h), a_down) * (w.unsqueeze(-1) * keep)).sum(1)  # (N, n*r)
        return self._proj(lay.down)(hidden) + client_linear(z, b_down)

    def _expert_mlp(self, x: torch.Tensor, j: int) -> torch.Tensor:
        """MLP_j(x): the frozen MLP with expert j's LoRA on every projection (no output dropout)."""
        lay, e = self.layout, self.experts[j]
        xd = self.dropout(x)
        lin = lambda p, v, vd: self._proj(p)(v) + e[p].delta(vd, self.scaling)  # noqa: E731
        if lay.gate:
            h = self._act(lin(lay.gate, x, xd)) * lin(lay.up, x, xd)
        else:
            h = self._act(lin(lay.up, x, xd))
        return lin(lay.down, h, self.dropout(h))

    def _naive(self, x: torch.Tensor, routing: Routing) -> torch.Tensor:
        out_dim = linear_dims(self._proj(self.layout.down))[1]
        out = x.new_zeros(x.shape[0], out_dim)
        for j in range(self.n_experts):
            tok, slot = (routing.topk_index == j).nonzero(as_tuple=True)
            if tok.numel() == 0:
                continue
            w = routing.topk_weight[tok, slot].unsqueeze(-1)
            out = out.index_add(0, tok, w * self._expert_mlp(x[tok], j))
        return out


def load_balance_loss(routing: Routing, n_experts: int, weighting: str = "uniform", clients: int = 1,
                      own: torch.Tensor | None = None) -> torch.Tensor:
    """Switch-style load balance from one block's routing (CoMiGS eq. 10-11).

    f_j: fraction of tokens with j among their top-k (not differentiable); P_j: mean router
    probability of j (differentiable). ``uniform``: n * sum_j f_j P_j (Fedus et al. 2022).
    ``generalist``: eq. 10, which weights the generalist (expert 0) by 1/((n-1)^2+1) and each
    specialist by (n-1)/((n-1)^2+1) so that the generalist is pushed towards probability 1/2. We
    multiply eq. 10 by n^2 so that at n = 2 it *equals* the uniform loss, as the paper states
    (eq. 10 as printed is the uniform loss / 4 there). ``none``: 0. With ``clients`` > 1 (a
    cohort's client-major tokens, models/cohort.py) each client's f and P are over its own
    tokens only, and the result is one loss per client, shape (clients,). ``own``: (clients, tokens)
    1 on the tokens a client's batch has alone, 0 on those a cohort padded on (instruction batches
    of unequal widths), so that f and P are each client's means over its own batch's tokens.
    """
    shape = (clients,) if clients > 1 else ()
    if routing.probs is None or weighting == "none":
        return routing.topk_weight.new_zeros(shape)
    n = n_experts
    p = at_least_fp32(routing.probs).reshape(clients, -1, n)
    f = F.one_hot(routing.topk_index, n).sum(-2).to(p.dtype).reshape(clients, -1, n)
    if own is None:
        f, p = f.mean(1), p.mean(1)  # (clients, n)
    else:
        weights = own.to(f.device, f.dtype).unsqueeze(-1) / own.sum(1).view(-1, 1, 1).to(f.device, f.dtype)
        f, p = (f * weights).sum(1), (p * weights).sum(1)
    if weighting == "uniform":
        return (n * (f * p).sum(-1)).reshape(shape)
    if weighting == "generalist":
        denom = (n - 1) ** 2 + 1
        w = torch.full((n,), (n - 1) / denom, device=p.device)
        w[:1].fill_(1.0 / denom)  # a fill kernel: a CUDA graph cannot capture a copy from the host
        return (n * n * (w * f * p).sum(-1)).reshape(shape)
    raise ValueError(f"load_balance must be one of none, uniform, generalist; got {weighting!r}")
