"""What the servers of DeepFusion, FedJETS and the centralized bound share about their global
mixture-of-experts LM: training it on the server's public data, scoring it on the server's test
data by domain, saving it as a transformers (Mixtral) folder, and the cache of device uploads
that lets a grid train each device once."""
from __future__ import annotations

import hashlib
import json
import math

import torch
import torch.nn.functional as F
from torch import nn
from transformers import AutoTokenizer

from ..progress import step as phase_step
from ..data import sample_batch
from ..eval.perplexity import split_token_stats
from ..eval.tasks import answer_nll, generated_token_accuracy
from ..files import atomic_write
from ..runtime import Runtime, to_cpu
from .base import ServerContext, Tensors
from .training import step_on


def train_moe_on_public(moe: nn.Module, public: torch.Tensor, steps: int, batch: int, params: list, lr: float,
                        aux_loss_coef: float, train, runtime: Runtime, gen: torch.Generator) -> list[float]:
    """``steps`` AdamW steps of ``params`` on public batches of ``batch`` (next-token CE + Mixtral's
    load balance); returns the CE of each step. DeepFusion's gate tuning and the baselines'
    public data both take them."""
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    scaler = runtime.grad_scaler()
    moe.train()
    losses = []
    for j in range(steps):
        phase_step("MoE steps on public data", j, steps)
        losses.append(float(moe_step(moe, *sample_batch(public, batch, train.seq_len, gen), params, opt,
                                     aux_loss_coef, train, runtime, scaler)))
    moe.eval().requires_grad_(False)
    return losses


def public_tuning(moe: nn.Module, public: torch.Tensor, steps: int, batch: int, lr: float, aux_loss_coef: float,
                  train, runtime: Runtime, seed: int) -> dict:
    """The server's public data for a baseline that has no teachers (FedJETS, central-moe):
    ``steps`` AdamW steps of every MoE weight on public batches of ``batch`` (CE + load balance),
    as many public batches as DeepFusion's server draws (K x kd_steps distillation steps and
    tune_steps tuning steps), so the comparison is on equal server data."""
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


def _scores(model: nn.Module, prefix: str, tokens: torch.Tensor, pairs, server: ServerContext, train) -> dict:
    """One model on one domain's split: stream perplexity and token accuracy, and on
    question-answer data the answer-only perplexity and the generated answers' accuracy."""
    row = {}
    with server.runtime.autocast():
        nll, n, correct = split_token_stats(model, tokens, train.seq_len, train.eval_batch_size)
        if pairs:  # Table II: generated answers against the references; Table I's answer-only perplexity
            row[f"{prefix}_answer_acc"] = generated_token_accuracy(
                model, pairs, server.data.pad_id, server.data.eos_id, train.eval_batch_size, train.max_new_tokens)
            a_nll, a_n = answer_nll(model, pairs, server.data.pad_id, train.eval_batch_size)
            row.update({f"{prefix}_answer_ppl": math.exp(a_nll / max(1, a_n)),
                        f"{prefix}_answer_log_ppl": a_nll / max(1, a_n)})
    row.update({f"{prefix}_ppl": math.exp(nll / n), f"{prefix}_log_ppl": nll / n,
                f"{prefix}_token_acc": 100.0 * correct / n})
    return row


# The dense base's scores by a digest of all they read: every method of a comparison scores the
# same base on the same test data (generation included: minutes on a CPU), so a process scores it once.
_BASE_SCORES: dict[str, dict] = {}


def _base_scores(server: ServerContext, train) -> dict[str, dict]:
    h = hashlib.sha256(tensors_digest(to_cpu(server.base.state_dict())).encode())
    h.update(json.dumps([train.seq_len, train.eval_batch_size, train.max_new_tokens, server.data.pad_id,
                         server.data.eos_id, str(server.runtime.device), server.runtime.precision]).encode())
    for domain, tokens in server.data.test.items():
        h.update(domain.encode() + tokens.numpy().tobytes())
        for q, a in server.data.answers.get(domain) or ():
            h.update(q.numpy().tobytes() + b"/" + a.numpy().tobytes())
    key = h.hexdigest()
    if key not in _BASE_SCORES:
        _BASE_SCORES[key] = {d: _scores(server.base, "test_base", tokens, server.data.answers.get(d), server, train)
                             for d, tokens in server.data.test.items()}
    return _BASE_SCORES[key]


