"""Every generated table of the README and docs, from committed result files.

    python bench/tables.py                 # rewrite the generated tables in README.md and docs/*.md
    python bench/tables.py --check         # exit 1 (naming the block) if a doc's table differs, or a
                                           # number quoted in prose from its file (bench/quotes.py)
    python bench/tables.py --save RUN [RUN ...] CASE   # finished runs or compare folders (or a committed
                                                       # case, to add seeds) into bench/results/CASE/
    python bench/tables.py --unpack CASE RUN_DIR       # a committed case's finished runs into a new compare
                                                       # folder: comix compare --resume RUN_DIR runs the rest

A *case* is a folder ``bench/results/<case>/``: ``case.json`` (the command that made it, the
machine, the date, the table kind), the run's ``config.yaml``, and per seed and method the run's
``results.json`` with its ``metrics.jsonl.xz`` and ``server.jsonl.xz`` (xz-compressed; never a
checkpoint or an adapter). A doc asks for a table with a marker pair::

    <!-- table: <case> -->
    ...generated, do not edit...
    <!-- end table -->

and this script writes the table between them; tests/test_tables.py runs ``--check``, so a doc
and its result files cannot drift apart.

Table kinds (``case.json``'s ``kind``):
  ablation   FedAMoLE Table III style: each method's MTAL, mean (std) over seeds and per seed,
             and its paired difference from ``reference`` (default ``fedamole``) with a 95 %
             t interval over the seeds, plus each method's assignment churn (share of a client's
             experts new each round) where its server.jsonl lists expert uploads.
  users      a CoMiGS Table 1 style table: per user and mean, one seed or mean over seeds.
  quant      bench/quant.py: the main job at each base precision (peak RSS, wall time, a device's
             base and training memory, each method's perplexity against the full-precision base).
  fleet      bench/fleet.py: a job on a fleet's budgets beside the same job unconstrained, per
             device profile (precision planned, memory, device time, perplexity and its cost).
  compare    methods side by side over seeds: mean (std), per seed, the paired difference from
             ``reference`` with a 95 % interval, bytes a client uploads a round, parameters it trains.
  settings   CoMiGS Table 1 across settings (bench/reproduce.py --save): one column per setting's case.
  costs      FedAMoLE Table IV: per client and round, state, bytes, training, aggregation, test time.
  global     DeepFusion and its baselines: each global model's scores on the server's test domains.
  privacy    client-level DP: each spec's clip, noise multiplier, epsilon and mean test perplexity.
  deepfusion DeepFusion's alpha sweep: alpha chosen on the server's validation documents, test per
             domain, paired differences from ``reference`` (FedKMT) and the seeds the paper's edge over
             FedKMT needs at their spread, the teachers' in-domain premise.
The marker ``<!-- table: methods -->`` is the one table made from code, not results: every method
as its class declares it (bench/methods_table.py; docs/methods.md). ``<!-- table: results -->`` is
docs/results.md's verdict per paper claim, made from the cases it names (bench/results_page.py; the cases a row pools: bench/pooling.py). ``<!-- table: layer-speed.md -->``
(and ``layer-speed-full.md``, ``layer-speed-h200-bf16.md``) renders the result file bench/layer_speed.py writes;
``cohort-cpu-fp32.json`` bench/cohort.py's, and ``cohort-cpu-runs`` a folder of whole runs timed one
client at a time and in cohorts (``/usr/bin/time -v`` lines and each method's server.jsonl).
A case whose case.json names ``runs_of`` (another case) and ``methods`` holds no runs of its own:
it shows those methods of the other case's runs in its own kind (one run, several tables). A case's
``seeds`` keeps the seeds its table shows (costs timed on one machine, where later seeds ran on
another; methods side by side on the seeds every one of them ran).

This file writes the docs and saves and unpacks cases; the tables live by what they render:
bench/cases.py (reading a case, the shared statistics), bench/case_tables.py (each kind's table),
bench/deepfusion_table.py (DeepFusion's), bench/bench_tables.py (a bench's own result file).
"""
from __future__ import annotations

import argparse
import json
import lzma
import re
import shutil
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))  # its table modules, when this file is loaded by path (tests)
from bench_tables import BENCH_DIRS, BENCH_FILES  # noqa: E402
from case_tables import (ablation_table, compare_table, costs_table, fleet_table, global_table, privacy_table,
                         quant_table, settings_table, users_table)
import cases  # noqa: E402 (cases.RESULTS read at each call: tests point it elsewhere)
from cases import load_case  # noqa: E402
from deepfusion_table import deepfusion_table  # noqa: E402

DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
MARK = re.compile(r"(<!-- table: (?P<case>[\w.-]+) -->\n)(?P<body>.*?)(<!-- end table -->)", re.S)


KINDS = {"ablation": ablation_table, "users": users_table, "quant": quant_table, "compare": compare_table,
         "fleet": fleet_table, "deepfusion": deepfusion_table, "privacy": privacy_table,
         "settings": settings_table, "global": global_table, "costs": costs_table}


