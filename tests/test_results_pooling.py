"""docs/results.md reads every committed case that ran a row's comparison the same way (bench/pooling.py):
cases are pooled seed by seed only where each method the row reads ran under the same effective
settings, a seed two cases hold is read from the row's own case, and a case left out says why."""
import importlib.util
import json
import sys
from pathlib import Path

import pytest
import yaml

from comix.config import load_config, to_dict

ROOT = Path(__file__).resolve().parents[1]


def _modules(results: Path, monkeypatch):
    sys.path.insert(0, str(ROOT / "bench"))
    spec = importlib.util.spec_from_file_location("results_page", ROOT / "bench" / "results_page.py")
    page = importlib.util.module_from_spec(spec)
    sys.modules["results_page"] = page  # its dataclass looks its module up
    spec.loader.exec_module(page)
    import cases
    monkeypatch.setattr(cases, "RESULTS", results)
    monkeypatch.setattr(page, "RESULTS", results)
    return page


def _case(results: Path, name: str, overrides: list[str], scores: dict[str, dict[int, float]]) -> None:
    """A committed case as bench/tables.py --save writes it: the run's config.yaml (what comix
    writes into a run folder), case.json, and per seed and method a results.json."""
    folder = results / name
    folder.mkdir(parents=True)
    cfg = load_config(None, ["corpus=multilingual", "model=tiny-llama", *overrides])
    (folder / "config.yaml").write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))
    (folder / "case.json").write_text(json.dumps({"kind": "users", "command": f"make {name}", "machine": "m",
                                                  "date": "d"}))
    for method, by in scores.items():
        for seed, x in by.items():
            d = folder / f"seed{seed}" / method.replace(":", "__")
            d.mkdir(parents=True)
            (d / "results.json").write_text(json.dumps({"method": method, "mean": x, "metric": "test_ppl",
                                                        "per_user": {"u0": {"test_ppl": x}}}))


def test_cases_run_the_same_way_are_pooled_and_a_seed_in_both_is_read_from_the_rows_own(tmp_path, monkeypatch):
    page = _modules(tmp_path, monkeypatch)
    _case(tmp_path, "grid", ["train.rounds=4"], {"comigs-1g1s": {42: 20.0}, "local": {42: 21.0},
                                                 "pretrained": {42: 40.0}})
    # the same settings on seeds 42 (another machine's last bits), 45 and 47, another grid and threads
    _case(tmp_path, "recent", ["train.rounds=4", "seeds=[42,45,47]", "seed=45", "threads=1", "run_dir=runs/x"], {"comigs-1g1s": {42: 99.0, 45: 20.2, 47: 20.1},
                                                   "local": {42: 99.0, 45: 21.1, 47: 21.3},
                                                   "pretrained": {42: 40.0, 45: 40.0, 47: 40.0}})
    # another schedule for the trained methods: left out, naming the setting
    _case(tmp_path, "longer", ["train.rounds=8"], {"comigs-1g1s": {50: 1.0}, "local": {50: 30.0},
                                                   "pretrained": {50: 40.0}})
    # another corpus: another column of the paper's table, not a candidate at all
    _case(tmp_path, "topics", ["corpus=topics", "train.rounds=4"], {"comigs-1g1s": {60: 1.0}, "local": {60: 30.0},
                                                                    "pretrained": {60: 40.0}})
    claim = page.Claim("CoMiGS Table 1", "Multilingual", "comigs-1g1s", "local", 47.19, 54.38, "grid", False, "mean")
    v = page.verdict(claim)
    assert v["cases"] == ["grid", "recent"]
    assert v["left_out"] == [("longer", "comigs-1g1s ran with train.rounds 8 there, 4 here")]
    # several settings differ: the schedule named before the data's sizes, and the count
    import pooling
    here = pooling.settings("grid", "comigs-1g1s")
    _case(tmp_path, "other", ["train.rounds=4", "data.test_tokens=1024", "train.local_steps=9", "train.eval_every=1",
                              "train.tau=1"], {"comigs-1g1s": {70: 1.0}, "local": {70: 30.0}, "pretrained": {70: 40.0}})
    assert page.verdict(claim)["left_out"][1] == (
        "other", f"comigs-1g1s ran with train.local_steps 9 there, {here['train.local_steps']} here; train.eval_every 1 "
                 f"there, {here['train.eval_every']} here; train.tau 1 there, {here['train.tau']} here (4 settings differ)")
    assert v["seeds"] == [42, 45, 47] and v["a"] == pytest.approx(20.1)  # seed 42 from grid, not 99
    assert v["verdict"].startswith("reproduced")  # 1.0, 0.9, 1.2 ahead: resolved on the pooled seeds
    assert v["counts"] == {"a": (3, 0, 0), "b": (3, 0, 0)}


def test_a_method_run_under_its_authors_defaults_in_one_case_is_not_pooled_with_a_user_set_optimiser(tmp_path, monkeypatch):
    """Two config.yaml files with one train.lr: in one the user set it, in the other the method took its
    authors' optimiser (FLoRA: 3e-4). The runs differ, so the cases are not pooled (comparing the
    files, not what each run resolved, would pool them)."""
    page = _modules(tmp_path, monkeypatch)
    import pooling
    _case(tmp_path, "set", ["train.lr=0.002"], {"flora": {42: 20.0}, "local": {42: 21.0}, "pretrained": {42: 40.0}})
    _case(tmp_path, "default", [], {"flora": {45: 20.0}, "local": {45: 21.0}, "pretrained": {45: 40.0}})
    assert yaml.safe_load((tmp_path / "set" / "config.yaml").read_text())["train"]["lr"] == \
        yaml.safe_load((tmp_path / "default" / "config.yaml").read_text())["train"]["lr"]
    read, left = pooling.cases_read("set", ["flora", "local"], ["pretrained"])
    assert read == ["set"] and left == [("default", "flora ran with train.lr 0.0003 there, 0.002 here")]
    # Local's optimiser is CoMiGS's either way: those two cases pool for Local against the base
    assert pooling.cases_read("set", ["local", "pretrained"], [])[0] == ["set", "default"]
    assert page.cases_of(page.Claim("P", "s", "flora", "local", 1.0, 2.0, "set", False, "mean"))[0] == ["set"]


def test_a_case_without_the_rows_trivial_baseline_is_left_out(tmp_path, monkeypatch):
    _modules(tmp_path, monkeypatch)
    import pooling
    _case(tmp_path, "grid", [], {"comigs-1g1s": {42: 20.0}, "fedavg": {42: 21.0}, "pretrained": {42: 40.0}})
    _case(tmp_path, "nobase", [], {"comigs-1g1s": {45: 20.0}, "fedavg": {45: 21.0}})
    # a case that never ran one of the row's methods does not measure its comparison: not named at all
    _case(tmp_path, "onlyone", [], {"comigs-1g1s": {47: 20.0}, "pretrained": {47: 40.0}})
    read, left = pooling.cases_read("grid", ["comigs-1g1s", "fedavg"], ["pretrained"])
    assert read == ["grid"] and left == [("nobase", "it holds no pretrained run (the row's trivial baseline)")]
