"""docs/results.md's body: does comix reproduce each paper? Per paper, its headline claims as
pairwise comparisons (the paper's own two numbers, from the table the claim comes from), comix's
measured numbers for the same two methods from a committed case (its scale, machine and seeds),
the trivial baseline beside them, and a verdict computed from the files by rules that cannot say
more than the case shows:

* the **trivial baseline**: each client's majority training label (classification); for a
  distillation, the student trained by CE alone on the same public text (the untrained dense base
  shown beside it); else the untrained base. Each trained model's lead over it must itself be
  resolved: on 2+ seeds its paired 95 % t interval above 0, on one seed ahead. Otherwise the row
  is **not testable at this scale** and no order is read. The row counts the client-seeds on which
  each model is above / level with / below that baseline.
* with seeds >= 2, the 95 % t interval of the paired difference (``cases.paired_interval``):
  **reproduced** (it excludes 0 on the paper's side), **reversed** (on the other side) or
  **unresolved** (it holds 0), or **not reproduced** where the paper's gap is in the same units
  and outside the interval; a difference resolved in the paper's direction whose interval excludes
  the paper's gap (same units) is **reproduced in direction**, smaller or larger than the paper's.
  The paper's gap is set against comix's only where the case's headroom (the better model's lead
  over the trivial baseline) could hold it; else the verdict says its size is not tested.
* within each paper's table, Holm's adjusted p (Holm 1979) beside each tested row's raw p: a raw
  verdict the correction does not keep at 5 % says so;
* the seeds a row needs for 80 % power (two-sided 5 % paired t test, noncentral t) at the paper's
  gap (same units) or comix's measured one, with the range the measured std's 95 % interval allows;
* with one seed: **agrees** or **disagrees** in direction, no interval (one seed cannot resolve).

``python bench/tables.py`` writes it between docs/results.md's markers (``<!-- table: results -->``)
and ``--check`` compares it with the files like every other table.
"""
from __future__ import annotations

import json
import statistics
from collections import Counter
from dataclasses import dataclass, field

import pooling
from cases import RESULTS, _result, holm, load_case, paired_interval, paired_p, sd_range, seeds_for_power

from comix.comparison import client_majority_accuracy
from comix.models.devices import assign_devices


@dataclass(frozen=True)
class Claim:
    paper: str      # the paper and the table the numbers come from
    setting: str    # the paper's column
    a: str          # the method the claim is about, and the one it is compared with (comix's specs)
    b: str
    paper_a: float  # the paper's numbers for a and b
    paper_b: float
    case: str       # comix's committed case with both methods
    higher_is_better: bool
    metric: str     # how comix scores it (a results.json per-user key, or "mean": the run's metric)
    # the paper's gap may be set against comix's interval: the same measure in the same units
    # (DeepFusion's log token perplexity), not a score whose level moves with the model and data (MTAL)
    same_units: bool = False


