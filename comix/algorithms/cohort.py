"""Local training of a *cohort*: C clients of one round in lockstep over the one frozen base.

Clients of a round are independent given the round's payloads, so their local steps can run
together: one forward and backward over the C clients' batches, concatenated in client order,
through a model whose adapters carry a client axis (models/cohort.py: the base's products once
for all rows, each client's adapters on its own rows). What the sequential executor
(``Algorithm.client_round``) does per client stays per client here:
  * the loss: each client's mean next-token CE over its own targets plus lb_weight x its own
    load balance (f and P over its own tokens); the step differentiates their *sum*, whose
    gradient in client c's slot is client c's own gradient (no other term touches that slot);
  * the optimiser: ``CohortAdamW``, torch's AdamW update term for term on stacked tensors, with
    each client's learning rate (its own step on the schedule), step count and moments; the
    moments are read from and written back to each ``ClientState`` in torch's own
    ``AdamW.state_dict()`` form, so either executor continues the other's state;
  * gradient clipping: each client's norm over its own slots (torch's clip_grad_norm_ rule);
  * batches: each client's own generator, drawn in the sequential order (expert batch, then
    the interleaved steps' batches when their period comes: CoMiGS's router steps every tau on
    validation data, ``Algorithm.interleaved``);
  * ``optimizer_state``: "run" loads and keeps each client's moments, "round" starts fresh.
Which methods can run so is ``cohort_refusal``'s answer (docs/methods.md lists it per method);
the others keep their own client step and run one client after another.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..data import sample_batch
from ..models.cohort import clients_of, load_stacked, unstack
from ..runtime import to_cpu
from .training import ClientState, TrainConfig, batch_generator, expert_lr, model_load_balance


class CohortAdamW:
    """AdamW over parameters stacked on a client axis (dim 0), each client with its own learning
    rate, step count and moments. The update is torch.optim.AdamW's single-tensor one, term for
    term (decoupled decay p *= 1 - lr*wd; m, v; bias corrections of the client's own step), with
    the per-client scalars as (C, 1) tensors: AdamW is elementwise, so slot c evolves exactly as
    client c's own optimiser would. Moments and the update live in flat (C, P) buffers, every
    parameter side by side: a handful of whole-buffer operations a step instead of eight per
    tensor (hundreds of small launches on a GPU: SmolLM2 with LoRA carries 420 adapter tensors)."""

    def __init__(self, params: list[torch.Tensor], train: TrainConfig, eps: float = 1e-8):
        if len({(p.dtype, p.device) for p in params}) != 1:
            raise ValueError("a cohort's trained parameters must share one dtype and device (fp32 masters)")
        self.params, self.eps = params, eps
        self.beta1, self.beta2 = train.betas
        self.weight_decay = train.weight_decay
        self.clients = params[0].shape[0]
        self.sizes = [p[0].numel() for p in params]
        self.exp_avg = params[0].new_zeros(self.clients, sum(self.sizes))
        self.exp_avg_sq = torch.zeros_like(self.exp_avg)
        self.steps = [0] * self.clients
        self.lrs = [0.0] * self.clients
        # torch's param_group of an AdamW built as make_optimizer builds it: what a saved state holds
        self.group = torch.optim.AdamW([torch.zeros(1)], lr=train.lr, betas=tuple(train.betas),
                                       weight_decay=train.weight_decay).state_dict()["param_groups"][0]

    def flat(self, tensors: list[torch.Tensor]) -> torch.Tensor:
        """``tensors`` (shaped as the parameters) side by side in one (C, P) tensor."""
        return torch.cat([t.reshape(self.clients, -1) for t in tensors], 1)

    def load(self, client: int, saved: dict) -> None:
        """Client ``client``'s moments from its ``AdamW.state_dict()`` (parameters in the same order)."""
        st = [saved["state"][i] for i in range(len(self.params))]
        self.exp_avg[client] = torch.cat([s["exp_avg"].reshape(-1) for s in st]).to(self.exp_avg)
        self.exp_avg_sq[client] = torch.cat([s["exp_avg_sq"].reshape(-1) for s in st]).to(self.exp_avg)
        self.steps[client] = int(float(st[0]["step"]))
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

    def _per_client(self, values: list[float]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.float64).to(self.exp_avg.device, self.exp_avg.dtype).view(-1, 1)

    @torch.no_grad()
    def step(self, grads: torch.Tensor, lrs: list[float]) -> None:
        """One step with ``grads``, the (C, P) gradients side by side (``flat``)."""
        self.lrs = list(lrs)
        self.steps = [s + 1 for s in self.steps]
        b1, b2 = self.beta1, self.beta2
        decay = self._per_client([1 - lr * self.weight_decay for lr in lrs])
        step_size = self._per_client([lr / (1 - b1 ** s) for lr, s in zip(lrs, self.steps)])
        bias2_sqrt = self._per_client([(1 - b2 ** s) ** 0.5 for s in self.steps])
        p, m, v = self.flat(self.params), self.exp_avg, self.exp_avg_sq
        p.mul_(decay)
        m.lerp_(grads, 1 - b1)
        v.mul_(b2).addcmul_(grads, grads, value=1 - b2)
        denom = (v.sqrt() / bias2_sqrt).add_(self.eps)
        p.sub_(step_size * (m / denom))
        torch._foreach_copy_(self.params, [t.view(q.shape) for t, q in zip(p.split(self.sizes, 1), self.params)])


def clip_per_client(grads: torch.Tensor, max_norm: float) -> None:
    """torch.nn.utils.clip_grad_norm_ applied to each client's row of the flat (C, P) gradients
    separately: client c's scaled by min(1, max_norm / (||g_c|| + 1e-6)), ||g_c|| its norm over
    every parameter."""
    coef = (max_norm / (torch.linalg.vector_norm(grads, 2, dim=1) + 1e-6)).clamp(max=1.0)
    grads.mul_(coef.view(-1, 1).to(grads.dtype))


def cohort_lm_losses(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Each client's mean next-token CE over its own targets (not -100), shape (C,): ``x`` and
    ``y`` hold the clients' batches in client order (lm_loss, per client)."""
    device = model.get_input_embeddings().weight.device
    x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
    logits = model(input_ids=x).logits[:, -x.shape[1]:]
    ce = nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1), reduction="none")
    clients = clients_of(model)
    targets = (y != -100).reshape(clients, -1)
    return (ce.reshape(clients, -1) * targets).sum(1) / targets.sum(1)


