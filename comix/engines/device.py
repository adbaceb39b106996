"""One client's side of federated training, whatever carries the messages (in-process calls or
Flower messages). A ``Device`` answers three requests:

  * ``init()``: create this client's private state (if it has none yet) and return its freshly
    initialised shared tensors (the server builds round 1's payloads from them);
  * ``train(payload, round, finish)``: one local round (``Algorithm.client_round``), then with
    ``finish`` the algorithm's final step on the last payload (``client_finish``);
  * ``evaluate(payload)``: the task metrics of the model this client holds after the round.
Private state (adapters incl. specialists and routers, optimizer moments, RNG) lives in a
``StateStore`` (engines/states.py): memory, or files keyed by the client id so that a restarted device
continues.
"""
from __future__ import annotations

import math
import time
from pathlib import Path

import torch
from torch import nn

from ..algorithms import Algorithm, ClientContext, ClientState
from ..algorithms.base import Tensors
from ..algorithms.training import adapter_tensors, turn_seed
from ..data import UserData
from ..eval import perplexity
from ..eval.perplexity import cohort_split_nll
from ..eval.tasks import split_accuracy, split_predictions, split_response_nll, split_rouge_l
from ..models import mixtures, routing_stats, set_record_stats
from ..models.amole import AMoLELinear
from ..models.lease import LeaseLinear
from ..models.quant import base_bytes
from ..models.lora import LoRALinear, LoRAWeights
from ..models.mixture import gate_entropy
from ..privacy import clip_upload
from .footprint import Footprint
from .states import StateStore
from ..runtime import Runtime, note_runtime


def fresh_adapters(model: nn.Module, seed: int) -> dict[str, torch.Tensor]:
    """Re-initialise every adapter of ``model`` from ``seed`` and return them (CPU copies). The
    random draws happen on the CPU, so a run starts from the same adapters on every device."""
    gen = torch.Generator().manual_seed(seed)

    def kaiming(p: torch.Tensor) -> None:  # nn.Linear's / PEFT's init: kaiming_uniform(a=sqrt(5))
        w = torch.empty(p.shape, dtype=torch.float32)
        nn.init.kaiming_uniform_(w, a=math.sqrt(5), generator=gen)
        p.data.copy_(w)

    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, LoRAWeights):
                kaiming(m.lora_A)
                m.lora_B.zero_()
            if isinstance(m, LoRALinear) and m.lora_fusion is not None:
                m.lora_fusion.fill_(1.0)
            if isinstance(m, LoRALinear) and m.lora_mixer is not None:  # FedALT's token mixer
                kaiming(m.lora_mixer.weight)
            if isinstance(m, LoRALinear) and m.lora_merged is not None:  # FLoRA: nothing merged yet
                m.lora_merged.zero_()
            if isinstance(m, LeaseLinear):  # FedLEASE: the router, and the warm-up's one expert
                kaiming(m.lease_router.weight)
                m.lease_state.copy_(torch.tensor([1.0, 0.0]))
        for m in mixtures(model):
            if m.router is not None:
                kaiming(m.router.weight)
            if isinstance(m, AMoLELinear):
                for a in m.expert_A:
                    kaiming(a)
                m.expert_B.zero_()
                kaiming(m.token_proj if m.token_proj is not None else m.vanilla_router.weight)
        for m in model.modules():
            init = getattr(m, "comix_init", None)  # a PEFT soft prompt (models/inject.add_soft_prompt)
            if init is None:
                continue
            for name, p in m.named_parameters():
                if type(m).__name__ == "PromptEmbedding":  # prompt tuning: the TEXT init, deterministic
                    p.copy_(init[name])
                elif p.dim() == 2 and name.endswith("embedding.weight"):  # P-tuning: nn.Embedding's N(0, 1)
                    p.copy_(torch.randn(p.shape, generator=gen))
                elif p.dim() == 2:
                    kaiming(p)
                else:  # nn.Linear's bias init: U(-1/sqrt(fan_in), 1/sqrt(fan_in))
                    fan_in = dict(m.named_parameters())[name[:-len("bias")] + "weight"].shape[1]
                    p.copy_((torch.rand(p.shape, generator=gen) * 2 - 1) / math.sqrt(fan_in))
    return adapter_tensors(model)


