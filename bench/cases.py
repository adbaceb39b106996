"""Reading a committed case (``bench/results/<case>/``: case.json, config.yaml, per seed and method the
run's results.json and its xz-compressed logs) and the statistics every table and the results page
share: paired t intervals over seeds, the seeds a margin needs, majority-label baselines."""
from __future__ import annotations

import json
import lzma
import math
import statistics
from pathlib import Path

from scipy.stats import t as student_t

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"


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
    # ``seeds``: the seeds this case's table shows, where its runs hold more (a view of costs timed
    # on one machine, or methods compared on the seeds every one of them ran); a view of a case
    # reads that case's runs, not its ``seeds``
    for res in sorted((RESULTS / meta.get("runs_of", case)).glob("seed*/*/results.json")):
        spec, seed = json.loads(res.read_text())["method"], int(res.parent.parent.name[4:])
        if spec in meta.get("methods", [spec]) and seed in meta.get("seeds", [seed]):
            runs.setdefault(spec, {})[seed] = res.parent
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


def paired_p(diffs: list[float]) -> float:
    """The two-sided p-value of the paired t test that the mean difference is 0 (nan below 2 seeds)."""
    if len(diffs) < 2:
        return float("nan")
    sd = statistics.stdev(diffs)
    if sd == 0:
        return 0.0 if statistics.fmean(diffs) != 0 else 1.0
    return float(2 * student_t.sf(abs(statistics.fmean(diffs)) / (sd / len(diffs) ** 0.5), len(diffs) - 1))


def holm(ps: list[float]) -> list[float]:
    """Holm's step-down adjusted p-values (Holm 1979), in the order given: the i-th smallest of m
    is multiplied by m - i + 1 (i from 1), kept at least as large as the one before, capped at 1."""
    order = sorted(range(len(ps)), key=lambda i: ps[i])
    out, running = [0.0] * len(ps), 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (len(ps) - rank) * ps[i]))
        out[i] = running
    return out


def seeds_for_power(effect: float, sd: float, power: float = 0.8, cap: int = 1000) -> int | None:
    """The fewest seeds at which the two-sided 5 % paired t test detects a true mean difference of
    ``effect`` with probability ``power`` when the differences spread by ``sd`` (the noncentral t:
    power = P(|T| > t_crit), T ~ t'(n - 1, effect / sd x sqrt(n))); None past ``cap``."""
    from scipy.stats import nct
    if sd <= 0:
        return 2
    for n in range(2, cap + 1):
        crit = student_t.ppf(0.975, n - 1)
        nc = abs(effect) / sd * n ** 0.5
        # scipy's noncentral t gives nan for a far tail at a large noncentrality: that tail is
        # then ~0 (the lower one) or read from its complement (the upper one), not a skipped n
        upper = nct.sf(crit, n - 1, nc)
        upper = 1.0 - nct.cdf(crit, n - 1, nc) if math.isnan(upper) else upper
        lower = nct.cdf(-crit, n - 1, nc)
        if (1.0 if math.isnan(upper) else upper) + (0.0 if math.isnan(lower) else lower) >= power:
            return n
    return None


def sd_range(sd: float, n: int) -> tuple[float, float]:
    """The 95 % interval of a standard deviation measured on ``n`` values (chi-square, n - 1 df)."""
    from scipy.stats import chi2
    return sd * ((n - 1) / chi2.ppf(0.975, n - 1)) ** 0.5, sd * ((n - 1) / chi2.ppf(0.025, n - 1)) ** 0.5


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
