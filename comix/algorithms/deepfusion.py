"""DeepFusion (Li et al., Sec. III-IV): one-shot federated distillation of heterogeneous
on-device LMs into a global MoE. This module holds the server's steps; the device side is plain
local training of the device's own model (``models/prune.py`` and ``models/base.py`` build them).

1. Devices train their own LM and send it once, with a data embedding (``data/embed.py``).
2. Local knowledge clustering (Sec. IV-B): KMeans into K domains on the cosine similarity of
   the data embeddings (``cluster_devices``).
3. A proxy teacher per domain: the weight average of the cluster's same-architecture models
   (Fig. 4; ``proxy_teachers``). Mixed-architecture clusters (the paper's clusters are "of the
   same type"; ours come from embeddings and may mix): one proxy per architecture present, and
   the cluster's distillation loss is the sum of the per-proxy losses weighted by the share of
   the cluster's devices of that architecture (``cluster_loss_weights``), so no device's model
   is dropped and a cluster of one architecture is exactly the paper's rule.
4. Cross-architecture KD of each domain's proxies into a copy of the dense base on public server
   data: L = CE + alpha * FM + beta * KL (eq. 11; ``kd_loss``) with the View-Aligned Attention
   feature loss (``models/vaa.py``).
5. Upcycling the K distilled dense models into one MoE (``models/upcycle.py``) and tuning all
   but its experts on public data.

Tokenizers: teachers and the student must read the same token ids (the offline devices are all
derived from SmolLM2's tokenizer: pruned SmolLM2, or random Llama/GPT-2/Qwen2-style configs with
its vocabulary); a teacher whose vocabulary differs is refused with one line
(``check_same_vocabulary``) rather than distilled through a guessed mapping.
"""
from __future__ import annotations

import copy
import logging
import math
import random
import time
import warnings

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from transformers import AutoTokenizer

from ..data import sample_batch
from ..data.embed import MINILM, SentenceEncoder
from ..eval.perplexity import split_token_stats
from ..eval.tasks import generated_token_accuracy
from ..files import atomic_write
from ..models.base import tokenizer_source
from ..models.devices import build_device_model, device_layers, device_problems, parse_device_spec
from ..models.upcycle import expert_params, upcycle
from ..models.vaa import ViewAlignedAttention, stage_ends, stage_features
from ..runtime import Runtime, offload
from .base import (Algorithm, ClientContext, ClientState, ServerContext, Tensors, batch_generator, expert_lr,
                   lm_loss, make_optimizer, step_on)

log = logging.getLogger("comix.deepfusion")


def cluster_devices(embeddings: torch.Tensor, k: int, seed: int = 0) -> list[int]:
    """Each device's domain in [0, K): KMeans on the L2-normalised embeddings, which is KMeans
    on cosine similarity (||a - b||^2 = 2 - 2 cos(a, b) for unit vectors; eq. 6)."""
    from sklearn.cluster import KMeans

    n = embeddings.shape[0]
    if not 1 <= k <= n:
        raise ValueError(f"deepfusion.experts = K = {k} must lie in [1, N = {n}] (the number of devices)")
    x = F.normalize(embeddings.double(), dim=-1).numpy()
    if len(np.unique(x.round(12), axis=0)) < k:
        raise ValueError(f"deepfusion.experts = K = {k} exceeds the {len(np.unique(x.round(12), axis=0))} distinct "
                         "device embeddings: some domains would be empty")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        labels = KMeans(n_clusters=k, n_init=10, random_state=seed).fit_predict(x)
    return [int(c) for c in labels]


def architecture_of(model: nn.Module) -> str:
    """What must match for two models' weights to be averaged: class and every shape."""
    c = model.config
    keys = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "n_embd", "n_layer", "n_head", "n_inner")
    return type(model).__name__ + "(" + ",".join(f"{k}={getattr(c, k)}" for k in keys if hasattr(c, k)) + ")"


@torch.no_grad()
def average_models(models: list[nn.Module]) -> nn.Module:
    """The element-wise mean of same-architecture models (a proxy teacher, Fig. 4), a new model."""
    arch = {architecture_of(m) for m in models}
    if len(arch) != 1:
        raise ValueError(f"cannot average models of different architectures: {sorted(arch)}")
    proxy = copy.deepcopy(models[0])
    states = [m.state_dict() for m in models]
    proxy.load_state_dict({n: torch.stack([s[n].float() for s in states]).mean(0).to(t.dtype)
                           for n, t in states[0].items()})
    return proxy.eval()