CLAIMS = [
    # CoMiGS (ICML 2025) Table 1, GPT2-124M columns (mean over 3 seeds there): the generalist +
    # specialist mixture against training alone and against FedAvg, in the three settings comix
    # runs (multilingual; topics in-distribution ~ SlimPajama; topics out-of-distribution ~ AG News);
    # each row also reads every other case that ran its methods the same way (bench/pooling.py: the
    # recent methods' cases hold CoMiGS-1G1S, Local and the untrained base on seeds 42, 45 and 47)
    *[Claim("CoMiGS Table 1", col, "comigs-1g1s", b, pa, pb, f"reproduce-small-table1-{name}", False, "mean")
      for col, name, b, pa, pb in [
          ("Multilingual", "multilingual", "local", 47.19, 54.38), ("Multilingual", "multilingual", "fedavg", 47.19, 58.80),
          ("SlimPajama", "topics-in", "local", 21.79, 26.95), ("SlimPajama", "topics-in", "fedavg", 21.79, 23.27),
          ("AG News", "topics-ood", "local", 33.53, 41.46), ("AG News", "topics-ood", "fedavg", 33.53, 31.84)]],
    # "CoMiGS-1G1S tracks the better of 2S and 2G" (Sec. 4.2.1): ahead of the worse of the two in
    # each setting (Table 1: 2G in Multilingual, 2S in SlimPajama and AG News)
    *[Claim("CoMiGS Table 1", col, "comigs-1g1s", b, pa, pb, f"reproduce-small-table1-{name}", False, "mean")
      for col, name, b, pa, pb in [("Multilingual", "multilingual", "comigs-2g", 47.19, 58.31),
                                   ("SlimPajama", "topics-in", "comigs-2s", 21.79, 22.51),
                                   ("AG News", "topics-ood", "comigs-2s", 33.53, 35.81)]],
    # FedAMoLE (journal) Table I, Natural Instructions with one task per client (MTAL, ROUGE-L)
    *[Claim("FedAMoLE Table I", "NI, 1 task/client", "fedamole", b, 60.04, pb, "fedamole-table1-instructions", True, "mean")
      for b, pb in [("fedit", 54.09), ("fedit-ft", 53.34), ("fdlora-fedamole", 57.04)]],
    # FedAMoLE Table III (SNLI, one seed there): AMoLE + RSEA against post-aggregation fine-tuning,
    # on the redesigned case (a partition per seed, every test example scored) that replaced
    # fedamole-cpu-table3-relations-dir1.0, whose majority training label beat every method
    # and its two ablations' claims: the AMoLE router against the vanilla router (both with RSEA),
    # RSEA against random expert assignment (both with AMoLE)
    *[Claim("FedAMoLE Table III", "SNLI ablation", "fedamole", b, 88.95, pb, "fedamole-cpu-table3-relations", True, "mean")
      for b, pb in [("fedit-ft", 86.45), ("fedamole-vanilla", 86.90), ("fedamole-random", 88.05)]],
    # DeepFusion Table I, open-ended QA at N = 16 (log token perplexity): VAA's feature distillation
    # against logits-only FedKMT, against OFA-KD and against federated MoE training (FedJETS)
    *[Claim("DeepFusion Table I", "open-ended QA, N = 16", "deepfusion:alpha=1.0", b, 3.9697, pb,
            "deepfusion-cpu-qa-open-hetero-n8", False, "test_answer_log_ppl", same_units=True)
      for b, pb in [("fedkmt", 3.9908), ("ofa-kd", 4.0375), ("fedjets:train.rounds=4,train.local_steps=50", 3.9717)]],
    # the same claim where VAA has something to bridge: three of four teachers Gemma-3-270M (another
    # family, its own tokenizer and width), public text the domains' held-out share (alpha = 1, fixed)
    Claim("DeepFusion Table I", "open-ended QA, N = 16", "deepfusion", "fedkmt",
          3.9697, 3.9908, "deepfusion-cpu-qa-open-gemma-n4", False, "test_answer_log_ppl", same_units=True),
]


def _per_user(result: dict, metric: str) -> dict[str, float]:
    """A run's score per user: its metric's own key ("mean": the key the run's mean is of)."""
    key = result.get("metric") if metric == "mean" else metric
    users = {u: v[key] for u, v in result.get("per_user", {}).items() if key in v}
    return users if users or metric != "mean" else {"": result["mean"]}  # a run that lists no per-user metric


def _scores(case: str, metric: str) -> dict[str, dict[int, dict[str, float]]]:
    """{spec: {seed: {user: the run's score}}}."""
    _, runs = load_case(case)
    return {spec: {seed: _per_user(_result(d), metric) for seed, d in by.items()} for spec, by in runs.items()}


def _gate_specs(case: str) -> list[str]:
    """The runs of ``case`` its trivial baseline is made of (the untrained base, CE only)."""
    _, runs = load_case(case)
    return [s for s in runs if s == "pretrained" or s == "deepfusion-ce" or s.startswith("deepfusion-ce:device_steps=")]


def cases_of(claim: Claim) -> tuple[list[str], list[tuple[str, str]]]:
    """The cases ``claim``'s row reads (its own first) and those left out, with why (bench/pooling.py)."""
    return pooling.cases_read(claim.case, [claim.a, claim.b], _gate_specs(claim.case))


def _mean(users: dict[int, dict[str, float]]) -> dict[int, float]:
    return {s: statistics.fmean(u.values()) for s, u in users.items() if u}


