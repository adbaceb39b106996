"""The algorithm contract (DESIGN.md): engine-agnostic client and server steps.

An algorithm says
  * which adapters a client carries (``adapter_config(client)``: plain LoRA or a mixture, and how
    many experts for this client),
  * which parameter names may leave the device (``is_shared(name)``): every upload holds exactly
    those tensors, never specialists, routers, optimizer state or data (tests assert it),
  * ``client_round(ctx, state, payload) -> (state, upload, metrics)``: runs on the device,
  * ``server_round(server_state, uploads) -> (server_state, payloads)``: one payload per client.
Engines (in-process, Flower) only move states, uploads and payloads around.

This module holds the contract's ``Algorithm`` base class (plain LoRA clients, FedAvg's uniform
mean as the server step, Alg. 1's); what the engine hands a client and the server is in
``contexts.py``.
A client's private state (``ClientState``) and the local training it runs by default live in
``training.py``.
"""
from __future__ import annotations

import contextlib
import dataclasses
from typing import Any

import torch
from torch import nn

from ..aggregation import ServerConfig, ServerOptimizer, combine
from ..data import sample_batch
from ..models import AdapterConfig, LoRAConfig
from ..models.cohort import load_stacked, unstack
from ..privacy import PrivacyConfig
from .fedprox import proximal_anchor, proximal_term
from .scaffold import (apply_correction, begin_control_round, control_correction, control_delta_sum,
                       end_control_round, is_control, server_controls, split_controls, with_controls, zero_controls)
from .contexts import ClientContext, ServerContext, turn_metrics  # (ClientContext, ServerContext: re-exported)
from .refusals import Refusals
from .training import (ClientState, InterleavedSteps, Tensors, TrainConfig, adapter_tensors, average,
                       batch_generator, executorch_step, expert_lr, expert_params, keep_optimizer, load_adapters,
                       make_optimizer, mean_of_sums, model_load_balance, train_step)


