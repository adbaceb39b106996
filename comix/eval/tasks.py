"""Task metrics of instruction tuning (FedAMoLE Sec. V-A-5): accuracy for classification (the
label whose continuation has the lowest LM loss), Rouge-L (the authors' ``rouge`` package by
default, ``rouge_score`` beside it) of greedy generations for generation tasks; MTA[t] = mean over clients of a round's metric, MTAL = MTA of
the last round (eq. 29-30).
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from ..runtime import to_cpu
from ..tokens import leading_special_ids


ROUGE = ("rouge", "rouge-score")  # the authors' package (default), Google's rouge_score


@functools.cache
def _scorer(impl: str):
    if impl == "rouge":
        from rouge import Rouge
        return Rouge()
    from rouge_score import rouge_scorer
    return rouge_scorer.RougeScorer(["rougeL"])


def rouge_l(prediction: str, reference: str, impl: str = "rouge") -> float:
    """Rouge-L F-measure. ``impl="rouge"``: the ``rouge`` package (1.0.1), as FedAMoLE's authors
    score (``evaluation.py``: ``Rouge().get_scores(hyp, ref)[0]['rouge-l']['f']``, 0 for an empty
    generation or whatever the package refuses): summary-level LCS over sentences split on '.',
    whitespace tokens, case-sensitive. ``impl="rouge-score"``: Google's ``rouge_score`` rougeL
    (one LCS over the whole text, lower-cased, punctuation dropped), as FedIT's evaluation uses."""
    if impl == "rouge":
        if not prediction:
            return 0.0
        try:
            return float(_scorer("rouge").get_scores(prediction, reference)[0]["rouge-l"]["f"])
        except (ValueError, RecursionError):  # an empty reference or a text the package cannot split
            return 0.0
    return _scorer("rouge-score").score(reference, prediction)["rougeL"].fmeasure


@torch.inference_mode()
def continuation_losses(model, tokenizer, prompt: str, continuations: list[str]) -> torch.Tensor:
    """Mean token NLL of each continuation after ``prompt`` (one batch, right-padded)."""
    device = model.get_input_embeddings().weight.device
    p = leading_special_ids(tokenizer) + tokenizer(prompt, add_special_tokens=False)["input_ids"]
    seqs = [p + tokenizer(c, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id] for c in continuations]
    width = max(map(len, seqs))
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    ids = torch.tensor([s + [pad] * (width - len(s)) for s in seqs], device=device)
    labels = torch.full_like(ids, -100)
    for i, s in enumerate(seqs):
        labels[i, len(p):len(s)] = ids[i, len(p):len(s)]
    # right padding needs no attention mask in a causal LM: no real token attends a later pad
    logits = model(input_ids=ids).logits
    nll = F.cross_entropy(logits[:, :-1].float().transpose(1, 2), labels[:, 1:], reduction="none")
    return nll.sum(1) / (labels[:, 1:] != -100).sum(1)


def choice_accuracy(model, tokenizer, prompts: list[str], choices: list[str], golds: list[str]) -> float:
    """Share of examples whose gold label has the lowest loss among ``choices``."""
    hits = 0
    for prompt, gold in zip(prompts, golds):
        losses = continuation_losses(model, tokenizer, prompt, choices)
        hits += choices[int(losses.argmin())] == gold
    return hits / max(1, len(prompts))


def mta(per_client: dict[str, float]) -> float:
    """MTA[t] (eq. 30): the mean over clients of their metric at one round."""
    return sum(per_client.values()) / max(1, len(per_client))


# -- over a client's split of tokenised examples (data.instructions.InstructionSplit) ---------------
def _right_pad(seqs: list[list[int]], pad: int, device) -> torch.Tensor:
    width = max(map(len, seqs))
    return torch.tensor([s + [pad] * (width - len(s)) for s in seqs], device=device)


@torch.inference_mode()
def choice_losses(model, split, choices: tuple[str, ...], batch_size: int = 8) -> torch.Tensor:
    """(examples, choices): mean token NLL of each label continuation (+ EOS, as trained) after
    each example's prompt, ``batch_size`` examples (x choices rows) per forward. The model's
    logits for prepended virtual tokens (prompt tuning) are dropped: the last positions are the
    inputs' (the reference evaluator slices them off the same way)."""
    tok = split.tokenizer
    device = model.get_input_embeddings().weight.device
    conts = [tok(c, add_special_tokens=False)["input_ids"] + [tok.eos_token_id] for c in choices]
    out = []
    for b in range(0, len(split), batch_size):
        prompts = [split.prompt_ids(i).tolist() for i in range(b, min(b + batch_size, len(split)))]
        seqs = [p + c for p in prompts for c in conts]
        ids = _right_pad(seqs, split.pad_id, device)
        labels = torch.full_like(ids, -100)
        row = 0
        for p in prompts:
            for c in conts:
                labels[row, len(p):len(p) + len(c)] = ids[row, len(p):len(p) + len(c)]
                row += 1
        logits = model(input_ids=ids).logits[:, -ids.shape[1]:]
        nll = F.cross_entropy(logits[:, :-1].float().transpose(1, 2), labels[:, 1:], reduction="none")
        out.append((nll.sum(1) / (labels[:, 1:] != -100).sum(1)).reshape(len(prompts), len(conts)))
    return to_cpu(torch.cat(out))


