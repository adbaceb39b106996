"""Distillation across tokenizers: a teacher of another family (e.g. Gemma-3-270M, vocabulary
262k) teaching a student (SmolLM2, 49k) on the same text, aligned as FuseLLM (Wan et al., ICLR
2024; FuseAI's ``FuseLLM/src/utils/others.py`` and ``vocab_mapping.py``) and FedMKT (Fan et al.,
2024; FATE-LLM's ``fate_llm/algo/fedmkt/token_alignment/``) align them:

1. Re-tokenisation. The student's window is decoded to text and the teacher reads that text
   through its own tokenizer (``CrossTokenizerTeacher.teacher_inputs``); a device of that family
   trains on its own tokenisation of its text the same way (``retokenize``).
2. Token alignment. The two token sequences are aligned by dynamic time warping with the edit
   distance between token strings as the cost (``dtw_alignment``; FedMKT's ``dtw``,
   ``align_strategy="dtw"``, after FuseLLM's).
3. Vocabulary mapping. A teacher token maps to the student token of the same text, else to the
   student token at minimum edit distance (MinED; FuseLLM's ``find_best_mapping``)
   (``VocabMapping``; computed for the tokens that occur and cached, where FuseLLM precomputes
   all 262k x 49k distances offline).
4. Per-step targets. Where the token a student step predicts is aligned one-to-one with the
   token a teacher step predicts and they are the same text (or the mapping says so), the teacher's top-k logits (k = 10,
   FuseLLM's ``--top_k_logits``) at that step, softened by the temperature and carried into the
   student's vocabulary through the mapping, are the target; everywhere else the target is
   one-hot on the student's own token (their "one-hot logits" fallback).

Special tokens are each tokenizer's own (``translate``): the student's EOS between documents
becomes the teacher's EOS (never its text, which a Llama-2-style tokenizer would read as
``<unk> e o <unk>``), and a teacher whose convention starts a sequence with BOS (Llama-2, Gemma)
gets its BOS in front of every window it reads; teacher and student EOS map onto each other.

Documented choices where this differs from the authors' code:
- A token's string is the text it stands for (its tokenizer's decoder applied to it alone:
  byte-level tokens through the byte table, SentencePiece's '▁' as a space) instead of one word
  marker replaced per tokenizer class (their ``TOKENIZER_TO_SPECIAL_TOKEN`` table): one rule for
  every tokenizer, so equal strings mean equal text.
- The steps are aligned on the tokens they *predict* (student step i predicts y_i, teacher step
  j predicts y'_j), since a step's distribution is over the next token; their code aligns the
  input tokens of the steps (with one-to-one neighbours the same pairs).
- Teacher tokens that map to one student token add their probabilities (FedMKT keeps the first).
"""
from __future__ import annotations

import functools

import numpy as np
import torch
import torch.nn.functional as F

from ..runtime import to_cpu
from ..tokens import leading_special_ids

TOP_K = 10  # FuseLLM's --top_k_logits and FedMKT's top_k_logits_keep default


@functools.lru_cache(maxsize=8)
def tokenizer_at(source: str):
    """The tokenizer saved at ``source`` (a folder or hub id), loaded once per process."""
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(source)


def reads_other_tokens(model, tokenizer: str) -> bool:
    """Whether ``model`` reads other token ids than those of ``tokenizer`` (a tokenizer's folder or
    hub id): it records a tokenizer of its own (``models/devices.py``) that is another."""
    own = getattr(model.config, "comix_tokenizer", None)
    return own is not None and str(own) != str(tokenizer)


def token_decoder(tokenizer):
    """``tokenizer``'s decoder (a fast tokenizer's) without the steps that drop a text's leading
    space: SentencePiece-converted tokenizers (Llama-2, TinyLlama, Mistral) end it with
    ``Strip(' ', 1, 0)`` or a ``Metaspace`` that skips the first word's space, so "▁hello"
    decoded alone became "hello" and never met the student's " hello". Without them every token
    reads as its surface form with its space (FuseLLM / FedMKT compare surface forms too, their
    '▁' / 'Ġ' markers made one)."""
    import json

    from tokenizers import Tokenizer

    state = json.loads(tokenizer.backend_tokenizer.to_str())
    if state.get("decoder") is None:
        return None

    def keep(d: dict) -> dict | None:
        if d.get("type") == "Strip":
            return None
        if d.get("type") == "Metaspace":
            d = {**d, "prepend_scheme": "never", "add_prefix_space": False}
        if d.get("type") == "Sequence":
            d = {**d, "decoders": [k for k in map(keep, d["decoders"]) if k is not None]}
        return d
    state["decoder"] = keep(state["decoder"])
    return Tokenizer.from_str(json.dumps(state)).decoder


