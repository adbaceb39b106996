"""Instruction-tuning data (FedAMoLE Sec. V-A): examples, prompt templates, client partitions.

* An ``Example`` is an instruction, an optional input (context), the reference output and a
  ``category`` (Dolly's category, SNLI's label, NI's task) that partitions use.
* Templates follow the reference code (zyc140345/FedAMoLE data/prompt.py): Alpaca for
  generation (Dolly-15K, Natural Instructions), "Suppose {premise} Can we infer that
  "{hypothesis}"? Yes, No, or Maybe?" for SNLI; the target is the output plus EOS, and the loss
  counts only the target's tokens (labels -100 on the prompt and the padding).
* The soft prompts of Sec. V-A-4 initialise prompt tuning's virtual tokens.
* Partitions (the same for every method given the seed): ``dirichlet`` label skew, per category
  c the shares over clients ~ Dirichlet(alpha * 1_N) (Li et al., NIID-Bench; the paper's
  alpha in {0.1, 1, 100}), or ``task``: one category (task) per client. Each client's examples
  are split 80/10/10 into train/valid/test, valid capped at 200 and test at 200
  (classification) or 50 (generation) examples (Sec. V-A-3).
"""
from __future__ import annotations

import json
import lzma
import random
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .corpora import BUILTIN_DIR
from ..tokens import leading_special_ids
from .partition import dirichlet_mixtures

ALPACA_INPUT = ("Below is an instruction that describes a task, paired with an input that provides further context. "
                "Write a response that appropriately completes the request.\n\n"
                "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n")
ALPACA = ("Below is an instruction that describes a task. Write a response that appropriately completes the "
          "request.\n\n### Instruction:\n{instruction}\n\n### Response:\n")
SNLI = 'Suppose {premise} Can we infer that "{hypothesis}"? Yes, No, or Maybe?\n'
SNLI_CHOICES = ("Yes", "Maybe", "No")  # SNLI labels 0 entailment, 1 neutral, 2 contradiction
# the built-in relations set (SNLI's role) in the form of the authors' SNLI template: the two words,
# one question naming the answers, the answer on the next line (a 135M model learns it within a few
# hundred examples where the Alpaca form's 40 tokens of preamble left it at the label priors:
# docs/fedamole.md)
RELATIONS_TEMPLATE = 'Are "{first}" and "{second}" synonyms, antonyms, or unrelated?\n'
SOFT_PROMPT_GENERATION = ("Generate a clear and direct response that accurately fulfills the task based on the "
                          "provided instruction and any given context.")
SOFT_PROMPT_SNLI = ("Based on the premise, determine if the hypothesis logically follows. Answer with 'Yes' if it "
                    "does, 'No' if it doesn't, or 'Maybe' if uncertain.")


@dataclass(frozen=True)
class Example:
    instruction: str
    output: str
    input: str = ""
    category: str = ""

    def prompt(self) -> str:
        if self.input:
            return ALPACA_INPUT.format(instruction=self.instruction, input=self.input)
        return ALPACA.format(instruction=self.instruction)


@dataclass(frozen=True)
class NLIExample(Example):
    """SNLI's premise (``instruction``) and hypothesis (``input``); the output is a label."""

    def prompt(self) -> str:
        return SNLI.format(premise=self.instruction, hypothesis=self.input)


@dataclass(frozen=True)
class RelationExample(Example):
    """Two words (``input`` "first, second") and their relation (Synonym / Antonym / Unrelated)."""

    def prompt(self) -> str:
        first, second = self.input.split(", ", 1)
        return RELATIONS_TEMPLATE.format(first=first, second=second)


