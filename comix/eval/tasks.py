"""Task metrics of instruction tuning (FedAMoLE Sec. V-A-5): accuracy for classification (the
label whose continuation has the lowest LM loss), Rouge-L (``rouge-score``) of greedy
generations for generation tasks; MTA[t] = mean over clients of a round's metric, MTAL = MTA of
the last round (eq. 29-30).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def rouge_l(prediction: str, reference: str) -> float:
    """Rouge-L F-measure (``rouge_score``'s, as the FedAMoLE and FedIT evaluations use)."""
    from rouge_score import rouge_scorer
    return rouge_scorer.RougeScorer(["rougeL"]).score(reference, prediction)["rougeL"].fmeasure


@torch.inference_mode()
def continuation_losses(model, tokenizer, prompt: str, continuations: list[str]) -> torch.Tensor:
    """Mean token NLL of each continuation after ``prompt`` (one batch, right-padded)."""
    device = model.get_input_embeddings().weight.device
    p = tokenizer(prompt, add_special_tokens=False)["input_ids"]
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


@torch.inference_mode()
def greedy_generate(model, tokenizer, prompt: str, max_new_tokens: int = 128) -> str:
    device = model.get_input_embeddings().weight.device
    ids = tokenizer(prompt, add_special_tokens=False, return_tensors="pt")["input_ids"].to(device)
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                         do_sample=False, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.eos_token_id)
    return tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True).strip()


def mean_rouge_l(model, tokenizer, prompts: list[str], references: list[str], max_new_tokens: int = 128) -> float:
    scores = [rouge_l(greedy_generate(model, tokenizer, p, max_new_tokens), r) for p, r in zip(prompts, references)]
    return sum(scores) / max(1, len(scores))


def mta(per_client: dict[str, float]) -> float:
    """MTA[t] (eq. 30): the mean over clients of their metric at one round."""
    return sum(per_client.values()) / max(1, len(per_client))