@dataclass
class Trivial:
    """A case's trivial baseline per seed and user (what each trained model must beat, resolved,
    before its comparison is read) and the baselines shown beside it."""
    name: str = ""
    users: dict = field(default_factory=dict)   # {seed: {user: score}}
    beside: list = field(default_factory=list)  # [(name, {seed: mean score})]


def _trivial(claim: Claim, cases: list[str]) -> Trivial:
    """The trivial baseline of ``claim``'s row over the cases it reads (a seed two hold, from the first)."""
    parts = [_trivial_of(claim, case) for case in cases]
    beside = pooling.pooled([dict(p.beside) for p in parts])
    return Trivial(parts[0].name, pooling.pooled([{"": p.users} for p in parts]).get("", {}), list(beside.items()))


def _trivial_of(claim: Claim, case: str) -> Trivial:
    """The majority training label (each client's own, from the partition) for a classification
    case; for a distillation, the student trained by CE alone on the same public text, beside the
    untrained dense base; else the untrained base (the ``pretrained`` run)."""
    meta, runs = load_case(case)
    seeds = sorted({s for by in runs.values() for s in by})
    folder = RESULTS / meta.get("runs_of", case)
    majority = {}
    for s in seeds:
        for path in (folder / f"seed{s}" / "partition.json", folder / "partition.json"):
            if path.exists():
                majority[s] = client_majority_accuracy(json.loads(path.read_text()))
                break
    majority = {s: m for s, m in majority.items() if m}
    if majority:
        return Trivial("majority training label", majority)
    if "pretrained" in runs:
        return Trivial("untrained base", {s: _per_user(_result(d), claim.metric) for s, d in runs["pretrained"].items()})
    base = f"test_base_{claim.metric.removeprefix('test_')}"
    by = runs.get(claim.b, {})
    untrained = {s: _per_user(_result(d), base) for s, d in by.items()}
    untrained = [("untrained base", _mean(untrained))] if any(untrained.values()) else []
    ce = _ce_only(runs, claim.metric)
    if ce:
        return Trivial("CE-only student", ce, untrained)
    return Trivial(*untrained[0][:1], {s: _per_user(_result(d), base) for s, d in by.items()}) if untrained else Trivial()


def _ce_only(runs: dict, metric: str) -> dict[int, dict[str, float]]:
    """CE only's per-seed scores: the ``deepfusion-ce`` runs, with those whose one option is
    ``device_steps`` (its student reads no teacher, so how long the devices trained changes
    nothing it computes: algorithms/deepfusion_ce.py), where a seed has no plain run."""
    out = {}
    for spec in sorted(runs, key=lambda k: k != "deepfusion-ce"):
        if spec == "deepfusion-ce" or spec.startswith("deepfusion-ce:device_steps="):
            for s, d in runs[spec].items():
                out.setdefault(s, _per_user(_result(d), metric))
    return out


def verdict(claim: Claim) -> dict:
    cases, left = cases_of(claim)
    scores = pooling.pooled([_scores(case, claim.metric) for case in cases])
    trivial = _trivial(claim, cases)
    out = judge(claim, scores.get(claim.a, {}), scores.get(claim.b, {}), trivial)
    out["cases"], out["left_out"] = cases, left
    if not trivial.users:  # nothing to gate on: no order can be read
        out["verdict"] = "not testable at this scale: the case's files hold no trivial baseline"
    partial = [p for case in cases if (p := json.loads((RESULTS / _folder(case) / "case.json").read_text()).get("partial"))]
    if partial:  # a grid still running across sessions: what is in so far, never a verdict
        out["verdict"] = f"partial case ({'; '.join(partial)}): {out['verdict']}"
    return out


def _counts(model: dict[int, dict[str, float]], trivial: dict[int, dict[str, float]], sign: int) -> tuple[int, int, int]:
    """Client-seeds on which ``model`` is above / level with / below its trivial baseline."""
    d = [sign * (model[s][u] - trivial[s][u]) for s in model if s in trivial for u in model[s] if u in trivial[s]]
    return sum(x > 1e-9 for x in d), sum(abs(x) <= 1e-9 for x in d), sum(x < -1e-9 for x in d)


