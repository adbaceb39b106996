"""One-line mutations of the modules where a silent bug changes results, each run against the
module's tests: a mutant *killed* (some test fails) shows the behaviour is pinned; a *surviving*
mutant is a behaviour no test notices. The list (bench/mutants.py) names each edit, what a user
would see if it shipped, and the tests that must catch it; the results go to
bench/results/mutation-sweep.json (one row per mutant: killed / survived / equivalent, seconds,
the first failing test).

    python bench/mutation_sweep.py                   # every mutant (an hour or more on 2 cores)
    python bench/mutation_sweep.py --module fleet    # the mutants of one module
    python bench/mutation_sweep.py --list            # what would run

First each distinct test selection runs on the unmutated tree and must pass (else the sweep stops:
a failing test would count every mutant as killed). Then each mutant is applied to the work tree, its tests run with ``-x`` (stop at the first failure),
and the file is put back byte for byte in a ``finally`` (also on Ctrl-C). An edit whose text is
not found exactly once refuses the whole sweep before anything runs: a mutant that no longer
applies says so instead of passing for killed. Run it alone (one heavy job at a time) on a
clean tree; it refuses a tree with changes to a file it mutates.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
import footprint  # noqa: E402,F401 (prints wall time and peak RSS at exit)
from mutants import MUTANTS  # noqa: E402

RESULT = ROOT / "bench" / "results" / "mutation-sweep.json"


def check(mutants) -> None:
    """Every edit applies exactly once and changes its file (before any test runs)."""
    for m in mutants:
        text = (ROOT / m.file).read_text()
        if text.count(m.find) != 1:
            raise SystemExit(f"mutant {m.name}: its text occurs {text.count(m.find)} times in {m.file} (want 1)")
        if m.find == m.replace:
            raise SystemExit(f"mutant {m.name}: its edit changes nothing")
    dirty = subprocess.run(["git", "status", "--porcelain", "--", *sorted({m.file for m in mutants})],
                           cwd=ROOT, capture_output=True, text=True).stdout.strip()
    if dirty:
        raise SystemExit(f"uncommitted changes to a file the sweep mutates: {dirty.splitlines()[0]}")


def machine() -> str:
    cpu = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                if ln.startswith("model name")), "unknown CPU") if Path("/proc/cpuinfo").exists() else "unknown CPU"
    return f"{os.cpu_count()} cores, {cpu}"


def pytest(tests, timeout: int) -> tuple[int, str]:
    """(pytest's exit code, or -1 past ``timeout``; its output) for ``tests``, stopping at the first failure."""
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}  # no cached bytecode of a mutated file outlives it
    try:
        proc = subprocess.run([sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *tests],
                              cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return -1, ""
    return proc.returncode, proc.stdout


def run_one(m, timeout: int) -> dict:
    path = ROOT / m.file
    original = path.read_bytes()
    t0 = time.time()
    try:
        path.write_text(original.decode().replace(m.find, m.replace))
        rc, out = pytest(m.tests, timeout)
    finally:
        path.write_bytes(original)
    failed = next((ln.split(" ")[1] for ln in out.splitlines() if ln.startswith("FAILED ")), "")
    outcome = ("timeout" if rc == -1 else "killed" if rc == 1 else ("equivalent" if m.equivalent else "survived")
               if rc == 0 else f"error (pytest rc {rc})")
    return {"module": m.module, "name": m.name, "file": m.file, "edit": m.what, "tests": m.tests,
            "outcome": outcome, "first_failure": failed, "seconds": round(time.time() - t0, 1),
            "machine": machine(), "date": time.strftime("%Y-%m-%d"),  # a sweep of some modules keeps the others' own
            **({"equivalent": m.equivalent} if outcome == "equivalent" else {})}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--module", action="append", help="only this module's mutants (repeatable)")
    ap.add_argument("--name", action="append", help="only the mutant of this name (repeatable)")
    ap.add_argument("--list", action="store_true")
    ap.add_argument("--timeout", type=int, default=900, help="seconds per mutant's tests")
    args = ap.parse_args(argv)
    chosen = [m for m in MUTANTS if (not args.module or m.module in args.module)
              and (not args.name or m.name in args.name)]
    if not chosen:
        raise SystemExit(f"no mutant matches (modules: {', '.join(sorted({m.module for m in MUTANTS}))})")
    check(chosen)
    if args.list:
        for m in chosen:
            print(f"{m.module:10} {m.name:34} {m.what}")
        return
    for tests in sorted({m.tests for m in chosen}):  # a mutant reads as killed only if its tests pass unmutated
        rc, out = pytest(tests, args.timeout)
        if rc != 0:
            raise SystemExit(f"the unmutated tree fails {' '.join(tests)}: fix that first\n{out[-2000:]}")
        print(f"baseline passes: {' '.join(tests)}", flush=True)
    saved = json.loads(RESULT.read_text()) if RESULT.exists() else {"mutants": []}
    # each row where and when it ran (a row from before rows said so: the file's, which its sweep wrote)
    old = {(r["module"], r["name"]): {"machine": saved.get("machine"), "date": saved.get("date"), **r}
           for r in saved["mutants"]}
    order = {(x.module, x.name): i for i, x in enumerate(MUTANTS)}  # the file's rows in the list's order
    for i, m in enumerate(chosen, 1):
        row = run_one(m, args.timeout)
        old[(m.module, m.name)] = row
        print(f"[{i}/{len(chosen)}] {row['outcome']:9} {m.module}/{m.name} ({row['seconds']} s) {row['first_failure']}",
              flush=True)
        rows = sorted(old.values(), key=lambda r: order.get((r["module"], r["name"]), len(order)))
        tmp = RESULT.with_suffix(".tmp")
        tmp.write_text(json.dumps({"command": "python bench/mutation_sweep.py", "machine": machine(),
                                   "date": time.strftime("%Y-%m-%d"), "mutants": rows}, indent=1) + "\n")
        tmp.replace(RESULT)  # written after each mutant: a stopped sweep keeps what it measured
    survived = [r for r in old.values() if r["outcome"] != "killed"]
    print(f"{len(old) - len(survived)} of {len(old)} killed" + "".join(
        f"\n  {r['outcome']}: {r['module']}/{r['name']}: {r['edit']}" for r in survived))


if __name__ == "__main__":
    main()
