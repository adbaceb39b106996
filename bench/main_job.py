"""The main job (``comix run``) of two commits, back to back on this machine: wall time, peak RAM
and the printed table of each (faster, with the same numbers).

    python bench/main_job.py --old eed3d04 [--new HEAD] [--repeat 1] [-- key=value ...]

Each commit is checked out into a temporary git worktree and run in its own process,
``python -m comix.cli run run_dir=<tmp> [overrides]``, with that worktree first on PYTHONPATH (the
installed environment is shared: same torch, same wheels, same $COMIX_CACHE, so the model and
the tokens are cached for both). Runs alternate old, new, old, new, ... after one untimed warm-up
of the cache. Prints a table and writes bench/results/main-job.md.
"""
from __future__ import annotations

import footprint  # noqa: F401  (prints wall time and peak RSS at exit)

import argparse
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def publish(lines: list[str], name: str) -> None:
    """Print a report and write it to bench/results/<name>."""
    text = "\n".join(lines)
    print(text)
    out = ROOT / "bench" / "results" / name
    out.write_text(text)
    print(f"wrote {out}")


def checkout(commit: str, where: Path) -> Path:
    path = where / commit.replace("/", "_")
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", "-q", str(path), commit], check=True)
    return path


def peak_mb_of(tree: Path, overrides: list[str], out: Path) -> tuple[float, float, str]:
    """(seconds, peak RSS MB, table) of one run, measured by /usr/bin/time -v when present."""
    time_bin = shutil.which("time") or "/usr/bin/time"
    cmd = [sys.executable, "-m", "comix.cli", "run", f"run_dir={out}", *overrides]
    env = {**os.environ, "PYTHONPATH": str(tree)}
    t0 = time.perf_counter()
    if Path(time_bin).exists():
        proc = subprocess.run([time_bin, "-v", *cmd], cwd=tree, env=env, capture_output=True, text=True)
        m = re.search(r"Maximum resident set size \(kbytes\): (\d+)", proc.stderr)
        peak = int(m.group(1)) / 1024 if m else float("nan")
    else:
        proc = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True)
        peak = float("nan")
    seconds = time.perf_counter() - t0
    if proc.returncode:
        raise SystemExit(f"comix run from {tree} failed (exit {proc.returncode}):\n{proc.stderr[-2000:]}")
    table = "\n".join(line for line in proc.stdout.splitlines() if line.startswith("|"))
    return seconds, peak, table


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--old", required=True, help="the commit to compare against (e.g. eed3d04, before the speed work)")
    ap.add_argument("--new", default="HEAD")
    ap.add_argument("--repeat", type=int, default=1, help="timed runs of each commit, interleaved")
    ap.add_argument("overrides", nargs="*", help="config overrides for both runs (key=value)")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="comix-main-job-"))
    trees = {}
    try:
        trees = {"old": checkout(args.old, work), "new": checkout(args.new, work)}
        commits = {k: subprocess.run(["git", "-C", str(t), "rev-parse", "--short", "HEAD"], capture_output=True,
                                     text=True, check=True).stdout.strip() for k, t in trees.items()}
        print(f"warm-up (model and token caches) with {commits['new']} ...", flush=True)
        peak_mb_of(trees["new"], [*args.overrides, "methods=[pretrained]"], work / "warmup")
        times = {"old": [], "new": []}
        peaks = {"old": [], "new": []}
        tables = {}
        for i in range(args.repeat):
            for which in ("old", "new"):
                s, peak, table = peak_mb_of(trees[which], args.overrides, work / f"{which}{i}")
                times[which].append(s)
                peaks[which].append(peak)
                tables[which] = table
                print(f"{which} ({commits[which]}) run {i + 1}: {s / 60:.2f} min, peak RSS {peak:,.0f} MB", flush=True)
    finally:
        for t in trees.values():
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(t)], check=False)
        shutil.rmtree(work, ignore_errors=True)
    old, new = statistics.median(times["old"]), statistics.median(times["new"])
    same = tables["old"] == tables["new"]
    command = " ".join(["python bench/main_job.py", "--old", args.old, "--new", args.new,
                        *(["--repeat", str(args.repeat)] if args.repeat > 1 else []), *args.overrides])
    lines = [f"# Main job, old vs new (`{command}`)", "",
             f"Machine: {platform.machine()}, {os.cpu_count()} CPUs, {platform.platform()}; "
             f"Python {platform.python_version()}. Runs interleaved old/new after a warm-up; medians of {args.repeat}.",
             "", "| commit | wall (min) | peak RSS (MB) |", "|---|---|---|",
             *(f"| {k} {commits[k]} | {statistics.median(times[k]) / 60:.2f} | {statistics.median(peaks[k]):,.0f} |"
               for k in ("old", "new")), "",
             f"Speed-up old / new: **{old / new:.2f}x**. Printed tables identical: **{same}**.", "",
             "Old table:", "", tables["old"], "", "New table:", "", tables["new"], ""]
    publish(lines, "main-job.md")


if __name__ == "__main__":
    main()
