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
    # shares are proportions: 0.5 and 0.25 (a file's shares need not sum to 1) split clients 2 : 1
    fleet = Fleet([DeviceProfile("a", 0.5, 1, 1), DeviceProfile("b", 0.25, 1, 1)])
    assert [fleet.profile_of(c, 6).name for c in range(6)] == ["a", "a", "a", "a", "b", "b"]


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
    # availability is the probability of being there, not of being away (0.5 cannot tell them apart)
    for p in (0.1, 0.9):
        fleet = Fleet([DeviceProfile("p", 1.0, 1, 1, availability=p)])
        there = sum(fleet.available(c, 50, r, seed=3) for c in range(50) for r in range(1, 41)) / 2000
        assert abs(there - p) < 0.04, (p, there)  # 2,000 draws: a std of at most 0.011


def test_a_run_asks_only_the_devices_that_are_there(tmp_path):
    """In a run, a device of availability 1 is asked every round and one of availability 0.05
    almost never; the absent ones are recorded as unavailable, with nothing uploaded."""
    fleet = _fleet_file(tmp_path, "profiles:\n"
                                  "  - {name: rare, share: 0.5, memory_mb: 4096, tokens_per_s: 1000, availability: 0.05}\n"
                                  "  - {name: always, share: 0.5, memory_mb: 4096, tokens_per_s: 1000}\n")
    assert main(["run", *COMMON, f"fleet={fleet}", f"run_dir={tmp_path / 'run'}", "seed=1"]) == 0
    rows = [json.loads(x) for x in (tmp_path / "run" / "fedavg" / "server.jsonl").read_text().splitlines()]
    fleet_of = Fleet([DeviceProfile("rare", 0.5, 1, 1, availability=0.05), DeviceProfile("always", 0.5, 1, 1)])
    for rnd, r in enumerate(rows, 1):  # multilingual: de and fr rare, it and nl always there
        away = {str(c) for c in range(4) if not fleet_of.available(c, 4, rnd, 1)}
        assert set(r.get("dropped", {})) == away and set(r["dropped"].values()) <= {"unavailable"}
        assert {"2", "3"} <= set(r["uploads"]) and not away & set(r["uploads"])
    assert sum(len(r.get("dropped", {})) for r in rows) >= 4  # the rare devices were mostly away


def _at(need: dict[str, float], slices: int = 1) -> dict:
    return {(q, slices): v for q, v in need.items()}


def test_the_memory_plan_gives_each_device_the_least_compressed_base_that_fits_it():
    fleet = Fleet([DeviceProfile("phone-1gb", 0.5, 1024, 1), DeviceProfile("board-4gb", 0.5, 4096, 1)])
    need = _at({"none": 3000, "int8": 1500, "nf4": 900})
    quants = lambda settings: tuple(q for q, _ in settings)  # noqa: E731
    assert plan(fleet, [need] * 4, "auto", "m") == (("nf4", 1), ("nf4", 1), ("none", 1), ("none", 1))
    assert quants(plan(fleet, [need, need, _at({"none": 5000, "int8": 2000, "nf4": 1000}), need], "auto", "m")) == (
        "nf4", "nf4", "int8", "none")  # each device by its own need
    assert quants(plan(fleet, [need] * 4, ["nf4", "nf4", "int8", "none"], "m")) == ("nf4", "nf4", "int8", "none")
    with pytest.raises(ValueError, match=r"device 1 \(phone-1gb, 1024 MB\) cannot train m with quant=int8 "
                                         r"\(1500 MB\); quant=nf4 fits it"):
        plan(fleet, [need] * 4, ["nf4", "int8", "none", "none"], "m")
    with pytest.raises(ValueError, match=r"device 0 \(phone-1gb, 1024 MB\) cannot train m with quant=none"):
        plan(fleet, [need] * 4, "none", "m")
    with pytest.raises(ValueError, match=r"nothing fits device 0 \(phone-1gb, 1024 MB\) for m.*; "
                                         r"micro_batches=auto would also try its batch in slices"):
        plan(fleet, [_at({"none": 3000, "int8": 2000, "nf4": 1100})] * 4, "auto", "m")
    with pytest.raises(ValueError, match=r"nothing fits device 0") as refused:  # slices tried already: no hint
        plan(fleet, [_at({"none": 3000, "int8": 2000, "nf4": 1100})] * 4, "auto", "m", "auto")
    assert "micro_batches=auto" not in str(refused.value)