def judge(claim: Claim, a: dict, b: dict, trivial: Trivial = Trivial()) -> dict:
    """The verdict on ``claim`` from comix's per-seed (and per-user) scores of its two methods,
    ``a`` and ``b`` as {seed: {user: score}} or {seed: score}, and of its trivial baseline (the
    module's docstring gives the rules)."""
    a, b, t = ({s: v if isinstance(v, dict) else {"": v} for s, v in x.items()} for x in (a, b, trivial.users))
    ma, mb, mt = _mean(a), _mean(b), _mean(t)
    seeds = sorted(set(ma) & set(mb))
    sign = 1 if claim.higher_is_better else -1  # positive: a ahead of b
    paper_gap = sign * (claim.paper_a - claim.paper_b)
    diffs = [sign * (ma[s] - mb[s]) for s in seeds]
    out = {"seeds": seeds, "a": statistics.fmean(ma[s] for s in seeds), "b": statistics.fmean(mb[s] for s in seeds),
           "trivial_name": trivial.name, "trivial": statistics.fmean(mt.values()) if mt else None,
           "beside": [(n, statistics.fmean(v.values())) for n, v in trivial.beside if v], "p": paired_p(diffs)}
    mean, half = paired_interval(diffs)
    out["gap"], out["half"] = mean, half
    if len(seeds) > 1:
        sd = statistics.stdev(diffs)
        effect = paper_gap if claim.same_units else mean
        out["power"] = [seeds_for_power(effect, x) for x in (sd, *sd_range(sd, len(seeds)))]
    # each model's lead over the trivial baseline on every seed the case holds it on (not only the
    # pair's: a model compared on one seed whose lead is unresolved over three is not read on the
    # one): resolved (2+ seeds), or ahead (1 seed); the counts read the same seeds
    leads = {}
    for name, m in (("a", ma), ("b", mb)):
        common = [s for s in m if s in mt]
        lead, lh = paired_interval([sign * (m[s] - mt[s]) for s in common]) if common else (float("nan"),) * 2
        leads[name] = (lead, lh, len(common))
    if mt:
        out["counts"] = {n: _counts(m, t, sign) for n, m in (("a", a), ("b", b))}
    unresolved = [n for n, (lead, lh, k) in leads.items() if not (lead > 0 and (k < 2 or lead - lh > 0))] if mt else []
    if mt and (len(seeds) > 1 and any(leads[n][2] < 2 for n in leads)):
        unresolved = sorted(set(unresolved) | {n for n in leads if leads[n][2] < 2})
    # the paper's gap set against comix's only where the case could show a gap that size: the
    # better model's lead over the trivial baseline (its headroom)
    headroom = max(leads["a"][0], leads["b"][0]) if mt else float("inf")
    sized = claim.same_units and abs(paper_gap) <= headroom
    excludes_paper_gap = sized and not mean - half <= paper_gap <= mean + half
    beyond = (f"; the paper's gap ({paper_gap:.3g}) is beyond the case's headroom (the better model's lead over "
              f"{trivial.name}, {headroom:.3g}), so its size is not tested") if claim.same_units and not sized else ""
    if unresolved:
        why = {n: f"not resolved over {leads[n][2]} seeds" if leads[n][2] > 1 else "not positive" for n in unresolved}
        if len(set(why.values())) == 1:
            which = " and ".join(getattr(claim, n) for n in unresolved)
            out["verdict"] = f"not testable at this scale: the lead{'s' * (len(unresolved) > 1)} of {which} over the " \
                f"{trivial.name} {'are' if len(unresolved) > 1 else 'is'} {why[unresolved[0]]}"
        else:  # one model unresolved over its seeds, the other behind on its one seed
            first, second = unresolved
            out["verdict"] = f"not testable at this scale: the lead of {getattr(claim, first)} over the " \
                f"{trivial.name} is {why[first]}, that of {getattr(claim, second)} {why[second]}"
    elif len(seeds) < 2:
        agrees = (mean > 0) == (paper_gap > 0)
        out["verdict"] = ("agrees" if agrees else "disagrees") + " in direction (one seed: no interval)"
    elif (mean - half > 0) == (paper_gap > 0) and abs(mean) > half:
        out["verdict"] = "reproduced" + beyond
        if excludes_paper_gap:  # the direction, not the size
            size = "smaller" if abs(paper_gap) > abs(mean) + half else "larger"
            out["verdict"] = f"reproduced in direction, {size} than the paper's gap ({paper_gap:.3g}), " \
                             "which the interval excludes"
    elif abs(mean) > half:
        out["verdict"] = "reversed" + beyond
    elif excludes_paper_gap:
        out["verdict"] = f"not reproduced: the interval holds 0 and excludes the paper's gap ({paper_gap:.3g})"
    else:
        out["verdict"] = "unresolved: the interval holds 0" + beyond
    return out