def proxy_teachers(models: list[nn.Module], labels: list[int], k: int) -> list[list[tuple[nn.Module, float]]]:
    """Per domain, [(proxy teacher, loss weight)]: one proxy per architecture among the domain's
    devices (their weight average), weighted by that architecture's share of the domain."""
    out = []
    for c in range(k):
        members = [m for m, lab in zip(models, labels) if lab == c]
        by_arch: dict[str, list[nn.Module]] = {}
        for m in members:
            by_arch.setdefault(architecture_of(m), []).append(m)
        out.append([(average_models(ms), len(ms) / len(members)) for _, ms in sorted(by_arch.items())])
    return out


def check_same_vocabulary(teacher: nn.Module, student: nn.Module) -> None:
    """Logit KL and position-aligned features need one token space (see the module docstring)."""
    tv, sv = teacher.config.vocab_size, student.config.vocab_size
    if tv != sv:
        raise ValueError(f"deepfusion: a teacher ({type(teacher).__name__}) has vocab_size {tv}, the student {sv}; "
                         "teachers must share the student's tokenizer")


def hidden_width(model: nn.Module) -> int:
    c = model.config
    return getattr(c, "hidden_size", None) or c.n_embd


def kd_loss(student_out, teacher_out, targets: torch.Tensor, vaa: ViewAlignedAttention | None, stages: int,
            alpha: float, beta: float, temperature: float = 1.0, ofa: "OFABranches | None" = None) -> dict:
    """Eq. 11 for one teacher on a batch whose next tokens are ``targets`` (B, T), aligned with
    the logits: CE of the student, alpha * FM and beta * KL(teacher || student) of the next-token
    distributions (eq. 10) at ``temperature`` with the usual T^2 factor, averaged over tokens.
    FM is VAA's (eq. 9) with ``vaa``; none when alpha = 0 or no module is given (the logit-only
    baseline). With ``ofa`` (OFA-KD, Hao et al. 2023) the logit terms are OFA's own: FM is the sum
    over the student's intermediate-stage branches of the OFA loss of each branch's logits, and
    the final logits' term is the OFA loss in place of the KL. Returns the terms and their total."""
    logits = student_out.logits.float()
    ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
    log_t = F.log_softmax(teacher_out.logits.float() / temperature, -1)

    def kl_to_teacher(student_logits: torch.Tensor) -> torch.Tensor:
        log_s = F.log_softmax(student_logits.float() / temperature, -1)
        return (log_t.exp() * (log_t - log_s)).sum(-1).mean() * temperature ** 2

    fm = logits.new_zeros(())
    if ofa is not None:
        kl = ofa_loss(logits, teacher_out.logits, targets, ofa.eps, ofa.temperature)
        if alpha:
            fm = sum(ofa_loss(z, teacher_out.logits, targets, ofa.eps, ofa.temperature)
                     for z in ofa(stage_features(student_out.hidden_states, stages)[:-1]))
        return {"ce": ce, "fm": fm, "kl": kl, "total": ce + alpha * fm + beta * kl}
    kl = kl_to_teacher(logits)
    if alpha and vaa is not None:
        fm = vaa.loss(stage_features(student_out.hidden_states, stages),
                      stage_features(teacher_out.hidden_states, stages))
    return {"ce": ce, "fm": fm, "kl": kl, "total": ce + alpha * fm + beta * kl}


def ofa_loss(student_logits: torch.Tensor, teacher_logits: torch.Tensor, targets: torch.Tensor, eps: float = 1.0,
             temperature: float = 1.0) -> torch.Tensor:
    """OFA-KD's loss (Hao et al., NeurIPS 2023; their distillers' ``ofa_loss``): the
    cross-entropy of the student against the teacher's distribution whose target-class
    probability is raised to (1 + p_t)^eps - 1 (eps = 1: plain cross-entropy to the teacher),
    averaged over the tokens that have a target (-100: none)."""
    keep = targets.reshape(-1) != -100
    log_s = F.log_softmax(student_logits.float().reshape(-1, student_logits.shape[-1])[keep] / temperature, -1)
    p_t = F.softmax(teacher_logits.float().reshape(-1, teacher_logits.shape[-1])[keep] / temperature, -1)
    mask = F.one_hot(targets.reshape(-1)[keep], p_t.shape[-1]).float()
    return (-((p_t + mask) ** eps - mask) * log_s).sum(-1).mean()