def split_predictions(model, split, choices: tuple[str, ...], batch_size: int = 8) -> list[str]:
    """Each example's lowest-loss label (FedAMoLE Sec. V-A-2, the reference evaluator's argmin)."""
    return [choices[p] for p in choice_losses(model, split, choices, batch_size).argmin(1).tolist()]


def split_accuracy(model, split, choices: tuple[str, ...], batch_size: int = 8,
                   predictions: list[str] | None = None) -> float:
    """Accuracy (%) of the lowest-loss label (``predictions``: computed already)."""
    pred = predictions if predictions is not None else split_predictions(model, split, choices, batch_size)
    return 100.0 * sum(p == ex.output for p, ex in zip(pred, split.examples)) / max(1, len(split))


def _left_pad(prompts: list[list[int]], pad: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Prompts left-padded to one width for generation, and their attention mask."""
    width = max(map(len, prompts))
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    return ids, mask


@torch.inference_mode()
def generate_split(model, split, max_new_tokens: int = 128, batch_size: int = 8) -> list[str]:
    """Greedy continuations of every example's prompt (at most ``max_new_tokens``, stopping at
    EOS), ``batch_size`` prompts at a time, left-padded with an attention mask."""
    tok = split.tokenizer
    device = model.get_input_embeddings().weight.device
    texts = []
    for b in range(0, len(split), batch_size):
        prompts = [split.prompt_ids(i).tolist() for i in range(b, min(b + batch_size, len(split)))]
        ids, mask = _left_pad(prompts, split.pad_id, device)
        width = ids.shape[1]
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False,
                             eos_token_id=tok.eos_token_id, pad_token_id=split.pad_id)
        texts += [tok.decode(row[width:], skip_special_tokens=True).strip() for row in out]
    return texts


def split_rouge_l(model, split, max_new_tokens: int = 128, batch_size: int = 8) -> dict[str, float]:
    """Mean Rouge-L F (%) of greedy generations against the references, by each implementation of
    ``ROUGE`` (the same generations scored both ways, so their difference is measured)."""
    gens = generate_split(model, split, max_new_tokens, batch_size)
    return {impl: 100.0 * sum(rouge_l(g, ex.output, impl) for g, ex in zip(gens, split.examples)) / max(1, len(split))
            for impl in ROUGE}


@torch.inference_mode()
def split_response_nll(model, split, batch_size: int = 8) -> tuple[float, int]:
    """(sum of NLLs, number of target tokens) of the responses only, over every example."""
    device = model.get_input_embeddings().weight.device
    total, count = 0.0, 0
    for b in range(0, len(split), batch_size):
        idx = range(b, min(b + batch_size, len(split)))
        ids = _right_pad([split.ids[i].tolist() for i in idx], split.pad_id, device)
        labels = _right_pad([split.labels[i].tolist() for i in idx], -100, device)
        logits = model(input_ids=ids).logits[:, -ids.shape[1]:]
        total += F.cross_entropy(logits[:, :-1].float().transpose(1, 2), labels[:, 1:], reduction="sum").item()
        count += int((labels[:, 1:] != -100).sum())
    return total, count


@torch.inference_mode()
def generated_token_accuracy(model, pairs: list[tuple[torch.Tensor, torch.Tensor]], pad_id: int,
                             eos_id: int | None = None, batch_size: int = 8, max_new_tokens: int = 64) -> float:
    """DeepFusion's token accuracy (Sec. V-B, Table II): the share (%) of reference-answer tokens
    that the greedy *generated* answer matches position by position (a generation that stops
    early misses the rest). Questions are left-padded with an attention mask; each answer is
    generated for as many tokens as its reference (at most ``max_new_tokens``)."""
    device = model.get_input_embeddings().weight.device
    was_training = model.training
    model.eval()
    correct = total = 0
    try:
        for b in range(0, len(pairs), batch_size):
            batch = pairs[b:b + batch_size]
            refs = [a[:max_new_tokens].tolist() for _, a in batch]
            ids, mask = _left_pad([q.tolist() for q, _ in batch], pad_id, device)
            width = ids.shape[1]
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max(map(len, refs)),
                                 do_sample=False, pad_token_id=pad_id, eos_token_id=eos_id)
            for row, ref in zip(out[:, width:].tolist(), refs):
                correct += sum(g == r for g, r in zip(row, ref))
                total += len(ref)
    finally:
        model.train(was_training)
    return 100.0 * correct / max(1, total)


@torch.inference_mode()
def answer_nll(model, pairs: list[tuple[torch.Tensor, torch.Tensor]], pad_id: int,
               batch_size: int = 8) -> tuple[float, int]:
    """(sum of NLLs, number of answer tokens) of each reference answer given its question,
    teacher-forced: the answer-only perplexity DeepFusion's QA tables report (Sec. V-B), where a
    stream perplexity also scores the questions' tokens. Right-padded: no real token attends a pad."""
    device = model.get_input_embeddings().weight.device
    total, count = 0.0, 0
    for b in range(0, len(pairs), batch_size):
        batch = pairs[b:b + batch_size]
        seqs = [q.tolist() + a.tolist() for q, a in batch]
        ids = _right_pad(seqs, pad_id, device)
        labels = torch.full_like(ids, -100)
        for i, (q, a) in enumerate(batch):
            labels[i, len(q):len(q) + len(a)] = ids[i, len(q):len(q) + len(a)]
        logits = model(input_ids=ids).logits
        total += F.cross_entropy(logits[:, :-1].float().transpose(1, 2), labels[:, 1:], reduction="sum").item()
        count += int((labels[:, 1:] != -100).sum())
    return total, count

