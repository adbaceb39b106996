"""What ``train.eval_clients`` saves: the same compare with every client scored every round and
with a seeded sample scored in the rounds before the last (every client in the last), one after
the other on this machine, each timed as a whole (/usr/bin/time -v) and by what its rounds' scoring
took (metrics.jsonl's ``eval_s``); and a check that the last round's per-user scores, every client's
in both, are identical (the sample changes what the curves cost, not the final table).

    python bench/eval_clients.py [--config configs/privacy/tiny-40-clients-dp.yaml] [--sample 8]

Writes bench/results/eval-clients.json; ``python bench/tables.py`` puts its table in docs/usage.md.
Run it alone on the machine.
"""
from __future__ import annotations

import footprint  # prints wall time and peak RSS at exit; timed_comix

import argparse
import datetime
import json
import os
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "bench" / "results" / "eval-clients.json"


def rows_of(run: Path) -> dict[str, list[dict]]:
    """{method folder: its metrics.jsonl rows} of a compare's one seed."""
    return {m.parent.name: [json.loads(x) for x in m.read_text().splitlines()]
            for m in sorted(run.glob("seed*/*/metrics.jsonl"))}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="configs/privacy/tiny-40-clients-dp.yaml")
    ap.add_argument("--sample", type=int, default=8)
    args = ap.parse_args(argv)
    runs = {}
    for sample in (0, args.sample):
        out = ROOT / "runs" / f"eval-clients-{sample}"
        shutil.rmtree(out, ignore_errors=True)
        measured = footprint.timed_comix(["compare", args.config, f"train.eval_clients={sample}", f"run_dir={out}"],
                                         ROOT, f"bench/eval_clients.py: eval_clients={sample}")
        rows = rows_of(out)
        last = {m: max(r["round"] for r in rs) for m, rs in rows.items()}
        runs[sample] = {**measured, "eval_s": round(sum(r.get("eval_s", 0.0) for rs in rows.values() for r in rs), 1),
                        "scored": sum(1 for rs in rows.values() for r in rs if "eval_s" in r),
                        "final": {m: {r["user"]: r.get("test_ppl") for r in rs if r["round"] == last[m] and "test_ppl" in r}
                                  for m, rs in rows.items()}}
        print(f"eval_clients={sample}: {measured['wall_s']:.0f} s, scoring {runs[sample]['eval_s']:.0f} s "
              f"({runs[sample]['scored']} client evaluations)", flush=True)
    full, sampled = runs[0], runs[args.sample]
    result = {"command": "python bench/eval_clients.py " + " ".join(argv if argv is not None else sys.argv[1:]),
              "config": args.config, "sample": args.sample,
              "machine": f"{os.cpu_count()} cores of an {footprint.cpu_name()}, alone",
              "date": datetime.date.today().isoformat(),
              "runs": {str(k): {x: v for x, v in r.items() if x != "final"} for k, r in runs.items()},
              "final_scores_identical": full["final"] == sampled["final"],
              "final_clients": sum(len(u) for u in full["final"].values())}
    footprint.write_result(OUT, result)
    print(f"wrote {OUT}; final scores identical: {result['final_scores_identical']}")
    return 0 if result["final_scores_identical"] else 1


if __name__ == "__main__":
    sys.exit(main())
