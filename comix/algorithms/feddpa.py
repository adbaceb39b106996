"""FedDPA (Yang et al., NeurIPS 2024): a global adapter learned federatedly and a local adapter
that never leaves, mixed per test instance, as its authors' code runs it (Lydia-yang/FedDPA:
code/main.py, code/fed_utils/client.py, code/GlobalModel_generated.py, code/peft/tuners/lora/layer.py).

What differs from FedIT (one LoRA on q and v, r 8, alpha 16, PEFT's alpha / r, dropout 0.05):
  * Each adapted linear carries the global LoRA (``lora``) and the local one (``lora_local``).
  * FedDPA-T (``feddpa-t``, main.py with ``--local_model True``): from the second round on, a
    client first trains its local LoRA beside the frozen global one, mixed (1 - a, a) with a =
    ``local_weight`` 0.5 (client.py set_local: the global adapter's output detached, weighted
    ``adapter_weight[1]``), then trains the global LoRA alone on the same data (the local one
    deleted for that phase), each phase as long as a round of the other methods and with a new
    optimiser (a new transformers Trainer per phase). Round 1 trains the global LoRA alone.
  * FedDPA-F (``feddpa-f``, the paper's sequential variant; the authors' code has no switch for it):
    the rounds train the global LoRA alone (FedIT); after the last round each client fine-tunes
    its local LoRA, starting from the final global LoRA, for ``finetune_steps`` (default: a
    round's local steps) with the global one frozen beside it at (1 - a, a).
  * Only the global LoRA leaves the device; the server averages it uniformly, as the authors do
    (fed_utils/model_aggregation.py: FedAvg's data-size weights commented out, weights of 1 each).
  * Scoring: instance-wise dynamic weighting (GlobalModel_generated.py ``get_weight``): an
    instance's global weight is w * mean cos(e, e_j) over 5 random local training instances j,
    w = ``dynamic_weight`` 0.5, the local weight 1 - w * mean cos; e is the last layer's hidden
    state of the instance's last token computed with the local adapter alone. comix computes e
    at every position from the position's own prefix (a causal weight per token: scoring a token
    never sees its future); at a prompt's last token this is the authors' instance weight, which
    generation keeps for every new token, as theirs does. Before the first local phase (round 1
    of FedDPA-T, every round of FedDPA-F before the fine-tuning) the local LoRA is untrained:
    the global one is scored alone, as the authors' global-only inference.
Defaults (main.py): r 8, alpha 16, dropout 0.05, q and v; AdamW at 3e-4 with transformers'
linear decay (no weight decay); 20 rounds of 10 local epochs.
"""
from __future__ import annotations

import contextlib
import dataclasses

import torch
import torch.nn.functional as F

from ..data import sample_batch
from ..models import AdapterConfig, LoRAConfig, param_role
from ..models.lora import LoRALinear
from .base import Algorithm, ClientContext, ClientState, Tensors
from .fedalt import TRAINER_PER_ROUND
from .flora import FLORA_OPTIMIZER
from .training import expert_lr, keep_optimizer, make_optimizer, train_step


STATIC_WEIGHTS = (0.5, 0.5)


def pairs(model) -> list[LoRALinear]:
    return [m for m in model.modules() if isinstance(m, LoRALinear) and m.lora_local is not None]


def set_mixing(model, weights) -> None:
    """Every pair of ``model`` at (w_global, w_local): a pair of numbers, or per sequence and
    token (batch, tokens, 2); None lets ``lora_fusion`` weigh again."""
    for m in pairs(model):
        m.instance_fusion = None if weights is None else torch.as_tensor(weights, dtype=torch.float32,
                                                                         device=m.lora.lora_A.device)


