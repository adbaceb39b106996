"""The optimiser side of a cohort (algorithms/cohort.py): the fp32 masters of the clients' stacked
parameters, AdamW with each client's own rate, step count and moments over them, and each client's
gradient clipped to its own norm."""
from __future__ import annotations

import torch

from ..runtime import at_least_fp32
from .training import TrainConfig


class CohortMasters:
    """The fp32 master values of a cohort's trained parameters, side by side in one (C, P) buffer
    (C clients, P values each), while the model computes with copies in the compute dtype.

    Under ``precision=bf16`` the sequential executor keeps fp32 adapters that autocast casts at each
    use (509 casts a step on the H200, docs/benchmarks.md "On a GPU"); here the parameters *are* bf16
    copies, AdamW updates the fp32 masters and rewrites the copies after each step: the master
    weights of mixed-precision training (Micikevicius et al. 2018, Sec. 3.1), so small LoRA steps
    are not lost to bf16's mantissa, and a forward sees the values autocast would have cast. In
    fp32 the copies are the parameters. ``restore`` puts the fp32 values back at the round's end."""

    def __init__(self, params: list[torch.Tensor], dtype: torch.dtype):
        self.params, self.dtype = params, dtype
        self.clients = params[0].shape[0]
        self.columns, start = {}, 0
        for p in params:
            self.columns[id(p)] = (start, start + p[0].numel())
            start += p[0].numel()
        self.flat = torch.cat([at_least_fp32(p.detach().reshape(self.clients, -1)) for p in params], 1)
        if dtype != torch.float32:
            for p in params:
                p.data = p.data.to(dtype)

    def of(self, params: list[torch.Tensor]) -> torch.Tensor:
        """The (C, P') columns holding ``params``' masters, a view (one optimiser's share)."""
        spans = [self.columns[id(p)] for p in params]
        if any(a[1] != b[0] for a, b in zip(spans, spans[1:])):
            raise ValueError("an optimiser's parameters must lie side by side among the cohort's masters")
        return self.flat[:, spans[0][0]:spans[-1][1]]

    def restore(self) -> None:
        """The model's parameters back to their fp32 master values."""
        if self.dtype != torch.float32:
            for p in self.params:
                a, b = self.columns[id(p)]
                p.data = self.flat[:, a:b].reshape(p.shape).clone()


