"""What a report reads: the method folders of a run, compare or method folder, their records, and
which model each method's scores are of."""
from __future__ import annotations

import json
from pathlib import Path


class ReportError(ValueError):
    pass


def _is_method_folder(path: Path) -> bool:
    """A method folder's results.json is one method's dict (a run's is the list of them)."""
    try:
        return isinstance(json.loads((path / "results.json").read_text()), dict)
    except (OSError, ValueError):
        return False


def find_runs(path: Path) -> dict[str, dict[int, Path]]:
    """{method spec: {seed: method folder}} of a run, compare or method folder. A method that never
    trains (Pretrained) has results.json alone: it is found too, for the results table."""
    path = Path(path)
    if _is_method_folder(path):
        dirs = [(path, _seed_of(path.parent))]
    else:
        dirs = [(d.parent, int(d.parent.parent.name[4:])) for d in sorted(path.glob("seed*/*/results.json"))]
        dirs += [(d.parent, _seed_of(path)) for d in sorted(path.glob("*/results.json")) if _is_method_folder(d.parent)]
    if not dirs:
        raise ReportError(f"{path} is not a comix run: no <method>/results.json (nor seed<S>/<method>/results.json)")
    out: dict[str, dict[int, Path]] = {}
    for d, seed in dirs:
        spec = json.loads((d / "results.json").read_text())["method"]
        out.setdefault(spec, {})[seed] = d
    return out


def _seed_of(run_dir: Path) -> int:
    import yaml
    cfg = run_dir / "config.yaml"
    return int((yaml.safe_load(cfg.read_text()) or {}).get("seed", 0)) if cfg.exists() else 0


def jsonl(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def results_of(runs: dict[str, dict[int, Path]]) -> dict[str, dict[int, dict]]:
    return {spec: {s: json.loads((d / "results.json").read_text()) for s, d in by.items()} for spec, by in runs.items()}


def scoring_rule(spec: str) -> str:
    """Which model a method's scores are of, from its class (the README's method table)."""
    from ..algorithms import REGISTRY, Algorithm
    cls = REGISTRY[spec.split(":")[0]][0]
    if not cls.trains:
        return "the frozen base"
    if cls.needs_server_data:
        return "the server's global model, on the server's test data per domain"
    if cls.pooled:
        return "the one model trained on every user's data"
    if cls.is_shared is Algorithm.is_shared:
        return "each client's own model after its local training (nothing is shared)"
    if cls.evaluate_local:
        return "each client's model after its local training, before aggregation"
    return "each client's model after it takes the round's new payload"