def test_micro_batches_come_before_a_more_compressed_base_and_only_as_many_as_the_budget_needs():
    fleet = Fleet([DeviceProfile("phone-1gb", 0.5, 1024, 1), DeviceProfile("board-4gb", 0.5, 4096, 1)])
    # slicing the batch shrinks the activations: full precision fits the phone in 4 slices, not 2
    need = {**_at({"none": 1300, "int8": 1000, "nf4": 900}), **_at({"none": 1100, "int8": 800, "nf4": 700}, 2),
            **_at({"none": 1000, "int8": 700, "nf4": 600}, 4)}
    assert plan(fleet, [need] * 4, "auto", "m", "auto") == (("none", 4), ("none", 4), ("none", 1), ("none", 1))
    assert plan(fleet, [need] * 4, "auto", "m", 2) == (("int8", 2), ("int8", 2), ("none", 2), ("none", 2))
    assert plan(fleet, [need] * 4, "auto", "m") == (("int8", 1), ("int8", 1), ("none", 1), ("none", 1))
    assert plan(fleet, [need] * 4, "nf4", "m", "auto") == (("nf4", 1), ("nf4", 1), ("nf4", 1), ("nf4", 1))
    with pytest.raises(ValueError, match=r"device 0 \(phone-1gb, 1024 MB\) cannot train m with quant=none, "
                                         r"micro_batches=2 \(1100 MB\); quant=none, micro_batches=4 fits it"):
        plan(fleet, [need] * 4, "none", "m", 2)


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
    # (on a model this small NF4's per-block statistics outweigh its halved codes: int8 stores less)
    assert need["none", 1] > max(need["int8", 1], need["nf4", 1]) > 0
    budget = (need["none", 1] + need["nf4", 1]) / 2  # fits quantised, not in full precision
    fleet = _fleet_file(tmp_path, f"profiles:\n  - {{name: small, share: 1.0, memory_mb: {budget}, tokens_per_s: 1}}\n")
    assert main(["run", *COMMON, f"fleet={fleet}", f"run_dir={tmp_path / 'run'}"]) == 2
    err = capsys.readouterr().err
    assert "device 0 (small, " in err and "cannot train fedavg with quant=none" in err and "quant=auto" in err
    assert not (tmp_path / "run").exists()


