"""Devices as they are (comix/fleet.py): profiles by share, a deadline that drops exactly the
devices too slow for it, availability draws, and a memory plan that refuses what cannot fit."""
import json

import pytest

from comix.cli import main
from comix.fleet import DeviceProfile, Fleet, plan

COMMON = ["model=tiny-llama", "methods=[fedavg]", "train.rounds=3", "train.local_steps=3", "train.batch_size=2",
          "train.seq_len=32", "data.valid_tokens=512", "data.test_tokens=512"]


def _fleet_file(tmp_path, text):
    f = tmp_path / "fleet.yaml"
    f.write_text(text)
    return f


def test_profiles_follow_the_shares_in_client_order():
    fleet = Fleet([DeviceProfile("a", 0.25, 1, 1), DeviceProfile("b", 0.5, 1, 1), DeviceProfile("c", 0.25, 1, 1)])
    assert [fleet.profile_of(c, 8).name for c in range(8)] == ["a", "a", "b", "b", "b", "b", "c", "c"]


def test_a_deadline_drops_exactly_the_devices_too_slow_for_it_and_aggregates_the_rest(tmp_path):
    # 3 steps x 2 x 32 = 192 tokens a round: 1.92 s at 100 tokens/s (late), 0.19 s at 1000 (in time)
    fleet = _fleet_file(tmp_path, "deadline_s: 1.0\nprofiles:\n"
                                  "  - {name: slow, share: 0.5, memory_mb: 4096, tokens_per_s: 100}\n"
                                  "  - {name: fast, share: 0.5, memory_mb: 4096, tokens_per_s: 1000}\n")
    assert main(["run", *COMMON, f"fleet={fleet}", f"run_dir={tmp_path / 'run'}"]) == 0
    rows = [json.loads(x) for x in (tmp_path / "run" / "fedavg" / "server.jsonl").read_text().splitlines()]
    for r in rows:  # multilingual: 4 users, de and fr slow, it and nl fast
        assert r["dropped"] == {"0": "deadline", "1": "deadline"} and sorted(r["uploads"]) == ["2", "3"]
    metrics = [json.loads(x) for x in (tmp_path / "run" / "fedavg" / "metrics.jsonl").read_text().splitlines()]
    assert {m["user"]: m["device_s"] for m in metrics if m["round"] == 1} == {"de": 1.92, "fr": 1.92, "it": 0.192,
                                                                             "nl": 0.192}
    assert all(m["bytes_up"] == 0 for m in metrics if m.get("dropped"))  # nothing of a late device is used


def test_availability_is_drawn_per_device_and_round_from_the_seed():
    fleet = Fleet([DeviceProfile("p", 1.0, 1, 1, availability=0.5)])
    draws = [[fleet.available(c, 10, r, seed=3) for c in range(10)] for r in range(1, 6)]
    assert draws == [[fleet.available(c, 10, r, seed=3) for c in range(10)] for r in range(1, 6)]
    share = sum(map(sum, draws)) / 50
    assert 0.3 < share < 0.7 and draws[0] != draws[1]
    assert all(Fleet([DeviceProfile("p", 1.0, 1, 1)]).available(c, 10, 1, 3) for c in range(10))


def test_the_memory_plan_takes_the_least_compressed_base_that_fits_every_device():
    fleet = Fleet([DeviceProfile("phone-1gb", 0.5, 1024, 1), DeviceProfile("board-4gb", 0.5, 4096, 1)])
    assert plan(fleet, {"none": 3000, "int8": 1500, "nf4": 900}, "m") == ("nf4", {"phone-1gb": "nf4",
                                                                                 "board-4gb": "none"})
    assert plan(fleet, {"none": 1000, "int8": 600, "nf4": 500}, "m")[0] == "none"
    with pytest.raises(ValueError, match="nothing fits device 'phone-1gb' \\(1024 MB\\) for m"):
        plan(fleet, {"none": 3000, "int8": 2000, "nf4": 1100}, "m")


def test_a_run_whose_base_does_not_fit_a_device_is_refused_naming_the_precision_that_would(tmp_path, capsys):
    from comix.config import load_config
    from comix.data import load_corpus, make_user_data
    from comix.engines.device import training_memory
    from comix.models import load_base_model
    from comix.specs import build_algorithm
    cfg = load_config(None, COMMON)
    model, tok = load_base_model("tiny-llama")
    need = training_memory(model, build_algorithm(cfg, "fedavg", 4), make_user_data(load_corpus(cfg.corpus), tok,
                                                                                    cfg.data)[0])
    assert need["none"] > need["int8"] > need["nf4"] > 0
    budget = (need["none"] + need["nf4"]) / 2  # fits quantised, not in full precision
    fleet = _fleet_file(tmp_path, f"profiles:\n  - {{name: small, share: 1.0, memory_mb: {budget}, tokens_per_s: 1}}\n")
    assert main(["run", *COMMON, f"fleet={fleet}", f"run_dir={tmp_path / 'run'}"]) == 2
    err = capsys.readouterr().err
    assert "device 'small' cannot train fedavg with quant=none" in err and "fits every device" in err
    assert not (tmp_path / "run").exists()


def test_a_bad_fleet_file_is_named_in_one_line(tmp_path, capsys):
    bad = _fleet_file(tmp_path, "profiles:\n  - {name: x, share: 1.0, memory: 5, tokens_per_s: 1}\n")
    assert main(["run", *COMMON, f"fleet={bad}", f"run_dir={tmp_path / 'run'}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith(f"comix: error: fleet {bad}:") and "memory" in err[-1]
    assert main(["run", *COMMON, f"fleet={tmp_path / 'none.yaml'}", f"run_dir={tmp_path / 'run'}"]) == 2
    assert "no such file" in capsys.readouterr().err and not (tmp_path / "run").exists()
