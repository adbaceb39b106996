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
local training loop (AdamW, cosine schedule, optional load balance; TrainConfig lists each
choice and its source) and uniform
FedAvg aggregation of the shared tensors (Alg. 1's server step).
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..data import UserData, sample_batch
from ..privacy import PrivacyConfig
from ..models import AdapterConfig, LoRAConfig, MixtureOfLoRAMLP, load_balance_loss, mixtures, param_role
from ..runtime import Runtime, to_cpu

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
    rounds: int = 20
    local_steps: int = 10           # expert iterations per round (paper App. B.1)
    batch_size: int = 64
    seq_len: int = 128
    lr: float = 2e-3                # expert lr: cosine from lr to lr * min_lr_ratio
    min_lr_ratio: float = 0.1
    schedule: str = "cosine"        # cosine | round_decay (lr * lr_decay ** round: FedAMoLE)
    lr_decay: float = 0.99
    warmup_frac: float = 0.0        # share of the schedule spent in linear warm-up (authors: none)
    weight_decay: float = 0.01
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    optimizer_state: str = "run"    # run (moments kept across rounds: CoMiGS) | round (fresh each round: FedAMoLE)
    grad_clip: float = 0.0          # max gradient norm; 0 = no clipping
    router_lr: float = 2e-3         # constant (App. B.1)
    tau: int = 30                   # router update period, in expert iterations
    router_steps: int = 10          # router steps each period, on validation batches
    lb_weight: float = 0.01         # lambda in eq. 7-8
    load_balance: str = "uniform"   # none | uniform | generalist (eq. 10)
    clients_per_round: int = 0      # clients sampled each round; 0 = client_fraction of them
    client_fraction: float = 1.0    # (1.0: full participation, as in the papers)
    client_sampling: str = "fixed"  # fixed (that many, without replacement) | poisson (each client with
                                    # probability client_fraction: DP-FedAvg's sampling, McMahan et al. 2018)
    eval_every: int = 1             # evaluate valid/test perplexity every k rounds (and the last)
    eval_batch_size: int = 8
    eval_splits: list[str] = field(default_factory=lambda: ["valid", "test"])
    max_new_tokens: int = 128       # generation tasks: greedy answer length cap (FedAMoLE's evaluator)


@dataclass
class ClientState:
    """Everything that stays on a device between rounds."""
    adapters: Tensors                      # all of this client's adapter tensors
    optimizers: dict[str, Any] = field(default_factory=dict)  # name -> optimizer.state_dict() (optimizer_state=run)
    rng: torch.Tensor | None = None        # batch-sampling generator state
    step: int = 0                          # expert iterations done so far (t in Alg. 1)
    extra: dict = field(default_factory=dict)  # method-specific private state (ranks, trust, ...)


@dataclass
class ClientContext:
    """What the engine hands a client for its turn: the model with this client's architecture
    (frozen base shared by all clients, on the run's device), its private data, the run's
    training config and where/in which precision it computes (``Runtime``)."""
    client: int
    model: nn.Module
    data: UserData | list[UserData]
    train: TrainConfig
    runtime: Runtime = field(default_factory=Runtime)


@dataclass
class ServerContext:
    """What an algorithm's server may use besides the uploads, handed to every algorithm before a
    run (``Algorithm.server``): the run's base model (on the run's device), the server's own
    data (``data.splits.ServerData``: public and test streams; None unless the config asks for
    it), the runtime, the method's output folder and the seed. Most methods ignore it; DeepFusion
    distils into copies of the base on the public data and scores its global model on the test."""
    base: nn.Module | None
    data: Any = None
    runtime: Runtime = field(default_factory=Runtime)
    out_dir: Any = None
    seed: int = 0


def batch_generator(state: ClientState) -> torch.Generator:
    """This client's batch-sampling generator, continued from its saved state."""
    gen = torch.Generator()
    if state.rng is not None:
        gen.set_state(state.rng)
    return gen


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


def tensor_bytes(tensors: Tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


def expert_lr(step: int, total: int, train: TrainConfig) -> float:
    """The expert learning rate at ``step`` (from 0) of ``total``: optional linear warm-up, then
    cosine annealing from ``lr`` to ``lr * min_lr_ratio`` (torch's CosineAnnealingLR with
    eta_min, as the authors' clients.py)."""
    if train.schedule == "round_decay":  # constant within a round, x lr_decay after each
        return train.lr * train.lr_decay ** (step // train.local_steps)
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
    out = {}
    for n in names:
        ts = [u[n] for u in uploads.values() if n in u]
        total = torch.stack([t.float() for t in ts]).sum(0)
        out[n] = ((noise(total) if noise else total) / len(ts)).to(ts[0].dtype)
    return out


class Algorithm:
    """Base: plain LoRA clients, nothing shared (= Local). Subclasses state what differs."""
    name = "local"
    trains = True
    pooled = False               # one model trained on every user's data (Centralized)
    lora_modules = 2             # "2x LoRA modules" on the MLP to match CoMiGS-1G1S (paper Sec. 4.2)
    common_init = False          # every client starts from the *same* adapters (FFA-LoRA's frozen A)
    section: str | None = None   # the config section holding this method's options
    # Post-aggregation fine-tuning (FedAMoLE's "-FT" baselines, after Yu et al.): each client's
    # personal model is the latest global model fine-tuned on its own data. As the reference
    # (train_baselines.py, --do_ft) does, that fine-tuning is the client's local training of the
    # next round: a client is evaluated on the model it holds after local training, before the
    # new aggregate replaces it, and keeps that model at the end.
    evaluate_local = False
    needs_server_data = False    # the server distils / tunes / scores on data of its own (DeepFusion)
    # Client-level DP (comix/privacy.py): offered when the server's step is a mean of the uploads
    # through ``aggregate`` (this base's server_round, or a subclass that says ``dp_aggregate``);
    # ``dp_refusal`` says why a method cannot offer it.
    dp_aggregate = False
    dp_refusal_reason: str | None = None

    def __init__(self, lora: LoRAConfig, train: TrainConfig, n_clients: int):
        self.lora, self.train, self.n_clients = lora, train, n_clients
        self.server: ServerContext | None = None  # set by the engine before the run
        self.privacy = PrivacyConfig()            # set by specs.build_algorithm from the config
        self.aggregation_noise = None             # set by the server loop each round when DP adds noise

    # -- which model a client trains -------------------------------------------------------------
    def device_spec(self, client: int) -> str | None:
        """The name of ``client``'s own model when it is not the shared frozen base with this
        algorithm's adapters (DeepFusion: each device's own LM); None = the shared base."""
        return None

    def build_device_model(self, spec: str, base: nn.Module) -> nn.Module:
        """The model named by ``device_spec``, built the same way on every engine."""
        raise NotImplementedError(f"{self.name} names device models but cannot build {spec!r}")

    def check_model(self, model_config) -> list[str]:
        """What is wrong with this method's options for a base of ``model_config`` (a transformers
        config, no weights), each one line naming the config key: checked for every method before
        any data or model loads (runner.load_inputs). Nothing by default."""
        return []

    def declared_upload(self, model: nn.Module, adapters: Tensors) -> Tensors:
        """The tensors (names and shapes) this client's uploads will hold, from its freshly
        initialised model: what the server checks every later upload against."""
        return self.upload_of(adapters)

    # -- what a client carries and what may leave it ---------------------------------------------
    def adapter_config(self, client: int) -> AdapterConfig:
        # Attention LoRA at rank r; `lora_modules` rank-r modules on each MLP linear (AdapterConfig).
        lora = LoRAConfig(r=self.lora.r, alpha=self.lora.alpha, dropout=self.lora.dropout)
        return AdapterConfig(lora=lora, mlp="lora", mlp_lora=dataclasses.replace(lora, modules=self.lora_modules))

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

    def expected_upload(self, server_state, client: int, reference: Tensors) -> Tensors:
        """The names and shapes ``client``'s upload must have this round (by default those of
        its initial upload; FedAMoLE: the experts the server assigned it)."""
        return reference

    def server_evaluate(self, server_state) -> dict[str, dict] | None:
        """Metrics of a *global* model the server holds, scored on the server's own test data,
        keyed by test domain (DeepFusion's global MoE); None: the clients evaluate themselves."""
        return None

    def server_report(self, server_state) -> dict:
        """What the server logs after a round (server.jsonl), e.g. FedAMoLE's assignment."""
        return {}

    @classmethod
    def dp_refusal(cls) -> str | None:
        """Why this method cannot offer client-level DP (one line), or None when it can."""
        if cls.dp_refusal_reason:
            return cls.dp_refusal_reason
        if cls.pooled or not cls.trains:
            return "it uploads nothing (one pooled model or no training): there is no upload to protect"
        if not cls.dp_aggregate and cls.server_round is not Algorithm.server_round:
            return "its server step is not a mean of the clients' uploads, so DP-FedAvg's noisy clipped sum " \
                   "gives it no guarantee"
        return None

    def dp_exempt(self, name: str) -> bool:
        """Upload tensors outside DP's clip and noise (privacy.md and the epsilon say they are not
        covered); none by default."""
        return False

    def aggregate(self, uploads: dict[int, Tensors]) -> Tensors:
        """The mean of each uploaded tensor over its uploaders, with DP-FedAvg's noise on each sum
        when the run adds it: every DP-capable server step averages through here."""
        return average(uploads, self.aggregation_noise)

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
        mean = self.aggregate(uploads)
        return server_state, {c: dict(mean) for c in range(self.n_clients)}

    # -- client ------------------------------------------------------------------------------------
    def apply_payload(self, state: ClientState, payload: Tensors) -> ClientState:
        for n, t in payload.items():
            if n not in state.adapters or not self.is_shared(n):
                raise ValueError(f"payload tensor {n!r} is not a shared parameter of this client")
            state.adapters[n] = t.detach().clone().to(state.adapters[n].dtype)
        return state

    def load_state(self, model: nn.Module, adapters: Tensors) -> None:
        """Put a client's adapters into ``model`` (FedAMoLE also picks the model's expert slots)."""
        load_adapters(model, adapters)

    def adapters_of(self, model_tensors: Tensors) -> Tensors:
        """A client's adapters as its state names them, from the model's own tensors (the same
        by default; FedAMoLE names domain experts by global id, not by model slot)."""
        return model_tensors

    def save_state(self, model: nn.Module, state: ClientState) -> ClientState:
        """Read the trained adapters back from ``model`` into ``state``."""
        state.adapters = self.adapters_of(adapter_tensors(model))
        return state

    def client_round(self, ctx: ClientContext, state: ClientState, payload: Tensors):
        state = self.apply_payload(state, payload)
        self.load_state(ctx.model, state.adapters)
        gen = batch_generator(state)
        ctx.model.train()
        losses = self.local_training(ctx, state, gen)
        state = self.save_state(ctx.model, state)
        state.rng = gen.get_state()
        upload = self.upload_of(state.adapters)
        return state, upload, {"train_loss": sum(losses) / max(1, len(losses))}

    def personal_adapters(self, ctx: ClientContext, state: ClientState, payload: Tensors) -> Tensors:
        """The adapters this client holds after taking ``payload`` (what it is evaluated with),
        without changing ``state``."""
        personal = ClientState(adapters=dict(state.adapters), extra=state.extra)
        if self.evaluate_local:
            return personal.adapters
        return self.apply_payload(personal, payload).adapters

    def client_finish(self, ctx: ClientContext, state: ClientState, payload: Tensors) -> ClientState:
        """After the last server round: take the final payload (FDLoRA also fuses here)."""
        return state if self.evaluate_local else self.apply_payload(state, payload)

    def regularizer(self, ctx: ClientContext, state: ClientState) -> torch.Tensor:
        """Extra term of the local loss (HetLoRA's rank regulariser); none by default."""
        return torch.zeros(())

    def local_training(self, ctx: ClientContext, state: ClientState, gen: torch.Generator) -> list[float]:
        """``local_steps`` expert iterations with AdamW; returns the training losses."""
        params = self.train_params(ctx.model)
        opt = make_optimizer(params, state, "experts", self.train)
        scaler = ctx.runtime.grad_scaler()
        total = self.train.rounds * self.train.local_steps
        losses = []
        for _ in range(self.train.local_steps):
            for g in opt.param_groups:
                g["lr"] = expert_lr(state.step, total, self.train)
            x, y = self.train_batch(ctx, gen)
            loss = lm_loss(ctx.model, x, y)
            total_loss = (loss + self.train.lb_weight * model_load_balance(ctx.model, self.train.load_balance)
                          + self.regularizer(ctx, state))
            step_on(total_loss, [p for _, p in params], opt, self.train.grad_clip, scaler)
            losses.append(loss.detach())
            state.step += 1
            self.after_expert_step(ctx, state, gen)
        keep_optimizer(state, "experts", opt, self.train)
        return torch.stack(losses).tolist()  # one device sync per round, not one per step

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


def make_optimizer(params, state: ClientState, key: str, train: TrainConfig, lr: float | None = None):
    """AdamW with the run's betas and weight decay (TrainConfig lists the sources); with
    ``optimizer_state="run"`` loaded with this client's own moments for ``key`` ("experts",
    "router", ...), with ``"round"`` fresh (moments and bias correction start again)."""
    opt = torch.optim.AdamW([p for _, p in params], lr=train.lr if lr is None else lr,
                            betas=tuple(train.betas), weight_decay=train.weight_decay)
    if train.optimizer_state == "run" and key in state.optimizers:  # this client's own moments only
        opt.load_state_dict(state.optimizers[key])
    return opt


def keep_optimizer(state: ClientState, key: str, opt: torch.optim.Optimizer, train: TrainConfig) -> None:
    """Store ``opt``'s moments in the client's state for the next round (``optimizer_state="run"``);
    with ``"round"`` nothing is kept, so no moment can outlive the round that made it."""
    if train.optimizer_state == "run":
        state.optimizers[key] = to_cpu(opt.state_dict())
    else:
        state.optimizers.pop(key, None)


def step_on(loss: torch.Tensor, params: list[nn.Parameter], opt: torch.optim.Optimizer, clip: float,
            scaler: "torch.amp.GradScaler | None" = None) -> None:
    """Gradients of ``loss`` w.r.t. ``params`` only (torch.autograd.grad), so no other
    parameter receives or keeps a gradient: the router step cannot leak validation data into
    experts and router gradients cannot accumulate between updates (DESIGN.md's reference bugs).
    ``scaler``: fp16's dynamic loss scale (a step with inf/NaN gradients is skipped)."""
    grads = torch.autograd.grad(scaler.scale(loss) if scaler else loss, params, allow_unused=True)
    for p, g in zip(params, grads):
        p.grad = torch.zeros_like(p) if g is None else g
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


def lm_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy over the targets that are not -100 (instruction data: the
    response only); the batch (sampled on the CPU) moves to the model's device. A model that
    prepends virtual tokens (prompt tuning) returns logits for them too: the last positions are
    the inputs'."""
    device = model.get_input_embeddings().weight.device
    x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
    logits = model(input_ids=x).logits[:, -x.shape[1]:]
    return nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1))


def model_load_balance(model: nn.Module, weighting: str) -> torch.Tensor:
    """Mean over blocks of each block's load-balance loss (from its last forward)."""
    layers = [m for m in mixtures(model) if isinstance(m, MixtureOfLoRAMLP) and m.last_routing is not None
              and m.n_experts > 1]
    if not layers or weighting == "none":
        return torch.zeros(())
    return torch.stack([load_balance_loss(m.last_routing, m.n_experts, weighting) for m in layers]).mean()
