"""Why Local beats CoMiGS-1G1S on a language shift: the gap as training grows, and the router's
own signals beside it.

    python bench/language_shift_scale.py                         # x1 x2 x4 x8, seeds 42 45 47
    python bench/language_shift_scale.py --scales 1 2 --seeds 42 # a part; run again to add the rest

The setting is the committed multilingual case's (bench/results/recent-multilingual/config.yaml:
SmolLM2-135M, the built-in multilingual corpus, one user a language, 4 rounds x 4 local steps of
4 x 128 tokens, the router's 2 steps every 4 expert iterations on validation batches, CoMiGS
App. B.1's optimiser). Scale xk multiplies the expert iterations by k: x2 = 8 rounds x 4, x4 =
8 x 8, x8 = 16 x 8, towards App. B.1's 20 rounds x 10 iterations (of 64 x 128 tokens, with 10
router steps every 30 iterations). The router's period and steps stay, so its steps grow with
the iterations (1 in 2 here, 1 in 3 in App. B.1); the one-cycle cosine spans each run's own
length, as it does in the authors' code.
For each scale and seed it runs Local and CoMiGS-1G1S (``comix compare``; a run stopped partway
resumes with comix's ``--resume``) and reads:
  * each method's mean test perplexity after the last round, and CoMiGS-1G1S's lead over Local
    (Local minus CoMiGS: positive = CoMiGS ahead) with its 95 % t interval over seeds;
  * the router's signals: the validation CE its steps read, per round (``router_valid_loss``,
    the mean over users: does the router's own objective fall?), each layer's mean per-token gate
    entropy at the end (log 2 = 0.693 is an even mix of the two experts, 0 a hard choice) and
    the generalist's share (the mean gate of expert 0 over layers and users).
x1 repeats the committed case's own runs: the result says how near it came to them.
Writes ``bench/results/language-shift-scale.json``; the runs go to ``runs/language-shift-scale``
(``--work``).
"""
from __future__ import annotations

import argparse
import json
import lzma
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import footprint  # prints wall time and peak RSS at exit
from cases import paired_interval

ROOT = Path(__file__).resolve().parents[1]
CASE = ROOT / "bench" / "results" / "recent-multilingual"
METHODS = ("local", "comigs-1g1s")
# xk -> (rounds, local steps): k x the case's 16 expert iterations
SCHEDULES = {1: (4, 4), 2: (8, 4), 4: (8, 8), 8: (16, 8)}


def schedule(scale: int) -> list[str]:
    rounds, steps = SCHEDULES[scale]
    return [f"train.rounds={rounds}", f"train.local_steps={steps}", f"train.eval_every={max(1, rounds // 2)}"]


def run(scale: int, seed: int, work: Path, config: Path, overrides: list[str] = ()) -> Path:
    """Local and CoMiGS-1G1S at ``scale`` on ``seed`` (skipped where finished, resumed where stopped)."""
    out = work / f"x{scale}-seed{seed}"
    if all((out / f"seed{seed}" / m / "results.json").exists() for m in METHODS):
        return out
    args = ["--resume", str(out)] if out.exists() else \
        [str(config), "--methods", *METHODS, "--seeds", str(seed), *schedule(scale), *overrides, f"run_dir={out}"]
    print(f"x{scale} seed {seed}: comix compare {' '.join(args)}", flush=True)
    subprocess.run([sys.executable, "-m", "comix.cli", "compare", *args], cwd=ROOT, check=True,
                   env={**os.environ, "PYTHONPATH": str(ROOT)})
    return out


def _rows(folder: Path) -> list[dict]:
    path = folder / "metrics.jsonl"
    text = path.read_text() if path.exists() else lzma.open(f"{path}.xz", "rt").read()
    return [json.loads(ln) for ln in text.splitlines()]


def signals(folder: Path) -> dict:
    """The router's signals of one CoMiGS run (the module docstring's list)."""
    rows, result = _rows(folder), json.loads((folder / "results.json").read_text())
    rounds = sorted({r["round"] for r in rows if "router_valid_loss" in r})
    users = result["per_user"].values()
    return {"router_valid_loss": [statistics.fmean(r["router_valid_loss"] for r in rows
                                                   if r["round"] == k and "router_valid_loss" in r) for k in rounds],
            "gate_entropy": [statistics.fmean(layer) for layer in zip(*(u["gate_entropy"] for u in users))],
            "generalist_share": statistics.fmean(statistics.fmean(g[0] for g in u["gates"]) for u in users)}