@functools.lru_cache(maxsize=8)
def token_texts(tokenizer) -> tuple[str, ...]:
    """The text of every token id of ``tokenizer`` (a fast tokenizer), read through its decoder
    alone, leading space kept (``token_decoder``; module docstring); cached per tokenizer."""
    decoder = token_decoder(tokenizer)
    tokens = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
    if decoder is None:
        return tuple(tokens)
    return tuple(decoder.decode([t]) if t is not None else "" for t in tokens)


def dtw_alignment(a: list[str], b: list[str]) -> list[list[int]]:
    """For every position of ``b``, the positions of ``a`` aligned to it by dynamic time warping
    with the edit distance between the strings as the cost: the monotone path from (0, 0) to the
    last pair of least total cost, traced back preferring the diagonal (FedMKT's ``dtw``)."""
    from rapidfuzz.distance import Levenshtein
    from rapidfuzz.process import cdist

    n, m = len(a), len(b)
    if not n or not m:
        return [[] for _ in range(m)]
    cost = cdist(a, b, scorer=Levenshtein.distance, dtype=np.int32).astype(np.float64)
    acc = np.full((n + 1, m + 1), np.inf)
    acc[0, 0] = 0.0
    for i in range(1, n + 1):
        row, prev, c = acc[i], acc[i - 1], cost[i - 1]
        best = np.minimum(prev[1:], prev[:-1])   # from above or the diagonal, for every j at once
        for j in range(1, m + 1):                # ... and from the left, which depends on this row
            row[j] = c[j - 1] + min(best[j - 1], row[j - 1])
    acc = acc[1:, 1:]
    i, j = n - 1, m - 1
    to_a: list[list[int]] = [[] for _ in range(m)]
    while i > 0 or j > 0:
        to_a[j].append(i)
        options = (acc[i - 1, j - 1] if i and j else np.inf, acc[i - 1, j] if i else np.inf,
                   acc[i, j - 1] if j else np.inf)
        move = int(np.argmin(options))  # ties: the diagonal first, as np.argmin in theirs
        i, j = (i - 1, j - 1) if move == 0 else (i - 1, j) if move == 1 else (i, j - 1)
    to_a[0].append(0)
    return [sorted(x) for x in to_a]


class VocabMapping:
    """Teacher token id -> student token id: the student token of the same text, else the one at
    minimum edit distance (MinED, FuseLLM's ``find_best_mapping``; ties: the lowest id)."""

    def __init__(self, teacher_tokenizer, student_tokenizer):
        self.teacher_text = token_texts(teacher_tokenizer)
        self.student_text = token_texts(student_tokenizer)
        self.student_id: dict[str, int] = {}
        for i, t in enumerate(self.student_text):
            self.student_id.setdefault(t, i)
        # special tokens stand for no text: each maps to the student's token of the same role
        self._cache: dict[int, int] = {t: s for t, s in special_pairs(teacher_tokenizer, student_tokenizer).items()}

    def text_of(self, teacher_id: int) -> str:
        """A teacher token's text; ids past its tokenizer (a padded embedding) have none."""
        return self.teacher_text[teacher_id] if teacher_id < len(self.teacher_text) else ""

    def __call__(self, teacher_id: int) -> int:
        if teacher_id not in self._cache:
            text = self.text_of(teacher_id)
            exact = self.student_id.get(text)
            if exact is None:
                from rapidfuzz.distance import Levenshtein
                from rapidfuzz.process import extractOne
                exact = extractOne(text, self.student_text, scorer=Levenshtein.distance)[2]
            self._cache[teacher_id] = exact
        return self._cache[teacher_id]

    def many(self, ids: torch.Tensor) -> torch.Tensor:
        return torch.tensor([self(int(i)) for i in ids.reshape(-1).tolist()], dtype=torch.long).reshape(ids.shape)


@functools.lru_cache(maxsize=8)
def vocab_mapping(teacher_tokenizer, student_tokenizer) -> VocabMapping:
    """One mapping per tokenizer pair and process: its MinED look-ups carry over from one domain's
    (and one method's) distillation to the next."""
    return VocabMapping(teacher_tokenizer, student_tokenizer)


def special_pairs(source_tokenizer, target_tokenizer) -> dict[int, int]:
    """Source special token id -> the target's token of the same role (EOS, BOS, pad), where the
    target has one."""
    out = {}
    for role in ("pad_token_id", "bos_token_id", "eos_token_id"):  # later roles win a shared id (EOS = pad)
        s, t = getattr(source_tokenizer, role, None), getattr(target_tokenizer, role, None)
        if s is not None and t is not None:
            out[s] = t
    return out


def translate(ids: list[int], source_tokenizer, target_tokenizer) -> list[int]:
    """``source_tokenizer``'s ids as ``target_tokenizer`` reads the same text: the text between
    special tokens decoded and re-encoded, each special token the target's of the same role
    (dropped where the target has none)."""
    specials, pairs = set(source_tokenizer.all_special_ids), special_pairs(source_tokenizer, target_tokenizer)
    out, run = [], []
    for i in [*ids, None]:
        if i is not None and i not in specials:
            run.append(i)
            continue
        if run:
            out.extend(target_tokenizer(source_tokenizer.decode(run), add_special_tokens=False).input_ids)
            run = []
        if i is not None and i in pairs:
            out.append(pairs[i])
    return out