def test_a_bad_fleet_file_is_named_in_one_line(tmp_path, capsys):
    bad = _fleet_file(tmp_path, "profiles:\n  - {name: x, share: 1.0, memory: 5, tokens_per_s: 1}\n")
    assert main(["run", *COMMON, f"fleet={bad}", f"run_dir={tmp_path / 'run'}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith(f"comix: error: fleet {bad}:") and "memory" in err[-1]
    assert main(["run", *COMMON, f"fleet={tmp_path / 'none.yaml'}", f"run_dir={tmp_path / 'run'}"]) == 2
    assert "no such file" in capsys.readouterr().err and not (tmp_path / "run").exists()


GOOD_PROFILE = "{name: x, share: 1.0, memory_mb: 512, tokens_per_s: 100}"


@pytest.mark.parametrize("text, names", [
    ("profiles:\n  - {name: x, share: 1.0, memory_mb: 1GB, tokens_per_s: 100}\n", ("memory_mb", "'1GB'")),
    ("profiles:\n  - {name: x, share: 1.0, memory_mb: -5, tokens_per_s: 100}\n", ("memory_mb", "-5")),
    ("profiles:\n  - {name: x, share: 1.0, memory_mb: 512, tokens_per_s: fast}\n", ("tokens_per_s", "'fast'")),
    ("profiles:\n  - {name: x, share: 1.0, memory_mb: 512, tokens_per_s: 100, availability: 2}\n",
     ("availability", "2")),
    (f"- {GOOD_PROFILE}\n", ("must hold a mapping", "list")),
    (f"deadline_s: soon\nprofiles: [{GOOD_PROFILE}]\n", ("deadline_s", "'soon'")),
    (f"deadline_s: -5\nprofiles: [{GOOD_PROFILE}]\n", ("deadline_s", "-5")),
    (f"deadline: 5\nprofiles: [{GOOD_PROFILE}]\n", ("unknown key", "'deadline'")),
    ("profiles: phones\n", ("profiles must be a list",)),
])
def test_every_bad_fleet_value_is_refused_naming_the_file_the_key_and_the_value(tmp_path, text, names):
    from comix.fleet import load_fleet
    path = tmp_path / "f.yaml"
    path.write_text(text)
    with pytest.raises(ValueError) as err:
        load_fleet(str(path))
    line = str(err.value)
    assert "\n" not in line and line.startswith(f"fleet {path}: ") and all(n in line for n in names), line


def test_a_fleet_s_unit_string_stops_the_cli_before_any_run_directory(tmp_path, capsys):
    bad = _fleet_file(tmp_path, "profiles:\n  - {name: x, share: 1.0, memory_mb: 1GB, tokens_per_s: 1}\n")
    assert main(["run", *COMMON, f"fleet={bad}", f"run_dir={tmp_path / 'run'}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "memory_mb" in err[0] and "'1GB'" in err[0] and not (tmp_path / "run").exists()


def test_quant_auto_gives_each_device_its_own_base_and_each_trains_as_alone_at_that_precision(tmp_path):
    # Local: no client depends on another, so each client of a fleet whose devices differ in
    # precision must score exactly as in a run where every device has that client's precision
    from comix.config import load_config
    from comix.data import load_corpus, make_user_data
    from comix.engines.device import training_memory
    from comix.models import load_base_model
    from comix.runtime import resolve
    from comix.specs import build_algorithm
    common = [*COMMON, "methods=[local]", "train.rounds=1"]
    cfg = load_config(None, common)
    model, tok = load_base_model("tiny-llama")
    # measured where and as the run holds its base (on CUDA a step saves other tensors than on the CPU)
    model = resolve(cfg.device, cfg.precision).prepare_base(model)
    need = training_memory(model, build_algorithm(cfg, "local", 4), make_user_data(load_corpus(cfg.corpus), tok,
                                                                                   cfg.data)[0])
    fleet = _fleet_file(tmp_path, f"profiles:\n  - {{name: small, share: 0.5, memory_mb: {(need['none', 1] + need['nf4', 1]) / 2}, "
                                  "tokens_per_s: 1}\n  - {name: big, share: 0.5, memory_mb: 100000, tokens_per_s: 1}\n")
    assert main(["run", *common, f"fleet={fleet}", "quant=auto", f"run_dir={tmp_path / 'auto'}"]) == 0
    for q in ("int8", "none"):  # the small devices fit int8, the least-compressed that fits them
        assert main(["run", *common, f"quant={q}", f"run_dir={tmp_path / q}"]) == 0

    def read(run):
        metrics = [json.loads(x) for x in (tmp_path / run / "local" / "metrics.jsonl").read_text().splitlines()]
        res = json.loads((tmp_path / run / "local" / "results.json").read_text())["per_user"]
        return {m["user"]: m["base_mb"] for m in metrics if "base_mb" in m}, {u: r["test_ppl"] for u, r in res.items()}
    base_mb, ppl = read("auto")
    int8, none = read("int8"), read("none")
    assert base_mb == {"de": int8[0]["de"], "fr": int8[0]["fr"], "it": none[0]["it"], "nl": none[0]["nl"]}
    assert base_mb["de"] < base_mb["it"]
    assert ppl == pytest.approx({"de": int8[1]["de"], "fr": int8[1]["fr"], "it": none[1]["it"], "nl": none[1]["nl"]},
                                rel=1e-6)
    assert int8[1]["de"] != pytest.approx(none[1]["de"], rel=1e-6)  # the precisions do score differently


def test_the_plan_counts_what_a_device_reports_at_each_precision(tmp_path):
    """The planner's need at a precision is the training memory a device at that precision then
    reports: its step measured on the quantised base (whose dequantisation adds transients; a
    plan from the full-precision step put SmolLM2's 1 GB phones 22 MB over), the base's bytes as
    stored (NF4's statistics counted)."""
    from comix.config import load_config
    from comix.data import load_corpus, make_user_data
    from comix.engines.device import training_memory
    from comix.models import load_base_model
    from comix.runtime import resolve
    from comix.specs import build_algorithm
    common = [*COMMON, "methods=[comigs-1g1s]", "train.rounds=1", "train.local_steps=1"]
    cfg = load_config(None, common)
    model = resolve(cfg.device, cfg.precision).prepare_base(load_base_model("tiny-llama")[0])
    need = training_memory(model, build_algorithm(cfg, "comigs-1g1s", 4),
                           make_user_data(load_corpus(cfg.corpus), load_base_model("tiny-llama")[1], cfg.data)[0])
    for q in ("none", "int8", "q4", "nf4"):
        assert main(["run", *common, f"quant={q}", f"run_dir={tmp_path / q}"]) == 0
        rows = [json.loads(x) for x in (tmp_path / q / "comigs-1g1s" / "metrics.jsonl").read_text().splitlines()]
        reported = [r["memory_mb"] for r in rows if r.get("user") == "de" and "memory_mb" in r]
        assert reported and need[q, 1] == pytest.approx(reported[0], abs=2e-3), q


def test_quant_auto_needs_a_fleet_and_a_list_one_precision_per_client(tmp_path, capsys):
    assert main(["run", *COMMON, "quant=auto", f"run_dir={tmp_path / 'a'}"]) == 2
    assert "quant=auto picks each device's base precision from its memory budget: give a fleet" in capsys.readouterr().err
    assert main(["run", *COMMON, "quant=[nf4,none]", f"run_dir={tmp_path / 'b'}"]) == 2
    assert "quant gives 2 precisions for 4 clients" in capsys.readouterr().err
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_the_built_in_fleets_load_by_name_and_say_where_each_figure_comes_from(tmp_path, capsys):
    from comix.fleet import builtin_fleets, load_fleet
    assert builtin_fleets() == ["edge-boards", "mixed", "phones"]
    for name in builtin_fleets():
        fleet = load_fleet(name)
        assert fleet.profiles and all(p.source and p.problem() is None for p in fleet.profiles)
    mixed = load_fleet("mixed")  # the thirds at 1, 2 and 4 GB, two speeds
    assert [p.memory_mb for p in mixed.profiles] == [1024, 2048, 4096]
    assert len({p.tokens_per_s for p in mixed.profiles}) == 2
    assert main(["run", *COMMON, "fleet=tablets", f"run_dir={tmp_path / 'run'}"]) == 2
    assert "fleet tablets: no such file (built-in fleets: edge-boards, mixed, phones)" in capsys.readouterr().err


def test_the_capacity_plan_gives_each_device_the_most_experts_or_rank_its_budget_holds_at_its_precision():
    from comix.fleet import plan_capacity
    fleet = Fleet([DeviceProfile("small", 0.5, 1000, 1), DeviceProfile("big", 0.5, 4000, 1)])

    def need(base):  # each value adds 200 MB of trainable state and activations
        return _at({"none": base, "int8": base - 300, "nf4": base - 400})
    needs = {v: [need(800 + 200 * i)] * 4 for i, v in enumerate((2, 3, 4, 6, 8))}
    assert plan_capacity(fleet, needs, "none", "m") == [3, 3, 8, 8]
    # quant=auto: the small devices keep full precision (it fits 2 experts), so 3; never int8 for 4
    assert plan_capacity(fleet, needs, "auto", "m") == [3, 3, 8, 8]
    assert plan_capacity(fleet, needs, "nf4", "m") == [6, 6, 8, 8]  # a precision given: its room used
    tight = {v: [need(1100 + 200 * i)] * 4 for i, v in enumerate((2, 3, 4))}  # 2 experts need int8 on small
    assert plan_capacity(fleet, tight, "auto", "m") == [3, 3, 4, 4]  # int8 then, and 3 fit at int8
    with pytest.raises(ValueError, match="nothing fits device 0"):
        plan_capacity(fleet, {2: [need(1500)] * 4}, "auto", "m")


def test_experts_and_ranks_auto_are_sized_per_device_and_written_into_the_run_s_config(tmp_path, capsys):
    import yaml
    from comix.config import load_config
    from comix.data import load_corpus, make_user_data
    from comix.engines.device import training_memory
    from comix.models import load_base_model
    from comix.runtime import resolve
    from comix.specs import build_algorithm
    common = [*COMMON, "train.rounds=1", "train.local_steps=1"]
    cfg = load_config(None, common)
    model, tok = load_base_model("tiny-llama")
    model = resolve(cfg.device, cfg.precision).prepare_base(model)  # as the run holds its base
    users = make_user_data(load_corpus(cfg.corpus), tok, cfg.data)
    need = {v: training_memory(model, build_algorithm(cfg, f"comigs-1gxs:experts=[{v},{v},{v},{v}]", 4), users[0])["none", 1]
            for v in (3, 4)}
    fleet = _fleet_file(tmp_path, f"profiles:\n  - {{name: small, share: 0.5, memory_mb: {(need[3] + need[4]) / 2}, "
                                  "tokens_per_s: 1}\n  - {name: big, share: 0.5, memory_mb: 100000, tokens_per_s: 1}\n")
    run = tmp_path / "run"
    assert main(["run", *common, "methods=['comigs-1gxs:experts=auto']", f"fleet={fleet}", f"run_dir={run}"]) == 0
    assert yaml.safe_load((run / "config.yaml").read_text())["methods"] == ["comigs-1gxs:experts=[3,3,8,8]"]
    rows = [json.loads(x) for x in (run / "comigs-1gxs__experts=_3_3_8_8" / "metrics.jsonl").read_text().splitlines()]
    assert all(r["memory_mb"] <= (need[3] + need[4]) / 2 for r in rows if r["user"] in ("de", "fr") and "memory_mb" in r)
    for bad, words in ((["methods=['comigs-1gxs:experts=auto']"], "experts=auto sizes each device from a fleet"),
                       (["methods=['comigs-1g1s:experts=auto']", f"fleet={fleet}"], "comigs-1g1s can size nothing"),
                       (["methods=['fedavg:ranks=auto']", f"fleet={fleet}"], "fedavg can size nothing")):
        assert main(["run", *common, *bad, f"run_dir={tmp_path / 'bad'}"]) == 2
        assert words in capsys.readouterr().err and not (tmp_path / "bad").exists()


def test_a_gpt2_base_refuses_a_quantised_base_in_one_line_and_trains_in_a_fleet(tmp_path, capsys):
    """GPT-2's blocks are Conv1D, which bitsandbytes has no form of: quant=nf4 is refused before the
    model loads (it used to run unquantised while its metrics said nf4); a fleet plans it in full
    precision (planning used to end in an IndexError)."""
    gpt2 = [a if not a.startswith("model=") else "model=tiny-gpt2" for a in COMMON]
    assert main(["run", *gpt2, "quant=nf4", f"run_dir={tmp_path / 'nf4'}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "quant=nf4" in err[0] and "Conv1D" in err[0] and not (tmp_path / "nf4").exists()
    fleet = _fleet_file(tmp_path, "deadline_s: 0\nprofiles:\n  - {name: big, share: 1.0, memory_mb: 100000, "
                                  "tokens_per_s: 1000}\n")
    assert main(["run", *gpt2, "train.rounds=1", f"fleet={fleet}", "quant=auto", f"run_dir={tmp_path / 'f'}"]) == 0
    rows = [json.loads(x) for x in (tmp_path / "f" / "fedavg" / "metrics.jsonl").read_text().splitlines()]
    assert {r.get("quant") for r in rows if "quant" in r} == {"none"}


def test_memory_figures_read_with_a_decimal_where_small():
    from comix.fleet import Fleet, DeviceProfile, megabytes, plan
    assert megabytes(0.42) == "0.4 MB" and megabytes(917.4) == "917 MB"
    fleet = Fleet([DeviceProfile("tiny", 1.0, memory_mb=0.1, tokens_per_s=1)])
    with pytest.raises(ValueError, match=r"0\.4 MB with quant=none"):
        plan(fleet, [{("none", 1): 0.42}], "none", "fedavg")
