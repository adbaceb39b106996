"""The local training every method shares: the training config (every optimisation choice and its
source), the learning-rate schedule, AdamW with per-client moments, one gradient step, the LM
loss and the load-balance term, and moving adapter tensors between a model and a client's
state. ``base.py`` holds the contract; this module holds what its default ``local_training``
and the methods' own loops are made of."""
from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn

from ..models import MixtureOfLoRAMLP, load_balance_loss, mixtures, param_role
from ..models.cohort import clients_of
from ..runtime import at_least_fp32, to_cpu

Tensors = dict[str, torch.Tensor]


@dataclass
class TrainConfig:
    """Local training, one place for every optimisation choice and its source.

    Paper = CoMiGS (ICML 2025) App. B.1; authors = epfml/CoMiGS, where the paper is silent.
      lr 2e-3, "one-cycle cosine" .... paper. The authors' one cycle is torch's CosineAnnealingLR
                                        from lr to lr/10 over rounds x local_steps, no warm-up
                                        (collab_utils/clients.py): ``min_lr_ratio`` 0.1,
                                        ``warmup_frac`` 0.
      router_lr 2e-3, constant ......... paper (ConstantLR in the authors' clients.py).
      AdamW betas (0.9, 0.95) .......... authors (clients.py: configure_optimizers(betas=...)).
      weight_decay 1e-2 ................ authors (collab_run*.py: -wd default 1e-2); applied to both
                                        optimizers here (the authors build both in one
                                        configure_optimizers(weight_decay=...) call).
      grad_clip 0 (none) ............... authors (clients.py clips nothing).
      tau 30, router_steps 10 .......... paper App. B.1 (update period and steps of Alg. 1).
      lb_weight 0.01, uniform .......... paper Sec. 3.3 / App. B.1 ("always applied").
      10 local steps, 20 rounds, 64x128  paper App. B.1.
      optimizer_state "run" ............ authors: one AdamW per client for the whole run, its
                                        moments carried from round to round (clients.py builds
                                        the optimizers once in Client.__init__).
    FedAMoLE's recipes (configs/fedamole/) set the journal's Sec. V-A-4 instead: Adam (AdamW with
    weight_decay 0, betas (0.9, 0.999): torch's Adam defaults) at 5e-5, ``schedule: round_decay``
    (lr x ``lr_decay`` = 0.99 per round, the reference's ``--lr_decay``), batch 1, 200 steps, and
    ``optimizer_state: round``: the FedAMoLE authors build a fresh Adam every round, for FedAMoLE
    (node.py, Client.train_experts) and every baseline (baselines/trainer.py, init_optimizer in
    each round's fed_avg), so moments and Adam's bias correction restart each round. FedAMoLE
    itself always runs so (algorithms/fedamole.py: its moments would belong to slots, not experts).
    At n = 2 experts with top-2 routing every expert is always selected (f_j = 1), so the
    load-balance loss n * sum_j f_j P_j = 2 is a constant with zero gradient: it changes
    nothing for 1G1S / 2G / 2S / pFedMoE (and Table 6's n = 2 rows are equal by construction).
    """
    rounds: int = 20                # communication rounds
    local_steps: int = 10           # expert iterations per round (paper App. B.1)
    batch_size: int = 64            # sequences per local step
    seq_len: int = 128              # tokens per training window (instruction examples: data.max_len)
    lr: float = 2e-3                # expert lr: cosine from lr to lr * min_lr_ratio
    min_lr_ratio: float = 0.1       # the cosine schedule's floor, as a share of lr
    schedule: str = "cosine"        # cosine | round_decay (lr * lr_decay ** round: FedAMoLE) | round_linear
                                    # (lr to 0 linearly within each round: a Trainer per round, FLoRA / FedALT)
    lr_decay: float = 0.99          # round_decay's factor per round
    warmup_frac: float = 0.0        # share of the schedule spent in linear warm-up (authors: none)
    weight_decay: float = 0.01      # AdamW's decoupled weight decay
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])  # AdamW's moment decays
    optimizer_state: str = "run"    # run (moments kept across rounds: CoMiGS) | round (fresh each round: FedAMoLE)
    grad_clip: float = 0.0          # max gradient norm; 0 = no clipping
    router_lr: float = 2e-3         # constant (App. B.1)
    tau: int = 30                   # router update period, in expert iterations
    router_steps: int = 10          # router steps each period, on validation batches
    lb_weight: float = 0.01         # lambda in eq. 7-8
    load_balance: str = "uniform"   # none | uniform | generalist (eq. 10)
    clients_per_round: int = 0      # clients sampled each round; 0 = client_fraction of them
    client_fraction: float = 1.0    # share of the clients sampled (1.0: full participation, as in the papers)
    client_sampling: str = "fixed"  # fixed (that many, without replacement) | poisson (each client with
                                    # probability client_fraction: DP-FedAvg's sampling, McMahan et al. 2018)
    eval_every: int = 1             # evaluate valid/test perplexity every k rounds (and the last)
    eval_clients: int = 0           # > 0: rounds before the last score a seeded sample of this many clients
    eval_batch_size: int = 8        # windows per evaluation forward
    eval_splits: list[str] = field(default_factory=lambda: ["valid", "test"])  # splits scored (valid and/or test)
    max_new_tokens: int = 128       # generation tasks: greedy answer length cap (FedAMoLE's evaluator)
    rouge: str = "rouge"            # Rouge-L of generations: rouge (the authors' package) | rouge-score (eval/tasks.py)
    tensorboard: bool = False       # also TensorBoard event files per method and user (comix/tracking.py)
    mlflow: bool = False            # also an MLflow run per method: a local store in its folder, or mlflow_uri
    mlflow_uri: str = ""            # an MLflow tracking server or store URI ("" = <method folder>/mlflow.db)
    wandb: bool = False             # also a W&B run per method (comix/tracking.py)
    wandb_mode: str = "offline"     # offline (synced later by wandb sync) | online
    # clients trained together in one step over the shared base (algorithms/cohort.py; in-process
    # engine): 1 = one after another; N = cohorts of up to N; auto = as many as memory holds
    cohort: int | str = 1
    # FedProx (Li et al., MLSys 2020, eq. 2): mu/2 ||w - w^t||^2 added to each local step's loss,
    # over the shared parameters only, w^t the round's payload (what the client started from)
    prox_mu: float = 0.0
    # SCAFFOLD (Karimireddy et al., ICML 2020, option II): control variates correct each local step
    # of the shared parameters; the upload adds each one's variate delta (algorithms/scaffold.py)
    scaffold: bool = False
    # where a device's local steps run: pytorch | executorch (each step's forward-backward in
    # ExecuTorch's training runtime, the program a phone runs: models/executorch_training.py), or
    # one per client (a federation some of whose devices train in ExecuTorch)
    client_runtime: str | list[str] = "pytorch"

    def runtime_of(self, client: int) -> str:
        """Where client ``client``'s local steps run (``client_runtime``)."""
        return self.client_runtime if isinstance(self.client_runtime, str) else self.client_runtime[client]

    @property
    def runtimes(self) -> set[str]:
        """Every runtime some client's local steps run in."""
        return {self.client_runtime} if isinstance(self.client_runtime, str) else set(self.client_runtime)


