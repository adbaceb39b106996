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

import random
from dataclasses import dataclass, field

import torch

from .splits import dirichlet_mixtures

ALPACA_INPUT = ("Below is an instruction that describes a task, paired with an input that provides further context. "
                "Write a response that appropriately completes the request.\n\n"
                "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n")
ALPACA = ("Below is an instruction that describes a task. Write a response that appropriately completes the "
          "request.\n\n### Instruction:\n{instruction}\n\n### Response:\n")
SNLI = 'Suppose {premise} Can we infer that "{hypothesis}"? Yes, No, or Maybe?\n'
SNLI_CHOICES = ("Yes", "Maybe", "No")  # SNLI labels 0 entailment, 1 neutral, 2 contradiction
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


@dataclass
class InstructionSplit:
    """Tokenised examples of one client's split: input ids and labels (-100 off the target)."""
    examples: list[Example]
    ids: list[torch.Tensor] = field(repr=False)
    labels: list[torch.Tensor] = field(repr=False)
    pad_id: int = 0

    def __len__(self) -> int:
        return len(self.examples)

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
    """Prompt + output + EOS, cut to ``max_len`` from the prompt's start (the target is kept:
    a too long prompt loses its beginning)."""
    ids, labels = [], []
    for ex in examples:
        p = tokenizer(ex.prompt(), add_special_tokens=False)["input_ids"]
        t = tokenizer(ex.output, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        t = t[:max_len - 1]
        p = p[-(max_len - len(t)):]
        ids.append(torch.tensor(p + t, dtype=torch.long))
        labels.append(torch.tensor([-100] * len(p) + t, dtype=torch.long))
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    return InstructionSplit(list(examples), ids, labels, pad)


def dirichlet_label_skew(examples: list[Example], n_clients: int, alpha: float, seed: int) -> list[list[Example]]:
    """Per category, its examples shared out over clients by Dirichlet(alpha) proportions."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    by_cat: dict[str, list[Example]] = {}
    for ex in examples:
        by_cat.setdefault(ex.category, []).append(ex)
    clients: list[list[Example]] = [[] for _ in range(n_clients)]
    shares = dirichlet_mixtures(len(by_cat), n_clients, alpha, gen)  # (categories, clients)
    for k, cat in enumerate(sorted(by_cat)):
        items = by_cat[cat][:]
        rng.shuffle(items)
        cuts = (shares[k].cumsum(0) * len(items)).round().long().tolist()
        start = 0
        for c, end in enumerate(cuts):
            clients[c].extend(items[start:end])
            start = end
    for c in clients:
        rng.shuffle(c)
    return clients


def task_per_client(examples: list[Example], n_clients: int, seed: int) -> list[list[Example]]:
    """Client i gets every example of the i-th category (task), categories in sorted order."""
    cats = sorted({ex.category for ex in examples})
    if len(cats) < n_clients:
        raise ValueError(f"data.partition=task needs one task per client: {len(cats)} tasks for {n_clients} clients")
    rng = random.Random(seed)
    out = []
    for cat in cats[:n_clients]:
        items = [ex for ex in examples if ex.category == cat]
        rng.shuffle(items)
        out.append(items)
    return out


def client_splits(examples: list[Example], classification: bool, seed: int) -> dict[str, list[Example]]:
    """80/10/10 train/valid/test; valid capped at 200, test at 200 (classification) or 50."""
    items = examples[:]
    random.Random(seed).shuffle(items)
    n_valid, n_test = round(0.1 * len(items)), round(0.1 * len(items))
    test = items[:n_test][:200 if classification else 50]
    valid = items[n_test:n_test + n_valid][:200]
    return {"train": items[n_test + n_valid:], "valid": valid, "test": test}


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