@dataclass
class InstructionSplit:
    """Tokenised examples of one client's split: input ids and labels (-100 off the target)."""
    examples: list[Example]
    ids: list[torch.Tensor] = field(repr=False)
    labels: list[torch.Tensor] = field(repr=False)
    pad_id: int = 0
    tokenizer: object = field(default=None, repr=False)  # decodes generations, encodes label choices

    def prompt_ids(self, i: int) -> torch.Tensor:
        """Example i's prompt tokens (everything before its target)."""
        return self.ids[i][:int((self.labels[i] == -100).sum())]

    def __len__(self) -> int:
        return len(self.examples)

    def subset(self, start: int, stop: int | None = None) -> "InstructionSplit":
        return InstructionSplit(self.examples[start:stop], self.ids[start:stop], self.labels[start:stop], self.pad_id,
                                self.tokenizer)

    def sample(self, batch_size: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """A random batch, right-padded: inputs x and next-token targets y (-100 where no loss)."""
        pick = torch.randint(len(self.ids), (batch_size,), generator=generator, device=generator.device).tolist()
        width = max(len(self.ids[i]) for i in pick) - 1
        x = torch.full((batch_size, width), self.pad_id, dtype=torch.long)
        y = torch.full((batch_size, width), -100, dtype=torch.long)
        for row, i in enumerate(pick):
            n = len(self.ids[i]) - 1
            x[row, :n] = self.ids[i][:-1]
            y[row, :n] = self.labels[i][1:]
        return x, y


def tokenize_examples(examples: list[Example], tokenizer, max_len: int = 512) -> InstructionSplit:
    """[BOS where the tokenizer adds it] + prompt + output + EOS, cut to ``max_len`` from the
    prompt's start (the target and BOS are kept: a too long prompt loses its beginning)."""
    ids, labels = [], []
    lead = leading_special_ids(tokenizer)  # BOS where the tokenizer puts it (comix/tokens.py)
    for ex in examples:
        p = tokenizer(ex.prompt(), add_special_tokens=False)["input_ids"]
        t = tokenizer(ex.output, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        t = t[:max_len - 1 - len(lead)]
        keep = max(0, max_len - len(t) - len(lead))
        p = lead + p[max(0, len(p) - keep):] if keep else lead
        ids.append(torch.tensor(p + t, dtype=torch.long))
        labels.append(torch.tensor([-100] * len(p) + t, dtype=torch.long))
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    return InstructionSplit(list(examples), ids, labels, pad, tokenizer)


def dirichlet_label_skew(examples: list[Example], n_clients: int, alpha: float, seed: int,
                         min_size: int = 10) -> list[list[Example]]:
    """Per category, its examples shared out over clients by Dirichlet(alpha) proportions; drawn
    again until every client holds at least ``min_size`` examples (NIID-Bench's
    ``min_require_size`` = 10, Li et al. 2022, whose label-skew partition the paper follows)."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    by_cat: dict[str, list[Example]] = {}
    for ex in examples:
        by_cat.setdefault(ex.category, []).append(ex)
    for cat in by_cat.values():
        rng.shuffle(cat)
    if len(examples) < n_clients * min_size:
        raise ValueError(f"data.clients = {n_clients}: {len(examples)} examples cannot give each client {min_size}")
    for _ in range(1000):
        clients: list[list[Example]] = [[] for _ in range(n_clients)]
        shares = dirichlet_mixtures(len(by_cat), n_clients, alpha, gen)  # (categories, clients)
        for k, cat in enumerate(sorted(by_cat)):
            items = by_cat[cat]
            cuts = (shares[k].cumsum(0) * len(items)).round().long().tolist()
            start = 0
            for c, end in enumerate(cuts):
                clients[c].extend(items[start:end])
                start = end
        if min(map(len, clients)) >= min_size:
            break
    else:
        raise ValueError(f"data.alpha = {alpha}: 1000 Dirichlet draws all left a client with fewer than "
                         f"{min_size} of the {len(examples)} examples; use a larger alpha or fewer clients")
    for c in clients:
        rng.shuffle(c)
    return clients


def task_per_client(examples: list[Example], n_clients: int, seed: int) -> list[list[Example]]:
    """One task per client: the ``n_clients`` tasks with the most examples (the paper's NI
    scenario: "the 10 tasks with the largest sample sizes"), clients in task-name order."""
    sizes: dict[str, int] = {}
    for ex in examples:
        sizes[ex.category] = sizes.get(ex.category, 0) + 1
    if len(sizes) < n_clients:
        raise ValueError(f"data.partition=task needs one task per client: {len(sizes)} tasks for {n_clients} clients")
    cats = sorted(sorted(sizes, key=lambda c: (-sizes[c], c))[:n_clients])
    rng = random.Random(seed)
    out = []
    for cat in cats:
        items = [ex for ex in examples if ex.category == cat]
        rng.shuffle(items)
        out.append(items)
    return out


def client_splits(examples: list[Example], classification: bool, seed: int, valid_cap: int | None = None,
                  test_cap: int | None = None) -> dict[str, list[Example]]:
    """80/10/10 train/valid/test; valid capped at 200, test at 200 (classification) or 50
    (the paper's caps; ``valid_cap`` / ``test_cap`` override them for small runs)."""
    items = examples[:]
    random.Random(seed).shuffle(items)
    n_valid, n_test = max(1, round(0.1 * len(items))), max(1, round(0.1 * len(items)))
    test = items[:n_test][:test_cap or (200 if classification else 50)]
    valid = items[n_test:n_test + n_valid][:valid_cap or 200]
    return {"train": items[n_test + n_valid:], "valid": valid, "test": test}


@dataclass
class InstructionSet:
    """A labelled instruction set: its examples (``category`` = label, Dolly category or task),
    whether it is ``classification`` (answers are one of ``choices``) or ``generation``."""
    name: str
    examples: list[Example]
    task: str = "generation"
    choices: tuple[str, ...] = ()

    def __post_init__(self):
        if self.task not in ("classification", "generation"):
            raise ValueError(f"instruction set {self.name}: task must be classification or generation")
        if self.task == "classification" and len(self.choices) < 2:
            raise ValueError(f"instruction set {self.name}: a classification set needs >= 2 choices")
        if not self.examples:
            raise ValueError(f"instruction set {self.name} holds no examples")


# -- real loaders (``datasets``); ``data_files``: a local copy with the hub dataset's schema ------------
def _rows(path: str, data_files=None, split: str = "train", **kw):
    from datasets import load_dataset
    if data_files is not None:
        fmt = "parquet" if str(data_files).endswith(".parquet") else "json"
        return load_dataset(fmt, data_files=str(data_files), split="train")
    return load_dataset(path, split=split, **kw)


def snli(data_files=None, split: str = "train", limit: int | None = None) -> list[NLIExample]:
    """SNLI (stanfordnlp/snli): premise, hypothesis, label 0/1/2 -> Yes/Maybe/No (-1: no gold, dropped)."""
    out = []
    for row in _rows("stanfordnlp/snli", data_files, split):
        if int(row["label"]) in (0, 1, 2):
            answer = SNLI_CHOICES[int(row["label"])]
            out.append(NLIExample(row["premise"].strip(), answer, input=row["hypothesis"].strip(), category=answer))
        if limit and len(out) >= limit:
            break
    return out


def dolly(data_files=None, limit: int | None = None) -> list[Example]:
    """Dolly-15K (databricks/databricks-dolly-15k): instruction, context, response, category (8)."""
    out = [Example(r["instruction"].strip(), r["response"].strip(), input=(r.get("context") or "").strip(),
                   category=r["category"]) for r in _rows("databricks/databricks-dolly-15k", data_files)]
    return out[:limit] if limit else out


def natural_instructions(data_files=None, tasks: list[str] | None = None, limit_per_task: int | None = None,
                         split: str = "train") -> list[Example]:
    """Natural Instructions v2.8 as Muennighoff/natural-instructions lays it out (task_name,
    definition, inputs, targets): the task's definition is the instruction, the instance's input
    the input; ``tasks`` picks which (one per client in the paper's NI scenario)."""
    out, seen = [], {}
    for r in _rows("Muennighoff/natural-instructions", data_files, split):
        task = r["task_name"]
        if tasks and task not in tasks:
            continue
        if limit_per_task and seen.get(task, 0) >= limit_per_task:
            continue
        seen[task] = seen.get(task, 0) + 1
        out.append(Example(r["definition"].strip(), r["targets"].strip(), input=r["inputs"].strip(), category=task))
    return out


# -- built-in offline sets (scripts/build_instructions.py; builtin/PROVENANCE.md) and local files --------
RELATIONS = ("Synonym", "Antonym", "Unrelated")
BUILTIN_SETS = {"instructions": ("generation", ()), "relations": ("classification", RELATIONS)}


def _example_rows(path, lines, cls=Example) -> list[Example]:
    out = []
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            if not isinstance(row, dict):
                raise TypeError
        except (json.JSONDecodeError, TypeError):
            raise ValueError(f"{path}:{i}: not a JSON object") from None
        for key in ("instruction", "output"):
            if not isinstance(row.get(key), str) or not row[key].strip():
                raise ValueError(f"{path}:{i}: field {key!r} must be a non-empty string")
        out.append(cls(row["instruction"], row["output"], input=row.get("input") or "",
                       category=str(row.get("task") or row.get("category") or "")))
    return out


def builtin_set(name: str) -> InstructionSet:
    task, choices = BUILTIN_SETS[name]
    path = BUILTIN_DIR / f"{name}.jsonl.xz"
    with lzma.open(path, "rt", encoding="utf-8") as fh:
        return InstructionSet(name, _example_rows(path, fh, RelationExample if name == "relations" else Example),
                              task, choices)


def instruction_file(path: str | Path) -> InstructionSet:
    """A user's instruction set: JSON lines with ``instruction``, ``output`` and optionally
    ``input`` and ``task`` (or ``category``: what partitions use); a first line
    ``{"choices": [...]}`` makes it a classification set (every output one of the choices)."""
    path = Path(path)
    lines = path.read_text(encoding="utf-8").splitlines()
    choices: tuple[str, ...] = ()
    if lines and lines[0].strip().startswith("{") and "choices" in json.loads(lines[0]):
        choices = tuple(json.loads(lines[0])["choices"])
        lines = ["", *lines[1:]]  # keep line numbers
    examples = _example_rows(path, lines)
    for i, ex in enumerate(examples):
        if choices and ex.output not in choices:
            raise ValueError(f"{path}: example {i + 1} answers {ex.output!r}, not one of the choices {list(choices)}")
    return InstructionSet(path.stem, examples, "classification" if choices else "generation", choices)


def online_set(name: str, **kw) -> InstructionSet:
    """The papers' data through ``datasets`` (``data_files``: a local copy of the same schema)."""
    if name == "snli":
        return InstructionSet("snli", snli(**kw), "classification", SNLI_CHOICES)
    if name == "dolly":
        return InstructionSet("dolly", dolly(**kw), "generation")
    return InstructionSet("natural_instructions", natural_instructions(**kw), "generation")


ONLINE_SETS = ("snli", "dolly", "natural_instructions")
