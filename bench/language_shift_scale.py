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
    the generalist's share (the mean gate of expert 0 over layers and users);
  * how far each point's schedule reads into a user's training split (``passes_read``: the fewest
    and most passes over the users).
x1 repeats the committed case's own runs: the result says how near it came to them.

The scales above stay far under one pass over a user's data (x8 reads 65,536 of its ~550,000
training tokens), where App. B.1's schedule reads each user's training split about 3.3 times
(1,638,400 tokens a user over Table 4's 407,498-557,662): Local, training its doubled LoRA on one
language for several epochs, may overfit there, where a router fitted to held-out validation data
has something to correct. ``--passes P`` reaches that regime at the CPU's cost: it keeps each
user's first (scale's tokens / P) training tokens (``data.train_tokens``), so the schedule reads
them P times; validation and test splits stay the case's.

    python bench/language_shift_scale.py --scales 1 --passes 3.3   # the paper's passes, x1's cost

Writes ``bench/results/language-shift-scale.json``; the runs go to ``runs/language-shift-scale``
(``--work``). Each finished seed of a point is also kept, compressed, in
``bench/results/language-shift-scale-runs/<point>-seed<s>/`` (results.json, metrics.jsonl.xz and
``measured.json``: the command, machine, date and wall time that ran it): an x8 seed costs over an
hour on 2 cores, so a point's seeds may run in different sessions (a session's runs/ may not
outlive it) and a point's row reads every seed kept, each naming its own run.
"""
from __future__ import annotations

import argparse
import json
import lzma
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import footprint  # prints wall time and peak RSS at exit
from cases import paired_interval

ROOT = Path(__file__).resolve().parents[1]
CASE = ROOT / "bench" / "results" / "recent-multilingual"
KEPT = ROOT / "bench" / "results" / "language-shift-scale-runs"
METHODS = ("local", "comigs-1g1s")
# xk -> (rounds, local steps): k x the case's 16 expert iterations
SCHEDULES = {1: (4, 4), 2: (8, 4), 4: (8, 8), 8: (16, 8)}
TOKENS_PER_STEP = 4 * 128  # the case's train.batch_size x train.seq_len
# CoMiGS App. B.1 (20 rounds x 10 iterations of 64 x 128 tokens) over Table 4's Multilingual users
PAPER_PASSES = 20 * 10 * 64 * 128 / statistics.fmean([557_662, 407_498, 556_796, 451_584])


def point(scale: int, passes: float | None) -> str:
    """A point of the study by name: ``x2``, or ``x1-train2482`` where each user's train split was
    cut to 2,482 tokens (no dot in the name: docs quote its numbers by key path, bench/quotes.py)."""
    return f"x{scale}" if passes is None else f"x{scale}-train{train_tokens(scale, passes)[0]}"


def train_tokens(scale: int, passes: float, users: int = 4) -> list[int]:
    """Each user's training tokens so that ``scale``'s schedule reads them ``passes`` times."""
    rounds, steps = SCHEDULES[scale]
    return [round(rounds * steps * TOKENS_PER_STEP / passes)] * users


def passes_read(x: dict, case_train_tokens: list[int]) -> list[float]:
    """The fewest and most passes a point's schedule reads over a user's training split: its rounds x
    local steps of TOKENS_PER_STEP over the split as the point cut it, else as the case holds it."""
    rounds, steps = x["rounds_x_local_steps"]
    splits = [x["train_tokens_per_user"]] if x.get("train_tokens_per_user") else case_train_tokens
    read = rounds * steps * TOKENS_PER_STEP
    return [read / max(splits), read / min(splits)]


def schedule(scale: int) -> list[str]:
    rounds, steps = SCHEDULES[scale]
    return [f"train.rounds={rounds}", f"train.local_steps={steps}", f"train.eval_every={max(1, rounds // 2)}"]


def run(scale: int, seed: int, work: Path, config: Path, overrides: list[str] = (), passes: float | None = None,
        kept: Path | None = KEPT, measured: dict | None = None) -> Path:
    """Local and CoMiGS-1G1S at ``scale`` on ``seed`` (skipped where finished or kept, resumed where
    stopped); a finished seed is kept in ``kept`` with ``measured`` (None: a rehearsal, not kept)."""
    out = work / f"{point(scale, passes)}-seed{seed}"
    if kept is not None and (kept / out.name / "measured.json").exists():
        return out
    if not all((out / f"seed{seed}" / m / "results.json").exists() for m in METHODS):
        cut = [] if passes is None else [f"data.train_tokens={train_tokens(scale, passes)}".replace(" ", "")]
        args = ["--resume", str(out)] if out.exists() else \
            [str(config), "--methods", *METHODS, "--seeds", str(seed), *schedule(scale), *cut, *overrides, f"run_dir={out}"]
        print(f"{point(scale, passes)} seed {seed}: comix compare {' '.join(args)}", flush=True)
        subprocess.run([sys.executable, "-m", "comix.cli", "compare", *args], cwd=ROOT, check=True,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    if kept is not None and measured is not None:
        keep(out, seed, kept, measured)
    return out


def keep(out: Path, seed: int, kept: Path, measured: dict) -> Path:
    """A finished point-seed's two runs, compressed, into ``kept/<out's name>/``, whole or not at
    all (a temp folder, then a rename), with ``measured`` and the wall time from the run folder's
    first file (its config.yaml, written at the start) to its last results.json."""
    dest, tmp = kept / out.name, kept / f".{out.name}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    ends = []
    for m in METHODS:
        src = out / f"seed{seed}" / m
        (tmp / f"seed{seed}" / m).mkdir(parents=True)
        # one line: results.json holds every user's gates per layer
        (tmp / f"seed{seed}" / m / "results.json").write_text(json.dumps(json.loads((src / "results.json").read_text())) + "\n")
        with lzma.open(tmp / f"seed{seed}" / m / "metrics.jsonl.xz", "wt", preset=9) as fh:
            fh.write((src / "metrics.jsonl").read_text())
        ends.append((src / "results.json").stat().st_mtime)
    wall = max(ends) - (out / "config.yaml").stat().st_mtime
    (tmp / "measured.json").write_text(json.dumps({**measured, "wall_s": round(wall)}, indent=1) + "\n")
    shutil.rmtree(dest, ignore_errors=True)
    tmp.rename(dest)
    return dest


def finished(work: Path, kept: Path | None, passes: float | None):
    """``folder(scale, seed, method)``: that run's folder, in ``work`` where it finished there, else
    where it was kept."""
    def folder(scale: int, seed: int, m: str) -> Path:
        name = f"{point(scale, passes)}-seed{seed}"
        here = work / name / f"seed{seed}" / m
        return here if (here / "results.json").exists() or kept is None else kept / name / f"seed{seed}" / m
    return folder


def measured_by(kept: Path, name: str, seeds: list[int]) -> list[dict] | None:
    """Who ran a point's seeds, from each kept seed's measured.json: [{command, machine, date,
    seeds, wall_s}], one entry a run; None where a seed was not kept (the file's own command)."""
    files = [kept / f"{name}-seed{s}" / "measured.json" for s in seeds]
    if not all(f.exists() for f in files):
        return None
    groups: dict[tuple, dict] = {}
    for s, f in zip(seeds, files):
        m = json.loads(f.read_text())
        g = groups.setdefault((m["command"], m["machine"], m["date"]),
                              {"command": m["command"], "machine": m["machine"], "date": m["date"], "seeds": [], "wall_s": []})
        g["seeds"].append(s)
        g["wall_s"].append(m["wall_s"])
    return list(groups.values())


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


def summarise(scales: list[int], seeds: list[int], folder, pretrained: dict | None, passes: float | None = None,
              kept: Path | None = None) -> dict:
    """Per scale, over the seeds whose two runs finished: each method's mean test perplexity per
    seed, the untrained base's, the lead with its interval, and the router's signals averaged over
    seeds. ``folder(scale, seed, method)``: that run's folder; ``pretrained``: {seed: base ppl};
    ``kept``: where finished seeds are kept (who measured each)."""
    out = {}
    for scale in scales:
        done = [s for s in seeds if all((folder(scale, s, m) / "results.json").exists() for m in METHODS)]
        if not done:
            continue
        ppl = {m: [json.loads((folder(scale, s, m) / "results.json").read_text())["mean_test_ppl"] for s in done]
               for m in METHODS}
        lead, half = paired_interval([a - b for a, b in zip(ppl["local"], ppl["comigs-1g1s"])])
        sig = [signals(folder(scale, s, "comigs-1g1s")) for s in done]
        out[point(scale, passes)] = {
            "rounds_x_local_steps": list(SCHEDULES[scale]), "seeds": done, "test_ppl": ppl,
            "train_tokens_per_user": None if passes is None else train_tokens(scale, passes)[0], "passes": passes,
            "pretrained_test_ppl": None if pretrained is None else [pretrained[s] for s in done],
            "comigs_lead_over_local": {"mean": lead, "half_width_95": half},
            "router_valid_loss": [statistics.fmean(v) for v in zip(*(s["router_valid_loss"] for s in sig))],
            "gate_entropy": [statistics.fmean(v) for v in zip(*(s["gate_entropy"] for s in sig))],
            "generalist_share": statistics.fmean(s["generalist_share"] for s in sig)}
        if kept is not None and (who := measured_by(kept, point(scale, passes), done)):
            out[point(scale, passes)]["measured"] = who
    return out


def kept_scales(earlier: dict, now: dict) -> dict:
    """``now`` with the scales an earlier result of the same setting read and this one did not (its
    runs may be gone: a scale costs CPU-hours), each scale keeping the command, date and machine that
    measured it; a rehearsal (overrides) keeps nothing, nor does a different setting."""
    if now["overrides"] or earlier.get("overrides") or earlier["setting"] != now["setting"]:
        return now
    for scale in now["scales"].values():
        scale.setdefault("measured", {k: now[k] for k in ("command", "date", "machine")})
    kept = {k: v for k, v in earlier["scales"].items() if k not in now["scales"]}
    for scale in kept.values():
        scale.setdefault("measured", {k: earlier[k] for k in ("command", "date", "machine")})
    scales = dict(sorted({**kept, **now["scales"]}.items(), key=lambda kv: (int(kv[0][1:].split("-")[0]), kv[0])))
    return {**now, "scales": scales, "seeds": sorted({s for x in scales.values() for s in x["seeds"]}),
            "x1_against_case": now["x1_against_case"] if "x1" in now["scales"] else earlier.get("x1_against_case")}


def reproduces_case(folder, seeds: list[int]) -> dict[str, float]:
    """x1's mean test perplexity relative to the committed case's run of the same method and seed
    (ours / theirs - 1: 0 where it reproduced them; the case ran on another day's machine)."""
    return {f"{m} seed {s}": json.loads((folder(1, s, m) / "results.json").read_text())
            ["mean_test_ppl"] / json.loads((CASE / f"seed{s}" / m / "results.json").read_text())["mean_test_ppl"] - 1
            for s in seeds for m in METHODS}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--scales", type=int, nargs="+", default=sorted(SCHEDULES), choices=sorted(SCHEDULES))
    ap.add_argument("--seeds", type=int, nargs="+", default=[42, 45, 47])
    ap.add_argument("--work", type=Path, default=ROOT / "runs" / "language-shift-scale")
    ap.add_argument("--result", type=Path, default=ROOT / "bench" / "results" / "language-shift-scale.json")
    ap.add_argument("--passes", type=float, default=None,
                    help=f"cut each user's train split so the schedule reads it this many times (App. B.1: {PAPER_PASSES:.1f})")
    ap.add_argument("--no-run", action="store_true",
                    help="read back the finished runs only (a bench cut short: each scale over the seeds it finished)")
    ap.add_argument("overrides", nargs="*", help="key=value for every run (a rehearsal: model=tiny-llama ...)")
    args = ap.parse_args()
    # the command that runs them (--no-run only reads back what it ran)
    command = "python bench/language_shift_scale.py " + " ".join(a for a in sys.argv[1:] if a != "--no-run")
    machine, kept = f"{os.cpu_count()} cores of an {footprint.cpu_name()}", None if args.overrides else KEPT
    for scale in [] if args.no_run else args.scales:  # every seed of a scale before the next scale
        for seed in args.seeds:
            run(scale, seed, args.work, CASE / "config.yaml", args.overrides, args.passes, kept,
                {"command": command, "machine": machine, "date": time.strftime("%Y-%m-%d")})
    folder = finished(args.work, kept, args.passes)
    # the untrained base's score does not depend on the schedule: the committed case's runs (the same data)
    pretrained = None if args.overrides else \
        {s: json.loads((CASE / f"seed{s}" / "pretrained" / "results.json").read_text())["mean_test_ppl"] for s in args.seeds}
    scales = summarise(args.scales, args.seeds, folder, pretrained, args.passes, kept)
    fig = {"setting": str(CASE.relative_to(ROOT) / "config.yaml"), "methods": list(METHODS), "seeds": args.seeds,
           "scales": scales, "x1_against_case": reproduces_case(folder, scales["x1"]["seeds"])
           if "x1" in scales and not args.overrides else None, "overrides": args.overrides,
           "command": command, "date": time.strftime("%Y-%m-%d"), "machine": machine}
    if args.result.exists():
        fig = kept_scales(json.loads(args.result.read_text()), fig)
    # every point, kept ones too: where the schedule stands against one pass over a user's data (a
    # rehearsal's overrides may change the data or the batch: not read)
    splits = [u["train"]["size"] for u in json.loads((CASE / "partition.json").read_text()).values()]
    for x in [] if args.overrides else fig["scales"].values():
        x["passes_read"] = passes_read(x, splits)
    footprint.write_result(args.result, fig)
    print(json.dumps({k: v["comigs_lead_over_local"] for k, v in fig["scales"].items()}, indent=1))
    print(f"wrote {args.result}")


if __name__ == "__main__":
    main()