def cohort_step(model: nn.Module, x: torch.Tensor, y: torch.Tensor, params: list[nn.Parameter],
                opt: CohortAdamW, lrs: list[float], train: TrainConfig) -> torch.Tensor:
    """One optimiser step of every client of the cohort (``train_step`` per client): the sum of
    the clients' losses (CE + lb_weight x load balance) differentiated w.r.t. ``params`` only,
    each client's gradient clipped to its own norm, then ``opt``. Returns each client's CE."""
    ce = cohort_lm_losses(model, x, y)
    loss = ce + train.lb_weight * model_load_balance(model, train.load_balance).to(ce.device)
    grads = torch.autograd.grad(loss.sum(), params, allow_unused=True)
    grads = opt.flat([torch.zeros_like(p) if g is None else g for p, g in zip(params, grads)])
    if train.grad_clip:
        clip_per_client(grads, train.grad_clip)
    opt.step(grads, lrs)
    return ce.detach()


@dataclass
class CohortMember:
    """One client of a cohort: what its sequential turn would be handed (``ClientContext``'s
    client and data) and its state and payload for the round."""
    client: int
    data: object
    state: ClientState
    payload: dict


def _optimizer(named, members: list[CohortMember], key: str, train: TrainConfig) -> CohortAdamW:
    """``make_optimizer`` for a cohort: each member's own saved moments with ``optimizer_state=run``."""
    opt = CohortAdamW([p for _, p in named], train)
    if train.optimizer_state == "run":
        for c, m in enumerate(members):
            if key in m.state.optimizers:
                opt.load(c, m.state.optimizers[key])
    return opt


def _keep(opt: CohortAdamW, members: list[CohortMember], key: str, train: TrainConfig) -> None:
    """``keep_optimizer`` for a cohort: each member keeps its own slot's moments, or none ("round")."""
    for c, m in enumerate(members):
        if train.optimizer_state == "run":
            m.state.optimizers[key] = to_cpu(opt.state_dict(c))
        else:
            m.state.optimizers.pop(key, None)


def _batches(members, gens, split: str, train: TrainConfig, algorithm, contexts):
    if split == "train":  # the method's own training batch (Algorithm.train_batch)
        xs, ys = zip(*(algorithm.train_batch(ctx, g) for ctx, g in zip(contexts, gens)))
    else:
        xs, ys = zip(*(sample_batch(getattr(m.data, split), train.batch_size, train.seq_len, g)
                       for m, g in zip(members, gens)))
    return torch.cat(xs), torch.cat(ys)


def cohort_round(algorithm, model: nn.Module, members: list[CohortMember], contexts) -> list[tuple]:
    """One local round of every member, in lockstep on ``model`` (stacked for len(members)
    clients): ``Algorithm.client_round``'s default body for each member. Returns
    [(state, upload, metrics)] in member order. ``contexts``: each member's ``ClientContext``
    (the methods' ``train_batch`` reads its data from it)."""
    train = algorithm.train
    if len({m.state.step for m in members}) != 1:
        raise ValueError("a cohort's members must have taken the same number of steps (engines group them so)")
    for m in members:
        m.state = algorithm.apply_payload(m.state, m.payload)
    load_stacked(model, [m.state.adapters for m in members])
    gens = [batch_generator(m.state) for m in members]
    model.train()
    named = algorithm.train_params(model)
    params = [p for _, p in named]
    opt = _optimizer(named, members, "experts", train)
    total = train.rounds * train.local_steps
    phase = algorithm.interleaved()
    losses, rows = [], {m.client: 0 for m in members}
    for _ in range(train.local_steps):
        lrs = [expert_lr(m.state.step, total, train) for m in members]
        x, y = _batches(members, gens, "train", train, algorithm, contexts)
        losses.append(cohort_step(model, x, y, params, opt, lrs, train))
        for m in members:
            rows[m.client] += x.numel() // len(members)
            m.state.step += 1
        if phase is not None and members[0].state.step % phase.every == 0 and phase.params(model):
            routed = phase.params(model)
            ropt = _optimizer(routed, members, phase.key, train)
            for _ in range(phase.steps):
                x, y = _batches(members, gens, phase.split, train, algorithm, contexts)
                cohort_step(model, x, y, [p for _, p in routed], ropt, [phase.lr] * len(members), train)
                for m in members:
                    rows[m.client] += x.numel() // len(members)
            _keep(ropt, members, phase.key, train)
    _keep(opt, members, "experts", train)
    per_client = torch.stack(losses).t().tolist()  # (C, steps): one device sync per round
    out = []
    trained = unstack(model, list(members[0].state.adapters))
    for m, g, adapters, client_losses in zip(members, gens, trained, per_client):
        m.state.adapters = algorithm.adapters_of(adapters)
        m.state.rng = g.get_state()
        upload = algorithm.upload_of(m.state.adapters)
        out.append((m.state, upload, {"train_loss": sum(client_losses) / max(1, len(client_losses)),
                                      "tokens": rows[m.client]}))
    return out