def table(case: str) -> str:
    if case in BENCH_FILES:  # a bench's own result file (bench/layer_speed.py writes it), not a run's
        return f"{BENCH_FILES[case]((cases.RESULTS / case).read_text())}\n\n*Generated by `python bench/tables.py` " \
               f"from `bench/results/{case}`.*\n"
    if case in BENCH_DIRS:
        return f"{BENCH_DIRS[case](cases.RESULTS / case)}\n\n*Generated by `python bench/tables.py` from `bench/results/{case}/`.*\n"
    if case == "results":  # docs/results.md: each paper's claims against the cases (bench/results_page.py)
        sys.path.insert(0, str(Path(__file__).parent))
        from results_page import results_page
        return f"{results_page()}\n\n*Generated by `python bench/tables.py` from the cases named in the last column " \
               "(bench/results_page.py: the claims, the paper's numbers and the verdict's rule).*\n"
    if case == "methods":  # from the algorithm classes, not from results (bench/methods_table.py)
        sys.path.insert(0, str(Path(__file__).parent))
        from methods_table import methods_table
        return methods_table()
    meta, runs = load_case(case)
    body = KINDS[meta["kind"]]({**meta, "case": meta.get("runs_of", case)}, runs)  # the folder of its logs
    if meta.get("partial"):  # a grid longer than a session, saved as it goes: the table says so itself
        body = f"**Partial case, not to be read yet**: {meta['partial']}.\n\n{body}"
    shown = f" (its seeds {', '.join(map(str, meta['seeds']))})" if meta.get("seeds") else ""
    return f"{body}\n\n*Generated by `python bench/tables.py` from `bench/results/{meta.get('runs_of', case)}/`{shown} ({meta['command']}; " \
           f"{meta['machine']}, {meta['date']}).*\n"


# -- docs -----------------------------------------------------------------------------------------
def render(text: str) -> str:
    return MARK.sub(lambda m: m.group(1) + table(m.group("case")) + m.group(4), text)


def data_seed_of(data_seed, seed: int):
    """The data seed a run of training seed ``seed`` split its data with (config.with_data_seed),
    from its config.yaml's ``data.seed``: a number, run, or a mapping {training seed: data seed}."""
    return seed if data_seed == "run" else data_seed.get(seed) if isinstance(data_seed, dict) else data_seed


