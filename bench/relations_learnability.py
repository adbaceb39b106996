"""Can SmolLM2-135M learn the built-in relations task (Synonym / Antonym / Unrelated of two WordNet
words) at all, and from how many examples? The premise of the CPU Table III case: a federated
comparison of methods means something only where one model, trained on everyone's data, learns
the task well above the label priors.

FedIT's adapter (LoRA r 8 on q and v, alpha 16, PEFT's scaling; algorithms/fedavg.py) is trained
on the pooled training examples (every label equally often: the 4,500 examples less a held-out
balanced test set of 300), AdamW at ``--lr``, batches of ``--batch`` examples in comix's own
format (the SNLI-style template, data/instructions.py; loss on the answer and EOS), and scored as
every comix run scores classification (the lowest-loss label, eval/tasks.py) after each
``--every`` steps.

    python bench/relations_learnability.py [--steps 300] [--batch 16] [--lr 1e-3]

Writes bench/results/relations-learnability.json (the accuracy after each block of steps, the
seconds, the machine).
"""
from __future__ import annotations

import footprint  # prints wall time and peak RSS at exit

import argparse
import datetime
import json
import os
import platform
import random
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main(argv=None) -> int:
    from comix.algorithms import TrainConfig, make_algorithm
    from comix.algorithms.training import lm_loss
    from comix.data.instructions import builtin_set, tokenize_examples
    from comix.eval.tasks import split_accuracy
    from comix.models import LoRAConfig, inject_adapters, load_base_model

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--every", type=int, default=100)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "relations-learnability.json"))
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    rel = builtin_set("relations")
    by_label: dict[str, list] = {}
    for ex in rel.examples:
        by_label.setdefault(ex.output, []).append(ex)
    test, train = [], []
    for label in sorted(by_label):
        items = by_label[label][:]
        random.Random(0).shuffle(items)
        test += items[:100]
        train += items[100:]
    base, tok = load_base_model("smollm2-135m")
    fedit = make_algorithm("fedit", LoRAConfig(), TrainConfig(), 1)
    model = inject_adapters(base, fedit.adapter_config(0)).train()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0)
    train_split, test_split = tokenize_examples(train, tok, 192), tokenize_examples(test, tok, 192)
    gen = torch.Generator().manual_seed(0)

    def score() -> float:
        model.eval()
        with torch.inference_mode():
            acc = split_accuracy(model, test_split, rel.choices, batch_size=16)
        model.train()
        return acc
    t0 = time.time()
    curve = [{"step": 0, "examples": 0, "accuracy": score(), "seconds": 0.0}]
    print(f"step 0: {curve[-1]['accuracy']:.1f} %", flush=True)
    for step in range(1, args.steps + 1):
        x, y = train_split.sample(args.batch, gen)
        loss = lm_loss(model, x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step % args.every == 0:
            curve.append({"step": step, "examples": step * args.batch, "accuracy": score(),
                          "loss": round(loss.item(), 4), "seconds": round(time.time() - t0, 1)})
            print(f"step {step}: {curve[-1]['accuracy']:.1f} % ({curve[-1]['seconds']:.0f} s)", flush=True)
    out = {"command": "python bench/relations_learnability.py " + " ".join(argv or sys.argv[1:]),
           "machine": f"{os.cpu_count()}-core {platform.machine()} CPU", "date": datetime.date.today().isoformat(),
           "test": "300 held-out pairs, 100 per label (chance 33.3 %)", "adapter": "FedIT's (LoRA r 8 on q, v)",
           "batch": args.batch, "lr": args.lr, "curve": curve}
    tmp = Path(args.out).with_suffix(".tmp")  # temp file, then rename: never a half-written result
    tmp.write_text(json.dumps(out, indent=1) + "\n")
    os.replace(tmp, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
