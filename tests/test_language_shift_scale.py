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


def test_a_later_run_keeps_the_scales_it_did_not_read_with_the_command_that_measured_them():
    bench = _bench()
    row = lambda seeds: {"seeds": seeds, "test_ppl": {}}  # noqa: E731
    earlier = {"setting": "s", "overrides": [], "command": "c12", "date": "d1", "machine": "m1",
               "x1_against_case": {"local seed 42": 0.0}, "scales": {"x1": row([42, 45]), "x2": row([42, 45, 47])}}
    now = {"setting": "s", "overrides": [], "command": "c24", "date": "d2", "machine": "m2", "x1_against_case": None,
           "scales": {"x2": row([42]), "x4": row([45])}}
    out = bench.kept_scales(json.loads(json.dumps(earlier)), json.loads(json.dumps(now)))
    assert list(out["scales"]) == ["x1", "x2", "x4"]  # in scale order
    assert out["scales"]["x2"]["seeds"] == [42]  # a scale read again is the new reading
    assert out["scales"]["x1"]["measured"] == {"command": "c12", "date": "d1", "machine": "m1"}
    assert out["scales"]["x4"]["measured"] == {"command": "c24", "date": "d2", "machine": "m2"}
    assert out["seeds"] == [42, 45] and out["x1_against_case"] == {"local seed 42": 0.0}
    for other in ({**earlier, "setting": "t"}, {**earlier, "overrides": ["model=tiny-llama"]}):
        assert list(bench.kept_scales(other, json.loads(json.dumps(now)))["scales"]) == ["x2", "x4"]


def test_passes_cut_each_user_s_train_split_so_the_schedule_reads_it_that_many_times(tmp_path):
    bench = _bench()
    for scale, (rounds, steps) in bench.SCHEDULES.items():
        tokens = bench.train_tokens(scale, 2.0)
        assert tokens == [rounds * steps * 4 * 128 // 2] * 4  # batch 4 x 128 tokens a step, 4 users
    assert bench.PAPER_PASSES == pytest.approx(3.32, abs=0.01)  # App. B.1 over Table 4's users
    assert bench.point(1, None) == "x1" and bench.point(1, 3.3) == "x1-train2482"
    _write(tmp_path / "local", 20.0)
    _write(tmp_path / "comigs-1g1s", 21.0, {"de": [[0.5, 0.5]]}, {"de": [0.6]}, [{"round": 1, "router_valid_loss": 3.0}])
    out = bench.summarise([1], [7], lambda scale, seed, m: tmp_path / m, None, passes=4.0)
    assert list(out) == ["x1-train2048"] and out["x1-train2048"]["train_tokens_per_user"] == 2048 and out["x1-train2048"]["passes"] == 4.0
    assert bench.summarise([1], [7], lambda scale, seed, m: tmp_path / m, None)["x1"]["train_tokens_per_user"] is None
    # passes read: the schedule's tokens (rounds x steps x 4 x 128) over the cut split, else the case's splits
    assert bench.passes_read(out["x1-train2048"], [10**6]) == pytest.approx([4.0, 4.0])
    assert bench.passes_read({"rounds_x_local_steps": [16, 8], "train_tokens_per_user": None},
                             [655_360, 524_288]) == pytest.approx([0.1, 0.125])  # fewest over the largest split
    now = {"setting": "s", "overrides": [], "command": "c", "date": "d", "machine": "m", "x1_against_case": None,
           "scales": {"x1-train2048": {"seeds": [7]}}}
    earlier = {**now, "scales": {"x2": {"seeds": [7]}, "x1": {"seeds": [7]}}}
    assert list(bench.kept_scales(earlier, now)["scales"]) == ["x1", "x1-train2048", "x2"]


def _finished_seed(work: Path, name: str, seed: int, local: float, comigs: float):
    """A point-seed's compare folder as comix leaves it: config.yaml first, then each method's run."""
    (work / name).mkdir(parents=True)
    (work / name / "config.yaml").write_text("seed: 0\n")
    _write(work / name / f"seed{seed}" / "local", local)
    _write(work / name / f"seed{seed}" / "comigs-1g1s", comigs, {"de": [[0.6, 0.4]]}, {"de": [0.5]},
           [{"round": 1, "user": "de", "router_valid_loss": 3.0 + seed / 100}])


def test_a_point_s_seeds_run_in_different_sessions_are_kept_and_read_together(tmp_path, monkeypatch):
    """A seed kept from an earlier session (its runs/ gone) is read beside one finished here, its
    router rows and all; a kept seed is not trained again; each seed names the run that measured it."""
    bench = _bench()
    work, kept = tmp_path / "runs", tmp_path / "kept"
    _finished_seed(work, "x8-seed42", 42, 20.0, 21.0)
    first = {"command": "python bench/language_shift_scale.py --scales 8 --seeds 42", "machine": "m1", "date": "d1"}
    bench.run(8, 42, work, tmp_path / "config.yaml", kept=kept, measured=first)  # finished: kept, not trained
    assert json.loads((kept / "x8-seed42" / "measured.json").read_text())["command"] == first["command"]
    assert (kept / "x8-seed42" / "seed42" / "comigs-1g1s" / "metrics.jsonl.xz").exists()
    assert not list(kept.glob(".*.tmp"))
    import shutil
    shutil.rmtree(work)  # the next session: a fresh work tree
    monkeypatch.setattr(bench.subprocess, "run", lambda *a, **k: pytest.fail(f"trained a kept seed: {a}"))
    bench.run(8, 42, work, tmp_path / "config.yaml", kept=kept, measured={**first, "date": "d2"})
    _finished_seed(work, "x8-seed47", 47, 22.0, 21.5)
    bench.keep(work / "x8-seed47", 47, kept, {"command": "c47", "machine": "m2", "date": "d2"})
    (work / "x8-seed47" / "seed47" / "local" / "results.json").write_text(json.dumps({"mean_test_ppl": 23.0, "per_user": {}}))
    out = bench.summarise([8], [42, 45, 47], bench.finished(work, kept, None), {42: 40.0, 45: 40.0, 47: 40.0},
                          kept=kept)["x8"]
    assert out["seeds"] == [42, 47]  # 45 ran nowhere
    assert out["test_ppl"] == {"local": [20.0, 23.0], "comigs-1g1s": [21.0, 21.5]}  # a run here before its kept copy
    assert out["router_valid_loss"] == pytest.approx([(3.42 + 3.47) / 2])  # the kept seed's router rows, unpacked
    assert [(g["command"], g["seeds"]) for g in out["measured"]] == [(first["command"], [42]), ("c47", [47])]
    assert all(isinstance(w, int) and w >= 0 for g in out["measured"] for w in g["wall_s"])
    # a rehearsal keeps nothing and reads only its own runs
    assert bench.finished(work, None, None)(8, 42, "local") == work / "x8-seed42" / "seed42" / "local"