class CohortAdamW:
    """AdamW over parameters stacked on a client axis (dim 0), each client with its own learning
    rate, step count and moments: torch.optim.AdamW's single-tensor update term for term (decoupled
    decay, m, v, the client's own bias corrections; the fused kernel one client at a time uses,
    make_optimizer, computes the same to 1e-7) with per-client scalars as (C, 1) tensors, so
    slot c evolves as client c's own optimiser would. Masters, moments and the update are flat (C, P)
    buffers: a few whole-buffer operations a step, not eight per tensor (SmolLM2 with LoRA carries
    420 adapter tensors). ``begin_step`` runs on the host (rates into a device tensor, the step
    counts' host mirror), ``update`` on the device and reads no host value (step counts and bias
    corrections are float64 device tensors, as torch computes them), so a CUDA graph can capture it
    (``CohortStep``). ``master``: the fp32 values (``CohortMasters.of``); by default a copy."""

    def __init__(self, params: list[torch.Tensor], train: TrainConfig, eps: float = 1e-8,
                 master: torch.Tensor | None = None):
        if len({p.device for p in params}) != 1:
            raise ValueError("a cohort's trained parameters must share one device")
        self.params, self.eps = params, eps
        self.beta1, self.beta2 = train.betas
        self.weight_decay = train.weight_decay
        self.clients = params[0].shape[0]
        self.sizes = [p[0].numel() for p in params]
        self.master = self.flat(params) if master is None else master
        self.correction: torch.Tensor | None = None  # SCAFFOLD's (C, P) c - c_i, applied after each step at lr
        self.exp_avg = torch.zeros(self.master.shape, dtype=self.master.dtype, device=self.master.device)
        self.exp_avg_sq = torch.zeros_like(self.exp_avg)
        self.steps = [0] * self.clients   # host mirrors of the device's step counts and rates (state_dict)
        self.lrs = [0.0] * self.clients
        self.step_count = torch.zeros(self.clients, 1, dtype=torch.float64, device=self.master.device)
        self.lr = torch.zeros_like(self.step_count)
        # torch's param_group of an AdamW built as make_optimizer builds it (fused): what a saved state holds
        self.group = torch.optim.AdamW([torch.zeros(1)], lr=train.lr, betas=tuple(train.betas),
                                       weight_decay=train.weight_decay, fused=True).state_dict()["param_groups"][0]

    def flat(self, tensors: list[torch.Tensor]) -> torch.Tensor:
        """``tensors`` (shaped as the parameters) side by side in one fp32 (C, P) tensor."""
        return at_least_fp32(torch.cat([t.reshape(self.clients, -1) for t in tensors], 1))

    def load(self, client: int, saved: dict) -> None:
        """Client ``client``'s moments from its ``AdamW.state_dict()`` (parameters in the same order)."""
        st = [saved["state"][i] for i in range(len(self.params))]
        self.exp_avg[client] = torch.cat([s["exp_avg"].reshape(-1) for s in st]).to(self.exp_avg)
        self.exp_avg_sq[client] = torch.cat([s["exp_avg_sq"].reshape(-1) for s in st]).to(self.exp_avg)
        self.steps[client] = int(float(st[0]["step"]))
        self.step_count[client] = self.steps[client]
        self.lrs[client] = saved["param_groups"][0]["lr"]

    def state_dict(self, client: int) -> dict:
        """Client ``client``'s optimiser as torch's ``AdamW.state_dict()`` (CPU tensors)."""
        shapes = [p.shape[1:] for p in self.params]
        m = [t.reshape(s) for t, s in zip(self.exp_avg[client].to("cpu", copy=True).split(self.sizes), shapes)]
        v = [t.reshape(s) for t, s in zip(self.exp_avg_sq[client].to("cpu", copy=True).split(self.sizes), shapes)]
        state = {i: {"step": torch.tensor(float(self.steps[client])), "exp_avg": m[i], "exp_avg_sq": v[i]}
                 for i in range(len(self.params))}
        return {"state": state, "param_groups": [{**self.group, "lr": self.lrs[client],
                                                  "params": list(range(len(self.params)))}]}

    def begin_step(self, lrs: list[float]) -> None:
        """The host's part of a step: each client's learning rate into the device tensor."""
        self.lrs = list(lrs)
        self.steps = [s + 1 for s in self.steps]
        self.lr.copy_(torch.tensor(self.lrs, dtype=torch.float64).view(-1, 1), non_blocking=True)

    @torch.no_grad()
    def update(self, grads: torch.Tensor) -> None:
        """The device's part: the update with ``grads``, the (C, P) gradients side by side
        (``flat``), then the parameters (the compute-dtype copies) rewritten from the masters."""
        self.step_count += 1
        b1, b2, dtype = self.beta1, self.beta2, self.master.dtype
        decay = (1 - self.lr * self.weight_decay).to(dtype)
        step_size = (self.lr / (1 - b1 ** self.step_count)).to(dtype)
        bias2_sqrt = (1 - b2 ** self.step_count).sqrt().to(dtype)
        p, m, v = self.master, self.exp_avg, self.exp_avg_sq
        p.mul_(decay)
        m.lerp_(grads, 1 - b1)
        v.mul_(b2).addcmul_(grads, grads, value=1 - b2)
        denom = (v.sqrt() / bias2_sqrt).add_(self.eps)
        p.sub_(step_size * (m / denom))
        if self.correction is not None:  # y <- y - lr (c - c_i), as Algorithm.local_training (algorithms/scaffold.py)
            p.sub_(self.lr.to(dtype) * self.correction)
        torch._foreach_copy_(self.params, [t.view(q.shape) for t, q in zip(p.split(self.sizes, 1), self.params)])

    def step(self, grads: torch.Tensor, lrs: list[float]) -> None:
        """One step with ``grads`` (``flat``) at each client's ``lrs``."""
        self.begin_step(lrs)
        self.update(grads)


def clip_per_client(grads: torch.Tensor, max_norm: float) -> None:
    """torch.nn.utils.clip_grad_norm_ applied to each client's row of the flat (C, P) gradients
    separately: client c's scaled by min(1, max_norm / (||g_c|| + 1e-6)), ||g_c|| its norm over
    every parameter."""
    coef = (max_norm / (torch.linalg.vector_norm(grads, 2, dim=1) + 1e-6)).clamp(max=1.0)
    grads.mul_(coef.view(-1, 1).to(grads.dtype))