def retokenize(tokens: torch.Tensor, source_tokenizer, target_tokenizer, chunk: int = 2048) -> torch.Tensor:
    """A token stream of ``source_tokenizer`` as ``target_tokenizer`` reads its text (``translate``)
    in chunks of ``chunk`` tokens (a word cut at a chunk boundary is read as two)."""
    out = []
    for s in range(0, len(tokens), chunk):
        out.extend(translate(tokens[s:s + chunk].tolist(), source_tokenizer, target_tokenizer))
    return torch.tensor(out, dtype=torch.int32)


class CrossTokenizerTeacher:
    """What a teacher with another tokenizer needs on each distillation batch: its inputs for the
    student's windows, and its next-token distributions carried onto the student's steps."""

    def __init__(self, teacher_tokenizer, student_tokenizer, top_k: int = TOP_K):
        self.teacher_tok, self.student_tok, self.top_k = teacher_tokenizer, student_tokenizer, top_k
        self.mapping = vocab_mapping(teacher_tokenizer, student_tokenizer)
        self.lead = leading_special_ids(teacher_tokenizer)  # its BOS where its convention puts one
        pad = teacher_tokenizer.pad_token_id
        self.pad = pad if pad is not None else (teacher_tokenizer.eos_token_id or 0)

    def teacher_inputs(self, x: torch.Tensor, y: torch.Tensor):
        """The student's windows (inputs ``x``, next tokens ``y``, (B, T)) as the teacher reads
        them, after its leading BOS where it uses one: (inputs (B, T'), attention mask (B, T'),
        each row's whole window of teacher tokens), right-padded."""
        if (y < 0).any():
            raise ValueError("cross-tokenizer distillation reads whole token windows (no masked targets)")
        rows = []
        for xi, yi in zip(x.tolist(), y.tolist()):
            ids = self.lead + translate(xi + yi[-1:], self.student_tok, self.teacher_tok)
            rows.append(ids if len(ids) >= 2 else ids + [self.pad] * (2 - len(ids)))
        width = max(len(r) for r in rows) - 1
        inputs = torch.full((len(rows), width), self.pad, dtype=torch.long)
        mask = torch.zeros(len(rows), width, dtype=torch.long)
        for r, ids in enumerate(rows):
            inputs[r, :len(ids) - 1] = torch.tensor(ids[:-1])
            mask[r, :len(ids) - 1] = 1
        return inputs, mask, rows

    @torch.no_grad()
    def targets(self, x: torch.Tensor, y: torch.Tensor, teacher_logits: torch.Tensor, teacher_rows: list[list[int]],
                vocab: int, temperature: float = 1.0) -> tuple[torch.Tensor, float]:
        """The teacher's next-token distribution on every student step (B, T, ``vocab``: the
        student's logits' width), and the share of steps that carry it (the rest are one-hot on
        the student's token). ``teacher_rows``: ``teacher_inputs``' whole windows."""
        x, y = to_cpu(x), to_cpu(y)
        b, t = y.shape
        s_text = self.mapping.student_text
        idx = y[..., None].repeat(1, 1, self.top_k)
        prob = torch.zeros(b, t, self.top_k)
        prob[..., 0] = 1.0
        top_logits, top_ids = teacher_logits.float().topk(self.top_k, dim=-1)
        top_p, top_ids = to_cpu(F.softmax(top_logits / temperature, -1)), to_cpu(top_ids)
        aligned = 0
        for r in range(b):
            # the whole windows are aligned (both start at the text's first character; the
            # teacher's BOS before it is left out); student step i predicts its window's token
            # i + 1, the teacher's step at row position lead + j - 1 its window's token j
            lead = len(self.lead)
            s_all, t_all = x[r].tolist() + y[r, -1:].tolist(), teacher_rows[r][lead:]
            to_teacher = dtw_alignment([self.mapping.text_of(i) for i in t_all], [s_text[i] for i in s_all])
            takers = [0] * len(t_all)
            for js in to_teacher:
                for j in js:
                    takers[j] += 1
            for i in range(t):
                js = to_teacher[i + 1]
                if len(js) != 1 or js[0] + lead == 0 or takers[js[0]] != 1:  # one-to-one only
                    continue
                j, target = js[0] + lead - 1, t_all[js[0]]
                if s_text[s_all[i + 1]] != self.mapping.text_of(target) and self.mapping(target) != s_all[i + 1]:
                    continue
                idx[r, i] = self.mapping.many(top_ids[r, j])
                prob[r, i] = top_p[r, j]
                aligned += 1
        dist = torch.zeros(b, t, vocab).scatter_add_(-1, idx, prob)
        return dist, aligned / max(1, b * t)
