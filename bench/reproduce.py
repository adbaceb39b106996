"""Reproduce CoMiGS Table 1's three settings on the built-in offline corpora.

    python bench/reproduce.py --scale smoke|small|paper [--seeds 42 45 47] [--out DIR]

Each setting is one resumable ``comix compare`` grid (rerun the same command to finish an
interrupted one); the combined table of mean test perplexity (users' mean; mean (std) over
seeds) is written to ``<out>/table.md`` and printed, next to the paper's qualitative claims.

  smoke  tiny random Llama, 2 rounds: checks the pipeline in seconds (not a result);
  small  SmolLM2-135M, configs/small/{multilingual,topics-in,topics-ood}.yaml: 20-40 min per setting on 2 CPU cores;
  paper  SmolLM2-135M at App. B.1's scale, configs/paper/table1-*.yaml (all Table 1 methods): a GPU job.
"""
from __future__ import annotations

import footprint  # noqa: F401  (prints wall time and peak RSS at exit)

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SETTINGS = {  # name -> (small config, paper config, what the paper reports for it)
    "multilingual (in-distribution)": ("small/multilingual.yaml", "paper/table1-multilingual.yaml",
                                       "language shift: CoMiGS-2S best, FedAvg/2G hurt"),
    "topics (in-distribution)": ("small/topics-in.yaml", "paper/table1-topics-in.yaml",
                                 "topic shift: 1G1S tracks the better of 2S and 2G"),
    "topics (out-of-distribution)": ("small/topics-ood.yaml", "paper/table1-topics-ood.yaml",
                                     "OOD: 2G and FedAvg win, Local/2S lose"),
}
SMOKE = ["model=tiny-llama", "train.rounds=2", "train.local_steps=2", "train.batch_size=2", "train.seq_len=32",
         "train.tau=2", "train.router_steps=1", "train.eval_every=1", "data.valid_tokens=1024",
         "data.test_tokens=512"]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scale", choices=("smoke", "small", "paper"), default="small")
    ap.add_argument("--seeds", nargs="+", type=int, default=[42])
    ap.add_argument("--methods", nargs="+", help="override the configs' method lists")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    from comix.cli import main as comix

    out = Path(args.out or f"runs/reproduce-{args.scale}")
    tables, started = {}, time.time()
    for setting, (small, paper, claim) in SETTINGS.items():
        config = ROOT / "configs" / (paper if args.scale == "paper" else small)
        run_dir = out / config.stem
        cmd = ["compare", str(config), f"run_dir={run_dir}", *(SMOKE if args.scale == "smoke" else [])]
        cmd += ["--seeds", *map(str, args.seeds)] + (["--methods", *args.methods] if args.methods else [])
        if comix(cmd) != 0:
            return 1
        tables[setting] = (json.loads((run_dir / "compare.json").read_text()), claim)
    methods = list(next(iter(tables.values()))[0])
    lines = ["| method | " + " | ".join(tables) + " |", "|---|" + "---|" * len(tables)]
    for m in methods:
        cells = []
        for res, _ in tables.values():
            xs = [r["mean_test_ppl"] for r in res.get(m, {}).values()]
            cells.append("-" if not xs else f"{statistics.fmean(xs):.2f}" + (
                f" ({statistics.pstdev(xs):.2f})" if len(xs) > 1 else ""))
        lines.append(f"| {m} | " + " | ".join(cells) + " |")
    lines += ["", "Paper's claims: " + "; ".join(f"{s}: {c}" for s, (_, c) in tables.items()) + ".",
              f"Scale {args.scale}, seeds {args.seeds}, {time.time() - started:.0f} s for this invocation."]
    (out / "table.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