def with_holm(verdicts: list[tuple[Claim, dict]]) -> None:
    """Holm's correction within each paper's table, over its rows tested on 2+ seeds (a row not
    testable tests nothing): each such row gets ``holm`` (its adjusted p), and a raw verdict that
    the adjusted p does not keep at 5 % says so."""
    for paper in dict.fromkeys(c.paper for c, _ in verdicts):
        rows = [v for c, v in verdicts if c.paper == paper and len(v["seeds"]) > 1
                and not v["verdict"].startswith(("not testable", "partial"))]
        for v, adjusted in zip(rows, holm([v["p"] for v in rows])):
            v["holm"] = adjusted
            if v["verdict"].startswith(("reproduced", "reversed")) and adjusted >= 0.05:
                v["verdict"] += f" (not after Holm's correction over the table's {len(rows)} tested rows)"


def _fmt(x: float, higher: bool) -> str:
    return f"{x:.2f}" if higher or abs(x) >= 10 else f"{x:.3f}"


def _power(v: dict) -> str:
    if "power" not in v:
        return "-"
    n, *span = ("more than 1000" if x is None else str(x) for x in v["power"])
    return f"{n} ({span[0]} to {span[1]})" if len(set(v["power"])) > 1 else n


def ran(case: str) -> str:
    """What comix ran in place of the paper's data and N, read from the case's committed config.yaml
    (the corpus, the clients, the base, the schedule, DeepFusion's devices), so a row's label cannot
    say more than its files."""
    import yaml
    folder = RESULTS / _folder(case)
    cfg = yaml.safe_load((folder / "config.yaml").read_text())
    data, train = cfg["data"], cfg["train"]
    # a set number of clients (DeepFusion's devices, a Dirichlet split), else one a user folder or
    # task (a run's per-user rows; a distillation's rows are the server's test domains instead)
    first = next(iter(sorted(folder.glob("seed*/*/results.json"))), None)
    users = data.get("clients") or (len(json.loads(first.read_text()).get("per_user", {})) if first else 0)
    corpus = str(cfg["corpus"])
    parts = [("the built-in " if "/" not in corpus else "") + corpus + " corpus"
             + (", test topics held out" if data.get("mode") == "ood" else ""),
             f"{users} clients" + (f" (Dirichlet alpha {data['alpha']:g})" if data.get("partition") == "dirichlet" else ""),
             cfg["model"], f"{train['rounds']} rounds x {train['local_steps']} steps"]
    deepfusion = cfg.get("deepfusion") or {}
    if deepfusion.get("devices"):  # the models the clients run, as drawn for them (not the specs' list)
        drawn = Counter(assign_devices(deepfusion["devices"], users, deepfusion.get("assign_seed", 0)))
        parts.append("devices " + ", ".join(f"{n}x {spec}" for spec, n in drawn.most_common()))
    return ", ".join(parts)


def read_specs(claims: list[Claim]) -> dict[str, list[str]]:
    """{case: the specs rows read from it}: each claim's two methods and the trivial baseline's own
    runs, in every case the claim's row reads."""
    out: dict[str, list[str]] = {}
    for c in claims:
        for case in cases_of(c)[0]:
            _, runs = load_case(case)
            out.setdefault(case, [])
            out[case] += [s for s in (c.a, c.b, *_gate_specs(c.case)) if s in runs and s not in out[case]]
    return out


