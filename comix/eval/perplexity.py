"""Exact perplexity: exp(mean token NLL) over a *whole* token split.

The split is cut into fixed, non-overlapping windows of ``seq_len`` inputs; window w predicts
tokens[w*L+1 : (w+1)*L+1], so every token after the first is predicted exactly once (the last,
shorter window included). Deterministic and batched; no sampling.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def split_nll(model, tokens: torch.Tensor, seq_len: int, batch_size: int = 8) -> tuple[float, int]:
    """(sum of token NLLs, number of predicted tokens) over the whole split."""
    total, n, _ = split_token_stats(model, tokens, seq_len, batch_size)
    return total, n


@torch.inference_mode()
def split_token_stats(model, tokens: torch.Tensor, seq_len: int, batch_size: int = 8) -> tuple[float, int, int]:
    """(sum of token NLLs, predicted tokens, tokens whose argmax prediction is right) over the
    whole split: perplexity and DeepFusion's token accuracy (Sec. V-B) from one pass."""
    n_pred = len(tokens) - 1
    if n_pred < 1:
        raise ValueError("a split needs at least 2 tokens for perplexity")
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    starts = list(range(0, n_pred, seq_len))
    full = [s for s in starts if s + seq_len <= n_pred]
    tail = [s for s in starts if s + seq_len > n_pred]
    total, correct = 0.0, 0
    try:
        for group, length in ((full, seq_len), (tail, None)):
            for b in range(0, len(group), batch_size):
                chunk = group[b:b + batch_size]
                L = length or (n_pred - chunk[0])
                x = torch.stack([tokens[s:s + L] for s in chunk]).long().to(device)
                y = torch.stack([tokens[s + 1:s + 1 + L] for s in chunk]).long().to(device)
                logits = model(input_ids=x).logits[:, -x.shape[1]:]  # past any virtual tokens
                total += F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1),
                                         reduction="sum").item()
                correct += int((logits.argmax(-1) == y).sum())
    finally:
        model.train(was_training)
    return total, n_pred, correct


def perplexity(model, tokens: torch.Tensor, seq_len: int, batch_size: int = 8) -> float:
    total, n = split_nll(model, tokens, seq_len, batch_size)
    return math.exp(total / n)


@torch.inference_mode()
def cohort_split_nll(model: nn.Module, splits: list[torch.Tensor], seq_len: int, batch_size: int) -> list[tuple[float, int]]:
    """``split_nll`` of each client of a cohort model (models/cohort.py) on its own split, in
    forwards of ``batch_size`` windows a client: the same windows as one client at a time, a
    shorter last window padded at its end (causal attention: the padding changes no earlier
    position) and a client with fewer windows given rows without targets."""
    device = next(model.parameters()).device
    windows = []
    for tokens in splits:
        n_pred = len(tokens) - 1
        rows = []
        for s in range(0, n_pred, seq_len):
            L = min(seq_len, n_pred - s)
            x = torch.zeros(seq_len, dtype=torch.long)
            y = torch.full((seq_len,), -100, dtype=torch.long)
            x[:L], y[:L] = tokens[s:s + L], tokens[s + 1:s + 1 + L]
            rows.append((x, y))
        windows.append(rows)
    most = max(len(w) for w in windows)
    totals = [0.0] * len(splits)
    empty = (torch.zeros(seq_len, dtype=torch.long), torch.full((seq_len,), -100, dtype=torch.long))
    for b in range(0, most, batch_size):
        xs, ys = zip(*(w[i] if i < len(w) else empty for w in windows for i in range(b, min(b + batch_size, most))))
        x, y = torch.stack(xs).to(device), torch.stack(ys).to(device)
        logits = model(input_ids=x).logits[:, -x.shape[1]:]
        nll = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1), reduction="none")
        for c, v in enumerate(nll.reshape(len(splits), -1).sum(1).tolist()):
            totals[c] += v
    return [(t, len(tokens) - 1) for t, tokens in zip(totals, splits)]
