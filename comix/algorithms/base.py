"""The algorithm contract (DESIGN.md): engine-agnostic client and server steps.

An algorithm says
  * which adapters a client carries (``adapter_config(client)``: plain LoRA or a mixture, and how
    many experts for this client),
  * which parameter names may leave the device (``is_shared(name)``): every upload holds exactly
    those tensors, never specialists, routers, optimizer state or data (tests assert it),
  * ``client_round(ctx, state, payload) -> (state, upload, metrics)``: runs on the device,
  * ``server_round(server_state, uploads) -> (server_state, payloads)``: one payload per client.
Engines (in-process, Flower) only move states, uploads and payloads around.

This module holds what every method shares: the training config, a client's private state, the
local training loop (AdamW, one-cycle cosine schedule, optional load balance) and uniform
FedAvg aggregation of the shared tensors (Alg. 1's server step).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..data import UserData, sample_batch
from ..models import AdapterConfig, LoRAConfig, load_balance_loss, mixtures, param_role

Tensors = dict[str, torch.Tensor]


@dataclass
class TrainConfig:
    rounds: int = 20
    local_steps: int = 10           # expert iterations per round (paper App. B.1)
    batch_size: int = 64
    seq_len: int = 128
    lr: float = 2e-3                # expert lr, one-cycle cosine over rounds * local_steps
    warmup_frac: float = 0.1        # share of the one cycle spent warming up
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    router_lr: float = 2e-3         # constant (App. B.1)
    tau: int = 30                   # router update period, in expert iterations
    router_steps: int = 10          # router steps each period, on validation batches
    lb_weight: float = 0.01         # lambda in eq. 7-8
    load_balance: str = "uniform"   # none | uniform | generalist (eq. 10)
    eval_every: int = 1             # evaluate valid/test perplexity every k rounds (and the last)
    eval_batch_size: int = 8
    eval_splits: list[str] = field(default_factory=lambda: ["valid", "test"])


@dataclass
class ClientState:
    """Everything that stays on a device between rounds."""
    adapters: Tensors                      # all of this client's adapter tensors
    optimizers: dict[str, Any] = field(default_factory=dict)  # name -> optimizer.state_dict()
    rng: torch.Tensor | None = None        # batch-sampling generator state
    step: int = 0                          # expert iterations done so far (t in Alg. 1)
    extra: dict = field(default_factory=dict)  # method-specific private state (ranks, trust, ...)


@dataclass
class ClientContext:
    """What the engine hands a client for its turn: the model with this client's architecture
    (frozen base shared by all clients), its private data and the run's training config."""
    client: int
    model: nn.Module
    data: UserData | list[UserData]
    train: TrainConfig