def evaluate(model: nn.Module, user: UserData, train, runtime: Runtime = Runtime()) -> dict:
    """What a client reports after a round, chosen by its data's task (``train`` = the run's
    TrainConfig): perplexity of each of ``train.eval_splits`` (on instruction data: of the
    responses); for classification the test accuracy (%) and how often each label was
    predicted, for generation the test Rouge-L (%) of
    greedy answers of at most ``train.max_new_tokens`` (FedAMoLE Sec. V-A-2); mixtures add their
    mean gate per layer and expert and each layer's mean gate entropy (nats) on one validation
    batch."""
    seq_len, batch_size = train.seq_len, train.eval_batch_size
    out = {}
    was_training = model.training
    model.eval()  # no dropout in any evaluation
    try:
        with runtime.autocast():
            for s in train.eval_splits:
                if user.task == "lm":
                    out[f"{s}_ppl"] = perplexity(model, user.tokens(s), seq_len, batch_size)
                else:
                    total, n = split_response_nll(model, user.tokens(s), batch_size)
                    out[f"{s}_ppl"] = math.exp(total / max(1, n))
            if "test" in train.eval_splits and user.task == "classification":
                pred = split_predictions(model, user.test, user.choices, batch_size)
                out["test_acc"] = split_accuracy(model, user.test, user.choices, predictions=pred)
                # how often each label was predicted: a model that answers one label whatever the
                # input has learnt the client's label prior, not the task (docs/fedamole.md)
                out["test_predicted"] = {c: pred.count(c) for c in user.choices}
            elif "test" in train.eval_splits and user.task == "generation":
                scores = split_rouge_l(model, user.test, train.max_new_tokens, batch_size)
                out["test_rouge_l"] = scores[train.rouge]  # the run's metric; the other beside it
                out.update({f"test_rouge_l_{k.replace('-', '_')}": v for k, v in scores.items() if k != train.rouge})
    finally:
        model.train(was_training)
    if mixtures(model):  # mean gate per layer and expert on one validation batch
        set_record_stats(model, True)
        if user.task == "lm":
            rows = max(1, min(4, (len(user.valid) - 1) // seq_len))
            batch = user.valid[:rows * seq_len].long().reshape(rows, seq_len)
        else:
            batch = user.valid.sample(min(4, len(user.valid)), torch.Generator().manual_seed(0))[0]
        with torch.inference_mode(), runtime.autocast():
            model.eval()
            model(input_ids=batch.to(runtime.device))
        out["gates"] = [[round(v, 4) for v in s["mean_gate"].tolist()] for s in routing_stats(model)]
        out["gate_entropy"] = [round(float(s["entropy"]), 4) for s in routing_stats(model)]
        set_record_stats(model, False)
    return out


def evaluate_cohort(model: nn.Module, users: list[UserData], train, runtime: Runtime = Runtime()) -> list[dict] | None:
    """``evaluate`` of each client of a cohort model at once (LM data: each split's perplexity, and
    a mixture's mean gate per layer and expert and gate entropy per layer on its own validation
    batch), or None when this
    data is not for it (instruction tasks): then the clients are evaluated one at a time."""
    if any(u.task != "lm" for u in users):
        return None
    seq_len = train.seq_len
    rows = [max(1, min(4, (len(u.valid) - 1) // seq_len)) for u in users]
    out = [{} for _ in users]
    was_training = model.training
    model.eval()
    try:
        with runtime.autocast():
            for s in train.eval_splits:
                for o, (total, n) in zip(out, cohort_split_nll(model, [u.tokens(s) for u in users], seq_len,
                                                              train.eval_batch_size)):
                    o[f"{s}_ppl"] = math.exp(total / n)
        if mixtures(model):  # each client's rows padded to the most any has; its gates over its own rows
            most = max(rows)
            batch = torch.zeros(len(users), most, seq_len, dtype=torch.long)
            for c, (u, r) in enumerate(zip(users, rows)):
                batch[c, :r] = u.valid[:r * seq_len].long().reshape(r, seq_len)
            with torch.inference_mode(), runtime.autocast():
                model(input_ids=batch.reshape(-1, seq_len).to(runtime.device))
                gates = [m.last_routing.dense_gates(m.n_experts).float().reshape(len(users), most * seq_len, -1)
                         for m in mixtures(model)]
            for c, (o, r) in enumerate(zip(out, rows)):  # each client's own experts' gates (FedAMoLE: its held slots)
                own = [g[c, :r * seq_len, :m.experts_of(c)] for g, m in zip(gates, mixtures(model))]
                o["gates"] = [[round(v, 4) for v in g.mean(0).tolist()] for g in own]
                o["gate_entropy"] = [round(float(gate_entropy(g)), 4) for g in own]
    finally:
        model.train(was_training)
    return out


def planned_base_bytes(base: nn.Module) -> dict[str, float]:
    """The frozen base's bytes as a device stores it at each precision: its block linears in the
    run's dtype (4 bytes fp32, 2 bf16 / fp16), 1 byte + a scale per row, or half a byte + a scale
    per block of 64 (bitsandbytes' int8 and NF4 storage); embeddings, norms and head as they are."""
    from ..models.inject import transformer_blocks
    linears = [m for b in transformer_blocks(base) for m in b.modules() if type(m) is nn.Linear]
    if not linears:  # GPT-2's Conv1D blocks: no quantised form (models/quant.py quant_refusal)
        return {"none": float(base_bytes(base))}
    weights = sum(m.weight.numel() for m in linears)
    rows = sum(m.out_features for m in linears)
    size = linears[0].weight.element_size()
    rest = base_bytes(base) - weights * size
    # q4: HQQ's 4-bit codes, a 16-bit scale and a zero in the run's dtype per group of 32 (models/quant.py)
    return {"none": rest + weights * size, "int8": rest + weights + rows * 4,
            "q4": rest + weights / 2 + weights / 32 * (2 + size), "nf4": rest + weights / 2 + weights / 64}


def training_memory(base: nn.Module, algorithm: Algorithm, user: UserData, client: int = 0,
                    measured: dict | None = None, micro_batches: tuple[int, ...] = (1,),
                    precisions: tuple[str, ...] | None = None, activations: dict | None = None
                    ) -> dict[tuple[str, int], float]:
    """MB client ``client`` of ``algorithm`` needs to train on ``user``'s data, with the
    unquantised ``base`` (on the run's device, in its dtype) at each precision (``precisions``, or
    every one the base has) and each batch in each number of ``micro_batches`` slices:
    {(precision, slices): MB}. Measured on a copy of the base quantised as the device would hold
    it: the base's bytes (``base_bytes``, what a round reports), the trainable state (parameters,
    gradients, AdamW's moments, fp32; with slices one more gradient, the sum the slices accumulate
    into), the peak of one training step (``Footprint``: its first batch, or that batch's first
    slice), and the process's runtime (``note_runtime``). ``measured`` memoises by adapter architecture and
    batch shape: clients alike are measured once. ``activations``, when given, receives the step's
    peak alone by the same keys (MB; what a captured CUDA graph holds for a round, cohort_size)."""
    import copy

    from ..models import inject_adapters
    from ..models.quant import quantize_base
    cfg = algorithm.adapter_config(client)
    gen = torch.Generator().manual_seed(0)
    x, y = algorithm.train_batch(ClientContext(client, None, user, algorithm.train), gen)
    precisions = tuple(q for q in planned_base_bytes(base) if precisions is None or q in precisions)
    key = (repr(cfg), tuple(x.shape), tuple(micro_batches), precisions)
    if measured is not None and key in measured:
        if activations is not None:
            activations.update(measured[key][1])
        return measured[key][0]
    # measured where and as the run holds its base (a run's base is on its device, in its dtype
    # before the fleet is planned): the adapters follow it, and the step runs under the autocast
    # the run trains with (comix/runtime.py), else a bf16 base meets fp32 adapters
    weight = next(p for p in base.parameters() if p.is_floating_point())
    autocast = torch.autocast(weight.device.type, dtype=weight.dtype, enabled=weight.dtype != torch.float32,
                              cache_enabled=False)  # as Runtime.autocast: no cast outlives a step
    runtime = note_runtime()
    from ..algorithms.training import lm_loss
    need, peaks = {}, {}
    for q in precisions:
        # each precision's step on its own quantised base: dequantising a block's weights adds
        # transients the full-precision step has not (CoMiGS-1G1S on SmolLM2-135M, 1 x 128 tokens:
        # +22.5 MB on the int8 and q4 bases, where planning on the fp32 step put a 1 GB phone 22 MB over)
        model = inject_adapters(quantize_base(copy.deepcopy(base), q, weight.dtype, weight.device), cfg)
        model = model.to(weight.device).train()
        fresh_adapters(model, 0)
        params, stored = sum(p.numel() for p in model.parameters() if p.requires_grad), base_bytes(model)
        for m in micro_batches:
            with Footprint(model) as footprint, autocast:
                lm_loss(model, x.chunk(m)[0], y.chunk(m)[0]).backward()
            model.zero_grad(set_to_none=True)
            trainable = params * (16 if m == 1 else 20)
            need[q, m] = runtime + (stored + trainable + footprint.peak) / 2**20
            peaks[q, m] = footprint.peak / 2**20
        del model
    if measured is not None:
        measured[key] = (need, peaks)
    if activations is not None:
        activations.update(peaks)
    return need


class Device:
    def __init__(self, algorithm: Algorithm, model: nn.Module, data: UserData | list[UserData], client: int,
                 seed: int, store: StateStore, runtime: Runtime = Runtime()):
        self.algorithm, self.model, self.data, self.client = algorithm, model, data, client
        self.seed, self.store, self.runtime = seed, store, runtime

    def init(self) -> Tensors:
        a, c = self.algorithm, self.client
        if c not in self.store:
            init_seed = self.seed + 1 if a.common_init else self.seed + 1 + c
            self.store[c] = ClientState(adapters=a.adapters_of(fresh_adapters(self.model, init_seed)),
                                        rng=torch.Generator().manual_seed(self.seed * 1000 + c).get_state())
        # the declared upload is built from the run seed's adapters: the same for every client of
        # one model, so made once per model (a 1,000-client run re-initialised them 1,000 times)
        declared = getattr(self.model, "comix_declared", None)
        if declared is None or declared[0] != (id(a), self.seed):
            self.model.comix_declared = declared = (
                (id(a), self.seed), a.declared_upload(self.model, a.adapters_of(fresh_adapters(self.model, self.seed))))
        return {n: t.clone() for n, t in declared[1].items()}

    def context(self) -> ClientContext:
        return ClientContext(self.client, self.model, self.data, self.algorithm.train, self.runtime)

    def train(self, payload: Tensors) -> tuple[Tensors, dict]:
        """One round of local training; the metrics add what FedAMoLE's Table IV reports per client:
        ``train_s`` (wall time of the round on this device), ``trainable_mb`` (what training holds
        beyond the frozen base: the trainable parameters, their gradients and AdamW's two moments,
        all fp32) and, on CUDA, ``peak_mem_mb`` (torch's peak allocation during the round); and what
        the device spent (``Footprint``): ``tokens`` of its training forwards, ``quant`` and ``base_mb`` (the
        frozen base's precision and its bytes at it), ``activation_mb`` (one step's peak beyond what
        the model holds), ``runtime_mb`` (``note_runtime``) and ``memory_mb`` = runtime + base +
        trainable + activations, its training memory."""
        cuda = self.runtime.device.type == "cuda"
        if cuda:
            torch.cuda.reset_peak_memory_stats(self.runtime.device)
        t0 = time.perf_counter()
        state = self.store[self.client]
        # dropout draws from torch's global generator, seeded for the round (training.turn_seed)
        with torch.random.fork_rng(devices=[self.runtime.device] if cuda else []), self.runtime.autocast(), \
                Footprint(self.model) as footprint:
            torch.manual_seed(turn_seed(self.seed, self.client, state.step))
            state, upload, metrics = self.algorithm.client_round(self.context(), state, payload)
        metrics["tokens"] = footprint.tokens
        if self.algorithm.train.runtime_of(self.client) != "pytorch":  # (a federation some of whose devices do)
            metrics["client_runtime"] = self.algorithm.train.runtime_of(self.client)
        self.store[self.client] = state
        return self.reply(payload, upload, metrics, time.perf_counter() - t0, footprint.peak)

    def reply(self, payload: Tensors, upload: Tensors, metrics: dict, seconds: float, activation_bytes: int
              ) -> tuple[Tensors, dict]:
        """What leaves the device after its round, however it was trained (alone, or in a cohort:
        engines/inprocess.py): the upload, clipped here for DP-FedAvg, and the round's metrics."""
        # DP-FedAvg's clip, here on the device: nothing unclipped leaves it. The norm of the update
        # (upload minus payload) is reported whatever the clip: what a user sets privacy.clip from.
        if upload and self.algorithm.dp_refusal() is None:
            upload, norm = clip_upload(upload, payload, self.algorithm.privacy.clip, self.algorithm.dp_exempt)
            metrics["update_norm"] = round(norm, 6)
        metrics["train_s"] = round(seconds, 4)
        trainable = sum(p.numel() for p in self.model.parameters() if p.requires_grad)
        metrics["trainable_mb"] = round(trainable * 4 * 4 / 2**20, 3)
        base_mb = base_bytes(self.model) / 2**20
        micro = self.runtime.micro_batches_of(self.client)
        held = metrics["trainable_mb"] * (1.25 if micro > 1 else 1)  # slices: one more gradient, their sum
        runtime = note_runtime()
        metrics.update(quant=self.runtime.quant_of(self.client), micro_batches=micro, runtime_mb=runtime,
                       base_mb=round(base_mb, 3), activation_mb=round(activation_bytes / 2**20, 3),
                       memory_mb=round(runtime + base_mb + held + activation_bytes / 2**20, 3))
        if self.runtime.device.type == "cuda":
            metrics["peak_mem_mb"] = round(torch.cuda.max_memory_allocated(self.runtime.device) / 2**20, 1)
        return upload, metrics

    def finish(self, payload: Tensors) -> None:
        with self.runtime.autocast():
            state = self.algorithm.client_finish(self.context(), self.store[self.client], payload)
        self.store[self.client] = state

    def personal_model(self, payload: Tensors) -> nn.Module:
        """The model this client holds after the round: its own state with the new payload applied."""
        with self.runtime.autocast():
            adapters = self.algorithm.personal_adapters(self.context(), self.store[self.client], payload)
        self.algorithm.load_state(self.model, adapters)
        return self.model

    def evaluate(self, payload: Tensors, user: UserData) -> dict:
        t0 = time.perf_counter()
        model = self.personal_model(payload)
        with self.algorithm.scoring(self.context(), self.store[self.client]):
            out = evaluate(model, user, self.algorithm.train, self.runtime)
        return {**out, "eval_s": round(time.perf_counter() - t0, 4)}  # Table IV's testing latency