class OFABranches(nn.Module):
    """OFA-KD's branches for an LM: every intermediate student stage gets a branch of its own, a
    projector (pre-norm residual MLP, the token-sequence counterpart of their ViT blocks) and its
    own norm and head into the vocabulary, initialised from the student's final norm and head but
    separate parameters (their branches end in classifier heads of their own; sharing the
    student's head would push every branch's loss into the student's output layer)."""

    def __init__(self, student: nn.Module, stages: int, eps: float = 1.0, temperature: float = 1.0):
        super().__init__()
        width = hidden_width(student)
        base = student.get_decoder() if hasattr(student, "get_decoder") else student.base_model
        norm = getattr(base, "norm", None) or getattr(base, "ln_f")
        head = student.get_output_embeddings()
        self.eps, self.temperature = eps, temperature
        self.projectors = nn.ModuleList(nn.Sequential(nn.LayerNorm(width), nn.Linear(width, width), nn.GELU(),
                                                      nn.Linear(width, width)) for _ in range(stages - 1))
        for p in self.projectors:
            nn.init.zeros_(p[-1].weight)  # a branch starts as the student's head on its stage
            nn.init.zeros_(p[-1].bias)
        self.norms = nn.ModuleList(copy.deepcopy(norm) for _ in range(stages - 1))
        self.heads = nn.ModuleList(nn.Linear(width, head.out_features, bias=False) for _ in range(stages - 1))
        with torch.no_grad():
            for h in self.heads:
                h.weight.copy_(head.weight)
        self.requires_grad_(True)

    def forward(self, features: list[torch.Tensor]) -> list[torch.Tensor]:
        return [h(n(f + p(f))) for p, n, h, f in zip(self.projectors, self.norms, self.heads, features)]