def tensor_bytes(tensors: Tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


def one_cycle_lr(step: int, total: int, max_lr: float, warmup_frac: float = 0.1,
                 div: float = 25.0, final_div: float = 1e4) -> float:
    """One-cycle cosine (as torch's OneCycleLR): cosine warm-up from max_lr/div to max_lr, then
    cosine annealing to max_lr/(div*final_div). ``step`` counts from 0."""
    total = max(total, 1)
    up = max(1, int(warmup_frac * total))
    lo, end = max_lr / div, max_lr / (div * final_div)
    if step < up:
        return lo + (max_lr - lo) * (1 - math.cos(math.pi * step / up)) / 2
    frac = min(1.0, (step - up) / max(1, total - up))
    return end + (max_lr - end) * (1 + math.cos(math.pi * frac)) / 2


def average(uploads: dict[int, Tensors]) -> Tensors:
    """Uniform mean of each tensor over the clients that uploaded it (CoMiGS eq. 4)."""
    names = sorted({n for u in uploads.values() for n in u})
    out = {}
    for n in names:
        ts = [u[n] for u in uploads.values() if n in u]
        out[n] = torch.stack([t.float() for t in ts]).mean(0).to(ts[0].dtype)
    return out


class Algorithm:
    """Base: plain LoRA clients, nothing shared (= Local). Subclasses state what differs."""
    name = "local"
    trains = True
    pooled = False               # one model trained on every user's data (Centralized)
    lora_modules = 2             # "2x LoRA modules" to match CoMiGS-1G1S (paper Sec. 4.2)
    common_init = False          # every client starts from the *same* adapters (FFA-LoRA's frozen A)
    section: str | None = None   # the config section holding this method's options

    def __init__(self, lora: LoRAConfig, train: TrainConfig, n_clients: int):
        self.lora, self.train, self.n_clients = lora, train, n_clients

    # -- what a client carries and what may leave it ---------------------------------------------
    def adapter_config(self, client: int) -> AdapterConfig:
        lora = LoRAConfig(r=self.lora.r, alpha=self.lora.alpha, dropout=self.lora.dropout,
                          modules=self.lora_modules)
        return AdapterConfig(lora=lora, mlp="lora")

    def is_shared(self, name: str) -> bool:
        return False

    def check_upload(self, upload: Tensors, reference: Tensors) -> str | None:
        """Why a client's upload must be rejected (None: accept). ``reference`` is the client's
        own initial upload: the same names and shapes, finite values. Engines never aggregate a
        rejected upload (a faulty or malicious device)."""
        extra, missing = set(upload) - set(reference), set(reference) - set(upload)
        if extra or missing:
            return f"undeclared tensors {sorted(extra)[:3]}" if extra else f"missing tensors {sorted(missing)[:3]}"
        for n, t in upload.items():
            if not self.shape_ok(n, tuple(t.shape), tuple(reference[n].shape)):
                return f"tensor {n} has shape {tuple(t.shape)}, expected {tuple(reference[n].shape)}"
            if not torch.isfinite(t).all():
                return f"tensor {n} holds NaN or inf"
        return None

    def shape_ok(self, name: str, shape: tuple, expected: tuple) -> bool:
        return shape == expected

    def upload_of(self, adapters: Tensors) -> Tensors:
        return {n: t.detach().clone() for n, t in adapters.items() if self.is_shared(n)}

    def train_params(self, model: nn.Module) -> list[tuple[str, nn.Parameter]]:
        """What the local (expert) optimizer updates; routers have their own steps (CoMiGS)."""
        return expert_params(model)

    # -- server ------------------------------------------------------------------------------------
    def server_init(self, initial: dict[int, Tensors]) -> tuple[Any, dict[int, Tensors]]:
        """Round-1 payloads from each client's freshly initialised shared tensors: by default
        client 0's for everyone (a common start; shapes agree when the architecture is shared)."""
        return None, {c: dict(initial[0]) for c in range(self.n_clients)}

    def server_round(self, server_state, uploads: dict[int, Tensors]) -> tuple[Any, dict[int, Tensors]]:
        if not uploads or not any(uploads.values()):
            return server_state, {c: {} for c in range(self.n_clients)}
        mean = average(uploads)
        return server_state, {c: dict(mean) for c in range(self.n_clients)}

    # -- client ------------------------------------------------------------------------------------
    def apply_payload(self, state: ClientState, payload: Tensors) -> ClientState:
        for n, t in payload.items():
            if n not in state.adapters or not self.is_shared(n):
                raise ValueError(f"payload tensor {n!r} is not a shared parameter of this client")
            state.adapters[n] = t.detach().clone().to(state.adapters[n].dtype)
        return state

    def client_round(self, ctx: ClientContext, state: ClientState, payload: Tensors):
        state = self.apply_payload(state, payload)
        load_adapters(ctx.model, state.adapters)
        gen = torch.Generator()
        if state.rng is not None:
            gen.set_state(state.rng)
        ctx.model.train()
        losses = self.local_training(ctx, state, gen)
        state.adapters = adapter_tensors(ctx.model)
        state.rng = gen.get_state()
        upload = self.upload_of(state.adapters)
        return state, upload, {"train_loss": sum(losses) / max(1, len(losses))}

    def client_finish(self, ctx: ClientContext, state: ClientState, payload: Tensors) -> ClientState:
        """After the last server round: take the final payload (FDLoRA also fuses here)."""
        return self.apply_payload(state, payload)

    def regularizer(self, ctx: ClientContext, state: ClientState) -> torch.Tensor:
        """Extra term of the local loss (HetLoRA's rank regulariser); none by default."""
        return torch.zeros(())

    def local_training(self, ctx: ClientContext, state: ClientState, gen: torch.Generator) -> list[float]:
        """``local_steps`` expert iterations with AdamW; returns the training losses."""
        params = self.train_params(ctx.model)
        opt = make_optimizer(params, state, "experts", self.train.weight_decay)
        total = self.train.rounds * self.train.local_steps
        losses = []
        for _ in range(self.train.local_steps):
            for g in opt.param_groups:
                g["lr"] = one_cycle_lr(state.step, total, self.train.lr, self.train.warmup_frac)
            x, y = self.train_batch(ctx, gen)
            loss = lm_loss(ctx.model, x, y)
            total_loss = (loss + self.train.lb_weight * model_load_balance(ctx.model, self.train.load_balance)
                          + self.regularizer(ctx, state))
            step_on(total_loss, [p for _, p in params], opt, self.train.grad_clip)
            losses.append(loss.item())
            state.step += 1
            self.after_expert_step(ctx, state, gen)
        state.optimizers["experts"] = opt.state_dict()
        return losses

    def after_expert_step(self, ctx: ClientContext, state: ClientState, gen: torch.Generator) -> None:
        """Hook for algorithms that interleave other updates (CoMiGS's router steps)."""

    def train_batch(self, ctx: ClientContext, gen: torch.Generator):
        data = ctx.data
        if isinstance(data, list):  # pooled: the same batch size from every user (Centralized)
            xs, ys = zip(*(sample_batch(u.train, self.train.batch_size, self.train.seq_len, gen) for u in data))
            return torch.cat(xs), torch.cat(ys)
        return sample_batch(data.train, self.train.batch_size, self.train.seq_len, gen)


# -- helpers shared by algorithms and engines ------------------------------------------------------
def adapter_tensors(model: nn.Module) -> Tensors:
    return {n: p.detach().clone() for n, p in model.named_parameters() if param_role(n) != "base"}


def load_adapters(model: nn.Module, adapters: Tensors) -> None:
    params = dict(model.named_parameters())
    with torch.no_grad():
        for n, t in adapters.items():
            params[n].copy_(t)


def expert_params(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """Everything trainable except routers (experts, plain LoRA, attention LoRA)."""
    return [(n, p) for n, p in model.named_parameters() if p.requires_grad and param_role(n) != "router"]


def router_params(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    return [(n, p) for n, p in model.named_parameters() if param_role(n) == "router"]


def make_optimizer(params, state: ClientState, key: str, weight_decay: float = 0.0, lr: float = 1e-3):
    opt = torch.optim.AdamW([p for _, p in params], lr=lr, weight_decay=weight_decay)
    if key in state.optimizers:  # this client's own moments, never another client's
        opt.load_state_dict(state.optimizers[key])
    return opt


def step_on(loss: torch.Tensor, params: list[nn.Parameter], opt: torch.optim.Optimizer, clip: float) -> None:
    """Gradients of ``loss`` w.r.t. ``params`` only (torch.autograd.grad), so no other
    parameter receives or keeps a gradient: the router step cannot leak validation data into
    experts and router gradients cannot accumulate between updates (DESIGN.md's reference bugs)."""
    grads = torch.autograd.grad(loss, params, allow_unused=True)
    for p, g in zip(params, grads):
        p.grad = torch.zeros_like(p) if g is None else g
    if clip:
        torch.nn.utils.clip_grad_norm_(params, clip)
    opt.step()
    for p in params:
        p.grad = None


def lm_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    logits = model(input_ids=x).logits
    return nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1))


def model_load_balance(model: nn.Module, weighting: str) -> torch.Tensor:
    """Mean over blocks of each block's load-balance loss (from its last forward)."""
    layers = [m for m in mixtures(model) if m.last_routing is not None and m.n_experts > 1]
    if not layers or weighting == "none":
        return torch.zeros(())
    return torch.stack([load_balance_loss(m.last_routing, m.n_experts, weighting) for m in layers]).mean()
