"""docs/results.md's body: does comix reproduce each paper? Per paper, its headline claims as
pairwise comparisons (the paper's own two numbers, from the table the claim comes from), comix's
measured numbers for the same two methods from a committed case (its scale, machine and seeds),
the trivial baseline beside them, and a verdict computed from the files:

* **not testable at this scale**: the trivial baseline (majority training label; the untrained
  base for perplexities) is as good as the better of the two trained models: the case cannot
  show a method's effect, whatever the methods' order;
* with seeds >= 2, the 95 % t interval of the paired difference (``tables.paired_interval``):
  **reproduced** (it excludes 0 on the paper's side), **reversed** (on the other side) or
  **unresolved** (it holds 0), or **not reproduced** where the paper's gap is in the same units
  and outside the interval; a difference resolved in the paper's direction whose interval excludes
  the paper's gap (same units) is **reproduced in direction**, smaller or larger than the paper's;
* with one seed: **agrees** or **disagrees** in direction, no interval (one seed cannot resolve).

``python bench/tables.py`` writes it between docs/results.md's markers (``<!-- table: results -->``)
and ``--check`` compares it with the files like every other table.
"""
from __future__ import annotations

import json
import statistics
from dataclasses import dataclass

from cases import RESULTS, _majority_label, _result, load_case, paired_interval


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
    # runs (multilingual; topics in-distribution ~ SlimPajama; topics out-of-distribution ~ AG News)
    *[Claim("CoMiGS Table 1", f"{col} (comix: {name})", "comigs-1g1s", b, pa, pb, f"reproduce-small-table1-{name}", False, "mean")
      for col, name, b, pa, pb in [
          ("Multilingual", "multilingual", "local", 47.19, 54.38), ("Multilingual", "multilingual", "fedavg", 47.19, 58.80),
          ("SlimPajama", "topics-in", "local", 21.79, 26.95), ("SlimPajama", "topics-in", "fedavg", 21.79, 23.27),
          ("AG News", "topics-ood", "local", 33.53, 41.46), ("AG News", "topics-ood", "fedavg", 33.53, 31.84)]],
    # FedAMoLE (journal) Table I, Natural Instructions with one task per client (MTAL, ROUGE-L)
    *[Claim("FedAMoLE Table I", "NI, 1 task/client", "fedamole", b, 60.04, pb, "fedamole-table1-instructions", True, "mean")
      for b, pb in [("fedit", 54.09), ("fedit-ft", 53.34), ("fdlora-fedamole", 57.04)]],
    # FedAMoLE Table III (SNLI, one seed there): AMoLE + RSEA against post-aggregation fine-tuning,
    # on the redesigned case (a partition per seed, every test example scored) that replaced
    # fedamole-cpu-table3-relations-dir1.0, whose majority training label beat every method
    Claim("FedAMoLE Table III", "SNLI ablation", "fedamole", "fedit-ft", 88.95, 86.45,
          "fedamole-cpu-table3-relations", True, "mean"),
    # DeepFusion Table I, open-ended QA at N = 16 (log token perplexity): VAA's feature distillation
    # against logits-only FedKMT, against OFA-KD and against federated MoE training (FedJETS)
    *[Claim("DeepFusion Table I", "open-ended QA, N = 16", "deepfusion:alpha=1.0", b, 3.9697, pb,
            "deepfusion-cpu-qa-open-hetero-n8", False, "test_answer_log_ppl", same_units=True)
      for b, pb in [("fedkmt", 3.9908), ("ofa-kd", 4.0375), ("fedjets:train.rounds=4,train.local_steps=50", 3.9717)]],
    # the same claim where VAA has something to bridge: three of four teachers Gemma-3-270M (another
    # family, its own tokenizer and width), public text the domains' held-out share (alpha = 1, fixed)
    Claim("DeepFusion Table I", "open-ended QA, N = 16 (comix: Gemma-3-270M teachers)", "deepfusion", "fedkmt",
          3.9697, 3.9908, "deepfusion-cpu-qa-open-gemma-n4", False, "test_answer_log_ppl", same_units=True),
]


def _scores(case: str, metric: str) -> dict[str, dict[int, float]]:
    """{spec: {seed: the run's score}}: its metric's mean over users, or one per-user key's mean."""
    _, runs = load_case(case)
    out = {}
    for spec, by in runs.items():
        out[spec] = {}
        for seed, d in by.items():
            r = _result(d)
            out[spec][seed] = r["mean"] if metric == "mean" else statistics.fmean(v[metric] for v in r["per_user"].values())
    return out


def _trivial(claim: Claim) -> tuple[str, dict[int, float]]:
    """The case's trivial baseline: the majority training label for a classification case, the
    untrained base (the ``pretrained`` run, or DeepFusion's dense base before distillation)."""
    meta, runs = load_case(claim.case)
    seeds = sorted({s for by in runs.values() for s in by})
    majority = _majority_label({**meta, "case": meta.get("runs_of", claim.case)}, runs, seeds)
    if majority:
        return "majority training label", majority
    if "pretrained" in runs:
        return "untrained base", {s: _result(d)["mean"] for s, d in runs["pretrained"].items()}
    base = f"test_base_{claim.metric.removeprefix('test_')}"
    by = runs.get(claim.b, {})
    if by and base in next(iter(_result(next(iter(by.values())))["per_user"].values())):
        return "untrained base", {s: statistics.fmean(v[base] for v in _result(d)["per_user"].values())
                                  for s, d in by.items()}
    return "", {}


