"""Local training of a *cohort*: C clients of one round in lockstep over the one frozen base.

Clients of a round are independent given the round's payloads, so their local steps can run
together: one forward and backward over the C clients' batches, concatenated in client order,
through a model whose adapters carry a client axis (models/cohort.py: the base's products once
for all rows, each client's adapters on its own rows). What the sequential executor
(``Algorithm.client_round``) does per client stays per client here:
  * the loss: each client's mean next-token CE over its own targets plus lb_weight x its own
    load balance (f and P over its own tokens); the step differentiates their *sum*, whose
    gradient in client c's slot is client c's own gradient (no other term touches that slot);
  * the optimiser: ``CohortAdamW``, torch's AdamW on stacked tensors with each client's rate,
    step count and moments, kept in each ``ClientState`` as ``AdamW.state_dict()`` (either executor
    continues the other's); FedProx's anchor and SCAFFOLD's correction are each client's own;
  * gradient clipping: each client's norm over its own slots (torch's clip_grad_norm_ rule);
  * batches: each client's own generator, in the sequential order (expert batch, then the
    interleaved steps' when their period comes: CoMiGS's router steps, ``Algorithm.interleaved``);
    instruction batches (each right-padded to its own longest example) padded on to the cohort's
    longest row with targets -100, so a client's loss and load balance are over its own batch's
    tokens only (causal attention: a padded position changes no earlier one);
  * LoRA dropout: each client's masks from its own generator, seeded as its turn alone would seed
    torch's (``turn_seed``), drawn at its own batch's shape in the same order (models/lora.py);
  * ``optimizer_state``: "run" loads and keeps each client's moments, "round" starts fresh.
Which methods can run so is ``cohort_refusal``'s answer (docs/methods.md lists it per method);
the others keep their own client step and run one client after another.
"""
from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

import torch
from torch import nn

from ..models.cohort import clients_of
from ..models.lora import CohortDraws, LoRADropout
from ..runtime import at_least_fp32, to_cpu
from .scaffold import add_control_rate, begin_control_round, cohort_correction
from .cohort_adamw import CohortAdamW, CohortMasters, clip_per_client
from .fedprox import proximal_term
from .contexts import turn_metrics
from .training import ClientState, TrainConfig, batch_generator, expert_lr, model_load_balance, turn_seed

log = logging.getLogger(__name__)