def score_on_server(model: nn.Module, server: ServerContext, train) -> dict[str, dict]:
    """A global model (and, for comparison, the dense base before distillation) on every
    domain's test data of the server: on question-answer data the answer-only perplexity and its
    log (``answer_ppl``: the answers' tokens given their questions, as the paper's QA perplexities
    score; the headline) and the accuracy of generated answers against the references (%, Table
    II: ``answer_acc``); on every domain the stream perplexity of the whole test text, questions
    included (``ppl``, beside it), and the teacher-forced next-token accuracy (``token_acc``);
    with the server's validation split (``data.server_valid_docs``) the same as ``valid_*``."""
    if server is None or server.data is None:
        raise ValueError("the global model is scored on the server's test data: set data.public_frac > 0")
    out, base = {}, _base_scores(server, train)
    for domain, test_tokens in server.data.test.items():
        row = {**_scores(model, "test", test_tokens, server.data.answers.get(domain), server, train), **base[domain]}
        # the server's validation split (data.server_valid_docs), global model only: what its own
        # settings are chosen on, never the test split
        if domain in server.data.valid:
            row.update(_scores(model, "valid", server.data.valid[domain], server.data.valid_answers.get(domain),
                               server, train))
        if getattr(model.config, "num_local_experts", 0):
            with server.runtime.autocast():
                row["expert_load"] = expert_load(model, test_tokens, train.seq_len, train.eval_batch_size)
        out[domain] = row
    return out


@torch.no_grad()
def expert_load(moe: nn.Module, tokens: torch.Tensor, seq_len: int, batch_size: int = 8) -> list[float]:
    """The share of top-k routing slots each expert of a Mixtral MoE takes on ``tokens`` (mean over
    layers; sums to 1): which experts a domain's text uses (the report's expert load per domain)."""
    was_training = moe.training
    moe.eval()
    device = next(moe.parameters()).device
    k, n = moe.config.num_experts_per_tok, moe.config.num_local_experts
    counts = torch.zeros(n, dtype=torch.float64)
    windows = [tokens[s:s + seq_len] for s in range(0, len(tokens) - 1, seq_len) if len(tokens[s:s + seq_len]) == seq_len]
    try:
        for b in range(0, len(windows), batch_size):
            x = torch.stack(windows[b:b + batch_size]).long().to(device)
            for logits in moe(input_ids=x, output_router_logits=True).router_logits:  # one per layer
                top = to_cpu(logits.float().topk(k, dim=-1).indices.reshape(-1))
                counts += torch.bincount(top, minlength=n).double()
    finally:
        moe.train(was_training)
    return [round(v, 4) for v in (counts / counts.sum().clamp_min(1)).tolist()]


def device_cache_path(key: str):
    from ..files import cache_dir
    return cache_dir() / "deepfusion-devices" / f"{key}.safetensors"


