"""A job on a fleet's memory budgets beside the same job with every device unconstrained: what
the budgets cost. Default: configs/devices/mixed-16.yaml (16 devices of the built-in mixed fleet,
FedAvg and CoMiGS-1G1S on SmolLM2-135M, quant=auto).

    python bench/fleet.py [--config configs/devices/mixed-16.yaml] [-- key=value ...]

Runs ``comix run <config>`` (the fleet), the same with ``micro_batches=auto`` (the fleet, each
device's batches sliced before its base is quantised) and ``comix run <config> quant=none fleet=``
(every device in full precision, no budget) one after the other under /usr/bin/time -v, saves
each as a case (bench/tables.py --save) and the measurements in ``<case>/case.json``; ``python
bench/tables.py`` makes the docs' table from them. ``--only sliced`` re-runs that part alone and
keeps the others' records.
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

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
from cases import RESULTS  # noqa: E402
from tables import save  # noqa: E402


# the fleet as planned (quant=auto), the same with micro_batches=auto, and no budget at all
PARTS = {"fleet": [], "sliced": ["micro_batches=auto"], "unconstrained": ["quant=none", "fleet=''"]}


def run(config: str, extra: list[str], out: Path) -> dict:
    shutil.rmtree(out, ignore_errors=True)
    # a plan refused (a device nothing fits) is a result too: recorded with comix's line
    return footprint.timed_comix(["run", config, f"run_dir={out}", *extra], ROOT, f"bench/fleet.py: {config} {extra}",
                                 refusal_ok=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="configs/devices/mixed-16.yaml")
    ap.add_argument("--only", nargs="+", choices=PARTS, help="re-run these parts, keep the others' records")
    ap.add_argument("extra", nargs="*", help="key=value overrides for every run")
    args = ap.parse_args(argv)
    name = "fleet-" + Path(args.config).stem
    recipe = yaml.safe_load((ROOT / args.config).read_text())
    kept = RESULTS / name / "case.json"
    measures = json.loads(kept.read_text())["measures"] if args.only and kept.exists() else {}
    for part, extra in PARTS.items():
        if args.only and part not in args.only and part in measures:
            continue
        out = ROOT / "runs" / f"{name}-{part}"
        measures[part] = run(args.config, [*args.extra, *extra], out)
        if "refused" in measures[part]:
            shutil.rmtree(RESULTS / f"{name}-{part}", ignore_errors=True)
            print(f"{part}: refused: {measures[part]['refused']}")
            continue
        save([out], f"{name}-{part}", {"kind": "users", "part_of": name})
        print(f"{part}: {measures[part]['wall_s']:.0f} s, peak RSS {measures[part]['peak_rss_mb']:.0f} MB")
    case = {"kind": "fleet", "command": f"python bench/fleet.py --config {args.config} " + " ".join(args.extra),
            "machine": f"{os.cpu_count()}-core {platform.machine()} CPU, alone", "date": datetime.date.today().isoformat(),
            "fleet": recipe["fleet"], "methods": recipe["methods"],
            "runs": {part: f"{name}-{part}" for part in PARTS}, "measures": measures}
    (RESULTS / name).mkdir(parents=True, exist_ok=True)
    (RESULTS / name / "case.json").write_text(json.dumps(case, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
