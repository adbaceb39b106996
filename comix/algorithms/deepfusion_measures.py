"""What DeepFusion's server measures besides training, for the tables and the report (nothing
here changes a model): how much each KD term steers the student, and what the devices' models
know of each domain next to the student they teach (the premise of distillation)."""
from __future__ import annotations

import copy
import hashlib
import json
import logging

import torch
import torch.nn.functional as F
from torch import nn

from ..eval.perplexity import split_token_stats
from ..models.base import tokenizer_source
from ..models.token_align import reads_other_tokens, retokenize, tokenizer_at
from ..runtime import to_cpu
from .global_moe import tensors_digest


def gradient_shares(parts: dict[str, torch.Tensor], params: list[nn.Parameter], log: dict, step: int,
                    whole: list[torch.Tensor] | None = None) -> None:
    """Each weighted KD term's gradient norm on the student's parameters (CE, alpha * FM, beta *
    KL, summed over the teachers), its share of the three norms, and the cosine between the FM
    gradient and the CE + KL one, appended to ``log`` (server.jsonl's ``kd[..]["grad"]``).
    ``whole``: the gradient of the parts' sum on ``params`` (the KD step's own backward pass), so
    CE's is that minus the others' and costs no backward pass of its own (with three passes the
    log took a quarter of the seed-42 sweep's KD time at every 5th step, py-spy on the 2-core EPYC)."""
    flat = {}
    for k, term in parts.items():
        if not term.requires_grad:  # FM is absent for the logit-only methods
            flat[k] = None
            continue
        if k == "ce" and whole is not None:
            continue
        g = torch.autograd.grad(term, params, retain_graph=True, allow_unused=True)
        flat[k] = torch.cat([(x if x is not None else torch.zeros_like(p)).reshape(-1).float()
                             for x, p in zip(g, params)])
    if whole is not None and parts["ce"].requires_grad:
        flat["ce"] = torch.cat([g.reshape(-1).float() for g in whole]) - sum(v for v in flat.values() if v is not None)
    norms = {k: float(v.norm()) if v is not None else 0.0 for k, v in flat.items()}
    total = sum(norms.values()) or 1.0
    log["step"].append(step)
    for k in ("ce", "fm", "kl"):
        log[k].append([round(norms[k], 6), round(norms[k] / total, 6)])
    rest = sum(v for k, v in flat.items() if k != "fm" and v is not None)
    cos = float(F.cosine_similarity(flat["fm"], rest, dim=0)) if flat["fm"] is not None and norms["fm"] else 0.0
    log["cos_fm_rest"].append(round(cos, 6))


# The premise by a digest of all it reads: FedKMT, DeepFusion and CE only of one comparison read the same
# cached devices and student (scoring 4 teachers took 8 min a method on the 2-core EPYC, Gemma-3-270M
# devices), so a process measures it once; untrained teachers (device_steps=0) are other weights: measured.
_PREMISES: dict[str, dict] = {}


def _premise_key(models: dict[int, nn.Module], server, seq_len: int) -> str:
    h = hashlib.sha256(b"deepfusion-premise-v1")
    for name, model in [("student", server.base), *sorted(models.items())]:
        h.update(f"{name}/{tokenizer_source(model)}".encode())
        h.update(tensors_digest(to_cpu(model.state_dict())).encode())
    h.update(json.dumps([seq_len, str(server.runtime.device), server.runtime.precision]).encode())
    for split in (server.data.test, server.data.public):
        for domain, tokens in split.items():
            h.update(domain.encode() + b"/" + tokens.numpy().tobytes())
    return h.hexdigest()


@torch.no_grad()
def in_domain_scores(models: dict[int, nn.Module], server, seq_len: int) -> dict:
    """Every device model's and the dense student's log perplexity per *character* (nats) on each
    domain's test text of the server: per character, so a device of another tokenizer (Gemma) reads
    the same text in its own tokens and still compares. {"devices": {client: {domain: nats/char}},
    "student": {domain: nats/char}, "public": the same on the public text distillation runs on}; the
    report puts each device's own dominant domain beside it. The public text is the premise's own
    ground: a teacher helps a student there only where it knows that text better (each public
    stream scored up to the longest test stream's length, so the measure costs what the test's
    does; its "all" pools the streams, nats over characters)."""
    student_tok = tokenizer_at(tokenizer_source(server.base))

    def nats(model, domain_tokens) -> float:
        own = tokenizer_source(model)
        tokens = retokenize(domain_tokens, student_tok, tokenizer_at(own)) \
            if reads_other_tokens(model, tokenizer_source(server.base)) else domain_tokens
        was = model.training
        model.eval()
        try:
            with server.runtime.autocast():
                nll, _, _ = split_token_stats(model.to(server.runtime.device), tokens, seq_len)
        finally:
            model.train(was)
        return nll

    def scores(streams: dict[str, torch.Tensor], pooled: bool) -> dict:
        chars = {d: max(1, len(student_tok.decode(t.tolist()))) for d, t in streams.items()}
        out = {"devices": {}, "student": {}}
        for name, model in [("student", server.base), *((str(c), m) for c, m in models.items())]:
            nll = {d: nats(model, t) for d, t in streams.items()}
            row = {d: round(nll[d] / chars[d], 6) for d in streams}
            if pooled:
                row["all"] = round(sum(nll.values()) / sum(chars.values()), 6)
            if name == "student":
                out["student"] = row
            else:
                out["devices"][name] = row
        return out
    key = _premise_key(models, server, seq_len)
    if key not in _PREMISES:
        out = scores(server.data.test, pooled=False)
        cap = max(len(t) for t in server.data.test.values())
        out["public"] = scores({d: t[:cap] for d, t in server.data.public.items()}, pooled=True)
        _PREMISES[key] = out
    out = copy.deepcopy(_PREMISES[key])  # the caller's copy goes into its own server.jsonl
    # logged at once, before the distillation it decides is worth running (server.jsonl has it only after)
    logging.getLogger("comix.deepfusion").info(
        "public text, nats/char pooled: student %.4f, devices %s", out["public"]["student"]["all"],
        {c: row["all"] for c, row in out["public"]["devices"].items()})
    return out
