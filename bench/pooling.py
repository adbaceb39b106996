"""Which committed cases a results row reads: its own case, and every other case that ran the row's
methods under the same settings, pooled seed by seed; every other case that ran both methods on
the row's data is left out with the settings that differ.

Two cases are pooled for a row only when each method the row reads (its two, and the untrained base
where that is the trivial baseline) ran under the same effective settings in both: the case's
committed config.yaml with the method's spec and its authors' defaults applied
(``comix.specs.spec_config``, what the run itself resolves), less what names the grid (methods,
seeds, seed, run_dir) or only sets how fast it ran (threads), and the list of train keys the user
set (``spec_config`` has already applied what it decides). A seed two pooled cases hold is read
once, from the first: the row's own case.
"""
from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path

import cases  # cases.RESULTS read at each call: tests point it elsewhere

GRID = {"methods", "seeds", "seed", "run_dir", "threads", "explicit_train"}
SETTING = ("corpus", "data.mode")  # the paper's column a case stands for


def _flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


@lru_cache(maxsize=None)
def _settings(folder: str, spec: str, config_text: str) -> tuple:
    from comix.config import load_config, to_dict
    from comix.specs import spec_config
    cfg = spec_config(load_config(text=config_text), spec)
    flat = {k: v for k, v in _flat(to_dict(cfg)).items() if k.split(".")[0] not in GRID}
    return tuple(sorted(flat.items(), key=lambda kv: kv[0]))


def settings(case: str, spec: str) -> dict:
    """The effective settings ``spec`` ran under in ``case`` (its committed config.yaml resolved)."""
    folder = cases.RESULTS / _own(case)
    return dict(_settings(str(folder), spec, (folder / "config.yaml").read_text()))


def difference(case: str, other: str, specs: list[str], shown: int = 3) -> str | None:
    """How the first of ``specs`` that ran differently in ``other`` than in ``case`` differs: its
    first ``shown`` differing settings, the schedule and the base before the data's sizes (what
    most changes a result first), and how many differ in all (None: every spec ran the same way)."""
    for spec in specs:
        mine, theirs = settings(case, spec), settings(other, spec)
        keys = sorted((k for k in set(mine) | set(theirs) if mine.get(k) != theirs.get(k)), key=_weight)
        if keys:
            said = "; ".join(f"{k} {_show(theirs.get(k))} there, {_show(mine.get(k))} here" for k in keys[:shown])
            more = f" ({len(keys)} settings differ)" if len(keys) > shown else ""
            return f"{spec} ran with {said}{more}"
    return None


# shown in this order, then the rest: the base, the schedule, the optimiser, the adapters, the data
FIRST = ("model", "precision", "quant", "train.rounds", "train.local_steps", "train.lr", "train.batch_size",
         "train.", "lora.", "comigs.", "data.")


def _weight(key: str) -> tuple:
    return next((i for i, p in enumerate(FIRST) if key == p or key.startswith(p)), len(FIRST)), key


def _show(v) -> str:
    return json.dumps(v) if isinstance(v, (list, dict, str)) or v is None else str(v)


def _own(case: str) -> str:
    """The folder that holds ``case``'s runs (a view's ``runs_of``)."""
    return json.loads((cases.RESULTS / case / "case.json").read_text()).get("runs_of", case)


@lru_cache(maxsize=None)
def _held(folder: str) -> frozenset:
    """The specs a case folder holds runs of (read once: every row scans every case)."""
    return frozenset(json.loads(r.read_text())["method"] for r in Path(folder).glob("seed*/*/results.json"))


def candidates(specs: list[str]) -> list[str]:
    """Every committed case whose own runs hold each of ``specs`` (a view of another case's runs is
    that case)."""
    out = []
    for meta in sorted(cases.RESULTS.glob("*/case.json")):
        folder = meta.parent
        if "runs_of" in json.loads(meta.read_text()) or not (folder / "config.yaml").exists():
            continue
        if all(s in _held(str(folder)) for s in specs):
            out.append(folder.name)
    return out


def cases_read(case: str, compared: list[str], gate: list[str]) -> tuple[list[str], list[tuple[str, str]]]:
    """(the cases a row reads, its own first; [(a case left out, why)]) for a row comparing the two
    specs ``compared`` on ``case``, gated on ``gate`` (the trivial baseline's own runs, where it has
    them: a pooled case must hold those too, run the same way). Only cases of the row's setting (its
    corpus and split mode) are considered: a case on other data measures another column."""
    own = _own(case)
    read, left = [case], []
    for other in candidates(compared):
        if other == own or any(settings(other, compared[0]).get(k) != settings(case, compared[0]).get(k)
                               for k in SETTING):
            continue
        missing = [s for s in gate if s not in _held(str(cases.RESULTS / other))]
        why = difference(case, other, compared) or (
            f"it holds no {', '.join(missing)} run (the row's trivial baseline)" if missing
            else difference(case, other, gate))
        if why:
            left.append((other, why))
        else:
            read.append(other)
    return read, left


def pooled(parts: list[dict]) -> dict:
    """{key: {seed: x}} of several cases as one: a seed two cases hold, from the first."""
    out: dict = {}
    for part in parts:
        for key, by in part.items():
            for seed, x in by.items():
                out.setdefault(key, {}).setdefault(seed, x)
    return out
