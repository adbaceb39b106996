"""Per-user token splits (CoMiGS Sec. 4.1.1, App. B.2) and nanoGPT-style batch sampling.

Documents of each category are split into train / valid / test *by document* (no text shared),
tokenised once (cached under ``$COMIX_CACHE/tokens``) and concatenated with EOS between
documents. Three setups:
  * ``in``  (in-distribution): user i trains, validates and tests on category i;
  * ``ood`` (out-of-distribution): user i trains on category i, but validates and tests on a
    uniform mixture of all categories (equal tokens from each, so a cap larger than n times the
    smallest category's split gives fewer tokens, never unequal shares);
  * quantity skew: ``train_tokens`` gives each user a training-token budget (e.g. high/low x4);
  * many clients (``clients`` = N > 0): label skew over the categories as in Hsu et al. (2019):
    client i's mixture of categories p_i ~ Dirichlet(alpha * 1_C) (small alpha: one or two
    categories per client; large alpha: near-uniform), with ``client_train_tokens`` training
    tokens (default: an equal share of 90 % of the corpus) handed out from each category's token
    stream in order, disjoint until a category is used up. Its valid/test splits mix the
    categories in the same proportions (``valid_tokens`` / ``test_tokens``, default 2048;
    windows at seeded offsets of each category's split).
"""
from __future__ import annotations

import hashlib
import os
import random
import tempfile
from dataclasses import dataclass, field

import torch

from .corpora import Corpus
from .instructions import (InstructionSet, client_splits, dirichlet_label_skew, task_per_client,
                           tokenize_examples)
from ..tokens import leading_special_ids
from .partition import dirichlet_mixtures


@dataclass
class SplitConfig:
    mode: str = "in"                      # "in" | "ood"
    valid_frac: float = 0.1                # share of each category's documents held out for validation
    test_frac: float = 0.1                 # and for test
    train_tokens: list[int] | None = None  # per-user training-token budget (quantity skew)
    valid_tokens: int | None = None        # cap per user (the router's validation set is small)
    test_tokens: int | None = None         # cap per user; perplexity runs over the whole capped split
    seed: int | str | dict = 0  # document-split / partition seed; "run": each grid seed its own split; {seed: data seed}: the one each names
    users: list[str] | None = None         # categories to use, in user order (default: all)
    clients: int = 0                       # > 0: that many clients with Dirichlet mixtures of the categories
    alpha: float = 1.0                     # Dirichlet concentration of those mixtures
    client_train_tokens: int | None = None  # training tokens per client (default: an equal share)
    # instruction sets (FedAMoLE Sec. V-A-3; data/instructions.py)
    partition: str = "task"                # task: one task per client (NI) | dirichlet: label skew (SNLI, Dolly)
    max_len: int = 512                     # tokens per example (prompt cut from its start)
    valid_examples: int | None = None      # cap per client; None = the paper's 200
    test_examples: int | None = None       # cap per client; None = the paper's 200 (classification) / 50
    # DeepFusion (Sec. IV-C): share of each category's documents held out as the server's *public*
    # data, which no device ever holds; the server's test set is each category's test split
    public_frac: float = 0.0
    # the server's public data from another corpus (its ``public_categories``, default all), e.g.
    # text of none of the test domains, instead of the test domains' public_frac share
    public_corpus: str = ""
    public_categories: list[str] | None = None  # that corpus's categories to use (default: all)
    # DeepFusion Table II: the server's test questions ("...\nAnswer: ...") whose generated answers
    # are scored token by token against the reference, at most this many per domain
    answer_examples: int = 50
    # the server's validation documents per domain, held out from its in-domain public share and
    # never distilled on: what a setting of the server's own (DeepFusion's alpha) is chosen on,
    # never the test split (scored as valid_* beside test_*); 0: none
    server_valid_docs: int = 0

    def __post_init__(self):
        if self.partition not in ("task", "dirichlet"):
            raise ValueError(f"data.partition must be task or dirichlet, got {self.partition!r}")
        if self.max_len < 8 or any(v is not None and v < 1 for v in (self.valid_examples, self.test_examples)):
            raise ValueError("data.max_len must be >= 8, data.valid_examples and data.test_examples >= 1")
        if self.answer_examples < 0:
            raise ValueError(f"data.answer_examples must be >= 0, got {self.answer_examples}")
        if self.server_valid_docs < 0 or self.server_valid_docs and not self.public_frac:
            raise ValueError("data.server_valid_docs (>= 0) is held out from the server's public share: "
                             "set data.public_frac too")
        for key, ok, want in (("clients", self.clients >= 0, ">= 0"), ("alpha", self.alpha > 0, "> 0"),
                              ("client_train_tokens", self.client_train_tokens is None or self.client_train_tokens >= 2,
                               ">= 2")):
            if not ok:
                raise ValueError(f"data.{key} must be {want}, got {getattr(self, key)}")
        if self.clients and (self.mode != "in" or self.train_tokens is not None):
            raise ValueError("data.clients (a Dirichlet partition) takes neither data.mode=ood nor data.train_tokens")
        if self.mode not in ("in", "ood"):
            raise ValueError(f"data.mode must be 'in' or 'ood', got {self.mode!r}")
        if not (0 < self.valid_frac < 1 and 0 < self.test_frac < 1 and 0 <= self.public_frac < 1
                and self.valid_frac + self.test_frac + self.public_frac < 1):
            raise ValueError("data.valid_frac, data.test_frac (in (0, 1)) and data.public_frac (in [0, 1)) must "
                             "sum below 1")