def summarise(scales: list[int], seeds: list[int], folder, pretrained: dict | None) -> dict:
    """Per scale, over the seeds whose two runs finished: each method's mean test perplexity per
    seed, the untrained base's, the lead with its interval, and the router's signals averaged over
    seeds. ``folder(scale, seed, method)``: that run's folder; ``pretrained``: {seed: base ppl}."""
    out = {}
    for scale in scales:
        done = [s for s in seeds if all((folder(scale, s, m) / "results.json").exists() for m in METHODS)]
        if not done:
            continue
        ppl = {m: [json.loads((folder(scale, s, m) / "results.json").read_text())["mean_test_ppl"] for s in done]
               for m in METHODS}
        lead, half = paired_interval([a - b for a, b in zip(ppl["local"], ppl["comigs-1g1s"])])
        sig = [signals(folder(scale, s, "comigs-1g1s")) for s in done]
        out[f"x{scale}"] = {
            "rounds_x_local_steps": list(SCHEDULES[scale]), "seeds": done, "test_ppl": ppl,
            "pretrained_test_ppl": None if pretrained is None else [pretrained[s] for s in done],
            "comigs_lead_over_local": {"mean": lead, "half_width_95": half},
            "router_valid_loss": [statistics.fmean(v) for v in zip(*(s["router_valid_loss"] for s in sig))],
            "gate_entropy": [statistics.fmean(v) for v in zip(*(s["gate_entropy"] for s in sig))],
            "generalist_share": statistics.fmean(s["generalist_share"] for s in sig)}
    return out


def reproduces_case(work: Path, seeds: list[int]) -> dict[str, float]:
    """x1's mean test perplexity relative to the committed case's run of the same method and seed
    (ours / theirs - 1: 0 where it reproduced them; the case ran on another day's machine)."""
    return {f"{m} seed {s}": json.loads((work / f"x1-seed{s}" / f"seed{s}" / m / "results.json").read_text())
            ["mean_test_ppl"] / json.loads((CASE / f"seed{s}" / m / "results.json").read_text())["mean_test_ppl"] - 1
            for s in seeds for m in METHODS}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--scales", type=int, nargs="+", default=sorted(SCHEDULES), choices=sorted(SCHEDULES))
    ap.add_argument("--seeds", type=int, nargs="+", default=[42, 45, 47])
    ap.add_argument("--work", type=Path, default=ROOT / "runs" / "language-shift-scale")
    ap.add_argument("--result", type=Path, default=ROOT / "bench" / "results" / "language-shift-scale.json")
    ap.add_argument("--no-run", action="store_true",
                    help="read back the finished runs only (a bench cut short: each scale over the seeds it finished)")
    ap.add_argument("overrides", nargs="*", help="key=value for every run (a rehearsal: model=tiny-llama ...)")
    args = ap.parse_args()
    for scale in [] if args.no_run else args.scales:  # every seed of a scale before the next scale
        for seed in args.seeds:
            run(scale, seed, args.work, CASE / "config.yaml", args.overrides)
    folder = lambda scale, seed, m: args.work / f"x{scale}-seed{seed}" / f"seed{seed}" / m  # noqa: E731
    # the untrained base's score does not depend on the schedule: the committed case's runs (the same data)
    pretrained = None if args.overrides else \
        {s: json.loads((CASE / f"seed{s}" / "pretrained" / "results.json").read_text())["mean_test_ppl"] for s in args.seeds}
    scales = summarise(args.scales, args.seeds, folder, pretrained)
    fig = {"setting": str(CASE.relative_to(ROOT) / "config.yaml"), "methods": list(METHODS), "seeds": args.seeds,
           "scales": scales, "x1_against_case": reproduces_case(args.work, scales["x1"]["seeds"])
           if "x1" in scales and not args.overrides else None, "overrides": args.overrides,
           "command": "python bench/language_shift_scale.py " + " ".join(sys.argv[1:]),
           "date": time.strftime("%Y-%m-%d"),
           "machine": f"{os.cpu_count()} cores of an {footprint.cpu_name()}"}
    footprint.write_result(args.result, fig)
    print(json.dumps({k: v["comigs_lead_over_local"] for k, v in fig["scales"].items()}, indent=1))
    print(f"wrote {args.result}")


if __name__ == "__main__":
    main()