# FedAMoLE journal Sec. V-A-4: "the Adam optimizer with ... a learning rate 5e-5 ... and a learning
# rate decay of 0.99 per round" (Adam = AdamW without decay; torch's betas, as the authors'
# node.py builds torch.optim.Adam with defaults), a fresh optimiser every round (node.py
# Client.train_experts). Its baselines (FedIT, FedPrompt, FedPTuning, FDLoRA) share it (Sec. V-A-4).
FEDAMOLE_OPTIMIZER = dict(lr=5e-5, schedule="round_decay", lr_decay=0.99, weight_decay=0.0, betas=[0.9, 0.999],
                          optimizer_state="round")
FEDAMOLE_OPTIMIZER_SOURCE = "FedAMoLE journal Sec. V-A-4 (Adam 5e-5, x0.99 a round); node.py (fresh Adam each round)"


@dataclass
class ClientState:
    """Everything that stays on a device between rounds."""
    adapters: Tensors                      # all of this client's adapter tensors
    optimizers: dict[str, Any] = field(default_factory=dict)  # name -> optimizer.state_dict() (optimizer_state=run)
    rng: torch.Tensor | None = None        # batch-sampling generator state
    step: int = 0                          # expert iterations done so far (t in Alg. 1)
    extra: dict = field(default_factory=dict)  # method-specific private state (ranks, trust, ...)



def turn_seed(run_seed: int, client: int, step: int) -> int:
    """The seed of torch's generators for one client's round (its LoRA dropout masks), from the run's
    seed, the client and the steps it has taken: a client's masks do not depend on which clients
    ran before it in the process, and every executor (one at a time, a cohort, one Flower process
    per device) draws the same ones."""
    return (run_seed * 1_000_003 + client) * 1_000_003 + step


def batch_generator(state: ClientState) -> torch.Generator:
    """This client's batch-sampling generator, continued from its saved state."""
    gen = torch.Generator()
    if state.rng is not None:
        gen.set_state(state.rng)
    return gen


