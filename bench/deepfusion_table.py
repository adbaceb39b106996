"""DeepFusion's case table (kind ``deepfusion``): alpha chosen on the server's validation documents,
test per domain, paired differences from the reference (FedKMT), the seeds the paper's edge needs at
the case's spread, and the teachers' in-domain premise."""
from __future__ import annotations

import json
import statistics
from pathlib import Path

import cases  # cases.RESULTS read at each call: tests point it elsewhere
from cases import _jsonl, _mean_std, _result, paired_interval, seeds_to_resolve, steps_to_close


# DeepFusion's edge over FedKMT on open-ended QA (paper Table I, DeepSeek-MoE, log token perplexity:
# FedKMT minus DeepFusion): its smallest (N = 32) and at its smallest system (N = 16)
PAPER_EDGE = {"N = 32": 3.9811 - 3.9700, "N = 16": 3.9908 - 3.9697}


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
    case = cases.RESULTS / meta["case"]
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
