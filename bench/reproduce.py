"""Reproduce CoMiGS Table 1's three settings on the built-in offline corpora.

    python bench/reproduce.py --scale smoke|small|paper [--seeds 42 45 47] [--out DIR]

Each setting is one resumable ``comix compare`` grid (rerun the same command to finish an
interrupted one); the combined table of mean test perplexity (users' mean; mean (std) over
seeds) is written to ``<out>/table.md`` and printed, next to the paper's qualitative claims.

  smoke  tiny random Llama, 2 rounds: checks the pipeline in seconds (not a result);
  small  SmolLM2-135M, configs/small/{multilingual,topics-in,topics-ood}.yaml: 22-50 min per setting on 2 CPU
         cores (67 min in all on an Intel Xeon with AMX, 148 min on an AMD EPYC);
  paper  SmolLM2-135M at App. B.1's scale, configs/paper/table1-*.yaml (all Table 1 methods): a GPU job.
"""
from __future__ import annotations

import footprint  # noqa: F401  (prints wall time and peak RSS at exit)

import argparse
import datetime
import json
import os
import platform
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
NAMES = {"pretrained": "Pretrained", "local": "Local", "fedavg": "FedAvg", "comigs-2s": "CoMiGS-2S",
         "comigs-2g": "CoMiGS-2G", "comigs-1g1s": "CoMiGS-1G1S"}
SMOKE = ["model=tiny-llama", "train.rounds=2", "train.local_steps=2", "train.batch_size=2", "train.seq_len=32",
         "train.tau=2", "train.router_steps=1", "train.eval_every=1", "data.valid_tokens=1024",
         "data.test_tokens=512"]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scale", choices=("smoke", "small", "paper"), default="small")
    ap.add_argument("--seeds", nargs="+", type=int, default=[42])
    ap.add_argument("--methods", nargs="+", help="override the configs' method lists")
    ap.add_argument("--out", default=None)
    ap.add_argument("--save", action="store_true", help="save the runs as bench/results cases (the docs' Table 1)")
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
    if args.scale != "smoke" and args.save:  # the docs' Table 1 (docs/comigs.md) is made from these cases
        sys.path.insert(0, str(ROOT / "bench"))
        from cases import RESULTS
        from tables import save
        name = f"reproduce-{args.scale}-table1"
        cases = {}
        for setting, (small, paper, _) in SETTINGS.items():
            stem = Path(paper if args.scale == "paper" else small).stem
            cases[setting] = f"{name}-{stem}"
            save([out / stem], cases[setting], {"kind": "users", "part_of": name})
        (RESULTS / name).mkdir(parents=True, exist_ok=True)
        (RESULTS / name / "case.json").write_text(json.dumps({
            "kind": "settings", "cases": cases, "order": methods, "names": NAMES,
            "command": f"python bench/reproduce.py --scale {args.scale} --seeds {' '.join(map(str, args.seeds))}"
                       + (f" --methods {' '.join(args.methods)}" if args.methods else ""),
            "machine": f"{os.cpu_count()}-core {platform.machine()} CPU", "date": datetime.date.today().isoformat(),
            "wall_s": round(time.time() - started)}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
