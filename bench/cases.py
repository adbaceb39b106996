"""Reading a committed case (``bench/results/<case>/``: case.json, config.yaml, per seed and method the
run's results.json and its xz-compressed logs) and the statistics every table and the results page
share: paired t intervals over seeds, the seeds a margin needs, majority-label baselines."""
from __future__ import annotations

import json
import lzma
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