@dataclass
class UserData:
    """One client's private data. Language modelling (``task="lm"``): train / valid / test are
    token streams; instruction tasks (``"classification"`` with its label ``choices``, or
    ``"generation"``): they are ``InstructionSplit``s of tokenised examples. Batching
    (``sample_batch``) and evaluation dispatch on that, so methods never ask which it is."""
    name: str
    train: torch.Tensor
    valid: torch.Tensor
    test: torch.Tensor
    splits: tuple[str, ...] = field(default=("train", "valid", "test"), repr=False)
    task: str = "lm"                       # lm | classification | generation
    choices: tuple[str, ...] = ()          # classification: the label strings scored by the LM
    # a Dirichlet client's share of each category (partition.json; the report colours DeepFusion's
    # device embeddings by the largest): what the data is, never sent to the server
    mixture: dict[str, float] = field(default_factory=dict, repr=False)

    def tokens(self, split: str) -> torch.Tensor:
        return getattr(self, split)


def _cache_path(key: str):
    from ..files import cache_dir
    return cache_dir() / "tokens" / f"{key}.pt"


def tokenize_docs(docs: list[str], tokenizer) -> torch.Tensor:
    """Concatenate documents with EOS between them; cached by tokenizer and text hash."""
    h = hashlib.sha1()
    h.update(f"{getattr(tokenizer, 'name_or_path', '')}|{len(tokenizer)}|{tokenizer.eos_token_id}".encode())
    lead = leading_special_ids(tokenizer)  # BOS per document where the tokenizer adds one (comix/tokens.py)
    if lead:  # (SmolLM2's and GPT-2's streams, with none, keep their cache key)
        h.update(f"|bos{lead}".encode())
    for d in docs:
        h.update(hashlib.sha1(d.encode()).digest())
    path = _cache_path(h.hexdigest())
    if path.exists():
        return torch.load(path)
    eos = tokenizer.eos_token_id
    ids: list[int] = []
    for enc in tokenizer(docs, add_special_tokens=False)["input_ids"]:
        ids.extend(lead)
        ids.extend(enc)
        ids.append(eos)
    out = torch.tensor(ids, dtype=torch.int32)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
    os.close(fd)
    torch.save(out, tmp)
    os.replace(tmp, path)
    return out


def _split_docs(docs: list[str], cfg: SplitConfig, name: str):
    """(train, valid, test, public) documents of one category: a seeded shuffle cut into test,
    valid, public (the server's, empty unless ``public_frac``) and the rest for training."""
    order = list(range(len(docs)))
    random.Random(f"{cfg.seed}:{name}").shuffle(order)
    n_test = max(1, round(cfg.test_frac * len(docs)))
    n_valid = max(1, round(cfg.valid_frac * len(docs)))
    n_public = max(1, round(cfg.public_frac * len(docs))) if cfg.public_frac else 0
    if len(docs) < 3 + (n_public > 0):
        raise ValueError(f"category {name!r} has {len(docs)} documents; need at least {3 + (n_public > 0)} to split")
    pick = lambda idx: [docs[i] for i in sorted(idx)]  # noqa: E731
    cut = n_test + n_valid
    return (pick(order[cut + n_public:]), pick(order[n_test:cut]), pick(order[:n_test]),
            pick(order[cut:cut + n_public]))


