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
docs/results.md's verdict per paper claim, made from the cases it names (bench/results_page.py). ``<!-- table: layer-speed.md -->``
(and ``layer-speed-full.md``, ``layer-speed-h200-bf16.md``) renders the result file bench/layer_speed.py writes;
``cohort-cpu-fp32.json`` bench/cohort.py's, and ``cohort-cpu-runs`` a folder of whole runs timed one
client at a time and in cohorts (``/usr/bin/time -v`` lines and each method's server.jsonl).
A case whose case.json names ``runs_of`` (another case) and ``methods`` holds no runs of its own:
it shows those methods of the other case's runs in its own kind (one run, several tables).
"""
from __future__ import annotations

import argparse
import json
import lzma
import re
import shutil
import statistics
import sys
from pathlib import Path

import yaml

from scipy.stats import t as student_t

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
MARK = re.compile(r"(<!-- table: (?P<case>[\w.-]+) -->\n)(?P<body>.*?)(<!-- end table -->)", re.S)

# DeepFusion's edge over FedKMT on open-ended QA (paper Table I, DeepSeek-MoE, log token perplexity:
# FedKMT minus DeepFusion): its smallest (N = 32) and at its smallest system (N = 16)
PAPER_EDGE = {"N = 32": 3.9811 - 3.9700, "N = 16": 3.9908 - 3.9697}


# -- reading a case -------------------------------------------------------------------------------
def _jsonl(path: Path) -> list[dict]:
    xz = path.with_name(path.name + ".xz")
    if xz.exists():
        with lzma.open(xz, "rt") as fh:
            return [json.loads(x) for x in fh.read().splitlines()]
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def load_case(case: str) -> tuple[dict, dict[str, dict[int, Path]]]:
    """(case.json, {spec: {seed: method folder}})."""
    folder = RESULTS / case
    if not (folder / "case.json").exists():
        raise SystemExit(f"bench/tables.py: no case {case!r} (bench/results/{case}/case.json is missing)")
    meta = json.loads((folder / "case.json").read_text())
    runs: dict[str, dict[int, Path]] = {}
    # ``runs_of``: this case is a view of another case's runs (one run, several papers' tables),
    # ``methods`` the specs it shows; how the runs were made is the source case's to say, so a
    # later seed merged into it updates every view's footnote
    if "runs_of" in meta:
        source = json.loads((RESULTS / meta["runs_of"] / "case.json").read_text())
        meta = {**meta, **{k: source[k] for k in ("command", "machine", "date")}}
    for res in sorted((RESULTS / meta.get("runs_of", case)).glob("seed*/*/results.json")):
        spec = json.loads(res.read_text())["method"]
        if spec in meta.get("methods", [spec]):
            runs.setdefault(spec, {})[int(res.parent.parent.name[4:])] = res.parent
    return meta, runs


def _result(d: Path) -> dict:
    return json.loads((d / "results.json").read_text())


def _mean_std(xs: list[float], digits: int = 2) -> str:
    return f"{statistics.fmean(xs):.{digits}f} ({statistics.pstdev(xs):.{digits}f})" if len(xs) > 1 else \
        f"{xs[0]:.{digits}f}"


def paired_interval(diffs: list[float]) -> tuple[float, float]:
    """(mean, half-width of the 95 % t interval) of paired differences over seeds."""
    mean = statistics.fmean(diffs)
    if len(diffs) < 2:
        return mean, float("nan")
    return mean, float(student_t.ppf(0.975, len(diffs) - 1)) * statistics.stdev(diffs) / len(diffs) ** 0.5


def seeds_to_resolve(sd: float, margin: float) -> int:
    """The fewest seeds whose 95 % t interval of a paired difference is narrower than +-``margin``
    at the seed-to-seed spread ``sd`` of that difference: from there on an edge of ``margin`` or
    more lies outside zero's interval."""
    n = 2
    while student_t.ppf(0.975, n - 1) * sd / n ** 0.5 >= margin:
        n += 1
    return n


def steps_to_close(first: float, last: float, span: float) -> float | None:
    """The KD steps, beyond a run's, for a gap to a reference (positive: behind it) to reach 0 if it
    kept the rate it closed at between the first and the last fifth of the run's steps (``span``
    steps apart, the fifths' centres): 0 when it has closed, None when it did not narrow. A
    straight line through two points: an estimate of the order, not a forecast."""
    if last <= 0:
        return 0.0
    if last >= first:
        return None
    return last * span / (first - last)


# -- table kinds ----------------------------------------------------------------------------------
def ablation_table(meta: dict, runs: dict[str, dict[int, Path]]) -> str:
    sys.path.insert(0, str(ROOT))
    from comix.comparison import assignment_churn
    ref = meta.get("reference", "fedamole")
    names = meta.get("names", {})
    seeds = sorted({s for by in runs.values() for s in by})
    order = [m for m in meta.get("order", []) if m in runs] + sorted(set(runs) - set(meta.get("order", [])))
    score = {m: {s: _result(d)["mean"] for s, d in by.items()} for m, by in runs.items()}
    rows = [f"| method | MTAL, mean (population std) over seeds | seed {' / '.join(map(str, seeds))} | "
            f"minus {names.get(ref, ref)}: mean, 95 % interval | experts new each round |",
            "|---|---|---|---|---|"]
    majority = _majority_label(meta, runs, seeds)
    if majority:  # the trivial baseline every row must beat before it is read
        rows.append(f"| *majority training label (trivial)* | {_mean_std(list(majority.values()))} | "
                    + " / ".join(f"{majority[s]:.2f}" if s in majority else "-" for s in seeds) + " | - | - |")
    for m in order:
        by = score[m]
        per_seed = " / ".join(f"{by[s]:.2f}" if s in by else "-" for s in seeds)
        common = [s for s in seeds if s in by and s in score.get(ref, {})]
        if m == ref or not common:
            diff = "-"
        else:
            mean, half = paired_interval([by[s] - score[ref][s] for s in common])
            diff = f"{mean:+.2f} [{mean - half:+.2f}, {mean + half:+.2f}]" if len(common) > 1 else \
                f"{mean:+.2f} (one seed: no interval)"
        churn = [c for d in runs[m].values() for c in assignment_churn(_jsonl(d / "server.jsonl"))]
        churn_cell = f"{statistics.fmean(churn):.2f}" if churn and all(c == c for c in churn) else "-"
        rows.append(f"| {names.get(m, m)} | {_mean_std(list(by.values()))} | {per_seed} | {diff} | {churn_cell} |")
    # the paper's gap to ``reference`` for some rows (case.json's "paper_gaps", points): the seeds
    # this case's spread of the paired difference needs before a 95 % interval could resolve it
    for m, gap in meta.get("paper_gaps", {}).items():
        common = [s for s in seeds if s in score.get(m, {}) and s in score.get(ref, {})]
        if len(common) > 1:
            sd = statistics.stdev(score[m][s] - score[ref][s] for s in common)
            rows += ["", f"The paper puts {names.get(ref, ref)} {gap:.2f} points ahead of {names.get(m, m)}; at this "
                     f"case's spread of that difference (sample std {sd:.2f} over {len(common)} seeds), a 95 % interval "
                     f"narrower than that gap needs {seeds_to_resolve(sd, gap)} seeds."]
    if majority:
        from comix.comparison import one_label_share
        shares = {m: [x for d in runs[m].values() if (x := one_label_share(_result(d))) is not None] for m in order}
        if any(shares.values()):  # runs from before the predictions were counted have none
            rows += ["", "Clients whose model answers every test example with one label (%), mean over seeds: "
                     + ", ".join(f"{names.get(m, m)} {statistics.fmean(v):.0f}" for m, v in shares.items() if v) + "."]
    return "\n".join(rows)


def _majority_label(meta: dict, runs: dict[str, dict[int, Path]], seeds: list[int]) -> dict[int, float]:
    """Per seed, the clients' majority-training-label accuracy (comparison.majority_label_accuracy)
    from the seed's partition.json (or the case's one partition)."""
    from comix.comparison import majority_label_accuracy
    case = RESULTS / meta["case"]
    out = {}
    for s in seeds:
        for path in (case / f"seed{s}" / "partition.json", case / "partition.json"):
            if path.exists():
                acc = majority_label_accuracy(json.loads(path.read_text()))
                if acc is not None:
                    out[s] = acc
                break
    return out


def users_table(meta: dict, runs: dict[str, dict[int, Path]]) -> str:
    order = [m for m in meta.get("order", []) if m in runs] + sorted(set(runs) - set(meta.get("order", [])))
    results = {m: [_result(d) for d in by.values()] for m, by in runs.items()}
    key = next(iter(results.values()))[0]["metric"]
    users = list(next(iter(results.values()))[0]["per_user"])
    rows = ["| method | " + " | ".join(users) + " | mean |", "|---" * (len(users) + 2) + "|"]
    for m in order:
        cells = [f"{statistics.fmean(r['per_user'][u][key] for r in results[m]):.2f}" for u in users]
        rows.append(f"| {meta.get('names', {}).get(m, m)} | " + " | ".join(cells)
                    + f" | {statistics.fmean(r['mean'] for r in results[m]):.2f} |")
    return "\n".join(rows)


def quant_table(meta: dict, runs: dict) -> str:
    """bench/quant.py's main job at each base precision: the process's peak RSS and wall time, one
    device's frozen base and training memory (metrics.jsonl), each method's mean test perplexity
    and its change from the full-precision base."""
    methods = meta["methods"]
    rows = ["| base | peak RSS MB | wall s | base MB / device | training MB / device (max) | "
            + " | ".join(f"{m} ppl (vs none)" for m in methods) + " |", "|---" * (5 + len(methods)) + "|"]
    means = {}
    for quant, case in meta["runs"].items():
        _, sub = load_case(case)
        results = {m: _result(next(iter(sub[m].values()))) for m in methods}
        first = _jsonl(next(iter(sub[methods[0]].values())) / "metrics.jsonl")[0]
        means[quant] = {m: r["mean"] for m, r in results.items()}
        cells = [f"{means[quant][m]:.2f} ({100 * (means[quant][m] / means['none'][m] - 1):+.1f} %)" for m in methods]
        memory = max(r["devices"]["memory_mb_max"] for r in results.values())
        rows.append(f"| {quant} | {meta['measures'][quant]['peak_rss_mb']:.0f} | {meta['measures'][quant]['wall_s']:.0f} | "
                    f"{first['base_mb']:.0f} | {memory:.0f} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def compare_table(meta: dict, runs: dict[str, dict[int, Path]]) -> str:
    """Methods side by side over seeds: the mean over users of the run's metric, mean (std) over
    seeds and per seed, the paired difference from ``reference`` with a 95 % t interval, and
    what a client spends: bytes it uploads a round (mean over the rounds it took part in) and the
    parameters it trains (metrics.jsonl's ``trainable_mb`` / 16 bytes: fp32 weight, gradient and
    AdamW's two moments)."""
    ref, names = meta["reference"], meta.get("names", {})
    seeds = sorted({s for by in runs.values() for s in by})
    order = [m for m in meta.get("order", []) if m in runs] + sorted(set(runs) - set(meta.get("order", [])))
    score = {m: {s: _result(d)["mean"] for s, d in by.items()} for m, by in runs.items()}
    metric = _result(next(iter(runs[order[0]].values())))["metric"].replace("_", " ")
    rows = [f"| method | {metric}, mean (population std) over seeds | seed {' / '.join(map(str, seeds))} | minus "
            f"{names.get(ref, ref)}: mean, 95 % interval | bytes up per client and round | trained per client |",
            "|---|---|---|---|---:|---:|"]
    for m in order:
        by = score[m]
        common = [s for s in seeds if s in by and s in score[ref]]
        if m == ref or len(common) < 2:
            diff = "-"
        else:
            mean, half = paired_interval([by[s] - score[ref][s] for s in common])
            diff = f"{mean:+.2f} [{mean - half:+.2f}, {mean + half:+.2f}]"
        trained = [r for d in runs[m].values() for r in _jsonl(d / "metrics.jsonl") if r.get("sampled")]
        up = statistics.fmean(r["bytes_up"] for r in trained) if trained else 0
        params = max((r.get("trainable_mb", 0) for r in trained), default=0) * 2**20 / 16
        rows.append(f"| {names.get(m, m)} | {_mean_std(list(by.values()))} | "
                    f"{' / '.join(f'{by[s]:.2f}' if s in by else '-' for s in seeds)} | {diff} | "
                    f"{up / 2**20:.2f} MB | {params / 1e6:.2f} M |")
    return "\n".join(rows)


def fleet_table(meta: dict, runs: dict) -> str:
    """bench/fleet.py: a job on a fleet (quant=auto: each device the base precision its budget
    fits; and, where the case has it, the same with micro_batches=auto: its batches sliced first)
    beside the same job with every device unconstrained; per method, plan and device profile, the
    base precision and slices the plan gave, the largest training memory against the budget, a
    device's seconds a round at its profile's speed, and its devices' mean perplexity both ways; a
    plan comix refused (a device nothing fits) gives its one line instead."""
    from collections import Counter
    sys.path.insert(0, str(ROOT))
    from comix.fleet import load_fleet
    budget = {p.name: p.memory_mb for p in load_fleet(meta["fleet"]).profiles}
    free = load_case(meta["runs"]["unconstrained"])[1]
    refused = {part: m["refused"] for part, m in meta["measures"].items() if "refused" in m}
    plans = [(part, None if part in refused else load_case(case)[1]) for part, case in meta["runs"].items()
             if part != "unconstrained"]
    label = {"fleet": "quant=auto", "sliced": "quant=auto, micro_batches=auto"}
    rows = ["| method | plan | devices | base, slices | training MB, max (budget) | device s a round | mean test ppl: "
            "fleet | unconstrained | cost |", "|---|---|---|---|---:|---:|---:|---:|---:|"]
    for m in meta["methods"]:
        off = _result(next(iter(free[m].values())))
        for j, (part, fleet) in enumerate(plans):
            if fleet is None:  # the plan refused the run before anything trained
                why = refused[part] if f" for {m}:" in refused[part] else "the run stopped at an earlier method"
                rows.append(f"| {meta.get('names', {}).get(m, m) if j == 0 else ''} | {label.get(part, part)} | "
                            f"refused before training: {why} | | | | | | |")
                continue
            on = _result(next(iter(fleet[m].values())))
            trained = [r for r in _jsonl(next(iter(fleet[m].values())) / "metrics.jsonl") if r.get("sampled")]
            groups = list(dict.fromkeys(r["profile"] for r in trained)) + ["all"]
            for i, p in enumerate(groups):
                mine = [r for r in trained if p in ("all", r["profile"])]
                users = list(dict.fromkeys(r["user"] for r in mine))
                a, b = (statistics.fmean(res["per_user"][u][on["metric"]] for u in users) for res in (on, off))
                how = Counter(next((r["quant"], r.get("micro_batches", 1)) for r in mine if r["user"] == u) for u in users)
                cap = f" ({budget[p]:.0f})" if p in budget else ""
                rows.append(f"| {meta.get('names', {}).get(m, m) if i == j == 0 else ''} | "
                            f"{label.get(part, part) if i == 0 else ''} | {p} ({len(users)}) | "
                            f"{' / '.join(f'{q}{_slices(k)} x{n}' for (q, k), n in how.items())} | "
                            f"{max(r['memory_mb'] for r in mine):.0f}{cap} | {statistics.fmean(r['device_s'] for r in mine):.1f} | "
                            f"{a:.2f} | {b:.2f} | {100 * (a / b - 1):+.1f} % |")
    return "\n".join(rows)


def privacy_table(meta: dict, runs: dict[str, dict[int, Path]]) -> str:
    """Client-level DP: per method spec (in ``order``), its clip and noise multiplier (the spec's
    ``privacy.*`` options), the epsilon its accountant reached by the last round (server.jsonl;
    delta from the config) and its mean test perplexity, one seed or mean over seeds."""
    sys.path.insert(0, str(ROOT))
    from comix.specs import split_spec
    names = meta.get("names", {})
    order = [m for m in meta.get("order", []) if m in runs] + sorted(set(runs) - set(meta.get("order", [])))
    delta = re.search(r"^\s*delta: ([\d.e-]+)", (RESULTS / meta["case"] / "config.yaml").read_text(), re.M)
    rows = [f"| method | clip | noise multiplier | epsilon (delta {float(delta[1]) if delta else 1e-5:g}) | "
            "mean test perplexity |", "|---|---|---|---|---|"]
    for m in order:
        name, pieces = split_spec(m)
        options = dict(p.split("=", 1) for p in pieces)
        eps = [next((r["epsilon"] for r in reversed(_jsonl(d / "server.jsonl")) if "epsilon" in r), None)
               for d in runs[m].values()]
        ppl = statistics.fmean(_result(d)["mean"] for d in runs[m].values())
        shown = f"{ppl:.2f}" if ppl < 1e4 else f"{ppl:.1e}".replace("e+0", "e").replace("e+", "e")
        rows.append(f"| {names.get(name, name)} | {options.get('privacy.clip', '-')} | "
                    f"{options.get('privacy.noise_multiplier', '-')} | "
                    f"{'no DP' if eps[0] is None else f'{statistics.fmean(eps):.3g}'} | {shown} |")
    return "\n".join(rows)


def settings_table(meta: dict, runs: dict) -> str:
    """CoMiGS Table 1 across settings (bench/reproduce.py): per method, each setting's mean test
    perplexity over users, mean (std) over seeds, from the setting's own case."""
    sub = {setting: load_case(case)[1] for setting, case in meta["cases"].items()}
    order = meta.get("order") or list(next(iter(sub.values())))
    rows = ["| method | " + " | ".join(sub) + " |", "|---" * (len(sub) + 1) + "|"]
    for m in order:
        cells = [_mean_std([_result(d)["mean"] for d in by[m].values()]) if m in by else "-" for by in sub.values()]
        rows.append(f"| {meta.get('names', {}).get(m, m)} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def global_table(meta: dict, runs: dict[str, dict[int, Path]]) -> str:
    """Global models scored on the server's test domains (DeepFusion and its baselines): per
    method (``order``) and the dense base before distillation, the mean over domains of the answer
    log perplexity (the paper's), the stream log perplexity, the generated answers' accuracy (%)
    and the teacher-forced token accuracy (%), mean (std) over seeds."""
    res = {m: [_result(d) for d in by.values()] for m, by in runs.items()}
    order = [m for m in meta.get("order", []) if m in runs] + sorted(set(runs) - set(meta.get("order", [])))
    cols = (("answer_log_ppl", 3, "answer log perplexity"), ("log_ppl", 3, "stream log perplexity"),
            ("answer_acc", 2, "generated-answer accuracy %"), ("token_acc", 2, "token accuracy %"))
    rows = ["| method | " + " | ".join(c[2] for c in cols) + " |", "|---" * (len(cols) + 1) + "|"]
    first = res[order[0]]
    for label, results, prefix in [("dense base (before distillation)", first, "test_base_"),
                                   *((meta.get("names", {}).get(m, m), res[m], "test_") for m in order)]:
        cells = []
        for key, digits, _ in cols:
            per_seed = [[row[prefix + key] for row in r["per_user"].values() if prefix + key in row] for r in results]
            cells.append(_mean_std([statistics.fmean(xs) for xs in per_seed], digits) if all(per_seed) else "-")
        rows.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def costs_table(meta: dict, runs: dict[str, dict[int, Path]]) -> str:
    """FedAMoLE Table IV from a case's logs (comix/comparison.py ``overhead_table``): per client
    and round, trainable state, upload / download, training, aggregation (RSEA in it) and test time."""
    sys.path.insert(0, str(ROOT))
    from comix.comparison import overhead_table
    order = [m for m in meta.get("order", []) if m in runs] + sorted(set(runs) - set(meta.get("order", [])))
    seeds = sorted({s for by in runs.values() for s in by})
    table = overhead_table(RESULTS / meta["case"], order, seeds)
    for m in order:  # the case's display names
        table = table.replace(f"| {m} |", f"| {meta.get('names', {}).get(m, m)} |")
    return table


def _slices(k: int) -> str:
    return f", {k} slices" if k > 1 else ""


def same_devices(run: Path, ref: Path) -> None:
    """A pair of one-shot runs on one seed reads the same devices: each client whose two runs
    trained it for the same steps uploaded the same weights (``upload_digest`` in metrics.jsonl;
    runs logged before it was, and a control with other device steps, are not compared). A device
    trained again in another session, its cache lost, pairs only if it came out bit for bit equal."""
    def devices(d: Path) -> dict[str, tuple]:
        return {r["user"]: (r.get("device_steps"), r["upload_digest"]) for r in _jsonl(d / "metrics.jsonl")
                if "upload_digest" in r}
    mine, theirs = devices(run), devices(ref)
    for user in mine.keys() & theirs.keys():
        if mine[user][0] == theirs[user][0] and mine[user][1] != theirs[user][1]:
            raise ValueError(f"bench/tables.py: {run} and {ref} pair on one seed but {user}'s device differs "
                             f"(upload_digest {mine[user][1]} against {theirs[user][1]})")


def deepfusion_table(meta: dict, runs: dict[str, dict[int, Path]]) -> str:
    """DeepFusion against its baselines with VAA's weight chosen on the server's validation
    documents (``valid_*``, never test): (1) the sweep: each swept spec's validation and test
    score, the feature term's share of the student's gradient norm and the cosine of its gradient
    with CE + KL's (server.jsonl ``kd[..]["grad"]``), its KD CE and KL minus the reference's on the
    same batches early and late in each domain's steps, and its feature loss then; (2) test per
    domain, mean (std) over seeds, the chosen spec standing for every swept one, the dense base
    before distillation as a row;
    (3) each method minus ``reference`` (FedKMT), paired over seeds, with a 95 % interval per domain
    and overall; (4) the premise: each device's log perplexity per character on its own dominant
    domain (partition.json) against the student's, from the reference's server.jsonl; (5) per
    domain, the teachers' mean and best edge there beside what the reference moved from the dense
    base and what the chosen spec moved beyond the reference; (6) what more weight and more steps
    would take: each swept spec's test score minus the reference's per percentage point of its
    gradient share, and the rate at which its KD CE gap to the reference closes (``steps_to_close``)."""
    ref, names, sweep = meta.get("reference", "fedkmt"), meta.get("names", {}), meta["sweep"]
    res = {m: {s: _result(d) for s, d in by.items()} for m, by in runs.items()}
    seeds = sorted({s for by in res.values() for s in by})
    domains = list(next(iter(res[ref].values()))["per_user"])
    # the paper's QA perplexities score the answers given their questions (docs/deepfusion.md)
    qa = all("test_answer_log_ppl" in r["per_user"][d] for by in res.values() for r in by.values() for d in domains)
    key = "answer_log_ppl" if qa else "log_ppl"
    what = "answer log perplexity" if qa else "log perplexity"

    def score(r: dict, split: str = "test", domain: str | None = None) -> float:
        return r["per_user"][domain][f"{split}_{key}"] if domain else \
            statistics.fmean(r["per_user"][d][f"{split}_{key}"] for d in domains)

    def grad(m: str) -> tuple[float | None, float | None]:
        """The feature term's mean share of the student's gradient norm and its gradient's cosine with CE + KL's."""
        rows = [g for d in runs[m].values() for kd in _jsonl(d / "server.jsonl")[0]["kd"] if (g := kd.get("grad"))]
        share = [x[1] for g in rows for x in g["fm"]]
        cos = [x for g in rows for x in g["cos_fm_rest"]]
        return (statistics.fmean(share) if share else None, statistics.fmean(cos) if cos else None)

    def fifth_means(m: str, term: str, minus_ref: bool = True) -> tuple[float, float, float] | None:
        """The spec's KD term (minus the reference's on the same batches: the batch RNG is shared), in
        the first and the last fifth of each domain's steps, averaged over domains and seeds, and the
        steps between the two fifths' centres: does the gap close with more steps? does the feature
        loss fall further with more weight on it?"""
        first, last, span = [], [], []
        for s, d in runs[m].items():
            if minus_ref and s not in runs[ref]:
                continue
            kd = _jsonl(d / "server.jsonl")[0]["kd"]
            for a, b in zip(kd, _jsonl(runs[ref][s] / "server.jsonl")[0]["kd"] if minus_ref else kd):
                xs = [u - v for u, v in zip(a["steps"][term], b["steps"][term])] if minus_ref else a["steps"][term]
                fifth = max(1, len(xs) // 5)
                first.append(statistics.fmean(xs[:fifth]))
                last.append(statistics.fmean(xs[-fifth:]))
                span.append(len(xs) - fifth)
        return (statistics.fmean(first), statistics.fmean(last), statistics.fmean(span)) if first else None

    def fifths(m: str, term: str, minus_ref: bool = True) -> tuple[str, str]:
        sign = "+" if minus_ref else ""
        got = fifth_means(m, term, minus_ref)
        return (f"{got[0]:{sign}.3f}", f"{got[1]:{sign}.3f}") if got else ("-", "-")

    def label(m: str, mine: list[int] | None = None) -> str:
        """The spec's name, with its seeds (``mine``: those it ran) where they are fewer than the
        case's: a mean over other seeds than its neighbours' says so in its row."""
        mine = sorted(res[m]) if mine is None else mine
        return names.get(m, m) + ("" if mine == seeds else
                                  f" (seed{'s' if len(mine) > 1 else ''} {', '.join(map(str, mine))})")

    # on the seeds every swept spec ran (a sweep may run on one seed, the chosen spec on all)
    shared = sorted(set.intersection(*(set(res[m]) for m in sweep)))
    valid = all(f"valid_{key}" in r["per_user"][d] for m in sweep for r in res[m].values() for d in domains)
    if len(sweep) == 1:  # one DeepFusion spec, its weight fixed before the run: nothing to choose
        chosen = sweep[0]
        said = f"One DeepFusion spec, {names.get(chosen, chosen)}, fixed before the run (no sweep, nothing chosen)."
    else:
        chosen = min(sweep, key=lambda m: statistics.fmean(score(res[m][s], "valid") for s in shared))
        said = (f"Chosen on the server's validation documents: {names.get(chosen, chosen)} (the lowest mean validation "
                f"{what} over seed{'s' if len(shared) > 1 else ''} {', '.join(map(str, shared))}; test played no part).")
    out = [said, "",
           f"| swept | validation {what}, mean (population std) | test {what}, mean (population std) | feature term's share of the "
           f"student's gradient | cosine of its gradient with CE + KL's | KD's CE minus {names.get(ref, ref)}'s on "
           "the same batches, first / last fifth of the steps | KL minus its, first / last fifth | feature loss FM, "
           "first / last fifth |",
           "|---|---|---|---:|---:|---:|---:|---:|"]
    grads = {m: grad(m) for m in sweep}  # server.jsonl read once a spec: the last table uses the shares again
    for m in sweep:
        share, cos = grads[m]
        on_valid = _mean_std([score(r, "valid") for r in res[m].values()], 3) if valid else "-"
        out.append(f"| {label(m)}{' (chosen)' if m == chosen and len(sweep) > 1 else ''} | {on_valid} | "
                   f"{_mean_std([score(r) for r in res[m].values()], 3)} | "
                   f"{'-' if share is None else f'{share:.3f}'} | {'-' if cos is None else f'{cos:+.3f}'} | "
                   + " / ".join(fifths(m, "ce")) + " | " + " / ".join(fifths(m, "kl")) + " | "
                   + " / ".join(fifths(m, "fm", minus_ref=False)) + " |")
    order = [m for m in meta.get("order", runs) if m in runs]
    first_swept = next(i for i, m in enumerate(order) if m in sweep)
    order = [m for m in order[:first_swept] if m not in sweep] + [chosen] + \
            [m for m in order[first_swept:] if m not in sweep]
    out += ["", f"Test {what} per domain, mean (population std) over seeds {', '.join(map(str, seeds))}:", "",
            "| method | " + " | ".join(domains) + " | mean | generated-answer accuracy % | stream log perplexity |",
            "|---" * (len(domains) + 4) + "|"]
    # the dense base is the same student on the same test split whatever the teachers: each seed's
    # from the reference's run, else from the first method that ran that seed (a control ahead of it)
    scored = {s: next(res[m][s] for m in [ref, *order] if s in res[m]) for s in seeds}
    base = {s: {"per_user": {d: {f"test_{k}": v for k, v in ((k[len("test_base_"):], v) for k, v in row.items()
                                                             if k.startswith("test_base_"))}
                             for d, row in r["per_user"].items()}} for s, r in scored.items()}
    for row_name, by in [("dense base (before distillation)", base), *((label(m), res[m]) for m in order)]:
        has_acc = all("test_answer_acc" in r["per_user"][d] for r in by.values() for d in domains)
        acc = [statistics.fmean(r["per_user"][d]["test_answer_acc"] for d in domains) for r in by.values()] \
            if has_acc else []
        stream = [statistics.fmean(r["per_user"][d]["test_log_ppl"] for d in domains) for r in by.values()]
        out.append(f"| {row_name} | " + " | ".join(_mean_std([score(r, domain=d) for r in by.values()], 3) for d in domains)
                   + f" | {_mean_std([score(r) for r in by.values()], 3)} | "
                   + (_mean_std(acc) if acc else "-") + f" | {_mean_std(stream, 3)} |")
    out += ["", f"Minus {names.get(ref, ref)}, paired over seeds: mean [95 % interval] of the test {what} "
            "(negative: better than it):", "",
            "| method | " + " | ".join(domains) + " | mean |", "|---" * (len(domains) + 2) + "|"]
    for m in order:
        if m == ref:
            continue
        common = [s for s in seeds if s in res[m] and s in res[ref]]
        if not common:  # its seeds are not the reference's yet (a control ahead of it): nothing to pair
            out.append(f"| {names.get(m, m)} (no seed shared with {names.get(ref, ref)}) | "
                       + " | ".join("-" for _ in (*domains, None)) + " |")
            continue
        for s in common:
            same_devices(runs[m][s], runs[ref][s])
        cells = []
        for d in (*domains, None):
            mean, half = paired_interval([score(res[m][s], domain=d) - score(res[ref][s], domain=d) for s in common])
            cells.append(f"{mean:+.3f} [{mean - half:+.3f}, {mean + half:+.3f}]" if len(common) > 1 else f"{mean:+.3f}")
        out.append(f"| {label(m, common)} | " + " | ".join(cells) + " |")  # the seeds of its pairs
    # how many seeds the paper's margin needs at the spread these seeds show
    common = [s for s in seeds if s in res[chosen] and s in res[ref]]
    if len(common) > 1:
        sd = statistics.stdev(score(res[chosen][s]) - score(res[ref][s]) for s in common)
        need = {edge: seeds_to_resolve(sd, edge) for edge in PAPER_EDGE.values()}
        out += ["", f"At the seed-to-seed spread of {names.get(chosen, chosen)} minus {names.get(ref, ref)} on the mean "
                f"(sample std {sd:.4f} over {len(common)} seeds), the seeds a 95 % interval needs to be narrower than the "
                "paper's edge over FedKMT (Table I, open-ended QA): "
                + ", ".join(f"{need[edge]} for its {n} edge ({edge:.3f} nats)" for n, edge in PAPER_EDGE.items()) + "."]
    case = RESULTS / meta["case"]
    mixtures = {}  # per seed: its own split (data.seed run or a mapping), else the case's one partition
    for s in runs[ref]:
        part = next((p for p in (case / f"seed{s}" / "partition.json", case / "partition.json") if p.exists()), None)
        mixtures[s] = json.loads(part.read_text()) if part else {}
    out += ["", "The premise: each device's log perplexity per character (nats) on its own dominant domain against "
            "the student's before distillation (lower is better), and the same on the public text the distillation "
            "runs on: its own domain's public stream, where a teacher must know more than the student for KD to "
            "help, and all streams pooled ('-' where the run did not measure it):", "",
            "| seed | device | model | dominant domain (share) | device | student | device minus student | "
            "public text of that domain: device | student | device minus student | public text pooled: device "
            "minus student |",
            "|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    gaps: dict[str, list[float]] = {d: [] for d in domains}  # device minus student on its own domain
    owners: dict[str, set[tuple[int, int]]] = {d: set() for d in domains}  # (seed, device) dominant in it
    for s in sorted(runs[ref]):  # the trained devices' premise, as the reference's run measured it
        row = _jsonl(runs[ref][s] / "server.jsonl")[0]
        known = row.get("in_domain", {})
        for i, (c, model) in enumerate(zip(row["clients"], row["devices"])):
            mix = mixtures[s].get(f"client{c}", {}).get("mixture")
            if not mix or str(c) not in known.get("devices", {}):
                continue
            dom = max(mix, key=mix.get)
            dev, stu = known["devices"][str(c)][dom], known["student"][dom]
            gaps.setdefault(dom, []).append(dev - stu)
            owners.setdefault(dom, set()).add((s, c))
            pub = known.get("public", {})
            p_dev, p_stu = pub.get("devices", {}).get(str(c), {}), pub.get("student", {})
            on_public = f"{p_dev[dom]:.4f} | {p_stu[dom]:.4f} | {p_dev[dom] - p_stu[dom]:+.4f}" \
                if dom in p_dev else "- | - | -"
            on_public += f" | {p_dev['all'] - p_stu['all']:+.4f}" if "all" in p_dev else " | -"
            out.append(f"| {s if i == 0 else ''} | client{c} | {model} | {dom} ({mix[dom]:.2f}) | {dev:.4f} | "
                       f"{stu:.4f} | {dev - stu:+.4f} | {on_public} |")
    # where the teachers know their domain better than the student, does distillation (and VAA
    # beyond the logits) gain more there? The premise set beside what each method moved, per domain.
    out += ["", f"Per domain: the teachers' edge (device minus student above; negative: the device knows the domain "
            f"better) beside what distillation moved on it (test {what}, means over the seeds):", "",
            f"| domain | devices dominant in it (a seed, mean over the seeds) | their mean edge | best edge | {names.get(ref, ref)} minus the dense "
            f"base | {names.get(chosen, chosen)} minus {names.get(ref, ref)} |", "|---|---:|---:|---:|---:|---:|"]
    both = [s for s in seeds if s in res[chosen] and s in res[ref]]
    for d in domains:
        g = gaps.get(d, [])
        moved = statistics.fmean(score(r, domain=d) - base[s]["per_user"][d][f"test_{key}"] for s, r in res[ref].items())
        vaa = statistics.fmean(score(res[chosen][s], domain=d) - score(res[ref][s], domain=d) for s in both)
        out.append(f"| {d} | {len(owners.get(d, ())) / max(1, len(runs[ref])):.3g} | " + (f"{statistics.fmean(g):+.4f} | {min(g):+.4f}" if g else "- | -")
                   + f" | {moved:+.3f} | {vaa:+.3f} |")
    # what more weight and more steps would take: the cost of each point of the feature term's
    # gradient share on test, and whether KD's CE gap to the reference closes as the steps go on
    out += ["", f"What more weight and more steps would take (each swept spec against {names.get(ref, ref)} on the "
            "seeds both ran; the steps a straight line through the first and last fifth gives, an order of "
            "magnitude):", "",
            f"| swept | feature term's share of the student's gradient | test {what} minus {names.get(ref, ref)} | "
            f"per percentage point of that share | KD's CE minus {names.get(ref, ref)}'s, change per 100 KD steps | "
            "KD steps more a domain for that gap to close at that rate |", "|---|---:|---:|---:|---:|---:|"]
    for m in sweep:
        share, _ = grads[m]
        common = [s for s in seeds if s in res[m] and s in res[ref]]
        diff = statistics.fmean(score(res[m][s]) - score(res[ref][s]) for s in common)
        ce = fifth_means(m, "ce")
        close = steps_to_close(*ce) if ce else None
        out.append(f"| {label(m)} | " + ("-" if share is None else f"{share:.3f}") + f" | {diff:+.3f} | "
                   + ("-" if not share else f"{diff / (100 * share):+.4f}") + " | "
                   + ("-" if not ce else f"{100 * (ce[1] - ce[0]) / ce[2]:+.4f}") + " | "
                   + ("-" if not ce else "none: it widens" if close is None else f"{close:.0f}") + " |")
    return "\n".join(out)


KINDS = {"ablation": ablation_table, "users": users_table, "quant": quant_table, "compare": compare_table,
         "fleet": fleet_table, "deepfusion": deepfusion_table, "privacy": privacy_table,
         "settings": settings_table, "global": global_table, "costs": costs_table}


def layer_speed_table(text: str) -> str:
    """bench/layer_speed.py's result file: per model, the mixture's training step over one plain
    LoRA's (run 1 / run 2, compiled and eager), then per MLP block compiled / eager / naive (run 1)."""
    rows, sections = [], re.findall(r"^(\S.*?): one LoRA r=\d+.*\n((?:    n=.*\n?)+)", text, re.M)
    shape = re.search(r"whole model (\d+)x(\d+)", text) or re.search(r"batch (\d+)x(\d+)", text)
    block = re.search(r"blocks (\d+)x(\d+)", text) or shape
    ns = sorted({int(n) for _, lines in sections for n in re.findall(r"n=(\d+)", lines)})
    ratio = {(name, int(n), kind): (float(a), float(b)) for name, lines in sections
             for n, kind, a, b in re.findall(r"n=(\d+) (\w+)\s+/ LoRA: ([\d.]+)\s+([\d.]+)", lines)}
    for name, _ in sections:
        if name.endswith("step"):
            label = name.replace("GPT-2-124M", "GPT-2-124M shapes")
            for kind, shown in (("compiled", "compiled"), ("fused", "eager")):
                cells = [" / ".join(f"{x:.2f}" for x in ratio[name, n, kind]) if (name, n, kind) in ratio else ""
                         for n in ns]
                rows.append(f"| {label} ({shape[1]} x {shape[2]}), {shown} | " + " | ".join(cells) + " |")
    for name, _ in sections:
        if name.endswith("block"):
            cells = [" / ".join(f"{ratio[name, n, k][0]:.2f}" for k in ("compiled", "fused", "naive"))
                     if (name, n, "naive") in ratio else "" for n in ns]
            rows.append(f"| {name.replace(' block', ' MLP block')} ({block[1]} x {block[2]} rows), compiled / eager / "
                        "naive (run 1) | " + " | ".join(cells) + " |")
    return "\n".join(["| | " + " | ".join(f"n = {n}" for n in ns) + " |", "|---" * (len(ns) + 1) + "|", *rows])


def vaa_attribution_table(text: str) -> str:
    """bench/vaa_attribution.py's result file: per run (alpha, VAA's lr, VAA's warm-up steps), the
    feature loss FM at the first and last joint step; the sums over the steps of each step's change
    in FM on its batch made by the student's update (VAA held at its weights before the step), by
    VAA's (the student held), by both, and of CE's change on the batch by the student's update (and
    the student's share in the first and the last quarter of the steps); on
    the held-out batches, FM under the final VAA with the final student minus with the starting
    one (what the student's moves left), and CE's change."""
    r = json.loads(text)
    rows = []
    for run in r["runs"].values():
        steps, held = run["steps"], run["held_out"]
        total = {k: sum(s[k] for s in steps) for k in ("fm_by_student", "fm_by_vaa", "fm_by_both", "ce_by_student")}
        q = max(1, len(steps) // 4)  # does the student's part grow as VAA settles? its share early and late
        share = [sum(s["fm_by_student"] for s in part) / sum(s["fm_by_both"] for s in part)
                 for part in (steps[:q], steps[-q:])]
        rows.append(f"| {run['alpha']:g} | {run['feature_lr']:g} | {run['warmup']} | {steps[0]['fm']:.3f} / "
                    f"{steps[-1]['fm']:.3f} | {total['fm_by_student']:+.4f} | {total['fm_by_vaa']:+.4f} | "
                    f"{total['fm_by_both']:+.4f} | {total['fm_by_student'] / total['fm_by_both']:.1%} | "
                    f"{share[0]:.1%} / {share[1]:.1%} | "
                    f"{total['ce_by_student']:+.4f} | {held['fm_final'] - held['fm_start_student']:+.4f} | "
                    f"{held['ce_final'] - held['ce_start']:+.4f} |")
    return "\n".join([f"Teacher {r['spec']} (device cache file {r['teacher'][:12]}...), {r['steps']} joint KD steps a run "
                      f"from the same start and batches, seed {r['seed']}; {r['machine']}, {r['date']}, "
                      f"{r['seconds'] / 60:.0f} min.", "",
                      "| alpha | VAA's lr | VAA's warm-up steps | FM, first / last joint step | FM's change by the "
                      "student's updates (sum over the steps) | by VAA's updates | by both | the student's share | "
                      "its share, first / last quarter of the steps | "
                      "CE's change on the batch by the student's updates (sum) | held out: FM with the final student "
                      "minus with the starting one (final VAA) | held out: CE's change |",
                      "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|", *rows])


def cohort_table(text: str) -> str:
    """bench/cohort.py's result file: per adapter kind and cohort size, the step's time, training
    tokens/s (and over cohort 1's), FLOPs counted a step, the share of the measured GEMM rate (and of
    the card's nominal peak on CUDA), the mixture's step over plain LoRA's at that cohort size, and memory."""
    r = json.loads(text)
    nominal = r.get("nominal_peak_flops")
    cuda = r["device"] == "cuda"
    head = ["adapters", "cohort", "step (ms)", "tokens/s", "x cohort 1", "GFLOP a step", "MFU of the GEMM rate",
            *(["MFU of nominal peak"] if nominal else []), "mixture / LoRA step",
            "peak GPU memory (MB)" if cuda else "step peak (MB)" if "step_peak_mb" in r["results"][0] else "activations kept (MB)"]
    rows = []
    for x in r["results"]:
        step = " (CUDA graph)" if x.get("graph") else " (eager)" if cuda and x["cohort"] > 1 and "graph" in x else ""
        rows.append([x["adapters"], f"{x['cohort']}{step}", f"{x['step_s'] * 1e3:.1f}", f"{x['tokens_per_s']:,.0f}",
                     f"{x.get('speedup_tokens_per_s', 1.0):.2f}", f"{x['flops'] / 1e9:,.0f}", f"{x['mfu_gemm']:.1%}",
                     *([f"{x['mfu_nominal']:.1%}"] if nominal else []),
                     f"{x['step_over_lora']:.2f}" if "step_over_lora" in x else "",
                     f"{x['peak_mem_mb']:,.0f}" if cuda else f"{x.get('step_peak_mb', x.get('activation_mb')):,.0f}"])
    gemm = f"{r['gemm_peak_flops'] / 1e12:.2f} TFLOP/s" if r["gemm_peak_flops"] >= 1e12 else \
        f"{r['gemm_peak_flops'] / 1e9:.0f} GFLOP/s"
    return "\n".join([f"`{r['command']}`: {r['model']}, {r['precision']}, {r['rows']} x {r['seq']} tokens a client, "
                      f"median of {r['reps']} interleaved steps; {r['machine']}, torch {r['torch']}, {r['date']}; "
                      f"the GEMM rate measured there: {gemm}; the bench took {r['seconds'] / 60:.1f} min, peak RSS "
                      f"{r['peak_rss_mb'] / 1024:.1f} GB.", "",
                      "| " + " | ".join(head) + " |", "|---" * len(head) + "|",
                      *("| " + " | ".join(row) + " |" for row in rows)])


def cohort_runs_table(folder: Path) -> str:
    """bench/results/<folder>/: whole runs one client at a time and in cohorts, each a subfolder
    with /usr/bin/time -v's lines (time.txt) and per method its server.jsonl (xz): wall time, peak
    RSS, the rounds' training seconds and the evaluations' seconds summed over the methods."""
    rows = []
    for run in sorted(p for p in folder.iterdir() if p.is_dir()):
        timing = (run / "time.txt").read_text()
        command = re.search(r'Command being timed: "(.*)"', timing)[1]
        command = re.sub(r"\S*/(comix|configs)", r"\1", command.replace(" run_dir=/tmp/" + run.name.replace("-", "/"), ""))
        command = re.sub(r" run_dir=\S+", "", command)
        h, m, sec = ([0] + [float(x) for x in re.search(r"Elapsed.*: ([\d:.]+)", timing)[1].split(":")])[-3:]
        peak = int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", timing)[1]) / 2**20
        server = [json.loads(ln) for f in sorted(run.glob("*.server.jsonl.xz"))
                  for ln in lzma.open(f, "rt").read().splitlines()]
        train = sum(r.get("train_s", 0) for r in server)
        evals = sum(r.get("eval_s", 0) for r in server)
        rows.append(f"| `{command}` | {(h * 60 + m) * 60 + sec:.1f} | {peak:.1f} | {train:.2f} | {evals:.2f} |")
    return "\n".join(["| command | wall (s) | peak RSS (GB) | training, summed over rounds and methods (s) | "
                      "evaluation (s) |", "|---|---:|---:|---:|---:|", *rows])


BENCH_DIRS = {"cohort-cpu-runs": cohort_runs_table}  # a bench folder of whole runs, not a case


def device_export_table(text: str) -> str:
    """bench/device_export.py's result file: per user model, format and precision, the file's size,
    perplexity on the user's test split (and llama.cpp's, where it ran) against comix's own model,
    greedy tokens/s on the CPU and whether the greedy tokens equal comix's."""
    r = json.loads(text)
    rows = []
    for x in r["rows"]:
        size = "-" if x["file_bytes"] is None else f"{x['file_bytes'] / 1e6:,.1f}"
        ppl = f"{x['ppl']:.3f} ({100 * x['ppl_vs_comix']:+.2f} %)"
        if "llama_cpp_ppl" in x:
            ppl += f"; llama.cpp {x['llama_cpp_ppl']:.3f}"
        speed = f"{x['tokens_per_s']:.1f}" if "tokens_per_s" in x else "-"
        same = {True: "yes", False: "no"}.get(x.get("greedy_equals_comix"), "-") if x["format"] != "comix" else ""
        export = f"{x['export_s']:.0f}" if "export_s" in x else "-"
        where = {"comix": "PyTorch (comix)", "executorch": f"ExecuTorch, XNNPACK {x.get('xnnpack') or ''}".strip(),
                 "gguf": "GGUF" + (" (llama.cpp)" if "llama_cpp_ppl" in x else " (transformers' reader)")}[x["format"]]
        rows.append(f"| {x['method']} | {where} | {x['precision']} | {size} | {ppl} | {speed} | {same} | {export} |")
    llama = f", llama-cpp-python {r['llama_cpp']}" if r.get("llama_cpp") else ", llama.cpp not installed"
    return "\n".join([f"`{r['command'].strip()}`: {r['base']}, user {r['user']}, perplexity over the test split in "
                      f"windows of {r['seq_len']} tokens, {r['new_tokens']} greedy tokens after 32 (median of 3 "
                      f"after a warm-up); {r['machine']}, {r['date']}, torch {r['torch']}, executorch "
                      f"{r['executorch']}{llama}; the bench took {r['seconds'] / 60:.1f} min, peak RSS "
                      f"{r['peak_rss_mb'] / 1024:.1f} GB.", "",
                      "| user model | runtime | precision | file (MB) | perplexity (vs comix) | tokens/s | "
                      "greedy tokens = comix's | export (s) |",
                      "|---|---|---|---:|---:|---:|---|---:|", *rows])


def soak_table(text: str) -> str:
    """bench/soak.py's result file: what a TLS + authenticated loopback deployment went through
    (faults injected and left out, by kind; restarts) and what held (rounds complete, aggregates
    equal to the in-process replay), with the server's memory and the wall time against the
    undisturbed run."""
    r = json.loads(text)
    faults = " ".join(f"{k} {f['left_out']}/{f['injected']}" for k, f in r["faults"].items())
    calm = f"{r['undisturbed_wall_s'] / 60:.1f} min" if "undisturbed_wall_s" in r else "not run"
    held = "none" if not r["problems"] else "; ".join(r["problems"])
    rows = [("SuperNodes x rounds", f"{r['nodes']} x {r['rounds']} (round timeout {r['timeout_s']:g} s)"),
            ("rounds completed, every device logged", f"{r['rounds_completed']} of {r['rounds']}"),
            ("faults left out of the aggregate / injected", faults),
            ("rounds a restarting device missed (not planned)", str(r["collateral_misses"])),
            ("SuperNodes restarted; ServerApp killed and resubmitted", f"{r['device_restarts']}; {r['server_kills']} "
             f"(in round {r.get('killed_in_round', '-')})"),
            ("aggregates equal to the in-process replay", f"{r['aggregates_equal_to_replay']} of {r['rounds']} "
             f"(worst relative difference {r['worst_fingerprint_rel_diff']:.2g}; final perplexities "
             f"{r['final_test_ppl_rel_diff']:.2g})"),
            ("peak RSS: ServerApp, SuperLink", f"{r['serverapp_peak_rss_mb']:.0f} MB, {r['superlink_peak_rss_mb']:.0f} MB"),
            ("wall time: soak, undisturbed run", f"{r['wall_s'] / 60:.1f} min, {calm}"),
            ("problems found", held)]
    note = f" Note: {r['note']}." if r.get("note") else ""
    return "\n".join([f"`{r['command'].strip()}` (seed {r['seed']}): {r['machine']}, {r['date']}, torch {r['torch']}, "
                      f"flwr {r['flwr']}.{note}", "", "| | |", "|---|---|", *(f"| {a} | {b} |" for a, b in rows)])


def large_upload_table(text: str) -> str:
    """bench/large_upload.py's result file: one device upload over 2 GB through a TLS + authenticated
    loopback deployment, whether it arrived bit for bit, its time and each process's peak memory."""
    r = json.loads(text)
    gb = r["upload_gb"]
    rows = [("upload (one fp32 tensor)", f"{gb:.2f} GB ({r['bytes']:,} bytes; protobuf's limit 2,147,483,647)"),
            ("arrived bit for bit (SHA-256)", "yes" if r.get("bit_exact") else "NO"),
            ("request to reply (device made it in)", f"{r['round_trip_s']:.0f} s ({r['made_s']:.0f} s)")]
    for key, what in (("device_clientapp_peak_rss_mb", "device: its ClientApp process"),
                      ("supernode_peak_rss_mb", "device: its SuperNode"), ("superlink_peak_rss_mb", "SuperLink"),
                      ("serverapp_peak_rss_mb", "server: the ServerApp (its own VmHWM)")):
        rows.append((f"peak RSS, {what}", f"{r[key] / 1024:.1f} GB ({r[key] / 1024 / gb:.1f}x the upload)"))
    return "\n".join([f"`{r['command'].strip()}`: {r['machine']}, {r['date']}, torch {r['torch']}, flwr {r['flwr']} "
                      f"(arrays cut into {r['chunk_mb']:g} MB chunks); the bench took {r['wall_s'] / 60:.1f} min.", "",
                      "| | |", "|---|---|", *(f"| {a} | {b} |" for a, b in rows)])


def eval_clients_table(text: str) -> str:
    """bench/eval_clients.py's result file: a compare with every client scored every round against
    the same with ``train.eval_clients`` (a seeded sample before the last round): wall time, the
    scoring's share of it, client evaluations, and whether the last round's scores are identical."""
    r = json.loads(text)
    rows = ["| train.eval_clients | wall time | scoring (sum of eval_s) | client evaluations | peak RSS (MB) |",
            "|---|---:|---:|---:|---:|"]
    for k, x in r["runs"].items():
        rows.append(f"| {k}{' (every client)' if k == '0' else ''} | {x['wall_s'] / 60:.1f} min | "
                    f"{x['eval_s'] / 60:.1f} min | {x['scored']:,} | {x['peak_rss_mb']:,.0f} |")
    full, sampled = r["runs"]["0"], r["runs"][str(r["sample"])]
    return "\n".join(rows) + (
        f"\n\n`{r['config']}`, {r['machine']}, {r['date']}: the sample saves "
        f"{1 - sampled['wall_s'] / full['wall_s']:.0%} of the wall time; the last round's scores of all "
        f"{r['final_clients']} client-method pairs are {'identical' if r['final_scores_identical'] else 'NOT identical'} "
        "in both runs.")


def main_job_profile_table(text: str) -> str:
    """bench/main_job_profile.py's file: each phase's exclusive wall time in the main job."""
    r = json.loads(text)
    rows = ["| phase | seconds | share | timed calls |", "|---|---:|---:|---:|"]
    rows += [f"| {p['phase']} | {p['seconds']:,.1f} | {p['share']:.1%} | {p['calls']:,} |" for p in r["phases"]]
    return "\n".join(rows) + (f"\n\n`{r['command']}`: {r['machine']}, {r['threads']} threads, torch {r['torch']}, "
                              f"{r['date']}; the whole job {r['total_s'] / 60:.2f} min (imports included), "
                              f"peak RSS {r['peak_rss_mb'] / 1024:.1f} GB.")


BENCH_FILES = {"eval-clients.json": eval_clients_table, "main-job-profile.json": main_job_profile_table, "soak.json": soak_table, "large-upload.json": large_upload_table, "device-export.json": device_export_table, "cohort-cpu-fp32.json": cohort_table, "layer-speed.md": layer_speed_table, "layer-speed-full.md": layer_speed_table,  # written by a bench
               "layer-speed-h200-bf16.md": layer_speed_table,
               "vaa-attribution.json": vaa_attribution_table, "vaa-attribution-long.json": vaa_attribution_table}


def table(case: str) -> str:
    if case in BENCH_FILES:  # a bench's own result file (bench/layer_speed.py writes it), not a run's
        return f"{BENCH_FILES[case]((RESULTS / case).read_text())}\n\n*Generated by `python bench/tables.py` " \
               f"from `bench/results/{case}`.*\n"
    if case in BENCH_DIRS:
        return f"{BENCH_DIRS[case](RESULTS / case)}\n\n*Generated by `python bench/tables.py` from `bench/results/{case}/`.*\n"
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
    return f"{body}\n\n*Generated by `python bench/tables.py` from `bench/results/{meta.get('runs_of', case)}/` ({meta['command']}; " \
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
    out = RESULTS / case
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
    src = RESULTS / case
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