def save(runs: list[Path], case: str, meta: dict) -> Path:
    """Finished runs' or compare folders' records, compressed, into bench/results/<case>/: one
    folder, or several of the same data (a sweep on one seed, its choice on more seeds; a committed
    case and the later seeds' run; their partition.json must agree). ``meta["methods"]``, when
    given, keeps those specs only."""
    out = cases.RESULTS / case
    tmp = out.with_name(f".{case}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    # a case splits the data once (data.seed a number: one partition.json, every run's the same) or
    # once per seed (data.seed run or a mapping, as the case's config.yaml, the first run's, says):
    # then each run's seeds must have used the case's data seed, and each seed keeps its own split
    case_seed = (yaml.safe_load((runs[0] / "config.yaml").read_text()).get("data") or {}).get("seed", 0)
    per_seed = case_seed == "run" or isinstance(case_seed, dict)
    partitions = {(r / "partition.json").read_text() for r in runs if (r / "partition.json").exists()}
    if len(partitions) > 1 and not per_seed:
        raise SystemExit(f"bench/tables.py --save: {', '.join(map(str, runs))} split the data differently "
                         "(partition.json): not one case")
    for run in runs:
        dirs = [p.parent for p in sorted(run.glob("seed*/*/results.json"))] or \
               [p.parent for p in sorted(run.glob("*/results.json"))]
        seed_of_run = int(re.search(r"^seed: (\d+)", (run / "config.yaml").read_text(), re.M).group(1))
        run_seed = (yaml.safe_load((run / "config.yaml").read_text()).get("data") or {}).get("seed", 0)
        for d in dirs:
            if meta.get("methods") and json.loads((d / "results.json").read_text())["method"] not in meta["methods"]:
                continue
            seed = d.parent.name if d.parent.name.startswith("seed") else f"seed{seed_of_run}"
            if per_seed and data_seed_of(run_seed, int(seed[4:])) != data_seed_of(case_seed, int(seed[4:])):
                raise SystemExit(f"bench/tables.py --save: {d} split the data with data seed "
                                 f"{data_seed_of(run_seed, int(seed[4:]))}, the case's config.yaml gives {seed} data "
                                 f"seed {data_seed_of(case_seed, int(seed[4:]))}: not this case's split")
            dest = tmp / seed / d.name
            if dest.exists():  # the same run given twice (a case and the run it was saved from): once, if equal
                if json.loads((dest / "results.json").read_text()) != json.loads((d / "results.json").read_text()):
                    raise SystemExit(f"bench/tables.py --save: {seed}/{d.name} is in two of the runs with other results")
                continue
            dest.mkdir(parents=True)
            if (d.parent / "partition.json").exists() and d.parent != run:  # a seed's own split (data.seed: run)
                shutil.copy(d.parent / "partition.json", tmp / seed / "partition.json")
            elif per_seed and (run / "partition.json").exists():  # a run of one data seed, the seed's split in a case of many
                shutil.copy(run / "partition.json", tmp / seed / "partition.json")
            # one line: a results.json holds every client's gates per module (thousands of pretty lines)
            (dest / "results.json").write_text(json.dumps(json.loads((d / "results.json").read_text())) + "\n")
            for name in ("metrics.jsonl", "server.jsonl"):
                if (d / name).exists():
                    with lzma.open(dest / f"{name}.xz", "wt", preset=9) as fh:
                        fh.write((d / name).read_text())
                elif (d / f"{name}.xz").exists():  # a committed case given as a run: later seeds merge into it
                    shutil.copy(d / f"{name}.xz", dest / f"{name}.xz")
    shutil.copy(runs[0] / "config.yaml", tmp / "config.yaml")
    if partitions and not per_seed:  # each client's data mixture (DeepFusion's premise table reads it)
        (tmp / "partition.json").write_text(partitions.pop())
    (tmp / "case.json").write_text(json.dumps(meta, indent=1) + "\n")
    if (out / "NOTES.md").exists():  # the case's diary of runs and readings, written by hand: kept
        shutil.copy(out / "NOTES.md", tmp / "NOTES.md")
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out


def unpack(case: str, run_dir: Path) -> Path:
    """A committed case back into a compare folder: its config.yaml, its partition.json (the grid's,
    or each seed's) and each finished run's results.json, metrics.jsonl and server.jsonl, so that ``comix compare
    --resume RUN_DIR`` skips those runs and trains only the rest. A grid longer than a session is
    saved with ``--save`` when the session stops (a work tree, and its ignored runs/, may not
    outlive it) and continued this way in the next."""
    src = cases.RESULTS / case
    if not (src / "config.yaml").exists():
        raise SystemExit(f"bench/tables.py --unpack: {src} is not a case (no config.yaml)")
    if run_dir.exists():
        raise SystemExit(f"bench/tables.py --unpack: {run_dir} exists; unpack into a new folder")
    tmp = run_dir.with_name(f".{run_dir.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    shutil.copy(src / "config.yaml", tmp / "config.yaml")
    if (src / "partition.json").exists():  # the grid's one split: a later --save of this folder keeps it
        shutil.copy(src / "partition.json", tmp / "partition.json")
    for f in src.glob("seed*/partition.json"):
        (tmp / f.parent.name).mkdir(exist_ok=True)
        shutil.copy(f, tmp / f.parent.name / "partition.json")
    for f in src.glob("seed*/*/results.json"):
        dest = tmp / f.parent.relative_to(src)
        dest.mkdir(parents=True)
        shutil.copy(f, dest / "results.json")
        for xz in f.parent.glob("*.jsonl.xz"):
            with lzma.open(xz, "rt") as fh:
                (dest / xz.name.removesuffix(".xz")).write_text(fh.read())
    tmp.rename(run_dir)
    return run_dir


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true", help="fail if a doc's generated table differs")
    ap.add_argument("--save", nargs="+", metavar="RUN [RUN ...] CASE",
                    help="copy finished runs (one case) into bench/results/CASE")
    ap.add_argument("--unpack", nargs=2, metavar=("CASE", "RUN_DIR"),
                    help="a committed case's finished runs into a new folder, for comix compare --resume")
    ap.add_argument("--meta", help="with --save: case.json as JSON (kind, command, machine, date, ...)")
    args = ap.parse_args(argv)
    if args.save:
        if len(args.save) < 2:
            ap.error("--save RUN [RUN ...] CASE")
        print(save([Path(r) for r in args.save[:-1]], args.save[-1], json.loads(args.meta or "{}")))
        return 0
    if args.unpack:
        print(unpack(args.unpack[0], Path(args.unpack[1])))
        return 0
    stale = []
    for doc in DOCS:
        text = doc.read_text()
        new = render(text)
        if new != text:
            # each block by name: the case whose table no longer matches its result files
            blocks = [m.group("case") for m in MARK.finditer(text) if m.group("body") != table(m.group("case"))]
            stale.append(f"{doc.relative_to(ROOT)} ({', '.join(blocks)})")
            if not args.check:
                doc.write_text(new)
    if args.check and stale:
        print(f"bench/tables.py: generated tables differ from their result files in {'; '.join(stale)}; "
              "run python bench/tables.py")
        return 1
    sys.path.insert(0, str(Path(__file__).parent))
    from quotes import stale_quotes  # the numbers quoted in prose (bench/quotes.py)
    if wrong := stale_quotes(DOCS):
        print("bench/tables.py: numbers quoted in prose differ from their files:\n  " + "\n  ".join(wrong))
        return 1
    print(("checked" if args.check else "wrote") + f" {sum(len(MARK.findall(d.read_text())) for d in DOCS)} tables")
    return 0


if __name__ == "__main__":
    sys.exit(main())