def tensors_digest(tensors: Tensors) -> str:
    """SHA-256 of named tensors' names and bytes."""
    h = hashlib.sha256()
    for n, t in sorted(tensors.items()):
        h.update(n.encode())
        h.update(t.contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def upload_digest(upload: Tensors) -> str:
    """The first 16 hex digits of the SHA-256 of a device's uploaded weights (not its data
    embedding), logged with the device's metrics: the methods a comparison pairs on one seed must
    have distilled the same devices, and a device trained again in another session (its cache
    lost) must come out bit for bit the same for its seed's runs to pair (bench/tables.py checks)."""
    return tensors_digest({n: t for n, t in upload.items() if n.startswith("weights.")})[:16]


def device_key(settings: dict, initial_digest: str, data: torch.Tensor, rng: torch.Tensor) -> str:
    """A digest of everything a device's one-shot phase reads: its settings (model spec, ``train``,
    embedding, runtime), its starting weights' digest, its training data and its batch RNG. The
    cache is a simulation shortcut: any change to these inputs is a different key and trains again."""
    h = hashlib.sha256(b"deepfusion-device-v1")
    h.update(json.dumps(settings, sort_keys=True, default=str).encode())
    h.update(initial_digest.encode())
    h.update(data.contiguous().view(torch.uint8).numpy().tobytes())
    h.update(rng.numpy().tobytes())
    return h.hexdigest()


def save_device_upload(key: str, upload: Tensors, metrics: dict, rng: torch.Tensor) -> None:
    """A device's upload, metrics and batch RNG under ``$COMIX_CACHE/deepfusion-devices``
    (temp file, then rename: a killed run leaves no half-written entry)."""
    from safetensors.torch import save_file

    tensors = {**{f"upload.{n}": t.contiguous() for n, t in upload.items()}, "rng": rng.contiguous()}
    atomic_write(device_cache_path(key), lambda p: save_file(tensors, p, metadata={"metrics": json.dumps(metrics)}))


def load_device_upload(key: str) -> tuple[Tensors, dict, torch.Tensor] | None:
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


class DistilledDomains:
    """The domains a DeepFusion server phase has finished distilling, under ``<method>/distilled``:
    each domain's dense student, its KD log and the RNG states after it (the batch generator's and
    torch's, CPU and CUDA; temp file, then rename). A phase killed mid-way (a session's end; 500 KD
    steps a domain on a GPU) resumes after its last finished domain with the numbers of an
    uninterrupted run instead of starting over. A file is used only when its key, a digest of every
    input of that domain's distillation (the method's settings, the teachers' weights and loss
    weights, the public data, the student's start and the RNG states before it), matches; ``clear``
    removes them once the MoE is scored."""

    def __init__(self, out_dir, settings: dict, public: torch.Tensor, student: nn.Module):
        from pathlib import Path
        self.dir = Path(out_dir) / "distilled"
        h = hashlib.sha256(b"deepfusion-distilled-v1")
        h.update(json.dumps(settings, sort_keys=True, default=str).encode())
        h.update(public.contiguous().view(torch.uint8).numpy().tobytes())
        h.update(tensors_digest(to_cpu(student.state_dict())).encode())
        self._inputs = h.hexdigest()

    def key(self, domain: int, teachers: list[tuple[nn.Module, float]], gen: torch.Generator) -> str:
        h = hashlib.sha256(f"{self._inputs}/{domain}".encode())
        for teacher, weight in teachers:
            h.update(f"{weight!r}".encode())
            h.update(tensors_digest(to_cpu(teacher.state_dict())).encode())
        h.update(gen.get_state().numpy().tobytes())
        h.update(torch.get_rng_state().numpy().tobytes())
        if torch.cuda.is_available():
            h.update(torch.cuda.get_rng_state().numpy().tobytes())
        return h.hexdigest()

    def load(self, key: str, domain: int, student: nn.Module, gen: torch.Generator) -> dict | None:
        """The finished domain's KD log, with ``student`` and both RNGs as the distillation left
        them; None when the domain has no file of this key."""
        from safetensors import safe_open

        path = self.dir / f"domain{domain}.safetensors"
        if not path.exists():
            return None
        with safe_open(str(path), "pt") as f:
            if f.metadata().get("key") != key:
                return None
            student.load_state_dict({n[len("student."):]: f.get_tensor(n) for n in f.keys() if n.startswith("student.")})
            gen.set_state(f.get_tensor("rng.batches"))
            torch.set_rng_state(f.get_tensor("rng.torch"))
            if "rng.cuda" in f.keys():
                torch.cuda.set_rng_state(f.get_tensor("rng.cuda"))
            return json.loads(f.metadata()["log"])

    def save(self, key: str, domain: int, student: nn.Module, log: dict, gen: torch.Generator) -> None:
        from safetensors.torch import save_file

        tensors = {**{f"student.{n}": t.detach().to("cpu", copy=True) for n, t in student.state_dict().items()},
                   "rng.batches": gen.get_state(), "rng.torch": torch.get_rng_state(),
                   **({"rng.cuda": torch.cuda.get_rng_state()} if torch.cuda.is_available() else {})}
        atomic_write(self.dir / f"domain{domain}.safetensors",
                     lambda p: save_file(tensors, p, metadata={"key": key, "log": json.dumps(log)}))

    def clear(self) -> None:
        import shutil
        shutil.rmtree(self.dir, ignore_errors=True)