def tensor_bytes(tensors: Tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


def expert_lr(step: int, total: int, train: TrainConfig) -> float:
    """The expert learning rate at ``step`` (from 0) of ``total``: optional linear warm-up, then
    cosine annealing from ``lr`` to ``lr * min_lr_ratio`` (torch's CosineAnnealingLR with
    eta_min, as the authors' clients.py)."""
    if train.schedule == "round_decay":  # constant within a round, x lr_decay after each
        return train.lr * train.lr_decay ** (step // train.local_steps)
    if train.schedule == "round_linear":  # transformers' Trainer built afresh each round: linear to 0, no warm-up
        return train.lr * (train.local_steps - step % train.local_steps) / train.local_steps
    total = max(total, 1)
    up = int(train.warmup_frac * total)
    if step < up:
        return train.lr * (step + 1) / up
    low = train.lr * train.min_lr_ratio
    frac = min(1.0, (step - up) / max(1, total - up))
    return low + (train.lr - low) * (1 + math.cos(math.pi * frac)) / 2


def average(uploads: dict[int, Tensors], noise=None) -> Tensors:
    """Uniform mean of each tensor over the clients that uploaded it (CoMiGS eq. 4). ``noise``
    (DP-FedAvg, ``privacy.GaussianSumNoise``) is added to each tensor's *sum* before the division,
    tensors taken in sorted name order so that every engine draws the same noise."""
    names = sorted({n for u in uploads.values() for n in u})
    sums, counts, dtypes = {}, {}, {}
    for n in names:
        ts = [u[n] for u in uploads.values() if n in u]
        sums[n], counts[n], dtypes[n] = torch.stack([at_least_fp32(t) for t in ts]).sum(0), len(ts), ts[0].dtype
    return mean_of_sums(sums, counts, noise, dtypes)


def mean_of_sums(sums: Tensors, counts: dict[str, int] | int, noise=None, dtypes: dict | None = None) -> Tensors:
    """Each sum (noised first, when DP adds noise) divided by its count, names in sorted order:
    the server's half of ``average``, also all that a server under secure aggregation holds
    (the sum of the uploads, never one upload)."""
    out = {}
    for n in sorted(sums):
        count = counts if isinstance(counts, int) else counts[n]
        out[n] = ((noise(sums[n]) if noise else sums[n]) / count).to((dtypes or {}).get(n, sums[n].dtype))
    return out


# -- helpers shared by algorithms and engines ------------------------------------------------------
def adapter_tensors(model: nn.Module) -> Tensors:
    """A CPU copy of every adapter tensor (client states live on the CPU between turns)."""
    return {n: p.detach().to("cpu", copy=True) for n, p in model.named_parameters() if param_role(n) != "base"}


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


def make_optimizer(params, state: ClientState, key: str, train: TrainConfig, lr: float | None = None,
                   fused: bool = True):
    """AdamW with the run's betas and weight decay (TrainConfig lists the sources); with
    ``optimizer_state="run"`` loaded with this client's own moments for ``key`` ("experts",
    "router", ...), with ``"round"`` fresh (moments and bias correction start again).
    ``fused``: torch's fused AdamW, the same update in one kernel a tensor, where torch's default
    on the CPU loops over ~10 elementwise passes a tensor: transformers' Trainer's default since
    torch 2.8 (``adamw_torch_fused``, training_args.py). On 420 tensors of SmolLM2's LoRA shapes:
    3.7 ms a step against 19.2 ms, the parameters equal to 1.1e-7 relative after 12 steps (2-core
    EPYC, 2026-12-04; the main job's round against a Trainer's: bench/trainer_peer.py); full
    fine-tuning of a 268M-parameter device spent about 12 % of its step in the loop (py-spy)."""
    opt = torch.optim.AdamW([p for _, p in params], lr=train.lr if lr is None else lr,
                            betas=tuple(train.betas), weight_decay=train.weight_decay, **({"fused": True} if fused else {}))
    if train.optimizer_state == "run" and key in state.optimizers:  # this client's own moments only
        opt.load_state_dict(state.optimizers[key])
        # a saved state's group names its own implementation, which load_state_dict takes over:
        # the one asked for here steps, its step counts on the parameters' device as it needs them
        for group in opt.param_groups:
            group["fused"], group["foreach"] = (True, None) if fused else (None, group.get("foreach"))
            for p in group["params"]:
                if fused and "step" in opt.state.get(p, {}):
                    opt.state[p]["step"] = opt.state[p]["step"].to(p.device, torch.float32)
    return opt


@contextlib.contextmanager
def sparse_tied_embedding_grads(model: nn.Module):
    """Within it, a model whose input embedding is tied to its output projection (Gemma-3, SmolLM2)
    takes its embedding's gradient as sparse rows, the rows of the batch's tokens, not a dense
    vocabulary x width tensor of zeros (262k x 640 for Gemma-3-270M) that autograd then adds to
    the output projection's dense gradient: the tied weight's gradient is the same sum, dense, and
    the fill and the add took about 19 % of a Gemma-3-270M full fine-tuning step (py-spy, 2-core
    EPYC). An untied embedding is left alone (its gradient would be sparse, which AdamW refuses)."""
    emb, out = model.get_input_embeddings(), model.get_output_embeddings()
    tied = isinstance(emb, nn.Embedding) and out is not None and out.weight is emb.weight and emb.weight.requires_grad
    was = emb.sparse if tied else None
    if tied:
        emb.sparse = True
    try:
        yield tied
    finally:
        if tied:
            emb.sparse = was


def keep_optimizer(state: ClientState, key: str, opt: torch.optim.Optimizer, train: TrainConfig) -> None:
    """Store ``opt``'s moments in the client's state for the next round (``optimizer_state="run"``);
    with ``"round"`` nothing is kept, so no moment can outlive the round that made it."""
    if train.optimizer_state == "run":
        state.optimizers[key] = to_cpu(opt.state_dict())
    else:
        state.optimizers.pop(key, None)


def step_on(loss: torch.Tensor, params: list[nn.Parameter], opt: torch.optim.Optimizer, clip: float,
            scaler: "torch.amp.GradScaler | None" = None, measure=None) -> None:
    """Gradients of ``loss`` w.r.t. ``params`` only (torch.autograd.grad), so no other
    parameter receives or keeps a gradient: the router step cannot leak validation data into
    experts and router gradients cannot accumulate between updates (DESIGN.md's reference bugs).
    ``scaler``: fp16's dynamic loss scale (a step with inf/NaN gradients is skipped).
    ``measure(grads)``, if given, reads the (unscaled) gradients before the step while the graph is
    still there, so a measurement of the loss's parts can reuse the step's own backward pass."""
    grads = _gradients(loss, params, scaler, retain_graph=measure is not None)
    if measure is not None:
        measure([g / scaler.get_scale() for g in grads] if scaler else grads)
    apply_step(params, grads, opt, clip, scaler)


def _gradients(loss: torch.Tensor, params: list[nn.Parameter], scaler, retain_graph: bool = False) -> list[torch.Tensor]:
    grads = torch.autograd.grad(scaler.scale(loss) if scaler else loss, params, allow_unused=True,
                                retain_graph=retain_graph)
    return [torch.zeros_like(p) if g is None else g for p, g in zip(params, grads)]


def apply_step(params: list[nn.Parameter], grads: list[torch.Tensor], opt: torch.optim.Optimizer, clip: float,
               scaler: "torch.amp.GradScaler | None" = None) -> None:
    """One optimiser step with ``grads`` as the gradients of ``params`` (clipped to norm ``clip``
    when > 0); the gradients are dropped after it. Each gradient is made contiguous first: torch's
    fused CPU AdamW (make_optimizer) reads a transposed or expanded gradient as if it were laid
    out as its parameter (torch 2.13, measured: one 8 x 6 parameter three steps at lr 1e-2 is
    0.059 off the for-loop AdamW with a transposed gradient, 0 with it contiguous), and autograd
    hands such gradients back (a product with ``weight.t()``)."""
    for p, g in zip(params, grads):
        p.grad = g.contiguous()
    if scaler:
        scaler.unscale_(opt)
    if clip:
        torch.nn.utils.clip_grad_norm_(params, clip)
    if scaler:
        scaler.step(opt)
        scaler.update()
    else:
        opt.step()
    for p in params:
        p.grad = None


def executorch_step(model: nn.Module, x: torch.Tensor, y: torch.Tensor, named: list[tuple[str, nn.Parameter]],
                    opt: torch.optim.Optimizer, clip: float, extra=None, extra_key: tuple = ()) -> torch.Tensor:
    """``train_step`` with the loss's forward and backward run by ExecuTorch's training runtime
    (``train.client_runtime=executorch``): the program takes the model's current adapters (all of
    them: a router step's forward reads the experts, an expert step's the router), returns the CE
    and the gradients of CE + ``extra()`` (a term of the same forward, keyed by ``extra_key``), and
    AdamW steps over ``named``'s gradients here (the runtime's only optimiser is SGD)."""
    from ..models.executorch_training import program_for, watch_step
    program = program_for(model, x, y, extra, extra_key)
    missing = {n for n, _ in named} - set(program.names)
    if missing:
        raise RuntimeError(f"the ExecuTorch program does not train {sorted(missing)[:3]}, which the step's optimiser holds")
    program.load_from(model)
    loss, grads = program.forward_backward(x, y)
    watch_step(model, x, program)
    apply_step([p for _, p in named], [grads[n] for n, _ in named], opt, clip)
    return loss.detach()


def train_step(model: nn.Module, x: torch.Tensor, y: torch.Tensor, params: list[nn.Parameter],
               opt: torch.optim.Optimizer, clip: float, scaler: "torch.amp.GradScaler | None" = None,
               micro_batches: int = 1, extra=None) -> torch.Tensor:
    """One optimiser step on the batch (``x``, ``y``): the mean next-token CE plus ``extra()``
    (a term of the last forward, such as the load balance, or of the parameters alone), its
    gradients by ``step_on``'s rule. With ``micro_batches`` > 1 the batch is computed in that many
    slices, one forward and backward at a time, each slice's gradients weighted by its share of
    the batch's targets and summed before the one step (gradient accumulation, as the HF Trainer's
    ``gradient_accumulation_steps``: a device whose one-step activations exceed its memory
    budget). The CE's gradient is then the whole batch's; a per-forward term such as the load
    balance becomes the slices' weighted mean. Returns the batch's CE (detached)."""
    slices = [(xs, ys) for xs, ys in zip(x.chunk(micro_batches), y.chunk(micro_batches)) if (ys != -100).any()]
    if micro_batches <= 1 or not slices:  # (a batch without targets: as unsliced, whatever that gives)
        loss = lm_loss(model, x, y)
        step_on(loss + extra() if extra else loss, params, opt, clip, scaler)
        return loss.detach()
    targets = [int((ys != -100).sum()) for _, ys in slices]
    grads, ce = None, []
    for (xs, ys), n in zip(slices, targets):
        share = n / sum(targets)
        loss = lm_loss(model, xs, ys)
        g = _gradients(share * (loss + extra() if extra else loss), params, scaler)
        grads = g if grads is None else [a.add_(b) for a, b in zip(grads, g)]
        ce.append(share * loss.detach())
    apply_step(params, grads, opt, clip, scaler)
    return torch.stack(ce).sum()


def lm_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy over the targets that are not -100 (instruction data: the
    response only); the batch (sampled on the CPU) moves to the model's device. A model that
    prepends virtual tokens (prompt tuning) returns logits for them too: the last positions are
    the inputs'."""
    device = model.get_input_embeddings().weight.device
    x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
    logits = model(input_ids=x).logits[:, -x.shape[1]:]
    return nn.functional.cross_entropy(at_least_fp32(logits).reshape(-1, logits.shape[-1]), y.reshape(-1))


def model_load_balance(model: nn.Module, weighting: str, own: torch.Tensor | None = None) -> torch.Tensor:
    """Mean over blocks of each block's load-balance loss (from its last forward); for a cohort
    (models/cohort.py) one such mean per client, shape (clients,), over each client's ``own``
    tokens where the cohort padded its batch (``load_balance_loss``)."""
    clients = clients_of(model)
    layers = [m for m in mixtures(model) if isinstance(m, MixtureOfLoRAMLP) and m.last_routing is not None
              and m.n_experts > 1]
    if not layers or weighting == "none":  # on the model's device: a cohort's captured step copies nothing in
        return torch.zeros((clients,) if clients > 1 else (), device=next(model.parameters()).device)
    return torch.stack([load_balance_loss(m.last_routing, m.n_experts, weighting, clients, own) for m in layers]).mean(0)


@dataclass(frozen=True)
class InterleavedSteps:
    """Steps of a second optimiser interleaved with the expert iterations, stated so that both
    executors (one client at a time: ``Algorithm.after_expert_step``; a cohort in lockstep:
    algorithms/cohort.py) run the same ones: after every ``every``-th expert iteration, ``steps``
    steps of the parameters ``params(model)`` on fresh batches of the client's ``split``, with
    the AdamW named ``key`` in the client's state at the constant ``lr``, minimising the LM loss
    plus lb_weight x the load balance (CoMiGS Alg. 1 and eq. 8: the router on validation data)."""
    key: str
    every: int
    steps: int
    split: str
    lr: float
    params: Callable[[nn.Module], list[tuple[str, nn.Parameter]]]

    @property
    def metric(self) -> str:  # the round's metric of these steps' CE (router_valid_loss: eq. 8's CE)
        return f"{self.key}_{self.split}_loss"