def reproducing_command(case: str, specs: list[str]) -> str:
    """The command that runs ``specs`` of ``case`` again from its committed config.yaml (not from a
    recipe that may have moved since), on the seeds the case holds for them."""
    _, runs = load_case(case)
    seeds = sorted({s for spec in specs for s in runs.get(spec, {})})
    quoted = " ".join(f"'{s}'" if any(ch in s for ch in ",=") else s for s in specs)
    return (f"comix compare bench/results/{_folder(case)}/config.yaml --methods {quoted} "
            f"--seeds {' '.join(map(str, seeds))} run_dir=runs/{case}")


def results_page() -> str:
    rows = ["| paper | setting | a vs b | paper: a / b | comix: a / b (seeds) | a's lead over b (positive: a ahead), "
            "95 % interval; p, Holm within the table | trivial baseline; client-seeds above / level / below it | "
            "seeds for 80 % power (range the std allows) | verdict | case |", "|---|---|---|---|---|---|---|---|---|---|"]
    verdicts = [(c, verdict(c)) for c in CLAIMS]
    with_holm(verdicts)
    for c, v in verdicts:
        h = c.higher_is_better
        interval = f"{v['gap']:+.3g}" + (f" [{v['gap'] - v['half']:+.3g}, {v['gap'] + v['half']:+.3g}]; p {v['p']:.2g}"
                                          if len(v["seeds"]) > 1 else "")
        interval += f", Holm {v['holm']:.2g}" if "holm" in v else ""
        trivial = f"{v['trivial_name']} {_fmt(v['trivial'], h)}" if v["trivial"] is not None else "not in the case's files"
        if "counts" in v:
            trivial += "; " + ", ".join(f"{getattr(c, n)} {'/'.join(map(str, k))}" for n, k in v["counts"].items())
        trivial += "".join(f" (beside it: {n} {_fmt(x, h)})" for n, x in v["beside"])
        rows.append(f"| {c.paper} | {c.setting}; comix ran: {ran(c.case)} | {c.a} vs {c.b} | {_fmt(c.paper_a, h)} / {_fmt(c.paper_b, h)} | "
                    f"{_fmt(v['a'], h)} / {_fmt(v['b'], h)} ({', '.join(map(str, v['seeds']))}) | {interval} | "
                    f"{trivial} | {_power(v)} | {v['verdict']} | "
                    + " + ".join(f"`bench/results/{_folder(case)}/`" for case in v["cases"]) + " |")
    # each case once: how it was made (its scale is in its command and config), on what machine, when
    rows += ["", "The cases: the command that runs the rows' methods again from the case's committed config "
             "(tests/test_tables.py derives every run's training settings from it; the untrained base's, which trains nothing, but for its schedule), then how the case was made (command; "
             "machine; date):", ""]
    specs = read_specs(CLAIMS)
    made = {}
    for case in specs:
        made.setdefault(_made_by(_folder(case)), []).append(case)
    for case, parts in made.items():
        meta = json.loads((RESULTS / case / "case.json").read_text())
        again = "; ".join(f"`{reproducing_command(p, specs[p])}`" for p in dict.fromkeys(parts))
        rows.append(f"- `{case}`: again: {again}. Made by: {meta['command']}; {meta['machine']}; {meta['date']}.")
    left = {}
    for c, v in verdicts:
        for case, why in v["left_out"]:
            left.setdefault(case, {}).setdefault(why, []).append(f"{c.a} vs {c.b} ({c.setting})")
    if left:
        rows += ["", "Cases that ran a row's two methods on its data but are not read with it (cases are read "
                 "together only where every method the row reads ran the same way: bench/pooling.py), each with the "
                 "settings that differ (the base, the schedule and the optimiser first; three at most, and the count):", ""]
        rows += [f"- `{case}` for {'; '.join(', '.join(rs) for rs in by.values())}: {'; '.join(by)}."
                 for case, by in left.items()]
    return "\n".join(rows)


def _made_by(case: str) -> str:
    """The case whose case.json says how ``case`` was made: itself, or the bench run it is part of."""
    return json.loads((RESULTS / case / "case.json").read_text()).get("part_of", case)


def _folder(case: str) -> str:
    meta = json.loads((RESULTS / case / "case.json").read_text())
    return meta.get("runs_of", case)


if __name__ == "__main__":
    print(results_page())