ANSWER = "\nAnswer:"  # where a QA document's reference answer starts (data/qa.py)


@dataclass
class ServerData:
    """What a server itself holds (DeepFusion): per domain, public token streams to distil and
    tune on, and the test streams the global model is scored on; for question-answer documents
    also (question ids, reference answer ids) pairs whose generated answers are scored (Table II).
    No device holds any of it."""
    public: dict[str, torch.Tensor]
    test: dict[str, torch.Tensor]
    answers: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = field(default_factory=dict)
    pad_id: int = 0
    eos_id: int | None = None
    # data.server_valid_docs: per domain the held-out validation stream and its question pairs
    valid: dict[str, torch.Tensor] = field(default_factory=dict)
    valid_answers: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = field(default_factory=dict)


def answer_pairs(docs: list[str], tokenizer, limit: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(question ids up to and including "Answer:", reference answer ids) of the first ``limit``
    documents that hold an answer marker."""
    out = []
    for doc in docs:
        cut = doc.rfind(ANSWER)
        if cut < 0 or len(out) >= limit:
            continue
        q = tokenizer(doc[:cut + len(ANSWER)])["input_ids"]
        a = tokenizer(" " + doc[cut + len(ANSWER):].strip(), add_special_tokens=False)["input_ids"]
        if a:
            out.append((torch.tensor(q), torch.tensor(a)))
    return out


def make_server_data(corpus: Corpus, tokenizer, cfg: SplitConfig, public_corpus: Corpus | None = None) -> ServerData | None:
    """The server's data of ``corpus`` under ``cfg`` (None unless ``data.public_frac`` > 0): the
    same per-category document split ``make_user_data`` makes, so it is disjoint from every
    device's training data; test streams capped at ``test_tokens``. With ``public_corpus``
    (``data.public_corpus``) the public data is that corpus's ``public_categories`` instead."""
    if not cfg.public_frac:
        return None
    if hasattr(corpus, "examples"):
        raise ValueError("data.public_frac: server data is built from token corpora (e.g. topics), not "
                         "instruction sets")
    public, test, answers, valid, valid_answers = {}, {}, {}, {}, {}
    for n in cfg.users or list(corpus):
        _, _, te, pub = _split_docs(corpus[n], cfg, n)
        if cfg.server_valid_docs:
            if len(pub) <= cfg.server_valid_docs:
                raise ValueError(f"data.server_valid_docs = {cfg.server_valid_docs}: category {n!r} has {len(pub)} "
                                 "public documents; raise data.public_frac or lower it")
            pub, held = pub[:-cfg.server_valid_docs], pub[-cfg.server_valid_docs:]
            valid[n] = tokenize_docs(held, tokenizer)
            pairs = answer_pairs(held, tokenizer, cfg.answer_examples)
            if pairs:
                valid_answers[n] = pairs
        public[n] = tokenize_docs(pub, tokenizer)
        test[n] = tokenize_docs(te, tokenizer)[:cfg.test_tokens] if cfg.test_tokens else tokenize_docs(te, tokenizer)
        pairs = answer_pairs(te, tokenizer, cfg.answer_examples)
        if pairs:
            answers[n] = pairs
    if public_corpus is not None:  # (its categories were checked before the model loaded: runner.py)
        public = {f"public:{n}": tokenize_docs(public_corpus[n], tokenizer) for n in cfg.public_categories or public_corpus}
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    return ServerData(public, test, answers, pad_id=pad or 0, eos_id=tokenizer.eos_token_id, valid=valid,
                      valid_answers=valid_answers)


def make_user_data(corpus: Corpus, tokenizer, cfg: SplitConfig | None = None) -> list[UserData]:
    cfg = cfg or SplitConfig()
    if hasattr(corpus, "examples"):  # an InstructionSet: clients of tokenised examples
        return instruction_clients(corpus, tokenizer, cfg)
    names = cfg.users or list(corpus)
    for n in names:
        if n not in corpus:
            raise ValueError(f"data.users names {n!r}, which the corpus lacks (has {', '.join(corpus)})")
    if cfg.train_tokens is not None and len(cfg.train_tokens) != len(names):
        raise ValueError(f"data.train_tokens has {len(cfg.train_tokens)} entries for {len(names)} users")
    parts = {}
    for n in names:
        tr, va, te, _ = _split_docs(corpus[n], cfg, n)
        parts[n] = {"train": tokenize_docs(tr, tokenizer), "valid": tokenize_docs(va, tokenizer),
                    "test": tokenize_docs(te, tokenizer)}
    if cfg.clients:
        return dirichlet_clients(parts, cfg)
    users = []
    for i, n in enumerate(names):
        train = parts[n]["train"]
        if cfg.train_tokens is not None:
            if cfg.train_tokens[i] > len(train):
                raise ValueError(f"data.train_tokens[{i}] = {cfg.train_tokens[i]} exceeds user {n!r}'s "
                                 f"{len(train)} training tokens")
            train = train[:cfg.train_tokens[i]]
        evals = {}
        for split, cap in (("valid", cfg.valid_tokens), ("test", cfg.test_tokens)):
            if cfg.mode == "in":
                evals[split] = parts[n][split][:cap] if cap else parts[n][split]
            else:  # uniform mixture of every category, the same for all users: equal tokens from
                # each, at most the smallest category's split (a cap above n x that is not reached)
                smallest = min(len(parts[m][split]) for m in names)
                per = min(cap // len(names), smallest) if cap else smallest
                evals[split] = torch.cat([parts[m][split][:per] for m in names])
        users.append(UserData(n, train, evals["valid"], evals["test"]))
    return users


def dirichlet_clients(parts: dict[str, dict[str, torch.Tensor]], cfg: SplitConfig) -> list[UserData]:
    """``cfg.clients`` clients with Dirichlet(alpha) mixtures of the categories (Hsu et al. 2019)."""
    names, n = list(parts), cfg.clients
    total = sum(len(parts[c]["train"]) for c in names)
    budget = cfg.client_train_tokens or int(0.9 * total / n)
    if budget < 2:
        raise ValueError(f"data.clients = {n}: the corpus's {total:,} training tokens give each client {budget}")
    rng = torch.Generator().manual_seed(cfg.seed)
    mixtures = dirichlet_mixtures(n, len(names), cfg.alpha, rng)
    taken = {c: 0 for c in names}  # each category's stream is handed out in order, disjointly
    users = []
    for i in range(n):
        want = (mixtures[i] * budget).floor().long()
        want[int(mixtures[i].argmax())] += budget - int(want.sum())  # exactly `budget` tokens
        pieces = []
        for k, c in enumerate(names):
            stream, m = parts[c]["train"], int(want[k])
            if m == 0:
                continue
            # a category handed out completely starts over (tokens then repeat across clients)
            start = taken[c] % len(stream)
            idx = (torch.arange(m) + start) % len(stream)
            pieces.append(stream[idx])
            taken[c] += m
        evals = {}
        for split, cap in (("valid", cfg.valid_tokens or 2048), ("test", cfg.test_tokens or 2048)):
            eval_pieces = []
            for k, c in enumerate(names):
                stream, m = parts[c][split], min(int(round(float(mixtures[i, k]) * cap)), len(parts[c][split]))
                if m == 0:
                    continue
                offset = int(torch.randint(len(stream) - m + 1, (1,), generator=rng))
                eval_pieces.append(stream[offset:offset + m])
            evals[split] = torch.cat(eval_pieces)
        users.append(UserData(f"client{i:0{len(str(n - 1))}d}", torch.cat(pieces), evals["valid"], evals["test"],
                              mixture={c: round(float(mixtures[i, k]), 4) for k, c in enumerate(names)}))
    return users


def token_table(users: list[UserData]) -> str:
    """Token counts per user and split, laid out like CoMiGS's Table 4 (a summary for many
    clients); examples instead of tokens for instruction tasks."""
    unit = "tokens" if all(u.task == "lm" for u in users) else "examples"
    if len(users) > 8:
        rows = [f"{len(users)} clients ({unit})"]
        for s in ("train", "valid", "test"):
            counts = [len(u.tokens(s)) for u in users]
            rows.append(f"{s.upper():8s} min {min(counts):,}  mean {sum(counts) // len(counts):,}  max {max(counts):,}")
        return "\n".join(rows)
    head = f"{unit:12s}" + "".join(f"{u.name[-11:]:>12s}" for u in users)
    rows = [f"{s.upper():12s}" + "".join(f"{len(u.tokens(s)):>12,d}" for u in users)
            for s in ("train", "valid", "test")]
    return "\n".join([head, *rows])


def describe_partition(users: list[UserData]) -> dict:
    """What each client holds (sizes and a content hash per split): written with every run
    (partition.json) so two runs can be checked to share one partition."""
    def digest(split) -> str:
        h = hashlib.sha1()
        for t in (split.ids if hasattr(split, "ids") else [split]):
            h.update(t.numpy().tobytes())
        return h.hexdigest()[:16]
    out = {}
    for u in users:
        row = {"task": u.task, **({"mixture": u.mixture} if u.mixture else {})}
        for s in ("train", "valid", "test"):
            split = u.tokens(s)
            row[s] = {"size": len(split), "sha1": digest(split)}
            if hasattr(split, "examples"):
                cats: dict[str, int] = {}
                for ex in split.examples:
                    cats[ex.category] = cats.get(ex.category, 0) + 1
                row[s]["categories"] = dict(sorted(cats.items()))
                if u.task == "classification":  # the trivial baselines' input (comparison.py)
                    row[s]["labels"] = {c: sum(ex.output == c for ex in split.examples) for c in u.choices}
        out[u.name] = row
    return out


def check_seq_len(users: list[UserData], seq_len: int) -> None:
    for u in users:
        if u.task != "lm":  # instruction examples are whole sequences (data.max_len caps them)
            continue
        for s in ("train", "valid", "test"):
            if len(u.tokens(s)) < seq_len + 1:
                raise ValueError(f"seq_len {seq_len} is longer than user {u.name!r}'s {s} split "
                                 f"({len(u.tokens(s))} tokens)")


def sample_batch(tokens: torch.Tensor, batch_size: int, seq_len: int, generator: torch.Generator):
    """Random windows as in nanoGPT: inputs x and next-token targets y, each (batch, seq_len). A split of
    instruction examples samples itself (``InstructionSplit.sample``: whole examples, targets -100 off the response)."""
    if hasattr(tokens, "sample"):
        return tokens.sample(batch_size, generator)
    if len(tokens) < seq_len + 1:
        raise ValueError(f"seq_len {seq_len} is longer than the split ({len(tokens)} tokens)")
    ix = torch.randint(len(tokens) - seq_len, (batch_size,), generator=generator, device=generator.device)
    x = torch.stack([tokens[i:i + seq_len] for i in ix.tolist()]).long()
    y = torch.stack([tokens[i + 1:i + 1 + seq_len] for i in ix.tolist()]).long()
    return x, y


def instruction_clients(iset: InstructionSet, tokenizer, cfg) -> list:
    """Clients of ``iset`` as ``cfg`` (a SplitConfig) partitions it: ``task`` (one task per
    client: ``data.users`` names them, else the ``data.clients`` largest, else all) or
    ``dirichlet`` (``data.clients`` clients, ``data.alpha``); each split 80/10/10. The
    partition depends only on the data and ``data.seed``: the same for every method."""
    classification = iset.task == "classification"
    if cfg.partition == "task":
        examples = iset.examples
        if cfg.users:
            unknown = sorted(set(cfg.users) - {ex.category for ex in examples})
            if unknown:
                raise ValueError(f"data.users names unknown task(s) {', '.join(unknown)} of {iset.name}")
            examples = [ex for ex in examples if ex.category in cfg.users]
        n = cfg.clients or len({ex.category for ex in examples})
        parts = task_per_client(examples, n, cfg.seed)
        names = [p[0].category for p in parts]
    else:
        if not cfg.clients:
            raise ValueError("data.partition=dirichlet needs data.clients (the number of clients)")
        parts = dirichlet_label_skew(iset.examples, cfg.clients, cfg.alpha, cfg.seed)
        names = [f"client{i:0{len(str(cfg.clients - 1))}d}" for i in range(cfg.clients)]
    users = []
    for i, (name, part) in enumerate(zip(names, parts)):
        if len(part) < 3:
            raise ValueError(f"client {name} of {iset.name} has {len(part)} examples; need at least 3 to split")
        split = client_splits(part, classification, cfg.seed * 1000 + i, cfg.valid_examples, cfg.test_examples)
        tok = {k: tokenize_examples(v, tokenizer, cfg.max_len) for k, v in split.items()}
        users.append(UserData(name, tok["train"], tok["valid"], tok["test"], task=iset.task, choices=iset.choices))
    return users