class FedDPA(Algorithm):
    name = "feddpa-t"
    section = "feddpa"
    lora_modules = 1
    dp_aggregate = True  # the global LoRA's uniform mean
    train_defaults = FLORA_OPTIMIZER
    train_defaults_source = "Lydia-yang/FedDPA main.py (lr 3e-4; a transformers Trainer per phase: AdamW, " \
                            "no decay, linear schedule, max_grad_norm 1.0)"
    fresh_optimizer_each_round = f"Lydia-yang/FedDPA main.py: {TRAINER_PER_ROUND} and phase"

    def __init__(self, lora, train, n_clients, iterative: bool = True, local_weight: float = 0.5,
                 dynamic_weight: float = 0.5, instances: int = 5, pool: int = 32, finetune_steps: int = 0,
                 alpha: float = 16.0, dropout: float = 0.05, targets: list[str] | None = None):
        super().__init__(lora, train, n_clients)
        if not 0 <= local_weight <= 1 or not 0 <= dynamic_weight <= 1 or min(instances, pool) < 1 or instances > pool:
            raise ValueError("feddpa: local_weight and dynamic_weight in [0, 1], 1 <= instances <= pool")
        self.iterative, self.local_weight, self.dynamic_weight = iterative, local_weight, dynamic_weight
        self.instances, self.pool = instances, pool
        self.finetune_steps = finetune_steps or train.local_steps
        self.alpha, self.dropout, self.targets = alpha, dropout, tuple(targets or ("q_proj", "v_proj"))

    def adapter_config(self, client: int) -> AdapterConfig:
        lora = LoRAConfig(r=self.lora.r, alpha=self.alpha, dropout=self.dropout, rslora=False)
        return AdapterConfig(lora=lora, mlp="none", attention_targets=self.targets, attention_personal=True)

    def is_shared(self, name: str) -> bool:
        return param_role(name) == "attention_lora"  # the global LoRA

    # -- client: the two phases ------------------------------------------------------------------
    def phase(self, ctx: ClientContext, state: ClientState, gen: torch.Generator, adapter: str, steps: int) -> list:
        """``steps`` steps on one adapter ("global" alone, or "local" beside the frozen global at
        (1 - a, a)) with a fresh optimiser and the round's linear schedule."""
        role = "attention_lora" if adapter == "global" else "personal_lora"
        params = [(n, p) for n, p in ctx.model.named_parameters() if param_role(n) == role]
        for n, p in ctx.model.named_parameters():
            if param_role(n) in ("attention_lora", "personal_lora"):
                p.requires_grad_(param_role(n) == role)  # the other adapter takes no gradient (detached)
        set_mixing(ctx.model, (1.0, 0.0) if adapter == "global" else (1 - self.local_weight, self.local_weight))
        opt = make_optimizer(params, state, adapter, self.train)
        schedule = dataclasses.replace(self.train, local_steps=steps)  # the phase is the Trainer's whole run
        losses = []
        try:
            for s in range(steps):
                for g in opt.param_groups:
                    g["lr"] = expert_lr(s, steps, schedule)
                x, y = sample_batch(ctx.data.train, self.train.batch_size, self.train.seq_len, gen)
                losses.append(train_step(ctx.model, x, y, [p for _, p in params], opt, self.train.grad_clip,
                                         ctx.runtime.grad_scaler(), ctx.runtime.micro_batches_of(ctx.client)))
                state.step += 1
        finally:
            set_mixing(ctx.model, None)
            for n, p in ctx.model.named_parameters():
                if param_role(n) in ("attention_lora", "personal_lora"):
                    p.requires_grad_(True)
        keep_optimizer(state, adapter, opt, self.train)
        return losses

    def local_training(self, ctx: ClientContext, state: ClientState, gen: torch.Generator) -> list[float]:
        rounds_done = state.extra.get("rounds", 0)
        losses = []
        if self.iterative and rounds_done > 0:  # main.py: ``if local_model and epoch > 0``
            self.phase(ctx, state, gen, "local", self.train.local_steps)
            state.extra["local_trained"] = True
        losses += self.phase(ctx, state, gen, "global", self.train.local_steps)
        state.extra["rounds"] = rounds_done + 1
        return torch.stack(losses).tolist()

    def client_finish(self, ctx: ClientContext, state: ClientState, payload: Tensors) -> ClientState:
        state = self.apply_payload(state, payload)
        if not self.iterative:  # FedDPA-F: the local LoRA fine-tuned from the final global one
            for n in [n for n in state.adapters if param_role(n) == "attention_lora"]:
                state.adapters[n.replace(".lora.", ".lora_local.")] = state.adapters[n].clone()
            self.load_state(ctx.model, state.adapters)
            gen = torch.Generator()
            gen.set_state(state.rng)
            ctx.model.train()
            self.phase(ctx, state, gen, "local", self.finetune_steps)
            state = self.save_state(ctx.model, state)
            state.rng = gen.get_state()
            state.extra["local_trained"] = True
        return state

    export_caveat = "the export runs the two adapters at fixed weights (0.5, 0.5), the authors' inference without " \
                    "--auto; the run scored with instance-wise weights, which need the device's training data"

    def save_state(self, model, state: ClientState) -> ClientState:
        """The pair's stored weights are the authors' fixed-weight inference (GlobalModel_generated.py
        without ``--auto``: ``weight`` 0.5 for each adapter): what an export without the dynamic
        weighting (a PEFT folder, ``comix.load_personal``) runs."""
        state = super().save_state(model, state)
        for n in state.adapters:
            if param_role(n) == "fusion":
                state.adapters[n] = torch.tensor(STATIC_WEIGHTS, dtype=state.adapters[n].dtype)
        return state

    # -- scoring: instance-wise dynamic weighting --------------------------------------------------
    def scoring(self, ctx: ClientContext, state: ClientState):
        if not state.extra.get("local_trained"):
            return _global_only(ctx.model)
        refs = references(ctx.model, ctx.data, self.pool, self.train.seq_len, seed=ctx.client)
        return DynamicWeighting(ctx.model, refs,
                                self.instances, self.dynamic_weight, seed=ctx.client)