def cohort_lm_losses(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Each client's mean next-token CE over its own targets (not -100), shape (C,): ``x`` and
    ``y`` hold the clients' batches in client order (lm_loss, per client)."""
    device = model.get_input_embeddings().weight.device
    x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
    # the model's default use_cache stays: without a cache (and without a mask) transformers checks
    # the position ids for packed sequences with a Python `if` on a tensor (masking_utils.py,
    # find_packed_sequence_indices), a read-back that a CUDA graph cannot capture
    logits = model(input_ids=x).logits[:, -x.shape[1]:]
    ce = nn.functional.cross_entropy(at_least_fp32(logits).reshape(-1, logits.shape[-1]), y.reshape(-1), reduction="none")
    clients = clients_of(model)
    targets = (y != -100).reshape(clients, -1)
    return (ce.reshape(clients, -1) * targets).sum(1) / targets.sum(1)


def own_tokens(widths: list[int], x: torch.Tensor) -> torch.Tensor | None:
    """(clients, tokens): 1 where a position of a client's rows lies within its own batch's width
    (``widths``), 0 where the cohort padded it on; None when no client's batch was padded."""
    if all(w == x.shape[1] for w in widths):
        return None
    positions = torch.arange(x.shape[1])
    own = positions.view(1, 1, -1) < torch.tensor(widths).view(-1, 1, 1)  # (clients, 1, width)
    return own.expand(len(widths), x.shape[0] // len(widths), x.shape[1]).reshape(len(widths), -1)


def cohort_step(model: nn.Module, x: torch.Tensor, y: torch.Tensor, params: list[nn.Parameter],
                opt: CohortAdamW, lrs: list[float], train: TrainConfig, anchor=(), widths=None,
                forward_loss=None) -> torch.Tensor:
    """One optimiser step of every client (``train_step`` per client): the sum of the clients' losses
    (CE + lb_weight x load balance, + the method's ``forward_loss`` (model, own) -> (C,), + FedProx's
    term over ``anchor``, each client's own round start)
    differentiated w.r.t. ``params`` only, each client's gradient clipped to its own norm, then
    ``opt`` (with SCAFFOLD's correction, if it holds one). ``widths``: each client's batch's own
    width, where the cohort padded the batches (``_batches``). Returns each client's CE."""
    opt.begin_step(lrs)
    return _device_step(model, x, y, params, opt, train, anchor, widths, forward_loss)


def _device_step(model, x, y, params, opt: CohortAdamW, train: TrainConfig, anchor=(), widths=None,
                 forward_loss=None) -> torch.Tensor:
    """``cohort_step`` after the host's part: fixed shapes, no value read back to the host."""
    ce = cohort_lm_losses(model, x, y)
    own = None if widths is None else own_tokens(widths, x)
    loss = ce + train.lb_weight * model_load_balance(model, train.load_balance, own).to(ce.device)
    if forward_loss is not None:
        loss = loss + forward_loss(model, own).to(ce.device)
    if anchor:
        loss = loss + proximal_term(anchor, train.prox_mu, opt.clients)
    grads = torch.autograd.grad(loss.sum(), params, allow_unused=True)
    grads = opt.flat([torch.zeros_like(p) if g is None else g for p, g in zip(params, grads)])
    if train.grad_clip:
        clip_per_client(grads, train.grad_clip)
    opt.update(grads)
    return ce.detach()


class CohortStep:
    """``cohort_step`` over fixed buffers, the cohort's expert iterations of one round. With
    ``capture`` (a CUDA device, ``graphs``: runtime.py) the whole step (forward, backward, each
    client's clip and AdamW) is captured as one CUDA graph after ``WARMUP`` eager steps, then
    replayed: one launch where eager mode issues ~1,500 kernels from Python (the H200's plain-LoRA
    step spent 43 ms in kernels and 409 ms on the host, docs/benchmarks.md "On a GPU"). The recipe
    is PyTorch's whole-network capture (torch.cuda.graphs docs, "Whole-network capture": warm-up
    on a side stream, static inputs copied in before each replay, autocast without its cast
    cache); the step has static shapes and reads nothing back to the host (``CohortAdamW.update``),
    which capture requires. Without ``capture`` (the CPU) the same step runs eagerly. A capture
    that fails is logged with its reason and the round goes on eagerly."""
    WARMUP = 3  # eager steps before capture: lazy initialisation (cuBLAS handles, autograd's buffers) happens outside it

    def __init__(self, model, params: list[nn.Parameter], opt: CohortAdamW, train: TrainConfig, capture=False, anchor=(),
                 forward_loss=None):
        self.model, self.params, self.opt, self.train, self.anchor = model, params, opt, train, anchor
        self.forward_loss = forward_loss
        # a model whose step could not be captured once (a quantised base's outlier path reads a
        # value back, bitsandbytes' int8) is not tried again each round
        capture = capture and not getattr(model, "_cohort_capture_failed", False)
        self.capture, self.calls, self.graph, self.captured = capture, 0, None, False
        self.x = self.y = self.out = None
        self.device = opt.master.device
        # one side stream for every warm-up (the recipe warms up on one stream other than the default)
        self.side = torch.cuda.Stream(self.device) if capture else None

    def __call__(self, x: torch.Tensor, y: torch.Tensor, lrs: list[float], widths=None) -> torch.Tensor:
        """One step of every client on its rows of ``x`` / ``y`` (``widths``: each client's own, where
        the cohort padded them; a captured step has one fixed shape, so none); returns each client's CE."""
        if not self.capture:
            return cohort_step(self.model, x, y, self.params, self.opt, lrs, self.train, self.anchor, widths,
                               self.forward_loss)
        assert widths is None or own_tokens(widths, x) is None, "a captured cohort step takes unpadded batches"
        # cuda:N, N > 0: warm-up, capture and replay on the model's device, not the current one
        with torch.cuda.device(self.device), self._autocast():
            self.opt.begin_step(lrs)
            if self.x is None:
                self.x, self.y = x.to(self.device), y.to(self.device)
            else:
                self.x.copy_(x, non_blocking=True)
                self.y.copy_(y, non_blocking=True)
            self.calls += 1
            if self.graph is not None:
                self.graph.replay()
                return self.out.clone()
            if self.calls <= self.WARMUP:
                self.side.wait_stream(torch.cuda.current_stream(self.device))
                with torch.cuda.stream(self.side):
                    out = _device_step(self.model, self.x, self.y, self.params, self.opt, self.train, self.anchor,
                                       forward_loss=self.forward_loss)
                torch.cuda.current_stream(self.device).wait_stream(self.side)
                return out
            return self._capture()

    @staticmethod
    def _autocast():
        """The round's autocast without its cast cache, for the warm-ups as for the capture: a graph
        cannot hold the cache's casts, and torch.compile's mixture (on by default on CUDA) would
        recompile inside the capture if its warm-ups had run under another autocast state."""
        return torch.autocast("cuda", dtype=torch.get_autocast_dtype("cuda"),
                              enabled=torch.is_autocast_enabled("cuda"), cache_enabled=False)

    def _capture(self) -> torch.Tensor:
        graph = torch.cuda.CUDAGraph()
        current = torch.cuda.current_stream(self.device)
        try:
            # captured on the warm-ups' stream, of the model's device (the default capture stream is
            # one per process, made on whichever device was current first)
            with torch.cuda.graph(graph, stream=self.side):
                self.out = _device_step(self.model, self.x, self.y, self.params, self.opt, self.train, self.anchor,
                                        forward_loss=self.forward_loss)
        except Exception as err:  # noqa: BLE001 (torch.compile's errors are not all RuntimeErrors)
            # torch.cuda.graph's exit ends the capture before it restores the stream, and a broken
            # capture makes that end raise too: the stream put back by hand, the first cause logged
            torch.cuda.set_stream(current)
            cause = err.__context__ or err
            log.warning("a cohort step could not be captured as a CUDA graph (%s: %s); it runs eagerly from now on",
                        type(cause).__name__, str(cause).splitlines()[0] if str(cause) else "")
            self.capture, self.model._cohort_capture_failed = False, True
            # the step, recorded but not run, has changed nothing on the device: run it eagerly
            return _device_step(self.model, self.x, self.y, self.params, self.opt, self.train, self.anchor,
                                forward_loss=self.forward_loss)
        self.graph, self.captured = graph, True
        graph.replay()
        return self.out.clone()


@dataclass
class CohortMember:
    """One client of a cohort: what its sequential turn would be handed (``ClientContext``'s
    client and data), its state and payload for the round, and the run's seed (its turn's
    dropout generator: ``turn_seed``)."""
    client: int
    data: object
    state: ClientState
    payload: dict
    run_seed: int = 0


def _optimizer(named, members: list[CohortMember], key: str, train: TrainConfig, masters: CohortMasters) -> CohortAdamW:
    """``make_optimizer`` for a cohort: each member's own saved moments with ``optimizer_state=run``."""
    params = [p for _, p in named]
    opt = CohortAdamW(params, train, master=masters.of(params))
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


def _batches(draw, gens, contexts):
    """Each member's batch by the sequential round's own ``draw`` (train_batch / interleaved_batch), in
    member order, each right-padded to the widest (inputs 0, targets -100: a language model's windows
    are all one width, instruction batches each their own longest example's); and each one's own width."""
    xs, ys = zip(*(draw(ctx, g) for ctx, g in zip(contexts, gens)))
    widths = [x.shape[1] for x in xs]
    wide = max(widths)
    x = torch.cat([nn.functional.pad(x, (0, wide - x.shape[1]), value=0) for x in xs])
    y = torch.cat([nn.functional.pad(y, (0, wide - y.shape[1]), value=-100) for y in ys])
    return x, y, widths


def _lockstep(algorithm, model, members, gens, contexts, step: CohortStep, routed, phase, masters, draws):
    """The round's local steps of every member, the router's every ``phase.every`` steps;
    returns (each step's per-client CE, each member's training tokens). ``draws``: the members'
    dropout generators, told each batch's widths before its forward."""
    train = algorithm.train
    total = train.rounds * train.local_steps
    losses, rows = [], {m.client: 0 for m in members}
    for _ in range(train.local_steps):
        lrs = [expert_lr(m.state.step, total, train) for m in members]
        x, y, draws.widths = _batches(algorithm.train_batch, gens, contexts)
        draws.rows, draws.wide = x.shape
        losses.append(step(x, y, lrs, draws.widths))
        for m, lr, width in zip(members, lrs, draws.widths):
            rows[m.client] += x.shape[0] // len(members) * width  # its own batch's tokens, as a turn alone counts them
            m.state.step += 1
            if step.opt.correction is not None:
                add_control_rate(m.state.extra, lr)
        if routed and members[0].state.step % phase.every == 0:  # router steps: few, run eagerly
            ropt = _optimizer(routed, members, phase.key, train, masters)
            for _ in range(phase.steps):
                x, y, draws.widths = _batches(lambda ctx, g: algorithm.interleaved_batch(ctx, phase, g), gens, contexts)
                draws.rows, draws.wide = x.shape
                ce = cohort_step(model, x, y, [p for _, p in routed], ropt, [phase.lr] * len(members), train,
                                 widths=draws.widths)
                for m, ctx, width, c in zip(members, contexts, draws.widths, ce):
                    rows[m.client] += x.shape[0] // len(members) * width
                    ctx.log.setdefault(phase.metric, []).append(c)
            _keep(ropt, members, phase.key, train)
    _keep(step.opt, members, "experts", train)
    return losses, rows


def cohort_round(algorithm, model: nn.Module, members: list[CohortMember], contexts, single: nn.Module) -> list[tuple]:
    """One local round of every member, in lockstep on ``model`` (stacked for len(members)
    clients): ``Algorithm.client_round``'s default body for each member. Returns
    [(state, upload, metrics)] in member order. ``contexts``: each member's ``ClientContext``
    (the methods' ``train_batch`` reads its data from it); ``single``: the members' architecture
    unstacked, where each member's trained adapters are loaded in turn for ``after_training``."""
    train = algorithm.train
    if len({m.state.step for m in members}) != 1:
        raise ValueError("a cohort's members must have taken the same number of steps (engines group them so)")
    for m in members:
        # on copies of the states' containers: a failed round (retried smaller) leaves each stored state as it was
        m.state = dataclasses.replace(m.state, adapters=dict(m.state.adapters), optimizers=dict(m.state.optimizers),
                                      extra=dict(m.state.extra))
        begin_control_round(m.state.extra, m.payload)
        m.state = algorithm.apply_payload(m.state, m.payload)
    names = algorithm.load_cohort(model, [m.state.adapters for m in members])
    gens = [batch_generator(m.state) for m in members]
    runtime = contexts[0].runtime
    # LoRA dropout: each member's masks from its own generator, seeded as its turn alone seeds torch's
    dropouts = [m for m in model.modules() if isinstance(m, LoRADropout)]
    draws = CohortDraws([torch.Generator(runtime.device).manual_seed(turn_seed(m.run_seed, m.client, m.state.step))
                         for m in members], [])
    for m in dropouts:
        m.draws = draws
    model.train()
    named = algorithm.train_params(model)
    params = [p for _, p in named]
    phase = algorithm.interleaved()
    routed = phase.params(model) if phase is not None else []
    # every trained tensor's fp32 master, the model computing with copies in the compute dtype
    seen = {id(p) for p in params}
    masters = CohortMasters(params + [p for _, p in routed if id(p) not in seen], runtime.dtype)
    step = None
    try:  # from the switch to the compute dtype on: loading the moments or building the step may fail too
        opt = _optimizer(named, members, "experts", train, masters)
        stacked = cohort_correction([m.state.extra for m in members], named)  # SCAFFOLD's, if any
        opt.correction = None if stacked is None else opt.flat(stacked)
        # FedProx's anchor: each member's shared tensors as the payload set them, fp32 (the masters)
        anchor = [(p, masters.of([p]).reshape(p.shape).clone()) for n, p in named if algorithm.is_shared(n)] * (train.prox_mu > 0)
        # a captured graph replays one shape and no host-side draws: batches of one width (language
        # modelling's windows), no dropout; instruction batches and dropout run their steps eagerly
        fixed = not dropouts and all(getattr(m.data, "task", "lm") == "lm" for m in members)
        step = CohortStep(model, params, opt, train, capture=runtime.graphs and fixed, anchor=anchor,
                          forward_loss=algorithm.forward_loss)
        losses, rows = _lockstep(algorithm, model, members, gens, contexts, step, routed, phase, masters, draws)
    finally:  # a failed round too leaves the model's tensors fp32 (the masters) for whatever runs next
        del step  # the captured graph's memory, before the states are read
        for m in dropouts:
            m.draws = None
        for m in model.modules():  # the routing a replay left in the graph's memory pool
            if getattr(m, "last_routing", None) is not None:
                m.last_routing = None
        masters.restore()
    per_client = torch.stack(losses).t().tolist()  # (C, steps): one device sync per round
    out = []
    for m, g, adapters, client_losses, ctx in zip(members, gens, algorithm.cohort_adapters(model, names), per_client,
                                                  contexts):
        m.state.adapters = adapters
        m.state.rng = g.get_state()
        # what the member computes with its trained model (FedAMoLE's RSEA embeddings), as its turn would
        algorithm.load_state(single, adapters)
        extra, metrics = algorithm.after_training(dataclasses.replace(ctx, model=single), m.state)
        out.append((m.state, {**algorithm.round_upload(m.state, m.payload), **extra},
                    {"train_loss": sum(client_losses) / max(1, len(client_losses)), "tokens": rows[m.client],
                     **turn_metrics(ctx), **metrics}))
    return out