class DeepFusion(Algorithm):
    """The method (module docstring). One round: every device trains its own model (full
    fine-tuning of all its weights with the run's ``train`` settings: a randomly initialised
    device model could not learn through LoRA, and the paper's Fig. 7 measures full training)
    and uploads it once with its data embedding; the server builds the global MoE."""
    name = "deepfusion"
    dp_refusal_reason = ("its one-shot upload is the whole device model: client-level DP would need "
                         "sample-level DP-SGD on the device, out of scope")
    section = "deepfusion"
    needs_server_data = True
    feature = "vaa"  # FM term of eq. 11: vaa (DeepFusion) | none (FedKMT) | ofa (OFA-KD)

    def __init__(self, lora, train, n_clients, devices: list[str] | None = None, assign_seed: int = 0,
                 experts: int = 4, top_k: int = 2, encoder: str = MINILM, embed_examples: int = 64,
                 embed_tokens: int = 128, stages: int = 4, queries: int = 64, vaa_dim: int = 256, vaa_heads: int = 4,
                 alpha: float = 1.0, beta: float = 1.0, temperature: float = 1.0, kd_steps: int = 20,
                 kd_lr: float = 1e-4, feature_lr: float = 1e-3, kd_batch: int = 4, tune_steps: int = 20,
                 tune_lr: float = 1e-4,
                 aux_loss_coef: float = 0.001, device_cache: bool = False, ofa_eps: float = 1.0):
        super().__init__(lora, train, n_clients)
        if train.rounds != 1:
            raise ValueError(f"{self.name} is one-shot (devices upload once): train.rounds must be 1, got {train.rounds}")
        if not 1 <= experts <= (experts if self.pooled else n_clients):
            raise ValueError(f"deepfusion.experts = K = {experts} must lie in [1, N = {n_clients}] (the devices)")
        if not 1 <= top_k <= experts:
            raise ValueError(f"deepfusion.top_k = {top_k} must lie in [1, K = {experts}]")
        if min(stages, queries, vaa_dim, vaa_heads, kd_batch, embed_examples, embed_tokens) < 1 or \
                min(kd_steps, tune_steps) < 0 or min(alpha, beta) < 0 or temperature <= 0 or feature_lr <= 0:
            raise ValueError("deepfusion: stages, queries, vaa_dim, vaa_heads, kd_batch, embed_examples and "
                             "embed_tokens must be >= 1, kd_steps/tune_steps/alpha/beta >= 0, temperature and "
                             "feature_lr > 0")
        if queries % stages or vaa_dim % vaa_heads:
            raise ValueError(f"deepfusion: queries ({queries}) must be a multiple of stages ({stages}) and "
                             f"vaa_dim ({vaa_dim}) of vaa_heads ({vaa_heads})")
        self.devices = list(devices or ["base", "prune:15:768", "random-gpt2:6:384"])
        for spec in self.devices:
            parse_device_spec(spec)  # one line naming a malformed spec, before anything loads
        # "each edge device is randomly assigned to operate one of the on-device LLMs" (Sec. V-A)
        rng = random.Random(assign_seed)
        self.spec_of = [rng.choice(self.devices) for _ in range(n_clients)]
        self.k, self.top_k, self.encoder_name = experts, top_k, encoder
        self.embed_examples, self.embed_tokens = embed_examples, embed_tokens
        self.stages, self.queries, self.vaa_dim, self.vaa_heads = stages, queries, vaa_dim, vaa_heads
        self.alpha, self.beta, self.temperature = alpha, beta, temperature
        # The paper gives no learning rates. The VAA / OFA modules start untrained and get their own
        # lr: measured on the CPU recipe (issue I), at the student's 1e-4 VAA's normalised FM went
        # 3.98 -> 3.67 in 30 steps (near its init; its gradient on the student had cosine -0.05 with
        # CE's), at 1e-3 it fell to 2.33.
        self.kd_steps, self.kd_lr, self.feature_lr, self.kd_batch = kd_steps, kd_lr, feature_lr, kd_batch
        self.tune_steps, self.tune_lr, self.aux_loss_coef = tune_steps, tune_lr, aux_loss_coef
        self.device_cache = device_cache
        self.ofa_eps = ofa_eps  # OFA-KD's target enhancement (their train.py default --ofa-eps 1)
        self._initial: dict[str, Tensors] = {}
        self._initial_digest: dict[str, str] = {}
        self._encoder = None
        self.moe = None

    # -- devices ---------------------------------------------------------------------------------
    def device_spec(self, client: int) -> str:
        return self.spec_of[client]

    def check_model(self, model_config) -> list[str]:
        """Every device spec against the base's sizes, and ``stages`` against every model's depth
        (the student's and each device's: stage features need a block per stage)."""
        problems = [p for spec in dict.fromkeys(self.devices) for p in device_problems(spec, model_config)]
        if problems or self.feature not in ("vaa", "ofa"):  # stage features: VAA's and OFA-KD's only
            return problems
        depths = {"the base": model_config.num_hidden_layers,
                  **{repr(s): device_layers(s, model_config) for s in dict.fromkeys(self.devices)}}
        return [f"deepfusion.stages = {self.stages} exceeds the {n} blocks of {who}" for who, n in depths.items()
                if n is not None and self.stages > n]

    def build_device_model(self, spec: str, base: nn.Module) -> nn.Module:
        model = build_device_model(spec, base)
        # what a device needs of the base on any engine: its own start and the shared tokenizer
        self._initial[spec] = {n: t.detach().to("cpu", copy=True) for n, t in model.state_dict().items()}
        self._tokenizer_dir = tokenizer_source(base)
        return model

    def encoder(self, runtime: Runtime = Runtime()) -> SentenceEncoder:
        if self._encoder is None:  # one MiniLM per process, on the device that computes
            self._encoder = SentenceEncoder(self.encoder_name, runtime)
        return self._encoder

    def declared_upload(self, model: nn.Module, adapters: Tensors) -> Tensors:
        return {**{f"weights.{n}": p.detach() for n, p in model.named_parameters()},
                "data_embedding": torch.zeros(self.encoder().dim)}

    def data_texts(self, tokens: torch.Tensor, tokenizer, seed: int) -> list[str]:
        """Up to ``embed_examples`` windows of ``embed_tokens`` of the device's training stream,
        decoded back to text (what the sentence encoder reads on the device)."""
        n = max(1, len(tokens) // self.embed_tokens)
        starts = torch.randperm(n, generator=torch.Generator().manual_seed(seed))[:self.embed_examples]
        return [tokenizer.decode(tokens[s * self.embed_tokens:(s + 1) * self.embed_tokens].tolist())
                for s in starts.sort().values.tolist()]

    def client_round(self, ctx: ClientContext, state: ClientState, payload: Tensors):
        key = self._device_key(ctx, state) if self.device_cache else None
        cached = load_device_upload(key) if key else None
        if cached is not None:  # this device already trained with exactly these inputs
            upload, metrics, state.rng = cached
            return state, upload, {**metrics, "device_cache": "hit"}
        model = ctx.model
        model.load_state_dict(self._initial[self.device_spec(ctx.client)])  # this device's own start
        gen = batch_generator(state)
        model.train()
        params = [(n, p) for n, p in model.named_parameters()]
        opt = make_optimizer(params, ClientState(adapters={}), "model", self.train)  # fresh: one round
        scaler = ctx.runtime.grad_scaler()
        losses = []
        for step in range(self.train.local_steps):
            for g in opt.param_groups:
                g["lr"] = expert_lr(step, self.train.local_steps, self.train)
            x, y = self.train_batch(ctx, gen)
            loss = lm_loss(model, x, y)
            step_on(loss, [p for _, p in params], opt, self.train.grad_clip, scaler)
            losses.append(loss.detach())
        state.rng = gen.get_state()
        texts = self.data_texts(ctx.data.train, AutoTokenizer.from_pretrained(self._tokenizer_dir), seed=ctx.client)
        embedding = self.encoder(ctx.runtime).data_embedding(texts, self.embed_examples, seed=ctx.client)
        upload = {**{f"weights.{n}": p.detach().to("cpu", copy=True) for n, p in params}, "data_embedding": embedding}
        metrics = {"train_loss": torch.stack(losses).mean().item(), "device_model": self.device_spec(ctx.client),
                   "device_params": sum(p.numel() for _, p in params)}
        if key:
            save_device_upload(key, upload, metrics, state.rng)
        return state, upload, metrics

    def _device_key(self, ctx: ClientContext, state: ClientState) -> str:
        """A digest of everything a device's one-shot phase reads: its model spec and starting
        weights, its training data and batch RNG, the ``train`` settings, the embedding settings and
        the runtime. DeepFusion, FedKMT and OFA-KD differ only on the server, so with
        ``device_cache`` a comparison trains each device once (a simulation shortcut; any change
        to these inputs is a different key and trains again)."""
        import dataclasses
        import hashlib
        import json

        spec = self.device_spec(ctx.client)
        if spec not in self._initial_digest:
            h = hashlib.sha256()
            for n, t in sorted(self._initial[spec].items()):
                h.update(n.encode())
                h.update(t.contiguous().view(torch.uint8).numpy().tobytes())
            self._initial_digest[spec] = h.hexdigest()
        h = hashlib.sha256(b"deepfusion-device-v1")
        rt = ctx.runtime
        settings = {"spec": spec, "client": ctx.client, "train": dataclasses.asdict(self.train),
                    "embed": [self.encoder_name, self.embed_examples, self.embed_tokens],
                    "tokenizer": str(self._tokenizer_dir), "runtime": [str(rt.device), rt.precision]}
        h.update(json.dumps(settings, sort_keys=True, default=str).encode())
        h.update(self._initial_digest[spec].encode())
        h.update(ctx.data.train.contiguous().view(torch.uint8).numpy().tobytes())
        h.update(batch_generator(state).get_state().numpy().tobytes())
        return h.hexdigest()

    # -- server ----------------------------------------------------------------------------------
    def server_init(self, initial):
        return {}, {c: {} for c in range(self.n_clients)}

    def _device_models(self, uploads: dict[int, Tensors]) -> dict[int, nn.Module]:
        out = {}
        for c, up in uploads.items():
            model = build_device_model(self.device_spec(c), self.server.base)
            missing = model.load_state_dict({n[8:]: t for n, t in up.items() if n.startswith("weights.")}, strict=False)
            if missing.missing_keys or missing.unexpected_keys:  # only tied weights may be absent
                tied = {n for n, _ in model.named_parameters(remove_duplicate=False)} - dict(model.named_parameters()).keys()
                if set(missing.missing_keys) - tied or missing.unexpected_keys:
                    raise ValueError(f"device {c}'s upload does not fit {self.device_spec(c)!r}")
            out[c] = model.eval().requires_grad_(False)
        return out

    def server_round(self, server_state, uploads: dict[int, Tensors]):
        ctx = self.server
        if ctx is None or ctx.data is None:
            raise ValueError(f"{self.name} needs the server's public data: set data.public_frac > 0")
        clients = sorted(uploads)
        if len(clients) < self.k:
            raise ValueError(f"{len(clients)} device(s) uploaded, fewer than K = {self.k} domains")
        seconds, t0 = {}, time.perf_counter()
        emb = torch.stack([uploads[c]["data_embedding"] for c in clients])
        labels = cluster_devices(emb, self.k, seed=ctx.seed)  # Sec. IV-B
        models = self._device_models(uploads)
        proxies = proxy_teachers([models[c] for c in clients], labels, self.k)  # Fig. 4
        del models
        seconds["cluster_and_proxies"], t0 = time.perf_counter() - t0, time.perf_counter()
        log.info("%s: domains %s; distilling %d proxies", self.name, labels, sum(map(len, proxies)))
        public = torch.cat(list(ctx.data.public.values()))
        gen = torch.Generator().manual_seed(ctx.seed)
        dense, kd_log = [], []
        for domain in range(self.k):  # Sec. IV-C: one MoE base model per domain
            teachers, proxies[domain] = proxies[domain], []  # freed once distilled
            student = copy.deepcopy(ctx.base).float()
            for t, _ in teachers:
                check_same_vocabulary(t, student)
            kd_log.append(self.distill(student, [(t.to(ctx.runtime.device), w) for t, w in teachers], public, gen))
            dense.append(offload(student))
            log.info("%s: domain %d distilled %s", self.name, domain, kd_log[-1])
        seconds["distill"], t0 = time.perf_counter() - t0, time.perf_counter()
        moe = upcycle(dense, top_k=self.top_k, seed=ctx.seed, aux_loss_coef=self.aux_loss_coef)  # Sec. IV-D
        del dense
        tune_log = self.tune(moe.to(ctx.runtime.device), public, gen)
        seconds["upcycle_and_tune"] = time.perf_counter() - t0
        self.moe = moe.eval()
        save_moe(moe, ctx.out_dir / "global-moe", tokenizer_source(ctx.base))
        state = {"domains": labels, "clients": clients, "devices": [self.device_spec(c) for c in clients],
                 "public_batches": self.k * self.kd_steps + self.tune_steps,
                 "kd": kd_log, "tune": tune_log, "seconds": {k: round(v, 2) for k, v in seconds.items()}}
        return state, {c: {} for c in range(self.n_clients)}

    def server_report(self, server_state) -> dict:
        return {k: server_state[k] for k in ("domains", "devices", "kd", "tune", "seconds", "public_batches")
                if k in server_state}

    def _feature_module(self, student: nn.Module, teacher: nn.Module) -> nn.Module | None:
        if self.feature == "vaa":
            return ViewAlignedAttention([hidden_width(student)] * self.stages, [hidden_width(teacher)] * self.stages,
                                        self.queries, self.vaa_dim, self.vaa_heads)
        if self.feature == "ofa":
            return OFABranches(student, self.stages, self.ofa_eps, self.temperature)
        return None

    def distill(self, student: nn.Module, teachers: list[tuple[nn.Module, float]], public: torch.Tensor,
                gen: torch.Generator) -> dict:
        """``kd_steps`` AdamW steps of eq. 11 on public batches, summed over the domain's proxy
        teachers with their weights; the student (``kd_lr``) and the VAA / OFA modules
        (``feature_lr``) train together. Returns the mean of each term and its value at every step
        (weighted over the teachers), which server.jsonl logs."""
        rt, t = self.server.runtime, self.train
        student.to(rt.device).train().requires_grad_(True)
        for model in (student, *(teacher for teacher, _ in teachers)):
            layers = getattr(model.config, "num_hidden_layers", None) or model.config.n_layer
            stage_ends(layers, self.stages)  # one line when a model has fewer blocks than stages
        extras = [self._feature_module(student, teacher) for teacher, _ in teachers]
        extras = [e.to(rt.device) if e is not None else None for e in extras]
        own = {id(p) for p in student.parameters()}
        feature_params = list({id(p): p for e in extras if e is not None for p in e.parameters()
                               if id(p) not in own}.values())
        params = [*student.parameters(), *feature_params]
        opt = torch.optim.AdamW([{"params": list(student.parameters()), "lr": self.kd_lr},
                                 {"params": feature_params, "lr": self.feature_lr}], weight_decay=0.0)
        scaler = rt.grad_scaler()
        log = {"ce": [], "fm": [], "kl": []}
        for _ in range(self.kd_steps):
            x, y = sample_batch(public, self.kd_batch, t.seq_len, gen)
            x, y = x.long().to(rt.device), y.long().to(rt.device)
            with rt.autocast():
                s_out = student(input_ids=x, output_hidden_states=True)
                total = s_out.logits.new_zeros((), dtype=torch.float32)
                for (teacher, w), extra in zip(teachers, extras):
                    with torch.no_grad():
                        t_out = teacher(input_ids=x, output_hidden_states=True)
                    terms = kd_loss(s_out, t_out, y, extra if self.feature == "vaa" else None, self.stages,
                                    self.alpha, self.beta, self.temperature, extra if self.feature == "ofa" else None)
                    total = total + w * terms["total"]
                    for k in log:
                        log[k].append(w * float(terms[k].detach()))
            step_on(total, params, opt, t.grad_clip, scaler)
        student.eval().requires_grad_(False)
        per_step = {k: [round(sum(v[i * len(teachers):(i + 1) * len(teachers)]), 4) for i in range(self.kd_steps)]
                    for k, v in log.items()}
        return {**{k: round(sum(v) / max(1, self.kd_steps), 4) for k, v in log.items()},
                "steps": per_step}

    def tune(self, moe: nn.Module, public: torch.Tensor, gen: torch.Generator) -> dict:
        """Sec. IV-D: ``tune_steps`` AdamW steps on public batches of everything but the FFN
        experts (embeddings, attention, norms, head and the new gate), next-token CE plus
        Mixtral's load-balancing loss (coefficient ``aux_loss_coef``)."""
        frozen = {id(p) for p in expert_params(moe)}
        params = [p for p in moe.parameters() if id(p) not in frozen]
        for p in moe.parameters():
            p.requires_grad_(id(p) not in frozen)
        losses = train_moe_on_public(moe, public, self.tune_steps, self.kd_batch, params, self.tune_lr,
                                     self.aux_loss_coef, self.train, self.server.runtime, gen)
        return {"ce_first": round(losses[0], 4), "ce_last": round(losses[-1], 4)} if losses else {}

    def server_evaluate(self, server_state) -> dict[str, dict] | None:
        return None if self.moe is None else score_on_server(self.moe, self.server, self.train)


def train_moe_on_public(moe: nn.Module, public: torch.Tensor, steps: int, batch: int, params: list, lr: float,
                        aux_loss_coef: float, train, runtime: Runtime, gen: torch.Generator) -> list[float]:
    """``steps`` AdamW steps of ``params`` on public batches of ``batch`` (next-token CE + Mixtral's
    load balance); returns the CE of each step. DeepFusion's gate tuning and the baselines'
    public data both take them."""
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    scaler = runtime.grad_scaler()
    moe.train()
    losses = [float(moe_step(moe, *sample_batch(public, batch, train.seq_len, gen), params, opt, aux_loss_coef,
                             train, runtime, scaler)) for _ in range(steps)]
    moe.eval().requires_grad_(False)
    return losses


def public_tuning(moe: nn.Module, public: torch.Tensor, steps: int, batch: int, lr: float, aux_loss_coef: float,
                  train, runtime: Runtime, seed: int) -> dict:
    """The server's public data for a baseline that has no teachers (FedJETS, central-moe):
    ``steps`` AdamW steps of every MoE weight on public batches of ``batch`` (CE + load balance),
    as many public batches as DeepFusion's server draws (K x kd_steps distillation steps and
    tune_steps tuning steps), so the comparison is on equal server data (issue I)."""
    if steps == 0:
        return {"public_batches": 0}
    moe.to(runtime.device).requires_grad_(True)
    losses = train_moe_on_public(moe, public, steps, batch, list(moe.parameters()), lr, aux_loss_coef, train, runtime,
                                 torch.Generator().manual_seed(seed))
    return {"public_batches": steps, "ce_first": round(losses[0], 4), "ce_last": round(losses[-1], 4)}


def moe_step(moe: nn.Module, x: torch.Tensor, y: torch.Tensor, params: list, opt, aux_loss_coef: float,
             train, runtime: Runtime, scaler=None) -> torch.Tensor:
    """One AdamW step of a Mixtral MoE on next-token CE + ``aux_loss_coef`` x its load-balancing
    loss (DeepFusion's MoE tuning, the centralized bound, FedJETS's devices); returns the CE."""
    x, y = x.long().to(runtime.device), y.long().to(runtime.device)
    with runtime.autocast():
        out = moe(input_ids=x, output_router_logits=True)
        ce = F.cross_entropy(out.logits.float().reshape(-1, out.logits.shape[-1]), y.reshape(-1))
        loss = ce + aux_loss_coef * out.aux_loss.float()
    step_on(loss, params, opt, train.grad_clip, scaler)
    return ce.detach()


def score_on_server(model: nn.Module, server: ServerContext, train) -> dict[str, dict]:
    """A global model (and, for comparison, the dense base before distillation) on every
    domain's test data of the server: token perplexity and its log (Table I), the accuracy of
    generated answers against the references (%, Table II: ``answer_acc``, on question-answer
    data) and the teacher-forced next-token accuracy over the whole stream (``token_acc``)."""
    if server is None or server.data is None:
        raise ValueError("the global model is scored on the server's test data: set data.public_frac > 0")
    out = {}
    for domain, tokens in server.data.test.items():
        row = {}
        pairs = server.data.answers.get(domain)
        for prefix, m in (("test", model), ("test_base", server.base)):
            with server.runtime.autocast():
                nll, n, correct = split_token_stats(m, tokens, train.seq_len, train.eval_batch_size)
                if pairs:  # Table II: generated answers against the references
                    row[f"{prefix}_answer_acc"] = generated_token_accuracy(
                        m, pairs, server.data.pad_id, server.data.eos_id, train.eval_batch_size,
                        train.max_new_tokens)
            row.update({f"{prefix}_ppl": math.exp(nll / n), f"{prefix}_log_ppl": nll / n,
                        f"{prefix}_token_acc": 100.0 * correct / n})
        out[domain] = row
    return out


class CEOnly(DeepFusion):
    """The same pipeline with alpha = beta = 0: the students learn from the public data's CE
    alone (teachers unused), so each KD term's gain over it is visible (issue I)."""
    name = "deepfusion-ce"
    feature = "none"
    variant = dict(alpha=0.0, beta=0.0)


class FedKMT(DeepFusion):
    """The paper's "FedKMT" baseline (FedMKT-style, Fan et al. 2024): the same pipeline, but each
    proxy supervises its student through the final logits only (CE + beta * KL; no features)."""
    name = "fedkmt"
    feature = "none"


class OFAKD(DeepFusion):
    """OFA-KD baseline (Hao et al. 2023): every intermediate student stage projected into the
    vocabulary by a branch with its own head (``OFABranches``), each branch and the final logits
    trained with the OFA loss against the teacher's logits, in place of VAA and the KL."""
    name = "ofa-kd"
    feature = "ofa"


def device_cache_path(key: str):
    from ..models.base import cache_dir
    return cache_dir() / "deepfusion-devices" / f"{key}.safetensors"


def save_device_upload(key: str, upload: Tensors, metrics: dict, rng: torch.Tensor) -> None:
    """A device's upload, metrics and batch RNG under ``$COMIX_CACHE/deepfusion-devices``
    (temp file, then rename: a killed run leaves no half-written entry)."""
    import json

    from safetensors.torch import save_file

    tensors = {**{f"upload.{n}": t.contiguous() for n, t in upload.items()}, "rng": rng.contiguous()}
    atomic_write(device_cache_path(key), lambda p: save_file(tensors, p, metadata={"metrics": json.dumps(metrics)}))


def load_device_upload(key: str) -> tuple[Tensors, dict, torch.Tensor] | None:
    import json

    from safetensors import safe_open

    path = device_cache_path(key)
    if not path.exists():
        return None
    with safe_open(str(path), "pt") as f:
        tensors = {n: f.get_tensor(n) for n in f.keys()}
        metrics = json.loads(f.metadata()["metrics"])
    upload = {n[len("upload."):]: t for n, t in tensors.items() if n.startswith("upload.")}
    return upload, metrics, tensors["rng"]


def save_moe(moe: nn.Module, path, tokenizer_dir: str | None) -> None:
    """``save_pretrained`` into a temp folder beside ``path``, then rename: never half a model."""
    import shutil
    import tempfile
    from pathlib import Path

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}."))
    try:
        moe.save_pretrained(tmp)
        if tokenizer_dir:
            AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(tmp)
        if path.exists():
            shutil.rmtree(path)
        tmp.rename(path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


class CentralMoE(DeepFusion):
    """The upper bound of Fig. 9 (the paper's DeepSpeed baseline): the *same* global MoE
    (upcycled from K copies of the dense base, Sec. II) trained centrally, every weight, on all
    devices' training data pooled; scored on the server's test data like DeepFusion. Its step
    budget is the devices' total (N x ``train.local_steps`` batches of ``train.batch_size``, the
    batches cycling through the users), so it sees as many training tokens as the devices did.
    Nothing is uploaded (the data is central)."""
    name = "central-moe"
    dp_refusal_reason = "it trains one model on every user's pooled data: there is no client upload to protect"
    pooled = True

    def device_spec(self, client: int) -> str:
        return "central-moe"

    def build_device_model(self, spec: str, base: nn.Module) -> nn.Module:
        dense = copy.deepcopy(base).float()
        moe = upcycle([dense] * self.k, top_k=self.top_k, seed=0, aux_loss_coef=self.aux_loss_coef)
        self._initial[spec] = {n: t.detach().to("cpu", copy=True) for n, t in moe.state_dict().items()}
        return moe.requires_grad_(True).train()

    def declared_upload(self, model: nn.Module, adapters: Tensors) -> Tensors:
        return {}

    def client_round(self, ctx: ClientContext, state: ClientState, payload: Tensors):
        model = ctx.model
        model.load_state_dict(self._initial["central-moe"])
        gen = batch_generator(state)
        model.train()
        params = list(model.parameters())
        opt = make_optimizer(list(model.named_parameters()), ClientState(adapters={}), "moe", self.train)
        scaler = ctx.runtime.grad_scaler()
        steps = len(ctx.data) * self.train.local_steps  # the devices' total budget
        losses = []
        for step in range(steps):
            for g in opt.param_groups:
                g["lr"] = expert_lr(step, steps, self.train)
            user = ctx.data[step % len(ctx.data)]  # batches cycle through the users
            x, y = sample_batch(user.train, self.train.batch_size, self.train.seq_len, gen)
            losses.append(moe_step(model, x, y, params, opt, self.aux_loss_coef, self.train, ctx.runtime, scaler))
        state.rng = gen.get_state()
        self.moe = model.eval()
        return state, {}, {"train_loss": torch.stack(losses).mean().item(), "device_model": "central-moe",
                           "device_params": sum(p.numel() for p in params), "train_steps": steps}

    def server_round(self, server_state, uploads: dict[int, Tensors]):
        if self.server is None or self.server.data is None:
            raise ValueError(f"{self.name} is scored on the server's test data: set data.public_frac > 0")
        public = torch.cat(list(self.server.data.public.values()))
        report = public_tuning(self.moe, public, self.k * self.kd_steps + self.tune_steps, self.kd_batch, self.tune_lr,
                               self.aux_loss_coef, self.train, self.server.runtime, self.server.seed)
        save_moe(self.moe, self.server.out_dir / "global-moe", tokenizer_source(self.server.base))
        return {"public": report}, {c: {} for c in range(self.n_clients)}

    def server_report(self, server_state) -> dict:
        return dict(server_state or {})