@contextlib.contextmanager
def _global_only(model):
    set_mixing(model, (1.0, 0.0))
    try:
        yield
    finally:
        set_mixing(model, None)


def last_hidden(model, input_ids: torch.Tensor, attention_mask=None) -> torch.Tensor:
    """The last layer's hidden states (batch, tokens, d) with the local adapter alone."""
    set_mixing(model, (0.0, 1.0))
    try:
        with torch.no_grad():
            out = model(input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=True)
    finally:
        set_mixing(model, None)
    return out.hidden_states[-1].float()


def references(model, data, n: int, seq_len: int, seed: int) -> torch.Tensor:
    """(n, d): the last token's embedding of n random local training instances (an instruction
    example's prompt, or a training window of the stream)."""
    gen = torch.Generator().manual_seed(seed)
    device = next(model.parameters()).device
    train = data.train
    if isinstance(train, torch.Tensor):
        x, _ = sample_batch(train, n, seq_len, gen)
        return last_hidden(model, x.to(device))[:, -1]
    pick = torch.randint(len(train), (n,), generator=gen).tolist()
    return torch.stack([last_hidden(model, train.prompt_ids(i)[None].to(device))[0, -1] for i in pick])


class DynamicWeighting:
    """While active, every forward of ``model`` first embeds its input with the local adapter and
    weighs the pair per sequence and position: global w * mean_j cos(e_t, ref_j) over
    ``instances`` references drawn per sequence, local 1 - that. Generation (a forward given a
    cache) weighs every position, the prompt's too, with the prompt's last token's weight, one
    weight an instance as GlobalModel_generated.py computes it before ``generate``; a forward
    without a cache (scoring a continuation, perplexity) keeps each position's own causal weight."""

    def __init__(self, model, refs: torch.Tensor, instances: int, w: float, seed: int):
        self.model, self.refs, self.instances, self.w = model, refs, instances, w
        self.gen = torch.Generator().manual_seed(seed)
        self.inside, self.last, self.handle = False, None, None

    def hook(self, module, args, kwargs):
        if self.inside:
            return
        ids = kwargs.get("input_ids", args[0] if args else None)
        past = kwargs.get("cache", kwargs.get("past_key_values"))  # transformers 5 names it cache, 4 past_key_values
        if past is not None and self.last is not None and past.get_seq_length() > 0:  # a generated token
            set_mixing(module, self.last[:, None, :].expand(ids.shape[0], ids.shape[1], 2))
            return
        self.inside = True
        try:
            e = last_hidden(module, ids, kwargs.get("attention_mask"))
        finally:
            self.inside = False
        pick = torch.stack([torch.randperm(len(self.refs), generator=self.gen)[:self.instances]
                            for _ in range(ids.shape[0])])
        refs = self.refs[pick].to(e.device)  # (batch, instances, d)
        sim = F.cosine_similarity(e[:, :, None, :], refs[:, None, :, :], dim=-1).mean(-1)  # (batch, tokens)
        g = self.w * sim
        weights = torch.stack([g, 1 - g], dim=-1)
        self.last = weights[:, -1]
        if past is not None:  # generation's prompt (left-padded: its last token is every row's last)
            weights = self.last[:, None, :].expand_as(weights)
        set_mixing(module, weights)

    def __enter__(self):
        self.handle = self.model.register_forward_pre_hook(self.hook, with_kwargs=True)
        return self

    def __exit__(self, *exc):
        self.handle.remove()
        set_mixing(self.model, None)
