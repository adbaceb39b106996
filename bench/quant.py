"""The main job on a full-precision, an int8, an HQQ 4-bit and an NF4 base
(``quant=none|int8|q4|nf4``), one process each on this machine: wall time, peak RSS, each
device's base and training memory, and the per-user test perplexity each costs.

    python bench/quant.py [--methods fedavg comigs-1g1s] [-- key=value ...]

Each run is ``python -m comix.cli run quant=<q> methods=[...] run_dir=runs/quant-<q>`` under
/usr/bin/time -v; runs go none, int8, q4, nf4 after one untimed warm-up of the caches. The runs are
saved as the cases ``quant-main-job-<q>`` (bench/tables.py --save) and the measurements with them
in ``quant-main-job/case.json``; ``python bench/tables.py`` makes the README's table from them.
"""
from __future__ import annotations

import footprint  # prints wall time and peak RSS at exit; timed_comix

import argparse
import datetime
import json
import os
import platform
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
from cases import RESULTS  # noqa: E402
from tables import save  # noqa: E402

QUANTS = ("none", "int8", "q4", "nf4")


def run(quant: str, methods: list[str], extra: list[str], out: Path) -> dict:
    """{"wall_s", "peak_rss_mb"} of one main job."""
    shutil.rmtree(out, ignore_errors=True)
    return footprint.timed_comix(["run", f"quant={quant}", f"methods=[{','.join(methods)}]", f"run_dir={out}", *extra],
                                 ROOT, f"bench/quant.py: quant={quant}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--methods", nargs="+", default=["fedavg", "comigs-1g1s"])
    ap.add_argument("--quants", nargs="+", default=list(QUANTS), choices=QUANTS,
                    help="measure these again, keeping the committed measures of the others")
    ap.add_argument("extra", nargs="*", help="key=value overrides for every run")
    args = ap.parse_args(argv)
    runs = ROOT / "runs"
    run("none", args.methods, [*args.extra, "train.rounds=1"], runs / "quant-warmup")  # caches, untimed
    committed = RESULTS / "quant-main-job" / "case.json"
    measures = json.loads(committed.read_text())["measures"] if set(args.quants) != set(QUANTS) else {}
    for quant in args.quants:
        measures[quant] = run(quant, args.methods, args.extra, runs / f"quant-{quant}")
        seconds, peak = measures[quant]["wall_s"], measures[quant]["peak_rss_mb"]
        save([runs / f"quant-{quant}"], f"quant-main-job-{quant}", {"kind": "users", "part_of": "quant-main-job"})
        print(f"quant={quant}: {seconds:.0f} s, peak RSS {peak:.0f} MB")
    case = {"kind": "quant", "command": "python bench/quant.py " + " ".join(args.extra),
            "methods": args.methods, "machine": f"{os.cpu_count()}-core {platform.machine()} CPU, alone",
            "date": datetime.date.today().isoformat(), "runs": {q: f"quant-main-job-{q}" for q in QUANTS},
            "measures": {q: measures[q] for q in QUANTS}}
    (RESULTS / "quant-main-job").mkdir(parents=True, exist_ok=True)
    (RESULTS / "quant-main-job" / "case.json").write_text(json.dumps(case, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
