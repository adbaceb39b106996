"""The tables of a case's kind (``case.json``'s ``kind``; bench/tables.py lists them), but DeepFusion's
(bench/deepfusion_table.py): each takes the case's meta and its runs {method: {seed: run folder}}."""
from __future__ import annotations

import re
import statistics
import sys
from pathlib import Path

import cases  # cases.RESULTS read at each call: tests point it elsewhere
from cases import ROOT, _jsonl, _majority_label, _mean_std, _result, load_case, paired_interval, seeds_to_resolve


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
    delta = re.search(r"^\s*delta: ([\d.e-]+)", (cases.RESULTS / meta["case"] / "config.yaml").read_text(), re.M)
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
    perplexity over users, mean (std) over seeds, from the setting's own case. Each column names
    its seeds (a grid continued across sessions may hold more seeds in one setting than in
    another), and a cell over fewer seeds than its column names them."""
    sub = {setting: load_case(case)[1] for setting, case in meta["cases"].items()}
    order = meta.get("order") or list(next(iter(sub.values())))
    seeds = {setting: sorted({s for by in runs.values() for s in by}) for setting, runs in sub.items()}
    rows = ["| method | " + " | ".join(f"{k} (seed{'s' * (len(v) > 1)} {', '.join(map(str, v))})"
                                       for k, v in seeds.items()) + " |", "|---" * (len(sub) + 1) + "|"]
    for m in order:
        cells = []
        for setting, by in sub.items():
            held = sorted(by.get(m, {}))
            cells.append("-" if not held else _mean_std([_result(by[m][s])["mean"] for s in held])
                         + (f" (seed{'s' * (len(held) > 1)} {', '.join(map(str, held))})" if held != seeds[setting] else ""))
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
    table = overhead_table(cases.RESULTS / meta["case"], order, seeds)
    for m in order:  # the case's display names
        table = table.replace(f"| {m} |", f"| {meta.get('names', {}).get(m, m)} |")
    return table


def _slices(k: int) -> str:
    return f", {k} slices" if k > 1 else ""