def verdict(claim: Claim) -> dict:
    scores = _scores(claim.case, claim.metric)
    out = judge(claim, scores.get(claim.a, {}), scores.get(claim.b, {}), *_trivial(claim))
    partial = json.loads((RESULTS / _folder(claim.case) / "case.json").read_text()).get("partial")
    if partial:  # a grid still running across sessions: what is in so far, never a verdict
        out["verdict"] = f"partial case ({partial}): {out['verdict']}"
    return out


def judge(claim: Claim, a: dict[int, float], b: dict[int, float], trivial_name: str, trivial: dict[int, float]) -> dict:
    """The verdict on ``claim`` from comix's per-seed scores of its two methods and of the trivial
    baseline (the module's docstring gives the rule)."""
    seeds = sorted(set(a) & set(b))
    sign = 1 if claim.higher_is_better else -1  # positive: a ahead of b
    paper_gap = sign * (claim.paper_a - claim.paper_b)
    diffs = [sign * (a[s] - b[s]) for s in seeds]
    out = {"seeds": seeds, "a": statistics.fmean(a[s] for s in seeds), "b": statistics.fmean(b[s] for s in seeds),
           "trivial_name": trivial_name, "trivial": statistics.fmean(trivial.values()) if trivial else None}
    mean, half = paired_interval(diffs)
    out["gap"], out["half"] = mean, half
    best = max(out["a"], out["b"]) if claim.higher_is_better else min(out["a"], out["b"])
    excludes_paper_gap = claim.same_units and not mean - half <= paper_gap <= mean + half
    if out["trivial"] is not None and sign * (out["trivial"] - best) >= 0:
        out["verdict"] = f"not testable at this scale: the {trivial_name} scores {out['trivial']:.2f}, " \
                         "as good as both methods"
    elif len(seeds) < 2:
        agrees = (mean > 0) == (paper_gap > 0)
        out["verdict"] = ("agrees" if agrees else "disagrees") + " in direction (one seed: no interval)"
    elif (mean - half > 0) == (paper_gap > 0) and abs(mean) > half:
        out["verdict"] = "reproduced"
        if excludes_paper_gap:  # the direction, not the size
            size = "smaller" if abs(paper_gap) > abs(mean) + half else "larger"
            out["verdict"] = f"reproduced in direction, {size} than the paper's gap ({paper_gap:.3g}), " \
                             "which the interval excludes"
    elif abs(mean) > half:
        out["verdict"] = "reversed"
    elif excludes_paper_gap:
        out["verdict"] = f"not reproduced: the interval holds 0 and excludes the paper's gap ({paper_gap:.3g})"
    else:
        out["verdict"] = "unresolved: the interval holds 0"
    return out


def _fmt(x: float, higher: bool) -> str:
    return f"{x:.2f}" if higher or abs(x) >= 10 else f"{x:.3f}"


def results_page() -> str:
    rows = ["| paper | setting | a vs b | paper: a / b | comix: a / b (seeds) | a's lead over b (positive: a ahead), "
            "95 % interval | trivial baseline | verdict | case |", "|---|---|---|---|---|---|---|---|---|"]
    for c in CLAIMS:
        v = verdict(c)
        h = c.higher_is_better
        interval = f"{v['gap']:+.3g}" + (f" [{v['gap'] - v['half']:+.3g}, {v['gap'] + v['half']:+.3g}]"
                                          if len(v["seeds"]) > 1 else "")
        trivial = f"{v['trivial_name']} {_fmt(v['trivial'], h)}" if v["trivial"] is not None else "not in the case's files"
        rows.append(f"| {c.paper} | {c.setting} | {c.a} vs {c.b} | {_fmt(c.paper_a, h)} / {_fmt(c.paper_b, h)} | "
                    f"{_fmt(v['a'], h)} / {_fmt(v['b'], h)} ({', '.join(map(str, v['seeds']))}) | {interval} | "
                    f"{trivial} | {v['verdict']} | `bench/results/{_folder(c.case)}/` |")
    # each case once: how it was made (its scale is in its command and config), on what machine, when
    rows += ["", "The cases (command; machine; date):", ""]
    for case in dict.fromkeys(_made_by(_folder(c.case)) for c in CLAIMS):
        meta = json.loads((RESULTS / case / "case.json").read_text())
        rows.append(f"- `{case}`: {meta['command']}; {meta['machine']}; {meta['date']}.")
    return "\n".join(rows)


def _made_by(case: str) -> str:
    """The case whose case.json says how ``case`` was made: itself, or the bench run it is part of."""
    return json.loads((RESULTS / case / "case.json").read_text()).get("part_of", case)


def _folder(case: str) -> str:
    meta = json.loads((RESULTS / case / "case.json").read_text())
    return meta.get("runs_of", case)


if __name__ == "__main__":
    print(results_page())
