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

Tokenizers: base, pruned and random devices read the student's token ids; a device of another
family with its own tokenizer (e.g. ``gemma3-270m``) trains on its own tokenisation of its text,
and as a teacher its distributions reach the student through FuseLLM / FedMKT's token alignment
and vocabulary mapping (``models/token_align.py``); its features are pooled over its own tokens
of the same text (``models/vaa.py``).
"""
from __future__ import annotations

import copy
import dataclasses
import logging
import time

import torch
from torch import nn

from ..progress import step as phase_step
from ..data import calibration_docs, sample_batch
from ..data.embed import MINILM, SentenceEncoder
from ..models.base import tokenizer_source
from ..models.devices import assign_devices, build_device_model, device_layers, device_problems, parse_device_spec
from ..models.upcycle import expert_params, upcycle
from ..models.qlora import QLORA, lora_layers, own_weights, qlora_model, reset_lora
from ..models.kd import OFABranches, check_same_vocabulary, hidden_width, kd_loss
from ..models.token_align import CrossTokenizerTeacher, reads_other_tokens, retokenize, tokenizer_at
from ..models.vaa import ViewAlignedAttention, stage_ends
from ..runtime import Runtime, offload, to_cpu
from .base import Algorithm, ClientContext, ClientState, Tensors
from .training import batch_generator, expert_lr, lm_loss, make_optimizer, sparse_tied_embedding_grads, step_on, train_step
from .deepfusion_clusters import cluster_devices, embedding_map, proxy_teachers, uploaded_models
from .deepfusion_measures import gradient_shares, in_domain_scores
from .global_moe import (DistilledDomains, device_key, load_device_upload, save_device_upload, save_moe,
                         score_on_server, tensors_digest, train_moe_on_public, upload_digest)

log = logging.getLogger("comix.deepfusion")


class DeepFusion(Algorithm):
    """The method (module docstring). One round: every device trains its own model (full
    fine-tuning of all its weights with the run's ``train`` settings: a randomly initialised
    device model could not learn through LoRA, and the paper's Fig. 7 measures full training)
    and uploads it once with its data embedding; the server builds the global MoE.

    With ``quant`` (nf4 | int8) a device trains QLoRA's way: a LoRA (``qlora_r``, ``qlora_alpha``)
    on every block linear of its model frozen at that precision, uploaded merged into the
    dequantised weights (``models/qlora.py``); the optimiser and steps stay the run's ``train``.
    Fig. 8 sizes the devices' training RAM "after bfloat16 and NF4 quantization" without saying
    how they train; a 4-bit model trains only through adapters."""
    name = "deepfusion"
    dp_refusal_reason = ("its one-shot upload is the whole device model: client-level DP would need "
                         "sample-level DP-SGD on the device, out of scope")
    section, needs_server_data = "deepfusion", True
    feature = "vaa"  # FM term of eq. 11: vaa (DeepFusion) | none (FedKMT) | ofa (OFA-KD)
    one_shot = True  # the devices upload once (Sec. III): a single round

    def __init__(self, lora, train, n_clients, devices: list[str] | None = None, assign_seed: int = 0,
                 experts: int = 4, top_k: int = 2, encoder: str = MINILM, embed_examples: int = 64,
                 embed_tokens: int = 128, stages: int = 4, queries: int = 64, vaa_dim: int = 256, vaa_heads: int = 4,
                 alpha: float = 1.0, beta: float = 1.0, temperature: float = 1.0, kd_steps: int = 20,
                 kd_lr: float = 1e-4, feature_lr: float = 1e-3, kd_batch: int = 4, tune_steps: int = 20,
                 tune_lr: float = 1e-4, aux_loss_coef: float = 0.001, device_cache: bool = False, ofa_eps: float = 1.0,
                 grad_log_every: int = 5, score_devices: bool = True, device_steps: int | None = None,
                 qlora_r: int = QLORA.r, qlora_alpha: float = QLORA.alpha):
        super().__init__(lora, train, n_clients)
        self.qlora = dataclasses.replace(QLORA, r=qlora_r, alpha=qlora_alpha)  # checks r >= 1
        # the devices' local training steps (None: train.local_steps); 0 is the untrained-teacher
        # control: the server distils devices that learned nothing, which separates knowledge
        # transfer from a pull towards the starting weights
        if device_steps is not None and device_steps < 0:
            raise ValueError(f"deepfusion.device_steps must be >= 0, got {device_steps}")
        self.device_steps = train.local_steps if device_steps is None else device_steps
        # every grad_log_every-th KD step (0: never) logs each term's gradient norm on the student
        # and its share: how much the feature term steers the student (two extra backward passes)
        self.grad_log_every, self.score_devices = grad_log_every, score_devices
        if self.one_shot and train.rounds != 1:
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
        self.spec_of = assign_devices(self.devices, n_clients, assign_seed)
        self.k, self.top_k, self.encoder_name = experts, top_k, encoder
        self.embed_examples, self.embed_tokens = embed_examples, embed_tokens
        self.stages, self.queries, self.vaa_dim, self.vaa_heads = stages, queries, vaa_dim, vaa_heads
        self.alpha, self.beta, self.temperature = alpha, beta, temperature
        # The paper gives no learning rates. The VAA / OFA modules start untrained and get their own
        # lr: measured on the CPU recipe, at the student's 1e-4 VAA's normalised FM went
        # 3.98 -> 3.67 in 30 steps (near its init; its gradient on the student had cosine -0.05 with
        # CE's), at 1e-3 it fell to 2.33.
        self.kd_steps, self.kd_lr, self.feature_lr, self.kd_batch = kd_steps, kd_lr, feature_lr, kd_batch
        self.tune_steps, self.tune_lr, self.aux_loss_coef = tune_steps, tune_lr, aux_loss_coef
        self.device_cache = device_cache
        self.ofa_eps = ofa_eps  # OFA-KD's target enhancement (their train.py default --ofa-eps 1)
        self._initial: dict[str, Tensors] = {}
        self._initial_digest: dict[str, str] = {}
        self._encoder = None
        self.moe = self._distilled = None

    # -- devices ---------------------------------------------------------------------------------
    def device_spec(self, client: int) -> str:
        return self.spec_of[client]

    @property
    def quant_refusal_reason(self) -> str | None:
        random = sorted({s for s in self.spec_of if parse_device_spec(s)[0].startswith("random-")})
        return (f"device model(s) {', '.join(random)} start from random weights: a LoRA over a frozen random "
                "base learns next to nothing, so a quantised device trains QLoRA's way only from a pretrained "
                "or pruned model (deepfusion.devices)") if random else None

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

    def build_device_model(self, spec: str, base: nn.Module, quant: str = "none") -> nn.Module:
        model = build_device_model(spec, base, calibration_docs())
        # what a device needs of the base on any engine: its own start and the shared tokenizer
        self._initial[spec] = {n: t.detach().to("cpu", copy=True) for n, t in model.state_dict().items()}
        self._tokenizer_dir = tokenizer_source(base)
        if quant == "none":
            return model
        # computing in the device model's fp32 (autocast gives the run's precision), on the run's device
        return qlora_model(model, quant, self.qlora, torch.float32, next(base.parameters()).device)

    def encoder(self, runtime: Runtime = Runtime()) -> SentenceEncoder:
        if self._encoder is None:  # one MiniLM per process, on the device that computes
            self._encoder = SentenceEncoder(self.encoder_name, runtime)
        return self._encoder

    def declared_upload(self, model: nn.Module, adapters: Tensors) -> Tensors:
        return {**{f"weights.{n}": t for n, t in own_weights(model).items()},
                "data_embedding": torch.zeros(self.encoder().dim)}

    def data_texts(self, tokens: torch.Tensor, tokenizer, seed: int) -> list[str]:
        """Up to ``embed_examples`` training windows of ``embed_tokens``, as text (the device's encoder reads it)."""
        n = max(1, len(tokens) // self.embed_tokens)
        starts = torch.randperm(n, generator=torch.Generator().manual_seed(seed))[:self.embed_examples]
        return [tokenizer.decode(tokens[s * self.embed_tokens:(s + 1) * self.embed_tokens].tolist())
                for s in starts.sort().values.tolist()]

    def client_round(self, ctx: ClientContext, state: ClientState, payload: Tensors):
        key = self._device_key(ctx, state) if self.device_cache else None
        cached = load_device_upload(key) if key else None
        if cached is not None:  # this device already trained with exactly these inputs
            upload, metrics, state.rng = cached
            return state, upload, {**metrics, "upload_digest": upload_digest(upload), "device_cache": "hit"}
        model = ctx.model
        if lora_layers(model):  # QLoRA: its frozen quantised start and fresh adapters
            reset_lora(model)
        else:
            model.load_state_dict(self._initial[self.device_spec(ctx.client)])  # this device's own start
        gen = batch_generator(state)
        model.train()
        own_tokens = None if not reads_other_tokens(model, self._tokenizer_dir) else (  # another family: its own tokens
            retokenize(ctx.data.train, tokenizer_at(self._tokenizer_dir), tokenizer_at(model.config.comix_tokenizer)))
        params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        # fresh: one round; full fine-tuning (every weight) by the fused AdamW, the same update
        opt = make_optimizer(params, ClientState(adapters={}), "model", self.train, fused=not lora_layers(model))
        scaler, losses = ctx.runtime.grad_scaler(), []

        def batch():
            return self.train_batch(ctx, gen) if own_tokens is None else \
                sample_batch(own_tokens, self.train.batch_size, self.train.seq_len, gen)
        with sparse_tied_embedding_grads(model):  # the same gradient, without a dense zero table
            for step in range(self.device_steps):
                for g in opt.param_groups:
                    g["lr"] = expert_lr(step, self.device_steps, self.train)
                losses.append(train_step(model, *batch(), [p for _, p in params], opt, self.train.grad_clip,
                                         scaler, ctx.runtime.micro_batches_of(ctx.client)))
                phase_step(f"client {ctx.client}'s device steps", step + 1, self.device_steps)  # hours on a CPU
        if not losses:  # the untrained control: the loss it would start from, on one of its batches
            with torch.no_grad():
                losses.append(lm_loss(model, *batch()))
        state.rng = gen.get_state()
        texts = self.data_texts(ctx.data.train, tokenizer_at(self._tokenizer_dir), seed=ctx.client)
        embedding = self.encoder(ctx.runtime).data_embedding(texts, self.embed_examples, seed=ctx.client)
        upload = {**{f"weights.{n}": t.to("cpu", copy=True) for n, t in own_weights(model).items()},  # fp32
                  "data_embedding": embedding}
        metrics = {"train_loss": torch.stack(losses).mean().item(), "device_model": self.device_spec(ctx.client),
                   "device_params": sum(p.numel() for _, p in params), "device_base": ctx.runtime.quant_of(ctx.client),
                   "device_steps": self.device_steps, "upload_digest": upload_digest(upload)}
        if key:
            save_device_upload(key, upload, metrics, state.rng)
        return state, upload, metrics

    def _device_key(self, ctx: ClientContext, state: ClientState) -> str:
        """The device cache's key (global_moe.py ``device_key``): DeepFusion, FedKMT and OFA-KD
        differ only on the server, so with ``device_cache`` a comparison trains each device once."""
        spec, rt = self.device_spec(ctx.client), ctx.runtime
        if spec not in self._initial_digest:
            self._initial_digest[spec] = tensors_digest(self._initial[spec])
        settings = {"spec": spec, "client": ctx.client, "train": dataclasses.asdict(self.train), "steps": self.device_steps,
                    "embed": [self.encoder_name, self.embed_examples, self.embed_tokens],
                    "tokenizer": str(self._tokenizer_dir), "runtime": [str(rt.device), rt.precision]}
        # (only when set: the keys of full-precision, unsliced devices stay as they were)
        if rt.quant_of(ctx.client) != "none":
            settings["qlora"] = [rt.quant_of(ctx.client), dataclasses.asdict(self.qlora)]
        if rt.micro_batches_of(ctx.client) != 1:
            settings["micro_batches"] = rt.micro_batches_of(ctx.client)
        settings.update({"update": "fused"} if self.device_steps and rt.quant_of(ctx.client) == "none" else {})  # its rounding
        return device_key(settings, self._initial_digest[spec], ctx.data.train, batch_generator(state).get_state())

    # -- server ----------------------------------------------------------------------------------
    def server_init(self, initial):
        return {}, {c: {} for c in range(self.n_clients)}

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
        models = uploaded_models(uploads, self.spec_of, ctx.base)
        proxies = proxy_teachers([models[c] for c in clients], labels, self.k)  # Fig. 4
        premise = in_domain_scores(models, ctx, self.train.seq_len) if self.score_devices else None  # what the teachers know
        del models
        seconds["cluster_and_proxies"], t0 = time.perf_counter() - t0, time.perf_counter()
        log.info("%s: domains %s; distilling %d proxies", self.name, labels, sum(map(len, proxies)))
        public = torch.cat(list(ctx.data.public.values()))
        gen = torch.Generator().manual_seed(ctx.seed)
        dense, kd_log = [], []
        settings = {**{k: v for k, v in vars(self).items() if isinstance(v, (bool, int, float, str))},
                    "train": dataclasses.asdict(self.train), "runtime": [str(ctx.runtime.device), ctx.runtime.precision]}
        finished = DistilledDomains(ctx.out_dir, settings, public, ctx.base)  # resume after the last finished domain
        for domain in range(self.k):  # Sec. IV-C: one MoE base model per domain
            teachers, proxies[domain] = proxies[domain], []  # freed once distilled
            student, key = copy.deepcopy(ctx.base).float(), finished.key(domain, teachers, gen)
            kd_log.append(finished.load(key, domain, student, gen))
            if kd_log[-1] is None:
                kd_log[-1] = self.distill(student, [(t.to(ctx.runtime.device), w) for t, w in teachers], public, gen)
                finished.save(key, domain, student, kd_log[-1], gen)
            dense.append(offload(student))
            log.info("%s: domain %d distilled (%.0f s; its terms in server.jsonl)", self.name, domain, kd_log[-1].get("seconds", 0))
        seconds["distill"], t0 = time.perf_counter() - t0, time.perf_counter()
        moe = upcycle(dense, top_k=self.top_k, seed=ctx.seed, aux_loss_coef=self.aux_loss_coef)  # Sec. IV-D
        del dense
        tune_log = self.tune(moe.to(ctx.runtime.device), public, gen)
        seconds["upcycle_and_tune"] = time.perf_counter() - t0
        self.moe = moe.eval()
        save_moe(moe, ctx.out_dir / "global-moe", tokenizer_source(ctx.base))
        self._distilled = finished  # kept until the MoE is scored: a kill while scoring does not distil again
        state = {"domains": labels, "clients": clients, "devices": [self.device_spec(c) for c in clients],
                 "embedding_2d": embedding_map(emb),
                 "public_batches": self.k * self.kd_steps + self.tune_steps,
                 "kd": kd_log, "tune": tune_log, "seconds": {k: round(v, 2) for k, v in seconds.items()},
                 **({"in_domain": premise} if premise else {})}
        return state, {c: {} for c in range(self.n_clients)}

    def server_report(self, server_state) -> dict:
        return {k: server_state[k] for k in ("domains", "devices", "kd", "tune", "seconds", "public_batches",
                                             "embedding_2d", "in_domain", "clients") if k in server_state}

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
        rt, t, t0 = self.server.runtime, self.train, time.perf_counter()
        student.to(rt.device).train().requires_grad_(True)
        for model in (student, *(teacher for teacher, _ in teachers)):
            layers = getattr(model.config, "num_hidden_layers", None) or model.config.n_layer
            stage_ends(layers, self.stages)  # one line when a model has fewer blocks than stages
        extras = [self._feature_module(student, teacher) for teacher, _ in teachers]
        extras = [e.to(rt.device) if e is not None else None for e in extras]
        aligners = [self._aligner(teacher, student) for teacher, _ in teachers]
        own = {id(p) for p in student.parameters()}
        feature_params = list({id(p): p for e in extras if e is not None for p in e.parameters()
                               if id(p) not in own}.values())
        params = [*student.parameters(), *feature_params]
        opt = torch.optim.AdamW([{"params": list(student.parameters()), "lr": self.kd_lr},
                                 {"params": feature_params, "lr": self.feature_lr}], weight_decay=0.0)
        scaler = rt.grad_scaler()
        log, aligned = {"ce": [], "fm": [], "kl": []}, {}  # teacher index -> aligned share per step
        grads: dict[str, list] = {"step": [], "ce": [], "fm": [], "kl": [], "cos_fm_rest": []}
        student_params = list(student.parameters())
        for j in range(self.kd_steps):
            phase_step("distillation steps", j, self.kd_steps)
            x, y = sample_batch(public, self.kd_batch, t.seq_len, gen)
            x, y = x.long().to(rt.device), y.long().to(rt.device)
            with rt.autocast():
                s_out = student(input_ids=x, output_hidden_states=True)
                total = s_out.logits.new_zeros((), dtype=torch.float32)
                parts = {k: s_out.logits.new_zeros((), dtype=torch.float32) for k in ("ce", "fm", "kl")}
                for ti, ((teacher, w), extra, aligner) in enumerate(zip(teachers, extras, aligners)):
                    dist = mask = None
                    with torch.no_grad():
                        if aligner is None:
                            t_out = teacher(input_ids=x, output_hidden_states=True)
                        else:  # another tokenizer: the same text in its tokens, its targets carried over
                            tx, mask, rows = aligner.teacher_inputs(to_cpu(x), to_cpu(y))
                            mask = mask.to(rt.device)
                            t_out = teacher(input_ids=tx.to(rt.device), attention_mask=mask, output_hidden_states=True)
                            dist, share = aligner.targets(x, y, t_out.logits, rows, s_out.logits.shape[-1],
                                                          self.temperature)
                            aligned.setdefault(ti, []).append(share)
                    terms = kd_loss(s_out, t_out, y, extra if self.feature == "vaa" else None, self.stages,
                                    self.alpha, self.beta, self.temperature, extra if self.feature == "ofa" else None,
                                    teacher_dist=dist, teacher_mask=mask)
                    total = total + w * terms["total"]
                    for k, coef in (("ce", 1.0), ("fm", self.alpha), ("kl", self.beta)):
                        parts[k] = parts[k] + w * coef * terms[k]
                    for k in log:
                        log[k].append(w * float(terms[k].detach()))
            measure = (lambda g: gradient_shares(parts, student_params, grads, j + 1, whole=g[:len(student_params)])) \
                if self.grad_log_every and j % self.grad_log_every == 0 else None  # the step's backward serves it too
            step_on(total, params, opt, t.grad_clip, scaler, measure=measure)
        student.eval().requires_grad_(False)
        per_step = {k: [round(sum(v[i * len(teachers):(i + 1) * len(teachers)]), 4) for i in range(self.kd_steps)]
                    for k, v in log.items()}
        out = {**{k: round(sum(v) / max(1, self.kd_steps), 4) for k, v in log.items()}, "steps": per_step,
               "seconds": round(time.perf_counter() - t0, 2)}  # kept with the domain when a phase resumes
        if grads["step"]:
            out["grad"] = grads
        if aligned:  # the share of student steps that got a cross-tokenizer teacher's distribution
            shares = {ti: sum(v) / len(v) for ti, v in aligned.items()}
            out["aligned_share"] = round(sum(shares.values()) / len(shares), 4)
            out["aligned_share_per_teacher"] = {str(ti): round(v, 4) for ti, v in shares.items()}
            logging.getLogger("comix.deepfusion").info(  # not ``log``: here that name is the steps' log
                "cross-tokenizer teachers: share of student steps aligned one-to-one: %s",
                ", ".join(f"teacher {ti} {v:.1%}" for ti, v in shares.items()))
        return out

    def _aligner(self, teacher: nn.Module, student: nn.Module) -> CrossTokenizerTeacher | None:
        """None for a teacher that reads the student's token ids (checked), else its alignment."""
        if not reads_other_tokens(teacher, tokenizer_source(student)):
            check_same_vocabulary(teacher, student)
            return None
        return CrossTokenizerTeacher(tokenizer_at(teacher.config.comix_tokenizer),
                                     tokenizer_at(tokenizer_source(student)))

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
        scores = None if self.moe is None else score_on_server(self.moe, self.server, self.train)
        if self._distilled is not None:  # scored: the kept domains are no longer needed
            self._distilled.clear()
            self._distilled = None
        return scores
