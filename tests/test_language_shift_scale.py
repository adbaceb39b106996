"""bench/language_shift_scale.py's reading of its runs, on run folders written here: the lead's
sign, which expert is the generalist, which rows the router's CE is averaged over, and which seeds
a scale's row reads (those whose two runs finished)."""
import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _bench():
    sys.path.insert(0, str(ROOT / "bench"))
    spec = importlib.util.spec_from_file_location("language_shift_scale", ROOT / "bench" / "language_shift_scale.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _write(folder: Path, ppl: float, gates=None, entropy=None, rows=()):
    folder.mkdir(parents=True)
    users = {u: {"test_ppl": ppl, "gates": gates[u], "gate_entropy": entropy[u]} for u in gates} if gates else {}
    (folder / "results.json").write_text(json.dumps({"mean_test_ppl": ppl, "per_user": users}))
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_the_lead_is_local_minus_comigs_and_the_signals_read_the_router_s_own_rows(tmp_path):
    bench = _bench()
    gates = {"de": [[0.8, 0.2], [0.6, 0.4]], "fr": [[0.3, 0.7], [0.5, 0.5]]}
    entropy = {"de": [0.5, 0.6], "fr": [0.3, 0.1]}
    rows = [{"round": 1, "user": "de", "router_valid_loss": 3.0}, {"round": 1, "user": "fr", "router_valid_loss": 5.0},
            {"round": 2, "user": "de", "router_valid_loss": 2.0}, {"round": 2, "user": "fr", "router_valid_loss": 4.0},
            {"round": 2, "user": "de", "test_ppl": 9.0}]  # an evaluation row: no router CE
    for seed, (local, comigs) in {1: (20.0, 21.0), 2: (22.0, 23.5)}.items():
        _write(tmp_path / "x1" / str(seed) / "local", local)
        _write(tmp_path / "x1" / str(seed) / "comigs-1g1s", comigs, gates, entropy, rows)
    _write(tmp_path / "x1" / "3" / "local", 19.0)  # seed 3's CoMiGS run did not finish: left out of the row
    out = bench.summarise([1, 2], [1, 2, 3], lambda scale, seed, m: tmp_path / f"x{scale}" / str(seed) / m, {1: 40.0, 2: 41.0, 3: 39.0})
    assert list(out) == ["x1"]  # x2 finished no seed: no row
    out = out["x1"]
    assert out["seeds"] == [1, 2] and out["pretrained_test_ppl"] == [40.0, 41.0]
    assert out["test_ppl"] == {"local": [20.0, 22.0], "comigs-1g1s": [21.0, 23.5]}
    assert out["comigs_lead_over_local"]["mean"] == pytest.approx(-1.25)  # Local ahead: negative
    assert math.isfinite(out["comigs_lead_over_local"]["half_width_95"])
    assert out["router_valid_loss"] == pytest.approx([4.0, 3.0])  # per round, the mean over users
    assert out["gate_entropy"] == pytest.approx([0.4, 0.35])  # per layer, the mean over users
    assert out["generalist_share"] == pytest.approx(0.55)  # expert 0: (0.7 + 0.4) / 2


def test_every_scale_multiplies_the_case_s_expert_iterations():
    bench = _bench()
    rounds, steps = bench.SCHEDULES[1]
    for k, (r, s) in bench.SCHEDULES.items():
        assert r * s == k * rounds * steps
        assert f"train.rounds={r}" in bench.schedule(k) and f"train.local_steps={s}" in bench.schedule(k)