class Algorithm(Refusals):
    """Base: plain LoRA clients, nothing shared (= Local). Subclasses state what differs; what a
    method refuses to run with, and why, is answered in refusals.py."""
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
    # Where the authors build a new optimiser every round (a transformers Trainer per round, or
    # FedAMoLE's Adam built inside each round), the source saying so: ``train.optimizer_state`` is
    # then "round" whatever a recipe shares among its methods, because moments carried over would
    # belong to adapters the round re-initialises or replaces (FLoRA's fresh LoRA, FedAMoLE's slots).
    fresh_optimizer_each_round: str | None = None
    # Why a quantised frozen base (``quant``: models/quant.py) cannot serve this method (one line),
    # or None. Clients over the shared base get it quantised by the engine; a client that holds its
    # own model (``device_spec``) gets it from ``build_device_model(spec, base, quant)``, built from
    # the base in full precision (DeepFusion's devices: models/qlora.py).
    quant_refusal_reason: str | None = None
    # The method's own optimiser where its authors give one: these train.* keys replace comix's
    # defaults (CoMiGS App. B.1, TrainConfig) unless the user's recipe or command line sets them
    # (specs.spec_config); ``train_defaults_source`` says where they come from.
    train_defaults: dict = {}
    # The per-client option a fleet may size from each device's memory budget (``<option>=auto``:
    # comix/fleet.py ``plan_capacity``) and the values it tries, smallest first; None: no such option.
    capacity: tuple[str, tuple[int, ...]] | None = None
    train_defaults_source = "CoMiGS App. B.1 (AdamW 2e-3, decay 0.01, betas (0.9, 0.95), one-cycle cosine), " \
                            "comix's TrainConfig defaults"

    def __init__(self, lora: LoRAConfig, train: TrainConfig, n_clients: int):
        if self.fresh_optimizer_each_round:
            train = dataclasses.replace(train, optimizer_state="round")
        self.lora, self.train, self.n_clients = lora, train, n_clients
        self.server: ServerContext | None = None  # set by the engine before the run
        self.privacy = PrivacyConfig()            # set by specs.build_algorithm from the config
        self.fleet = None                         # the devices as they are (comix/fleet.py), likewise
        self.aggregation_noise = None             # set by the server loop each round when DP adds noise
        # the server's combining rule and optimiser (comix/aggregation.py), set by specs.build_algorithm
        self.server_config = ServerConfig()
        self.server_optimizer: ServerOptimizer | None = None
        self.round_start: Tensors = {}            # the tensors the round's clients started from (serve sets it)

    # -- which model a client trains -------------------------------------------------------------
    def device_spec(self, client: int) -> str | None:
        """The name of ``client``'s own model when it is not the shared frozen base with this
        algorithm's adapters (DeepFusion: each device's own LM); None = the shared base."""
        return None

    def build_device_model(self, spec: str, base: nn.Module, quant: str = "none") -> nn.Module:
        """The model named by ``device_spec``, built the same way on every engine from the
        full-precision ``base``, for a device whose frozen weights are stored at ``quant``."""
        raise NotImplementedError(f"{self.name} names device models but cannot build {spec!r}")

    def check_model(self, model_config) -> list[str]:
        """What is wrong with this method's options for a base of ``model_config`` (a transformers
        config, no weights), each one line naming the config key: checked for every method before
        any data or model loads (runner.load_inputs). Nothing by default."""
        return []

    def declared_upload(self, model: nn.Module, adapters: Tensors) -> Tensors:
        """The tensors (names and shapes) this client's uploads will hold, from its freshly
        initialised model: what the server checks every later upload against (with SCAFFOLD,
        each shared tensor's variate delta beside it: algorithms/scaffold.py)."""
        upload = self.upload_of(adapters)
        return with_controls(upload, zero_controls(upload)) if self.train.scaffold else upload

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
            if t.dtype != reference[n].dtype:  # averaged with the others, it would change their precision
                return f"tensor {n} has dtype {str(t.dtype).removeprefix('torch.')}, expected " \
                       f"{str(reference[n].dtype).removeprefix('torch.')}"
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

    def dp_exempt(self, name: str) -> bool:
        """Upload tensors outside DP's clip and noise (privacy.md and the epsilon say they are not
        covered); none by default but SCAFFOLD's variates, which are no update of a parameter (the
        reported ``update_norm`` leaves them out; DP refuses SCAFFOLD)."""
        return is_control(name)

    def aggregate(self, uploads: dict[int, Tensors]) -> Tensors:
        """The mean of each uploaded tensor over its uploaders, with DP-FedAvg's noise on each sum
        when the run adds it (every DP-capable server step averages through here), or the run's
        robust rule (``server.aggregate``); then the server's optimiser step, if the run has one."""
        if self.server_config.robust:
            return self.server_step(combine(uploads, self.server_config))
        return self.server_step(average(uploads, self.aggregation_noise))

    def server_step(self, combined: Tensors) -> Tensors:
        """``server.optimizer``'s step from the round's start to ``combined`` (the combined uploads
        are the next global tensors without one: FedAvg)."""
        if self.server_optimizer is None:
            return combined
        return self.server_optimizer.step(self.round_start, combined)

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
        mean = self.aggregate({c: split_controls(up)[0] for c, up in uploads.items()})
        if self.train.scaffold:  # c + (1/N) x the round's sum of variate deltas (algorithms/scaffold.py)
            mean.update(server_controls(self.round_start, control_delta_sum(uploads), self.n_clients))
        return server_state, {c: dict(mean) for c in range(self.n_clients)}

    def server_round_of_sum(self, server_state, total: Tensors, count: int) -> tuple[Any, dict[int, Tensors]]:
        """``server_round`` when the server holds only the sum of ``count`` uploads (secure
        aggregation): the same mean, with DP's noise on the same sums in the same order."""
        mean = self.server_step(mean_of_sums(split_controls(total)[0], count, self.aggregation_noise))
        if self.train.scaffold:  # the variates' update needs only their sum too
            mean.update(server_controls(self.round_start, total, self.n_clients))
        return server_state, {c: dict(mean) for c in range(self.n_clients)}

    # -- client ------------------------------------------------------------------------------------
    def apply_payload(self, state: ClientState, payload: Tensors) -> ClientState:
        for n, t in payload.items():
            if is_control(n):  # the server's variate, taken for the round by client_round
                continue
            if n not in state.adapters or not self.is_shared(n):
                raise ValueError(f"payload tensor {n!r} is not a shared parameter of this client")
            state.adapters[n] = t.detach().clone().to(state.adapters[n].dtype)
        return state

    def load_state(self, model: nn.Module, adapters: Tensors) -> None:
        """Put a client's adapters into ``model`` (FedAMoLE also picks the model's expert slots)."""
        load_adapters(model, adapters)

    def load_cohort(self, model: nn.Module, adapters: list[Tensors]) -> list[str]:
        """``load_state`` for a cohort model (models/cohort.py): client c's adapters into slot c of
        each stacked tensor; returns the names of the model's tensors so loaded."""
        load_stacked(model, adapters)
        return list(adapters[0])

    def cohort_adapters(self, model: nn.Module, names: list[str]) -> list[Tensors]:
        """``save_state`` for a cohort model: each client's adapters, as its state names them."""
        return [self.adapters_of(tensors) for tensors in unstack(model, names)]

    def adapters_of(self, model_tensors: Tensors) -> Tensors:
        """A client's adapters as its state names them, from the model's own tensors (the same
        by default; FedAMoLE names domain experts by global id, not by model slot)."""
        return model_tensors

    def save_state(self, model: nn.Module, state: ClientState) -> ClientState:
        """Read the trained adapters back from ``model`` into ``state``."""
        state.adapters = self.adapters_of(adapter_tensors(model))
        return state

    def client_round(self, ctx: ClientContext, state: ClientState, payload: Tensors):
        begin_control_round(state.extra, payload)
        state = self.apply_payload(state, payload)
        self.load_state(ctx.model, state.adapters)
        gen = batch_generator(state)
        ctx.model.train()
        losses = self.local_training(ctx, state, gen)
        state = self.save_state(ctx.model, state)
        state.rng = gen.get_state()
        extra, metrics = self.after_training(ctx, state)
        return state, {**self.round_upload(state, payload), **extra}, \
            {"train_loss": sum(losses) / max(1, len(losses)), **turn_metrics(ctx), **metrics}

    def after_training(self, ctx: ClientContext, state: ClientState) -> tuple[Tensors, dict]:
        """What a client computes with its trained model (in ``ctx.model``) after its local steps,
        both executors alike: tensors its upload carries beside the shared ones (FedAMoLE's RSEA
        embeddings) and metrics; none by default."""
        return {}, {}

    def round_upload(self, state: ClientState, payload: Tensors) -> Tensors:
        """What leaves the device after the contract's round (both executors): the shared tensors,
        and with SCAFFOLD each one's variate delta, from the round's start (``payload``) and end."""
        return {**self.upload_of(state.adapters), **end_control_round(state.extra, payload, state.adapters)}

    def personal_adapters(self, ctx: ClientContext, state: ClientState, payload: Tensors) -> Tensors:
        """The adapters this client holds after taking ``payload`` (what it is evaluated with),
        without changing ``state``."""
        personal = ClientState(adapters=dict(state.adapters), extra=state.extra)
        if self.evaluate_local:
            return personal.adapters
        return self.apply_payload(personal, payload).adapters

    # what an exported personal model lacks of how the run scored it (None: nothing), one line
    export_caveat: str | None = None

    def scoring(self, ctx: ClientContext, state: ClientState):
        """A context manager under which the personal model (already in ``ctx.model``) is scored:
        how it runs at test time when that differs from training (FedDPA's instance-wise weights
        of its two adapters); nothing by default."""
        return contextlib.nullcontext()

    def client_finish(self, ctx: ClientContext, state: ClientState, payload: Tensors) -> ClientState:
        """After the last server round: take the final payload (FDLoRA also fuses here)."""
        return state if self.evaluate_local else self.apply_payload(state, payload)

    def regularizer(self, ctx: ClientContext, state: ClientState) -> torch.Tensor:
        """Extra term of the local loss (HetLoRA's rank regulariser); none by default."""
        return torch.zeros(())

    def forward_loss(self, model: nn.Module, own: torch.Tensor | None = None) -> torch.Tensor:
        """A term of the local loss that the model's last forward defines besides the CE and
        ``train.load_balance`` (FedAMoLE's eq. 19-20), both executors alike: a scalar, or in a
        cohort one per client (``own``: each client's own tokens, where the cohort padded); 0 here, on
        the model's device (a cohort's captured step takes no tensor made on the host)."""
        return torch.zeros((), device=next(model.parameters()).device)

    def local_training(self, ctx: ClientContext, state: ClientState, gen: torch.Generator) -> list[float]:
        """``local_steps`` expert iterations with AdamW; returns the training losses."""
        params = self.train_params(ctx.model)
        opt = make_optimizer(params, state, "experts", self.train)
        scaler = ctx.runtime.grad_scaler()
        total = self.train.rounds * self.train.local_steps
        mu = self.train.prox_mu
        anchor = proximal_anchor(params, self.is_shared) if mu > 0 else []  # fixed for the round
        corr = control_correction(state.extra)  # SCAFFOLD's c - c_i, None without it
        controlled = [(p, corr[n]) for n, p in params if n in corr] if corr is not None else None
        losses = []
        for _ in range(self.train.local_steps):
            lr = expert_lr(state.step, total, self.train)
            for g in opt.param_groups:
                g["lr"] = lr
            x, y = self.train_batch(ctx, gen)
            if self.train.runtime_of(ctx.client) == "executorch":  # the step's forward-backward in the device runtime
                loss = executorch_step(ctx.model, x, y, params, opt, self.train.grad_clip, *self._load_balance(ctx))
            else:
                loss = train_step(ctx.model, x, y, [p for _, p in params], opt, self.train.grad_clip, scaler,
                                  ctx.runtime.micro_batches_of(ctx.client),
                                  lambda: (self.train.lb_weight * model_load_balance(ctx.model, self.train.load_balance)
                                           + self.forward_loss(ctx.model) + self.regularizer(ctx, state)
                                           + (proximal_term(anchor, mu) if anchor else 0.0)))
            if controlled is not None:
                apply_correction(controlled, lr, state.extra)
            losses.append(loss)
            state.step += 1
            self.after_expert_step(ctx, state, gen)
        keep_optimizer(state, "experts", opt, self.train)
        return torch.stack(losses).tolist()  # one device sync per round, not one per step

    def interleaved(self) -> InterleavedSteps | None:
        """The steps of a second optimiser this method interleaves with its expert iterations
        (CoMiGS's router steps), or None."""
        return None

    def after_expert_step(self, ctx: ClientContext, state: ClientState, gen: torch.Generator) -> None:
        """After each expert iteration: the ``interleaved`` steps when their period comes."""
        phase = self.interleaved()
        if phase is None or state.step % phase.every != 0 or not phase.params(ctx.model):
            return
        named = phase.params(ctx.model)
        opt = make_optimizer(named, state, phase.key, self.train, lr=phase.lr)
        scaler = ctx.runtime.grad_scaler()
        load_balance, settings = self._load_balance(ctx)
        for _ in range(phase.steps):
            x, y = self.interleaved_batch(ctx, phase, gen)
            if self.train.runtime_of(ctx.client) == "executorch":  # the router step in the device runtime too
                ce = executorch_step(ctx.model, x, y, named, opt, self.train.grad_clip, load_balance, settings)
            else:
                ce = train_step(ctx.model, x, y, [p for _, p in named], opt, self.train.grad_clip, scaler,
                                ctx.runtime.micro_batches_of(ctx.client), load_balance)
            ctx.log.setdefault(phase.metric, []).append(ce)
        keep_optimizer(state, phase.key, opt, self.train)

    def _load_balance(self, ctx: ClientContext):
        """(the load-balance term of a step's forward, its settings): what an ExecuTorch step adds to
        its CE, exactly the term ``train_step``'s ``extra`` adds on the PyTorch path (eq. 7-8)."""
        lb_weight, weighting = self.train.lb_weight, self.train.load_balance
        return (lambda: lb_weight * model_load_balance(ctx.model, weighting)), (lb_weight, weighting)

    def interleaved_batch(self, ctx: ClientContext, phase: InterleavedSteps, gen: torch.Generator):
        """A batch of one ``interleaved`` step, from the client's ``phase.split``: the one place both
        executors draw it (a cohort's members each from their own generator, algorithms/cohort.py)."""
        split = ctx.data.valid if phase.split == "valid" else ctx.data.train
        return sample_batch(split, self.train.batch_size, self.train.seq_len, gen)

    def train_batch(self, ctx: ClientContext, gen: torch.Generator):
        """A batch of one expert iteration, drawn here for both executors."""
        data = ctx.data
        if isinstance(data, list):  # pooled: the same batch size from every user (Centralized)
            xs, ys = zip(*(sample_batch(u.train, self.train.batch_size, self.train.seq_len, gen) for u in data))
            return torch.cat(xs), torch.cat(ys)
        return sample_batch(data.train, self.train.batch_size, self.train.seq_len, gen)
