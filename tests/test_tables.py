"""bench/tables.py: the generated tables of the README and docs equal what their committed result
files give (a doc cannot drift from its numbers), and the paired intervals are the t intervals."""
import importlib.util
import json
import lzma
import shutil
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]


def _tables():
    spec = importlib.util.spec_from_file_location("tables", ROOT / "bench" / "tables.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_generated_table_matches_its_result_files(capsys):
    assert _tables().main(["--check"]) == 0, capsys.readouterr().out


def test_a_case_renders_paired_differences_and_a_stale_doc_is_caught(tmp_path, monkeypatch):
    tables = _tables()
    monkeypatch.setattr(sys.modules["cases"], "RESULTS", tmp_path / "results")
    scores = {"fedamole": [10.0, 12.0, 14.0], "fedmole": [11.0, 12.5, 16.0]}
    for m, xs in scores.items():
        for seed, x in zip((1, 2, 3), xs):
            d = tmp_path / "results" / "c" / f"seed{seed}" / m
            d.mkdir(parents=True)
            (d / "results.json").write_text(json.dumps({"method": m, "mean": x}))
            with lzma.open(d / "server.jsonl.xz", "wt") as fh:
                fh.write("")
    (tmp_path / "results" / "c" / "case.json").write_text(json.dumps(
        {"kind": "ablation", "command": "cmd", "machine": "m", "date": "d", "order": ["fedamole", "fedmole"]}))
    out = tables.table("c")
    # differences 1, 0.5, 2: mean 1.1667, sd 0.7638, half-width 4.303 * 0.7638 / sqrt(3) = 1.8975
    assert "| fedmole | 13.17 (2.09) | 11.00 / 12.50 / 16.00 | +1.17 [-0.73, +3.06] | - |" in out
    assert sys.modules["cases"].paired_interval([1, 0.5, 2]) == pytest.approx((7 / 6, 4.303 * 0.763763 / 3 ** 0.5), rel=1e-4)
    # the paper's gap (fedamole 1.5 points ahead of fedmole): at sd 0.7638, t(n-1) * 0.7638 / sqrt(n) < 1.5
    # first at n = 4 (3.182 * 0.3819 = 1.215; n = 3 gives 1.90)
    meta = json.loads((tmp_path / "results" / "c" / "case.json").read_text())
    (tmp_path / "results" / "c" / "case.json").write_text(json.dumps({**meta, "paper_gaps": {"fedmole": 1.5}}))
    assert "The paper puts fedamole 1.50 points ahead of fedmole; at this case's spread of that difference " \
           "(sample std 0.76 over 3 seeds), a 95 % interval narrower than that gap needs 4 seeds." in tables.table("c")
    # a grid saved before its seeds are all in says so above its table, and is not read
    (tmp_path / "results" / "c" / "case.json").write_text(json.dumps({**meta, "partial": "seed 1 of 1, 2, 3"}))
    assert tables.table("c").startswith("**Partial case, not to be read yet**: seed 1 of 1, 2, 3.")
    (tmp_path / "results" / "c" / "case.json").write_text(json.dumps(meta))
    assert "Partial" not in tables.table("c")
    doc = tmp_path / "doc.md"
    doc.write_text("x\n<!-- table: c -->\nold\n<!-- end table -->\n")
    monkeypatch.setattr(tables, "DOCS", [doc])
    monkeypatch.setattr(tables, "ROOT", tmp_path)
    assert tables.main(["--check"]) == 1
    assert tables.main([]) == 0 and tables.main(["--check"]) == 0 and "+1.17 [-0.73, +3.06]" in doc.read_text()


def test_deepfusion_case_chooses_vaa_s_weight_on_validation_and_pairs_against_fedkmt(tmp_path, monkeypatch):
    """The sweep's choice reads valid_* only (alpha=10 is better on test, alpha=1 on validation:
    alpha=1 is chosen and stands for the sweep below); the paired differences are the chosen spec's
    minus FedKMT's per seed; the premise row reads each device's dominant domain from partition.json."""
    tables = _tables()
    monkeypatch.setattr(sys.modules["cases"], "RESULTS", tmp_path / "results")
    case = tmp_path / "results" / "df"
    #                  seed:   1     2     3      (test, valid) answer log ppl, the same in both domains
    scores = {"fedkmt": ([3.0, 3.2, 3.1], [3.0, 3.0, 3.0]),
              "deepfusion:alpha=1.0": ([2.9, 3.0, 3.0], [2.0, 2.0, 2.0]),
              "deepfusion:alpha=10.0": ([1.0, 1.0, 1.0], [2.5, 2.5, 2.5])}
    grad = {"step": [1], "ce": [[1.0, 0.5]], "fm": [[1.0, 0.25]], "kl": [[1.0, 0.25]], "cos_fm_rest": [-0.5]}
    # 10 KD steps: CE above FedKMT's by `early` in the first two (a fifth), by `late` in the last two;
    # the feature loss (not FedKMT's: it has none) from 2.0 to `fm_end`
    steps = {m: {"ce": [3.0 + early] * 2 + [3.0] * 6 + [3.0 + late] * 2, "kl": [1.0 + kl] * 10,
                 "fm": [2.0] * 2 + [1.0] * 6 + [fm_end] * 2}
             for m, early, late, kl, fm_end in (("fedkmt", 0, 0, 0, 0.0), ("deepfusion:alpha=1.0", 0.2, 0.05, -0.1, 0.5),
                                                ("deepfusion:alpha=10.0", 0.4, 0.3, 0, 0.7))}
    for m, (test, valid) in scores.items():
        for seed, t, v in zip((1, 2, 3), test, valid):
            d = case / f"seed{seed}" / m
            d.mkdir(parents=True)
            per = {"a": t, "b": t + 1}
            (d / "results.json").write_text(json.dumps({"method": m, "per_user": {
                dom: {"test_answer_log_ppl": x, "valid_answer_log_ppl": v, "test_log_ppl": x + 1, "test_answer_acc": 1.0,
                      "test_base_answer_log_ppl": 9.0, "test_base_log_ppl": 9.5} for dom, x in per.items()}}))
            with lzma.open(d / "server.jsonl.xz", "wt") as fh:
                fh.write(json.dumps({"kd": [{"grad": grad, "steps": steps[m]}], "clients": [0, 1], "devices": ["base", "prune:2:32"],
                                     "in_domain": {"devices": {"0": {"a": 1.0, "b": 2.0}, "1": {"a": 1.5, "b": 0.4 + seed / 10}},
                                                   "student": {"a": 1.25, "b": 1.0},
                                                   "public": {"devices": {"0": {"a": 0.5, "all": 2.0 + seed}},
                                                              "student": {"a": 1.5, "all": 2.5}}}})
                         + "\n")
    (case / "partition.json").write_text(json.dumps({"client0": {"mixture": {"a": 0.9, "b": 0.1}},
                                                     "client1": {"mixture": {"a": 0.2, "b": 0.8}}}))
    (case / "case.json").write_text(json.dumps({"kind": "deepfusion", "reference": "fedkmt", "command": "cmd",
                                                "machine": "m", "date": "d", "order": ["fedkmt", *list(scores)[1:]],
                                                "sweep": list(scores)[1:]}))
    out = tables.table("df")
    assert "Chosen on the server's validation documents: deepfusion:alpha=1.0 (the lowest mean validation answer log perplexity over seeds 1, 2, 3;" in out
    assert "| deepfusion:alpha=1.0 (chosen) | 2.000 (0.000) | 3.467 (0.047) | 0.250 | -0.500 | +0.200 / +0.050 | " \
           "-0.100 / -0.100 | 2.000 / 0.500 |" in out
    assert "| deepfusion:alpha=10.0 | 2.500 (0.000) | 1.500 (0.000) | 0.250 | -0.500 | +0.400 / +0.300 | +0.000 / +0.000 " \
           "| 2.000 / 0.700 |" in out
    # the chosen spec stands for the sweep in the per-domain and paired tables
    assert "| deepfusion:alpha=10.0 |" not in out.split("per domain")[1].split("What more weight")[0]
    # seed differences -0.1, -0.2, -0.1: mean -0.1333, half-width 4.303 * 0.05774 / sqrt(3) = 0.1434
    assert "| deepfusion:alpha=1.0 | -0.133 [-0.277, +0.010] | -0.133 [-0.277, +0.010] | -0.133 [-0.277, +0.010] |" in out
    # at that spread (std 0.0577) the paper's edges over FedKMT (0.011, 0.021 nats) need 107 and 32 seeds
    assert "(sample std 0.0577 over 3 seeds), the seeds a 95 % interval needs to be narrower than the paper's edge over " \
           "FedKMT (Table I, open-ended QA): 107 for its N = 32 edge (0.011 nats), 32 for its N = 16 edge (0.021 nats)." in out
    assert "| dense base (before distillation) | 9.000 (0.000) | 9.000 (0.000) | 9.000 (0.000) | - | 9.500 (0.000) |" in out
    assert "| fedkmt | 3.100 (0.082) | 4.100 (0.082) | 3.600 (0.082) | 1.00 (0.00) | 4.600 (0.082) |" in out
    # beside it the premise on the public text, its own domain's stream (a) and pooled, where the run measured it
    assert "| 1 | client0 | base | a (0.90) | 1.0000 | 1.2500 | -0.2500 | 0.5000 | 1.5000 | -1.0000 | +0.5000 |" in out
    assert "|  | client1 | prune:2:32 | b (0.80) | 0.5000 | 1.0000 | -0.5000 | - | - | - | - |" in out
    # per domain: the teachers' edge over the seeds (b: -0.5, -0.4, -0.3) beside FedKMT minus the base
    # (3.1 - 9 on a, 4.1 - 9 on b) and the chosen spec minus FedKMT
    # (one device dominant in each domain, counted once however many seeds ran it)
    assert "| a | 1 | -0.2500 | -0.2500 | -5.900 | -0.133 |" in out
    assert "| b | 1 | -0.4000 | -0.5000 | -4.900 | -0.133 |" in out
    # what it would take: test minus FedKMT (-0.133; -2.1) per percentage point of the 0.25 share; KD's CE
    # gap from +0.2 to +0.05 between fifths 8 steps apart: -1.875 per 100 steps, closed 0.05 * 8 / 0.15
    # = 2.7 steps later (alpha=10: from +0.4 to +0.3, 0.3 * 8 / 0.1 = 24)
    take = out.split("What more weight and more steps would take")[1]
    assert "| deepfusion:alpha=1.0 | 0.250 | -0.133 | -0.0053 | -1.8750 | 3 |" in take
    assert "| deepfusion:alpha=10.0 | 0.250 | -2.100 | -0.0840 | -1.2500 | 24 |" in take
    # a spec on fewer seeds than the case names its seeds wherever its mean sits beside others'
    shutil.rmtree(case / "seed3" / "deepfusion:alpha=1.0")
    out = tables.table("df")
    assert "| deepfusion:alpha=1.0 (seeds 1, 2) (chosen) | 2.000 (0.000) |" in out
    assert "| deepfusion:alpha=1.0 (seeds 1, 2) | 2.950 (0.050) |" in out.split("per domain")[1]
    assert "| deepfusion:alpha=1.0 (seeds 1, 2) | -0.150 [" in out
    assert "| fedkmt | 3.100 (0.082) |" in out  # on every seed: no label
    # one DeepFusion spec and no validation documents (a case without a sweep): nothing is chosen,
    # the validation cell says it was not measured, and the spec still stands in every table
    meta = json.loads((case / "case.json").read_text())
    (case / "case.json").write_text(json.dumps({**meta, "sweep": ["deepfusion:alpha=1.0"],
                                                "order": ["fedkmt", "deepfusion:alpha=1.0"]}))
    shutil.rmtree(case / "seed1" / "deepfusion:alpha=10.0")
    for r in case.glob("seed*/*/results.json"):
        got = json.loads(r.read_text())
        got["per_user"] = {d: {k: v for k, v in row.items() if not k.startswith("valid_")} for d, row in got["per_user"].items()}
        r.write_text(json.dumps(got))
    out = tables.table("df")
    assert out.startswith("One DeepFusion spec, deepfusion:alpha=1.0, fixed before the run (no sweep, nothing chosen).")
    assert "| deepfusion:alpha=1.0 (seeds 1, 2) | - | 3.450 (0.050) | 0.250 |" in out
    assert "(chosen)" not in out and "| deepfusion:alpha=1.0 (seeds 1, 2) | -0.150 [" in out
    # a seed that a method ran and the reference did not (a control run ahead of FedKMT): the dense
    # base comes from that method's run, the premise rows (FedKMT's trained devices) only from the
    # reference's seeds, and the paired row names the seeds of its pairs, not of the method
    shutil.copytree(case / "seed2" / "deepfusion:alpha=1.0", case / "seed3" / "deepfusion:alpha=1.0")
    shutil.rmtree(case / "seed3" / "fedkmt")
    moved = case / "seed3" / "deepfusion:alpha=1.0" / "results.json"
    got = json.loads(moved.read_text())
    for row in got["per_user"].values():
        row["test_base_answer_log_ppl"] = 9.6
    moved.write_text(json.dumps(got))
    out = tables.table("df")
    assert "| dense base (before distillation) | 9.200 (0.283) |" in out  # 9.0, 9.0 and seed 3's 9.6
    assert "| deepfusion:alpha=1.0 | 2.967 (0.047) |" in out.split("per domain")[1]  # 2.9, 3.0, 3.0: every seed
    assert "| deepfusion:alpha=1.0 (seeds 1, 2) | -0.150 [" in out  # paired where FedKMT ran
    assert "| fedkmt (seeds 1, 2) | 3.100 (0.100) |" in out  # 3.0, 3.2
    premise = out.split("The premise:")[1].split("Per domain")[0]
    assert "| 1 | client0 |" in premise and "| 2 | client0 |" in premise and "| 3 | client0 |" not in premise
    assert "| a | 1 | -0.2500 | -0.2500 | -5.900 | -0.150 |" in out  # both columns over seeds 1, 2
    # a method on none of the reference's seeds is a row of its own and no pair
    shutil.copytree(case / "seed3" / "deepfusion:alpha=1.0", case / "seed3" / "deepfusion-ce")
    ce = case / "seed3" / "deepfusion-ce" / "results.json"
    ce.write_text(json.dumps({**json.loads(ce.read_text()), "method": "deepfusion-ce"}))
    (case / "case.json").write_text(json.dumps({**json.loads((case / "case.json").read_text()),
                                                "order": ["fedkmt", "deepfusion:alpha=1.0", "deepfusion-ce"]}))
    out = tables.table("df")
    assert "| deepfusion-ce (seed 3) | 3.000 | 4.000 | 3.500 |" in out.split("per domain")[1]
    assert "| deepfusion-ce (no seed shared with fedkmt) | - | - | - |" in out
    # a pair reads one seed's same devices: a client's weights differing between the two runs (a
    # device trained again, not bit for bit) refuses the table; a control's other device steps do not
    def devices(method: str, digest: str, steps: int = 200) -> None:
        (case / "seed1" / method / "metrics.jsonl").write_text(
            json.dumps({"user": "client0", "device_steps": steps, "upload_digest": digest}) + "\n"
            + json.dumps({"user": "client1", "device_steps": steps, "upload_digest": "b" * 16}) + "\n")
    devices("fedkmt", "a" * 16)
    devices("deepfusion:alpha=1.0", "a" * 16)
    assert "| deepfusion:alpha=1.0 (seeds 1, 2) | -0.150 [" in tables.table("df")
    devices("deepfusion:alpha=1.0", "c" * 16)
    with pytest.raises(ValueError, match="client0's device differs"):
        tables.table("df")
    devices("deepfusion:alpha=1.0", "c" * 16, steps=0)
    assert "| deepfusion:alpha=1.0 (seeds 1, 2) | -0.150 [" in tables.table("df")
    # each seed its own split (data.seed run or a mapping): seed 2's premise rows read seed 2's
    # partition.json, seed 1's the case's; a domain counts its dominant devices a seed, on the mean
    (case / "seed2" / "partition.json").write_text(json.dumps({"client0": {"mixture": {"a": 0.3, "b": 0.7}},
                                                               "client1": {"mixture": {"a": 0.2, "b": 0.8}}}))
    out = tables.table("df")
    premise = out.split("The premise:")[1].split("Per domain")[0]
    assert "| 1 | client0 | base | a (0.90) | 1.0000 | 1.2500 | -0.2500 |" in premise
    assert "| 2 | client0 | base | b (0.70) | 2.0000 | 1.0000 | +1.0000 | - | - | - | +1.5000 |" in premise
    assert "| a | 0.5 | -0.2500 |" in out and "| b | 1.5 |" in out  # a: seed 1's client0; b: 1 + 2 devices


def test_seeds_to_resolve_is_the_first_seed_count_whose_t_interval_is_narrower_than_the_margin():
    tables = _tables()
    # half-widths at std 0.01: 12.71 x 0.01 / sqrt(2) = 0.0898, then 0.0248, 0.0159, 0.0124, 0.0105 (6 seeds)
    assert sys.modules["cases"].seeds_to_resolve(0.01, 0.0111) == 6
    assert sys.modules["cases"].seeds_to_resolve(0.01, 0.0125) == 5  # 0.01242 at 5 seeds
    assert sys.modules["cases"].seeds_to_resolve(0.01, 0.0124) == 6  # ... is not narrower than 0.0124
    assert sys.modules["cases"].seeds_to_resolve(0.001, 0.1) == 2


def test_steps_to_close_extends_the_line_through_the_two_fifths_to_zero():
    tables = _tables()
    assert sys.modules["cases"].steps_to_close(0.4, 0.3, 80) == pytest.approx(240)  # 0.1 closed in 80 steps: 0.3 in 240
    assert sys.modules["cases"].steps_to_close(0.03, 0.01, 80) == pytest.approx(40)
    assert sys.modules["cases"].steps_to_close(0.3, 0.3, 80) is None  # flat: never
    assert sys.modules["cases"].steps_to_close(0.2, 0.25, 80) is None  # widening: never
    assert sys.modules["cases"].steps_to_close(0.2, -0.01, 80) == 0  # already closed
    assert sys.modules["cases"].steps_to_close(0.2, 0.0, 80) == 0


def test_save_merges_runs_of_one_partition_keeps_the_named_methods_and_refuses_two_partitions(tmp_path, monkeypatch):
    tables = _tables()
    monkeypatch.setattr(sys.modules["cases"], "RESULTS", tmp_path / "results")

    def run(name, seeds, methods, partition):
        root = tmp_path / name
        for seed in seeds:
            for m in methods:
                d = root / f"seed{seed}" / m.replace(":", "__")
                d.mkdir(parents=True)
                (d / "results.json").write_text(json.dumps({"method": m, "mean": seed}, indent=2))
                (d / "metrics.jsonl").write_text('{"round": 1}\n')
        (root / "config.yaml").write_text("seed: 42\n")
        (root / "partition.json").write_text(partition)
        return root
    a = run("a", [42], ["fedkmt", "deepfusion:alpha=1.0", "deepfusion:alpha=10.0"], '{"client0": 1}')
    b = run("b", [62, 82], ["fedkmt", "deepfusion:alpha=1.0", "deepfusion-ce"], '{"client0": 1}')
    out = tables.save([a, b], "c", {"kind": "deepfusion", "methods": ["fedkmt", "deepfusion:alpha=1.0", "deepfusion:alpha=10.0"]})
    got = sorted(str(p.parent.relative_to(out)) for p in out.glob("seed*/*/results.json"))
    assert got == ["seed42/deepfusion__alpha=1.0", "seed42/deepfusion__alpha=10.0", "seed42/fedkmt",
                   "seed62/deepfusion__alpha=1.0", "seed62/fedkmt", "seed82/deepfusion__alpha=1.0", "seed82/fedkmt"]
    assert (out / "partition.json").read_text() == '{"client0": 1}'
    with lzma.open(out / "seed62" / "fedkmt" / "metrics.jsonl.xz", "rt") as fh:
        assert fh.read() == '{"round": 1}\n'
    # a committed case and a later seed's run merge (the case's compressed logs carried as they are)
    later = run("later", [92], ["fedkmt"], '{"client0": 1}')
    merged = tables.save([out, later], "c", {"kind": "deepfusion"})
    assert sorted(str(p.parent.relative_to(merged)) for p in merged.glob("seed*/*/results.json")) == sorted(got + ["seed92/fedkmt"])
    with lzma.open(merged / "seed62" / "fedkmt" / "metrics.jsonl.xz", "rt") as fh:
        assert fh.read() == '{"round": 1}\n'
    other = run("o", [62], ["fedkmt"], '{"client0": 2}')
    with pytest.raises(SystemExit, match="split the data differently"):
        tables.save([a, other], "d", {})
    assert not (tmp_path / "results" / "d").exists()


def test_save_keeps_each_seed_s_own_split_where_the_case_states_a_data_seed_per_seed(tmp_path, monkeypatch):
    """A case whose config.yaml maps each seed to its data seed takes a later seed's run of one
    data seed (its partition.json becomes that seed's), keeps no one partition for the case, and
    refuses a run whose data seed is not the one the case states for its seed."""
    tables = _tables()
    monkeypatch.setattr(sys.modules["cases"], "RESULTS", tmp_path / "results")

    def run(name, seed, data_seed, partition):
        root = tmp_path / name
        (root / f"seed{seed}" / "fedkmt").mkdir(parents=True)
        (root / f"seed{seed}" / "fedkmt" / "results.json").write_text(json.dumps({"method": "fedkmt", "mean": seed}))
        (root / "config.yaml").write_text(f"seed: 42\ndata:\n  seed: {data_seed}\n")
        (root / "partition.json").write_text(partition)
        return root
    first = run("first", 42, "{42: 0, 62: 1}", '{"client0": 0}')
    out = tables.save([first, run("later", 62, "1", '{"client0": 1}')], "c", {"kind": "deepfusion"})
    assert (out / "seed42" / "partition.json").read_text() == '{"client0": 0}'
    assert (out / "seed62" / "partition.json").read_text() == '{"client0": 1}'
    assert not (out / "partition.json").exists()
    # unpacked and saved again, each seed keeps its split
    again = tables.save([tables.unpack("c", tmp_path / "u")], "c", {"kind": "deepfusion"})
    assert (again / "seed62" / "partition.json").read_text() == '{"client0": 1}' and not (again / "partition.json").exists()
    # the run a case was saved from, given again beside it, is taken once; another run of that seed and method is refused
    assert tables.save([again, tmp_path / "later"], "c", {"kind": "deepfusion"}).exists()
    clash = run("clash", 62, "1", '{"client0": 1}')
    (clash / "seed62" / "fedkmt" / "results.json").write_text(json.dumps({"method": "fedkmt", "mean": 0}))
    with pytest.raises(SystemExit, match="seed62/fedkmt is in two of the runs with other results"):
        tables.save([again, clash], "c", {"kind": "deepfusion"})
    with pytest.raises(SystemExit, match="data seed 5, the case's config.yaml gives seed62 data seed 1"):
        tables.save([first, run("wrong", 62, "5", '{"client0": 5}')], "d", {})
    assert not (tmp_path / "results" / "d").exists()


def test_a_saved_part_of_a_grid_unpacked_is_resumed_where_it_stopped(tmp_path, monkeypatch, capsys):
    """A grid longer than a session: its finished runs saved as a case, unpacked into a new folder,
    and ``comix compare --resume`` trains only the runs the case lacks (to the same result as the
    uninterrupted grid), keeping the saved ones (results and logs as they were)."""
    from comix.cli import main
    from test_cli import TINY, _user_dirs
    tables = _tables()
    monkeypatch.setattr(sys.modules["cases"], "RESULTS", tmp_path / "results")
    data = _user_dirs(tmp_path / "data")
    first = tmp_path / "first"
    args = [f"corpus={data}", f"run_dir={first}", *TINY, "--methods", "local", "fedavg", "--seeds", "1"]
    assert main(["compare", *args]) == 0
    whole = json.loads((first / "compare.json").read_text())
    tables.save([first], "part", {"kind": "users", "methods": ["local"]})  # as if fedavg had not finished
    run = tables.unpack("part", tmp_path / "again")
    assert sorted(p.parent.name for p in run.glob("seed1/*/results.json")) == ["local"]
    # the grid's one split comes back too: saving the unpacked folder alone must not drop it
    assert (run / "partition.json").read_text() == (first / "partition.json").read_text()
    for name in ("metrics.jsonl", "server.jsonl"):
        assert (run / "seed1" / "local" / name).read_text() == (first / "seed1" / "local" / name).read_text()
    with pytest.raises(SystemExit, match="exists"):
        tables.unpack("part", run)
    with pytest.raises(SystemExit, match="not a case"):
        tables.unpack("nothing", tmp_path / "x")
    capsys.readouterr()
    assert main(["compare", "--resume", str(run)]) == 0
    assert capsys.readouterr().err.count("done earlier") == 1  # local; fedavg trained again
    again = json.loads((run / "compare.json").read_text())
    assert again["local"] == whole["local"]
    assert again["fedavg"]["1"]["mean_test_ppl"] == pytest.approx(whole["fedavg"]["1"]["mean_test_ppl"], rel=1e-6)


def test_privacy_case_reads_each_spec_s_clip_noise_and_the_epsilon_of_its_last_round(tmp_path, monkeypatch):
    tables = _tables()
    monkeypatch.setattr(sys.modules["cases"], "RESULTS", tmp_path / "results")
    case = tmp_path / "results" / "p"
    specs = {"fedavg": (27.36, None), "fedavg:privacy.clip=1.0,privacy.noise_multiplier=0.3": (3.46e8, [61.2, 42.81])}
    for m, (ppl, eps) in specs.items():
        d = case / "seed42" / m.replace(":", "__")
        d.mkdir(parents=True)
        (d / "results.json").write_text(json.dumps({"method": m, "mean": ppl}))
        with lzma.open(d / "server.jsonl.xz", "wt") as fh:
            fh.write("".join(json.dumps({"round": i + 1, **({"epsilon": e} if eps else {})}) + "\n"
                             for i, e in enumerate(eps or [0, 0])))
    (case / "config.yaml").write_text("privacy:\n  delta: 1.0e-05\n")
    (case / "case.json").write_text(json.dumps({"kind": "privacy", "command": "c", "machine": "m", "date": "d",
                                                "order": list(specs), "names": {"fedavg": "FedAvg"}}))
    out = tables.table("p")
    assert "| method | clip | noise multiplier | epsilon (delta 1e-05) | mean test perplexity |" in out
    assert "| FedAvg | - | - | no DP | 27.36 |" in out
    assert "| FedAvg | 1.0 | 0.3 | 42.8 | 3.5e8 |" in out  # the last round's epsilon, not the first


def test_settings_case_puts_each_setting_s_case_in_its_column(tmp_path, monkeypatch):
    tables = _tables()
    monkeypatch.setattr(sys.modules["cases"], "RESULTS", tmp_path / "results")
    for case, scores in (("a", {"local": [10.0, 12.0], "fedavg": [20.0, 20.0]}), ("b", {"local": [5.0, 5.0]}),
                         ("c", {"local": [7.0, 9.0, 8.0], "fedavg": [3.0, 4.0]})):
        for m, xs in scores.items():
            for seed, x in zip((1, 2, 3), xs):
                d = tmp_path / "results" / case / f"seed{seed}" / m
                d.mkdir(parents=True)
                (d / "results.json").write_text(json.dumps({"method": m, "mean": x}))
        (tmp_path / "results" / case / "case.json").write_text(json.dumps({"kind": "users"}))
    (tmp_path / "results" / "t").mkdir()
    (tmp_path / "results" / "t" / "case.json").write_text(json.dumps({
        "kind": "settings", "cases": {"in": "a", "ood": "b", "later": "c"}, "order": ["local", "fedavg"],
        "names": {"local": "Local"}, "command": "c", "machine": "m", "date": "d"}))
    out = tables.table("t")
    # each column names its seeds; a cell over fewer seeds than its column says which
    assert "| method | in (seeds 1, 2) | ood (seeds 1, 2) | later (seeds 1, 2, 3) |" in out
    assert "| Local | 11.00 (1.00) | 5.00 (0.00) | 8.00 (0.82) |" in out
    assert "| fedavg | 20.00 (0.00) | - | 3.50 (0.50) (seeds 1, 2) |" in out


def test_global_case_scores_each_method_and_the_dense_base_over_the_domains(tmp_path, monkeypatch):
    tables = _tables()
    monkeypatch.setattr(sys.modules["cases"], "RESULTS", tmp_path / "results")
    for seed, shift in ((1, 0.0), (2, 0.2)):
        d = tmp_path / "results" / "g" / f"seed{seed}" / "fedkmt"
        d.mkdir(parents=True)
        row = lambda x: {"test_answer_log_ppl": x + shift, "test_log_ppl": x + 1, "test_answer_acc": 10.0,  # noqa: E731
                         "test_token_acc": 40.0, "test_base_answer_log_ppl": 4.0, "test_base_log_ppl": 5.0,
                         "test_base_answer_acc": 1.0, "test_base_token_acc": 30.0}
        (d / "results.json").write_text(json.dumps({"method": "fedkmt", "per_user": {"a": row(3.0), "b": row(3.4)}}))
    (tmp_path / "results" / "g" / "case.json").write_text(json.dumps({"kind": "global", "command": "c", "machine": "m",
                                                                      "date": "d", "names": {"fedkmt": "FedKMT"}}))
    out = tables.table("g")
    assert "| dense base (before distillation) | 4.000 (0.000) | 5.000 (0.000) | 1.00 (0.00) | 30.00 (0.00) |" in out
    assert "| FedKMT | 3.300 (0.100) | 4.200 (0.000) | 10.00 (0.00) | 40.00 (0.00) |" in out


def test_costs_case_reads_the_compressed_logs(tmp_path, monkeypatch):
    tables = _tables()
    monkeypatch.setattr(sys.modules["cases"], "RESULTS", tmp_path / "results")
    d = tmp_path / "results" / "k" / "seed1" / "fedit"
    d.mkdir(parents=True)
    (d / "results.json").write_text(json.dumps({"method": "fedit", "mean": 1.0}))
    rows = [{"sampled": True, "train_s": t, "trainable_mb": 7.0, "bytes_up": 2**20, "bytes_down": 2 * 2**20}
            for t in (2.0, 4.0)]
    for name, lines in (("metrics.jsonl", rows), ("server.jsonl", [{"aggregate_s": 0.5}])):
        with lzma.open(d / f"{name}.xz", "wt") as fh:
            fh.write("".join(json.dumps(r) + "\n" for r in lines))
    (tmp_path / "results" / "k" / "case.json").write_text(json.dumps({"kind": "costs", "command": "c", "machine": "m",
                                                                      "date": "d", "names": {"fedit": "FedIT"}}))
    assert "| FedIT | 7 | - | 1 | 2 | 3 | 0.5 | - | - |" in tables.table("k")


def test_a_view_case_shows_the_named_methods_of_another_case_s_runs(tmp_path, monkeypatch):
    """One run, several papers' tables: ``runs_of`` reads the other case's runs (its logs too, for
    the costs kind), ``methods`` keeps the named specs only, and the footer names the run's folder
    and says how the source case's runs were made (a later seed merged there updates the view)."""
    tables = _tables()
    monkeypatch.setattr(sys.modules["cases"], "RESULTS", tmp_path / "results")
    for m, x in (("fedit", 1.0), ("flora", 2.0)):
        d = tmp_path / "results" / "run" / "seed1" / m
        d.mkdir(parents=True)
        (d / "results.json").write_text(json.dumps({"method": m, "mean": x, "metric": "test_ppl"}))
        with lzma.open(d / "metrics.jsonl.xz", "wt") as fh:
            fh.write(json.dumps({"sampled": True, "train_s": 3.0, "trainable_mb": x, "bytes_up": 2**20,
                                 "bytes_down": 2**20}) + "\n")
    (tmp_path / "results" / "run" / "case.json").write_text(json.dumps(
        {"kind": "compare", "reference": "fedit", "command": "c", "machine": "m2", "date": "d2"}))
    (tmp_path / "results" / "view").mkdir()
    (tmp_path / "results" / "view" / "case.json").write_text(json.dumps(
        {"kind": "costs", "runs_of": "run", "methods": ["flora"]}))
    out = tables.table("view")
    assert "| flora | 2 |" in out and "fedit" not in out
    assert "from `bench/results/run/` (c; m2, d2)" in out
    assert "| flora |" in tables.table("run") and "| fedit |" in tables.table("run")


def test_a_case_s_seeds_keep_the_seeds_its_table_shows_and_a_view_reads_its_own(tmp_path, monkeypatch):
    """``seeds`` in a case.json keeps those seeds in its table and says so in the footer (costs
    timed on one machine, where later seeds ran on another); a view of that case reads the runs
    with its own ``seeds`` (none: every seed), not the source's."""
    tables = _tables()
    monkeypatch.setattr(sys.modules["cases"], "RESULTS", tmp_path / "results")
    for seed, x in ((1, 1.0), (2, 5.0)):
        d = tmp_path / "results" / "run" / f"seed{seed}" / "fedit"
        d.mkdir(parents=True)
        (d / "results.json").write_text(json.dumps({"method": "fedit", "mean": x, "metric": "test_ppl"}))
        with lzma.open(d / "metrics.jsonl.xz", "wt") as fh:
            fh.write(json.dumps({"sampled": True, "train_s": 3.0 * seed, "trainable_mb": 1.0, "bytes_up": 2**20,
                                 "bytes_down": 2**20}) + "\n")
    (tmp_path / "results" / "run" / "case.json").write_text(json.dumps(
        {"kind": "compare", "reference": "fedit", "seeds": [1], "command": "c", "machine": "m", "date": "d"}))
    out = tables.table("run")
    assert "| fedit | 1.00 | 1.00 |" in out and "5.00" not in out and "(its seeds 1)" in out
    (tmp_path / "results" / "view").mkdir()
    (tmp_path / "results" / "view" / "case.json").write_text(json.dumps(
        {"kind": "compare", "reference": "fedit", "runs_of": "run"}))
    assert "| fedit | 3.00 (2.00) | 1.00 / 5.00 |" in tables.table("view")
    (tmp_path / "results" / "view" / "case.json").write_text(json.dumps(
        {"kind": "costs", "runs_of": "run", "seeds": [2]}))
    assert "| fedit | 1 | - | 1 | 1 | 6 |" in tables.table("view")


def test_vaa_attribution_table_sums_each_run_s_steps_and_splits_the_fall_between_student_and_vaa(tmp_path, monkeypatch):
    """bench/vaa_attribution.py's file: per run (alpha, VAA's lr, warm-up), FM at the first and last
    step, the sums over the steps of FM's change by the student's updates, by VAA's, by both (the
    student's share of it) and of CE's change, and on the held-out batches what the student's moves
    left; a swapped key, a share of the wrong denominator or a reversed difference changes a cell."""
    tables = _tables()
    monkeypatch.setattr(sys.modules["cases"], "RESULTS", tmp_path)

    def step(fm, student, vaa, both, ce):
        return {"fm": fm, "fm_by_student": student, "fm_by_vaa": vaa, "fm_by_both": both, "ce_by_student": ce}
    held = {"fm_final": 0.9, "fm_start_student": 1.0, "ce_final": 3.1, "ce_start": 3.0}
    (tmp_path / "vaa-attribution.json").write_text(json.dumps({
        "teacher": "abcdef0123456789.safetensors", "spec": "prune:2:32", "steps": 2, "seed": 7, "machine": "m",
        "date": "d", "seconds": 120.0,
        "runs": {"a": {"alpha": 10.0, "feature_lr": 0.001, "warmup": 0, "held_out": held,
                       "steps": [step(4.0, -0.01, -0.2, -0.2, -0.1), step(3.5, -0.03, -0.1, -0.2, 0.05)]},
                 "b": {"alpha": 100.0, "feature_lr": 0.0001, "warmup": 25, "held_out": {**held, "fm_start_student": 0.8},
                       "steps": [step(4.0, -0.1, -0.3, -0.35, 0.2), step(3.0, -0.2, -0.1, -0.25, 0.1)]}}}))
    out = tables.table("vaa-attribution.json")
    # the long run's file (bench/vaa_attribution.py --out) is a table of the same kind
    (tmp_path / "vaa-attribution-long.json").write_text((tmp_path / "vaa-attribution.json").read_text())
    assert tables.table("vaa-attribution-long.json") == out.replace("vaa-attribution.json", "vaa-attribution-long.json")
    assert "Teacher prune:2:32 (device cache file abcdef012345...), 2 joint KD steps a run" in out and "2 min" in out
    assert "| 10 | 0.001 | 0 | 4.000 / 3.500 | -0.0400 | -0.3000 | -0.4000 | 10.0% | 5.0% / 15.0% | -0.0500 | -0.1000 | +0.1000 |" in out
    assert "| 100 | 0.0001 | 25 | 4.000 / 3.000 | -0.3000 | -0.4000 | -0.6000 | 50.0% | 28.6% / 80.0% | +0.3000 | +0.1000 | +0.1000 |" in out


def _results_page():
    import sys
    sys.path.insert(0, str(ROOT / "bench"))
    spec = importlib.util.spec_from_file_location("results_page", ROOT / "bench" / "results_page.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["results_page"] = module  # its dataclass looks its module up
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("a,b,trivial,higher,expected", [
    # a ahead of b on every seed, both above the majority label: the paper's direction, reproduced
    ({1: 60.0, 2: 62.0, 3: 61.0}, {1: 55.0, 2: 56.0, 3: 55.5}, {1: 50.0, 2: 50.0, 3: 50.0}, True, "reproduced"),
    # b ahead outside the interval: reversed
    ({1: 50.0, 2: 51.0, 3: 50.5}, {1: 55.0, 2: 56.0, 3: 55.5}, {1: 40.0, 2: 40.0, 3: 40.0}, True, "reversed"),
    # the interval holds 0
    ({1: 60.0, 2: 52.0, 3: 57.0}, {1: 55.0, 2: 56.0, 3: 55.5}, {1: 40.0, 2: 40.0, 3: 40.0}, True, "unresolved"),
    # the majority label as good as the better method: whatever the order, not testable
    ({1: 60.0, 2: 62.0, 3: 61.0}, {1: 55.0, 2: 56.0, 3: 55.5}, {1: 62.0, 2: 62.0, 3: 62.0}, True, "not testable"),
    # lower is better (perplexity): a lower than b is a ahead; the untrained base is worse than both
    ({1: 20.0, 2: 21.0, 3: 20.5}, {1: 22.0, 2: 23.0, 3: 22.6}, {1: 40.0, 2: 40.0, 3: 40.0}, False, "reproduced"),
    # one seed: a direction, never an interval
    ({42: 20.0}, {42: 22.0}, {42: 40.0}, False, "agrees in direction (one seed"),
    ({42: 23.0}, {42: 22.0}, {42: 40.0}, False, "disagrees in direction (one seed"),
])
def test_each_verdict_follows_from_the_scores(a, b, trivial, higher, expected):
    page = _results_page()
    claim = page.Claim("P", "s", "a", "b", 2.0 if higher else 1.0, 1.0 if higher else 2.0, "case", higher, "mean")
    assert page.judge(claim, a, b, page.Trivial("baseline", trivial))["verdict"].startswith(expected)


def test_a_tie_that_excludes_the_papers_gap_is_not_reproduced_only_in_the_same_units():
    page = _results_page()
    a, b = {1: 3.770, 2: 3.771, 3: 3.769}, {1: 3.768, 2: 3.770, 3: 3.769}  # lower is better, a tie
    same = page.Claim("P", "s", "a", "b", 3.97, 3.99, "case", False, "x", same_units=True)
    assert page.judge(same, a, b).get("verdict").startswith("not reproduced")
    other = page.Claim("P", "s", "a", "b", 3.97, 3.99, "case", False, "x")
    assert page.judge(other, a, b)["verdict"] == "unresolved: the interval holds 0"


def test_a_resolved_gap_a_tenth_of_the_papers_is_reproduced_in_direction_only():
    page = _results_page()
    a, b = {1: 3.402, 2: 3.439, 3: 3.3585}, {1: 3.403, 2: 3.441, 3: 3.360}  # a ahead by 0.001-0.002: [+0.0003, +0.0027]
    same = page.Claim("P", "s", "a", "b", 3.97, 3.99, "case", False, "x", same_units=True)
    assert page.judge(same, a, b)["verdict"].startswith(
        "reproduced in direction, smaller than the paper's gap (0.02)")
    wide = page.Claim("P", "s", "a", "b", 3.9998, 4.0, "case", False, "x", same_units=True)  # gap 0.0002
    assert page.judge(wide, a, b)["verdict"].startswith("reproduced in direction, larger")
    close = page.Claim("P", "s", "a", "b", 3.9985, 4.0, "case", False, "x", same_units=True)  # gap 0.0015, inside
    assert page.judge(close, a, b)["verdict"] == "reproduced"
    other = page.Claim("P", "s", "a", "b", 3.97, 3.99, "case", False, "x")  # other units: the direction alone
    assert page.judge(other, a, b)["verdict"] == "reproduced"


def test_a_model_whose_lead_over_the_trivial_baseline_is_not_resolved_makes_the_row_not_testable():
    """Both models ahead of the baseline on the mean, but b's lead holds 0 over the seeds: nothing
    is read, whatever a's lead over b (dropping the gate, or gating on point means, fails)."""
    page = _results_page()
    claim = page.Claim("P", "s", "a", "b", 2.0, 1.0, "case", True, "mean")
    a, b = {1: 60.0, 2: 62.0, 3: 61.0}, {1: 55.0, 2: 50.0, 3: 56.0}
    trivial = page.Trivial("majority training label", {1: 50.0, 2: 53.0, 3: 49.0})  # b - t: 5, -3, 7
    v = page.judge(claim, a, b, trivial)
    assert v["verdict"] == "not testable at this scale: the lead of b over the majority training label is not " \
                           "resolved over 3 seeds"
    one = page.judge(claim, {1: 60.0}, {1: 49.0}, page.Trivial("untrained base", {1: 50.0}))
    assert one["verdict"] == "not testable at this scale: the lead of b over the untrained base is not positive"
    # a compared with b on one seed, but held on three where its lead holds 0: not read on the one
    # (gating on the pair's seeds alone lets a's lucky seed through)
    lucky = page.judge(claim, {1: 51.0, 2: 45.0, 3: 56.0}, {1: 50.5}, page.Trivial("majority training label",
                                                                                 {1: 50.0, 2: 53.0, 3: 49.0}))
    assert lucky["seeds"] == [1] and lucky["verdict"] == \
        "not testable at this scale: the lead of a over the majority training label is not resolved over 3 seeds"
    assert lucky["counts"]["a"] == (2, 0, 1)  # the counts read the seeds the gate reads
    both = page.judge(claim, {1: 51.0, 2: 45.0, 3: 56.0}, {1: 49.0}, page.Trivial("majority training label",
                                                                                {1: 50.0, 2: 53.0, 3: 49.0}))
    assert both["verdict"] == "not testable at this scale: the lead of a over the majority training label is not " \
                              "resolved over 3 seeds, that of b not positive"
    lower = page.Claim("P", "s", "a", "b", 1.0, 2.0, "case", False, "mean")  # perplexity: the base is worse
    assert page.judge(lower, {1: 20.0, 2: 21.0, 3: 20.5}, {1: 22.0, 2: 23.5, 3: 22.6},
                      page.Trivial("untrained base", {1: 40.0, 2: 41.0, 3: 40.5}))["verdict"] == "reproduced"


def test_the_row_counts_client_seeds_above_level_and_below_their_own_baseline():
    page = _results_page()
    claim = page.Claim("P", "s", "a", "b", 1.0, 2.0, "case", False, "mean")  # lower is better
    a = {1: {"u": 10.0, "v": 30.0}, 2: {"u": 12.0, "v": 20.0}}
    b = {1: {"u": 11.0, "v": 31.0}, 2: {"u": 13.0, "v": 21.0}}
    trivial = page.Trivial("untrained base", {1: {"u": 12.0, "v": 25.0}, 2: {"u": 12.0, "v": 22.0}})
    v = page.judge(claim, a, b, trivial)
    assert v["counts"] == {"a": (2, 1, 1), "b": (2, 0, 2)}  # a: u 2 below (ahead), v 1 ahead / 1 behind; u 2 level
    assert v["trivial"] == pytest.approx(17.75)


def test_holm_keeps_only_the_rows_its_adjusted_p_holds():
    """Three rows of one table at p 0.012, 0.041, 0.071: Holm's adjusted 0.036, 0.082, 0.082; the
    second row's raw 'reproduced' is marked (adjusting by the wrong count, or not at all, fails)."""
    page = _results_page()
    import cases
    assert cases.holm([0.012, 0.041, 0.071]) == pytest.approx([0.036, 0.082, 0.082])
    assert cases.holm([0.04, 0.01]) == pytest.approx([0.04, 0.02])  # order kept; step-down monotone
    claims = [page.Claim("T", str(i), "a", "b", 2.0, 1.0, "c", True, "mean") for i in range(3)]
    rows = [{"seeds": [1, 2, 3], "p": p, "verdict": "reproduced"} for p in (0.012, 0.041, 0.071)]
    rows[2]["verdict"] = "unresolved: the interval holds 0"
    other = {"seeds": [1, 2, 3], "p": 0.5, "verdict": "not testable at this scale: ..."}
    page.with_holm([*zip(claims, rows), (page.Claim("U", "x", "a", "b", 2.0, 1.0, "c", True, "mean"), other)])
    assert rows[0]["verdict"] == "reproduced" and rows[0]["holm"] == pytest.approx(0.036)
    assert rows[1]["verdict"] == "reproduced (not after Holm's correction over the table's 3 tested rows)"
    assert "holm" not in other


def test_seeds_for_80_percent_power_follow_the_noncentral_t():
    _results_page()
    import cases
    # Cohen's tables for a one-sample (paired) two-sided t test at 5 %: d = 1 needs 10, d = 0.5 needs 34
    assert cases.seeds_for_power(1.0, 1.0) == 10 and cases.seeds_for_power(0.5, 1.0) == 34
    assert cases.seeds_for_power(-0.5, 1.0) == 34  # the sign of the gap does not matter
    assert cases.seeds_for_power(0.001, 1.0) is None  # past the cap
    # a large effect: scipy's far tail is nan there, which must not skip n (2 seeds: power 0.97)
    assert cases.seeds_for_power(20.0, 1.0) == 2 and cases.seeds_for_power(5.0, 1.0) <= 4
    # the fewer seeds the larger the effect, never more
    need = [cases.seeds_for_power(d, 1.0) for d in (0.5, 1, 2, 3, 5, 8, 13, 20, 40)]
    assert need == sorted(need, reverse=True), need
    low, high = cases.sd_range(1.0, 3)
    assert low == pytest.approx(0.5207, rel=1e-3) and high == pytest.approx(6.285, rel=1e-3)


def test_the_papers_gap_is_not_set_against_a_case_without_the_headroom_to_show_it():
    """The better model 0.005 ahead of CE only, the paper's gap 0.02: the interval's exclusion of the
    paper's gap says nothing about its size, so the verdict does not claim 'not reproduced'."""
    page = _results_page()
    claim = page.Claim("P", "s", "a", "b", 3.97, 3.99, "case", False, "x", same_units=True)
    a, b = {1: 3.770, 2: 3.771, 3: 3.769}, {1: 3.768, 2: 3.770, 3: 3.769}
    ce = page.Trivial("CE-only student", {1: 3.775, 2: 3.776, 3: 3.774})
    v = page.judge(claim, a, b, ce)
    assert v["verdict"].startswith("unresolved: the interval holds 0; the paper's gap (0.02) is beyond the case's headroom")
    roomy = page.Trivial("CE-only student", {1: 3.80, 2: 3.81, 3: 3.79})
    assert page.judge(claim, a, b, roomy)["verdict"].startswith("not reproduced")


def test_a_partial_case_gives_what_is_in_so_far_and_never_a_bare_verdict(tmp_path, monkeypatch):
    page = _results_page()
    results = tmp_path / "results"
    monkeypatch.setattr(page, "RESULTS", results)
    monkeypatch.setattr(sys.modules["cases"], "RESULTS", results)  # load_case's folder
    for m, x in {"a": 60.0, "b": 55.0, "pretrained": 40.0}.items():  # the untrained base: the gate passes
        d = results / "c" / "seed42" / m
        d.mkdir(parents=True)
        (d / "results.json").write_text(json.dumps({"method": m, "mean": x, "per_user": {"u0": {"acc": x}}}))
    meta = {"kind": "ablation", "command": "cmd", "machine": "m", "date": "d"}
    (results / "c" / "case.json").write_text(json.dumps(meta))
    claim = page.Claim("P", "s", "a", "b", 2.0, 1.0, "c", True, "mean")
    assert page.verdict(claim)["verdict"] == "agrees in direction (one seed: no interval)"
    (results / "c" / "case.json").write_text(json.dumps({**meta, "partial": "seed 42 of 42, 62, 82"}))
    assert page.verdict(claim)["verdict"] == "partial case (seed 42 of 42, 62, 82): agrees in direction (one seed: no interval)"


def test_saving_a_case_again_keeps_its_notes(tmp_path, monkeypatch):
    tables = _tables()
    monkeypatch.setattr(sys.modules["cases"], "RESULTS", tmp_path / "results")
    run = tmp_path / "run"
    (run / "fedavg").mkdir(parents=True)
    (run / "config.yaml").write_text("seed: 42\n")
    (run / "fedavg" / "results.json").write_text(json.dumps({"method": "fedavg", "mean": 1.0}))
    tables.save([run], "c", {"kind": "users"})
    (tmp_path / "results" / "c" / "NOTES.md").write_text("diary")
    tables.save([run], "c", {"kind": "users"})
    assert (tmp_path / "results" / "c" / "NOTES.md").read_text() == "diary"
    assert (tmp_path / "results" / "c" / "seed42" / "fedavg" / "results.json").exists()


def _quotes():
    spec = importlib.util.spec_from_file_location("quotes", ROOT / "bench" / "quotes.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_number_quoted_in_prose_is_checked_against_the_file_it_links(tmp_path, monkeypatch):
    quotes = _quotes()
    monkeypatch.setattr(quotes, "ROOT", tmp_path)
    results = tmp_path / "bench" / "results"
    results.mkdir(parents=True)
    (results / "soak.json").write_text(json.dumps({"wall_s": 2394, "rows": [{"cohort": 4, "mb": 1881.4},
                                                                              {"cohort": 8, "mb": 3012.0}]}))
    (results / "job.md").write_text("| fp32 | 8.83 min | 4,412 MB |\n")
    doc = tmp_path / "docs" / "x.md"
    doc.parent.mkdir()
    right = ("took [39.9 min](../bench/results/soak.json#wall_s/60), held [1,881 MB](../bench/results/soak.json#"
             "rows.cohort=4.mb) and [60 %](../bench/results/soak.json#(rows.1.mb/rows.0.mb-1)*100); "
             "[8.83 min](../bench/results/job.md), [4,412 MB](../bench/results/job.md)\n")
    doc.write_text(right)
    assert len(quotes.quotes(doc)) == 5 and quotes.stale_quotes([doc]) == []
    for wrong, why in [("[39.8 min](../bench/results/soak.json#wall_s/60)", "the file says 39.90"),
                       ("[1,882 MB](../bench/results/soak.json#rows.cohort=4.mb)", "the file says 1,881.4"),
                       ("[2 MB](../bench/results/soak.json#rows.cohort=5.mb)", "cannot evaluate"),
                       ("[2 MB](../bench/results/soak.json#wall)", "cannot evaluate"),
                       ("[2 MB](../bench/results/gone.json#wall_s)", "no file"),
                       ("[8.8 min](../bench/results/job.md)", "8.8 is not in the file"),
                       ("[412 MB](../bench/results/job.md)", "412 is not in the file")]:
        doc.write_text(right + wrong + "\n")
        stale = quotes.stale_quotes([doc])
        assert len(stale) == 1 and why in stale[0] and stale[0].startswith("docs/x.md: ["), (wrong, stale)
    # a time, a memory or a rate in prose with no file behind it is listed; quoted or in a table, not
    doc.write_text(right + "a round took 33 s.\n| phone | 1024 MB |\n```\ntook 5 s\n```\n")
    assert [ln.split(": ", 1)[0] for ln in quotes.unbacked([doc])] == ["docs/x.md:2"]


def test_every_results_row_s_runs_follow_from_the_command_its_footnote_gives():
    """Each case's footnote on docs/results.md runs its rows' methods again from the case's committed
    config.yaml: every committed run of those methods has the training settings that command gives it
    (the config with the method's spec and its authors' defaults, as the run itself would resolve them),
    so a recipe that moved after a case ran cannot stand in for it. A method that trains nothing (the
    untrained base) is exempt from the schedule only."""
    import dataclasses
    import re

    _tables()
    import results_page
    from comix.algorithms import REGISTRY
    from comix.config import load_config
    from comix.specs import build_algorithm, split_spec
    page = results_page.results_page()
    checked = 0
    for case, specs in results_page.read_specs(results_page.CLAIMS).items():
        command = results_page.reproducing_command(case, specs)
        assert f"`{command}`" in page
        config = re.search(r"comix compare (\S+) --methods", command)[1]
        cfg = load_config(str(ROOT / config))
        _, runs = results_page.load_case(case)
        for spec in specs:
            for seed, folder in runs[spec].items():
                result = json.loads((folder / "results.json").read_text())
                want = dataclasses.asdict(build_algorithm(cfg, spec, max(1, len(result["per_user"]))).train)
                ran = {k: v for k, v in result["train"].items()
                       if REGISTRY[split_spec(spec)[0]][0].trains or k not in ("rounds", "local_steps", "eval_every")}
                assert ran == {k: want[k] for k in ran}, (case, spec, seed)
                checked += 1
    assert checked > 50


def test_the_poisoned_uploads_table_reads_the_rules_only_where_training_gained_over_the_base():
    """bench/poisoned.py's table: each rule's honest perplexity per attack, its difference from the
    clean mean run over the seeds' pairs, and the headline reads the rules only when the clean run's
    gain over the untrained base is resolved over the seeds (a gain inside noise makes no rule readable)."""
    sys.path.insert(0, str(ROOT / "bench"))
    from bench_tables import poisoned_table
    rules = ["mean", "median", "trimmed_mean", "krum", "server_clip"]
    result = {"command": "python bench/poisoned.py", "clients": 10, "attackers": [0, 1], "seeds": [42, 45, 47],
              "machine": "m", "date": "d", "torch": "t", "pretrained_honest_test_ppl": [22.0, 22.2, 21.9],
              "honest_test_ppl": {"none": {r: [19.6, 19.8, 19.7] for r in rules},
                                  "sign-flip": {r: [19.6, 19.8, 19.7] for r in rules}}}
    result["honest_test_ppl"]["sign-flip"]["mean"] = [30.6, 31.8, 30.7]
    text = poisoned_table(json.dumps(result))
    assert "resolved over the seeds, so the rules can be read" in text
    assert "| mean | 19.70 (19.60 / 19.80 / 19.70) | 31.03 (30.60 / 31.80 / 30.70); +11.33 [" in text
    result["pretrained_honest_test_ppl"] = [19.0, 22.0, 19.9]  # the gain within the seeds' noise
    assert "not resolved over the seeds: the rules cannot be read" in poisoned_table(json.dumps(result))


def test_the_language_shift_scale_table_reads_each_scale_by_the_results_page_rules():
    """bench/language_shift_scale.py's table: a scale reads "Local ahead" / "CoMiGS-1G1S ahead" only
    where the lead's interval excludes zero (the sign: Local minus CoMiGS, positive = CoMiGS ahead)
    and both models' gains over the untrained base are resolved; one seed reads in direction only."""
    sys.path.insert(0, str(ROOT / "bench"))
    from bench_tables import language_shift_scale_table
    from cases import paired_interval

    def scale(local, comigs):
        mean, half = paired_interval([a - b for a, b in zip(local, comigs)])
        return {"rounds_x_local_steps": [4, 4], "seeds": [42, 45, 47][:len(local)], "test_ppl": {"local": local, "comigs-1g1s": comigs},
                "pretrained_test_ppl": [40.0, 41.0, 40.5][:len(local)],
                "comigs_lead_over_local": {"mean": mean, "half_width_95": half},
                "router_valid_loss": [3.1, 2.9, 2.8], "gate_entropy": [0.69, 0.6, 0.5, 0.4], "generalist_share": 0.5}
    result = {"command": "python bench/language_shift_scale.py", "setting": "s", "seeds": [42, 45, 47], "machine": "m",
              "date": "d", "x1_against_case": {"local seed 42": 0.001},
              "scales": {"x1": scale([20.0, 20.5, 20.2], [21.0, 21.4, 21.1]),
                         "x2": scale([18.0, 18.5, 18.2], [17.0, 17.6, 17.1]),
                         "x4": scale([17.0, 17.5, 17.2], [17.1, 17.3, 17.4])}}
    lines = language_shift_scale_table(json.dumps(result)).splitlines()
    assert lines[2].count("|") == lines[3].count("|")  # as many columns as the header names
    rows = {ln.split(" | ")[0].strip("| "): ln for ln in lines if ln.startswith("| x")}
    assert "| -0.93 [" in rows["x1"] and "| Local ahead |" in rows["x1"]
    assert "| +1.00 [" in rows["x2"] and "| CoMiGS-1G1S ahead |" in rows["x2"]
    assert "| unresolved |" in rows["x4"]
    assert "3.100 -> 2.800" in rows["x1"] and "0.690 / 0.500 / 0.400" in rows["x1"]
    assert "(-4.6% of Local's)" in rows["x1"] and "(+5.5% of Local's)" in rows["x2"]  # lead / Local's mean ppl
    assert lines[0].startswith("On `s`: x1, x2, x4 by `python bench/language_shift_scale.py` (m, d).")
    result["scales"]["x4"]["measured"] = {"command": "python bench/language_shift_scale.py --scales 4", "machine": "m2", "date": "d2"}
    head = language_shift_scale_table(json.dumps(result)).splitlines()[0]  # a scale added later names its own run
    assert "x1, x2 by `python bench/language_shift_scale.py` (m, d); x4 by `python bench/language_shift_scale.py --scales 4` (m2, d2)" in head
    # a scale whose seeds ran in two sessions (each seed kept): each run names its seeds and their cost
    result["scales"]["x4"]["measured"] = [
        {"command": "c8", "machine": "m2", "date": "d2", "seeds": [42, 45], "wall_s": [4140, 4260]},
        {"command": "c8 --seeds 47", "machine": "m3", "date": "d3", "seeds": [47], "wall_s": [4200]}]
    head = language_shift_scale_table(json.dumps(result)).splitlines()[0]
    assert "; x4 seeds 42, 45 (69, 71 min) by `c8` (m2, d2); x4 seed 47 (70 min) by `c8 --seeds 47` (m3, d3)." in head
    result["scales"]["x4"]["measured"] = result["scales"]["x4"]["measured"][:1]
    result["scales"]["x4"]["measured"][0]["seeds"] = [42, 45, 47]  # one run, every seed: the scale's name alone
    assert "; x4 (69, 71 min) by `c8` (m2, d2)." in language_shift_scale_table(json.dumps(result)).splitlines()[0]
    for x in result["scales"].values():  # a gain inside the seeds' noise: nothing to read
        x["pretrained_test_ppl"] = [21.0, 19.0, 22.0]
    assert all("| not testable (a model's gain over the untrained base is not resolved) |" in ln
               for ln in language_shift_scale_table(json.dumps(result)).splitlines() if ln.startswith("| x"))
    result["scales"] = {"x1": scale([45.0, 46.2, 45.3], [35.0, 34.5, 33.0])}  # Local overfit past the base
    assert "| not testable (Local behind the untrained base) |" in language_shift_scale_table(json.dumps(result))
    cut = {**scale([20.0, 20.5, 20.2], [21.0, 21.4, 21.1]), "train_tokens_per_user": 2482, "passes": 3.3}
    result["scales"] = {"x1-train2482": cut}  # a train split cut to 2,482 tokens: 16 steps of 4 x 128 read it 3.3 times
    assert "| x1-train2482 | 4 x 4 on 2,482 train tokens a user (3.3 passes) |" in language_shift_scale_table(json.dumps(result))
    result["scales"] = {"x1": {**scale([20.0], [21.0]), "passes_read": [0.1046, 0.121]}}
    table = language_shift_scale_table(json.dumps(result))
    assert "| one seed: direction only |" in table
    assert "| x1 | 4 x 4 (10.5% to 12.1% of a pass) |" in table  # the case's own splits, fewest to most


def test_the_mutation_sweep_names_where_and_when_each_modules_mutants_ran(tmp_path, monkeypatch):
    """A sweep of some modules (--module) rewrites its rows only: every other row keeps the machine
    and date its own sweep ran on (a row from before rows carried them takes its file's), and the
    table's footer names each machine and date with the modules measured there."""
    sys.path.insert(0, str(ROOT / "bench"))
    import mutation_sweep
    from bench_tables import mutation_sweep_table
    from mutant import _m
    mutants = [_m("privacy", "p1", "comix/privacy.py", "a", "b", "p edit", ("tests/test_x.py",)),
               _m("cohort", "c1", "comix/algorithms/cohort.py", "a", "b", "c edit", ("tests/test_y.py",))]
    result = tmp_path / "mutation-sweep.json"
    old = [{"module": m.module, "name": m.name, "file": m.file, "edit": m.what, "tests": m.tests,
            "outcome": "killed", "first_failure": "tests/test_x.py::test_old", "seconds": 1.0} for m in mutants]
    result.write_text(json.dumps({"command": "python bench/mutation_sweep.py", "machine": "Xeon", "date": "d1",
                                  "mutants": old}))
    monkeypatch.setattr(mutation_sweep, "MUTANTS", mutants)
    monkeypatch.setattr(mutation_sweep, "RESULT", result)
    monkeypatch.setattr(mutation_sweep, "check", lambda chosen: None)
    monkeypatch.setattr(mutation_sweep, "machine", lambda: "EPYC")
    monkeypatch.setattr(mutation_sweep, "run_one", lambda m, timeout: {
        **old[1], "first_failure": "tests/test_y.py::test_new", "machine": "EPYC", "date": "d2"})
    monkeypatch.setattr(mutation_sweep, "pytest", lambda tests, timeout: (0, ""))
    mutation_sweep.main(["--module", "cohort"])
    rows = {r["name"]: r for r in json.loads(result.read_text())["mutants"]}
    assert (rows["p1"]["machine"], rows["p1"]["date"]) == ("Xeon", "d1")  # not the later sweep's
    assert (rows["c1"]["machine"], rows["c1"]["first_failure"]) == ("EPYC", "tests/test_y.py::test_new")
    footer = mutation_sweep_table(result.read_text()).splitlines()[-1]
    assert "(Xeon, d1: privacy; EPYC, d2: cohort): 2 of 2 mutants killed" in footer
    one = json.loads(result.read_text())
    for r in one["mutants"]:
        r.update(machine="EPYC", date="d2")
    assert "(EPYC, d2): 2 of 2" in mutation_sweep_table(json.dumps(one))


def test_a_distillation_row_names_the_models_its_clients_were_drawn_to_run(tmp_path, monkeypatch):
    """A row's "comix ran" reads DeepFusion's devices as the clients run them (DeepFusion's own draw,
    counted), not the list of specs it draws from: the committed Gemma case's four clients are three
    Gemma-3-270M and one pruned SmolLM2 on every seed (docs/deepfusion-cases.md's per-device rows)."""
    page = _results_page()
    assert page.ran("deepfusion-cpu-qa-open-gemma-n4").endswith("devices 3x gemma3-270m, 1x prune:30:1536:512")
    from comix.algorithms import TrainConfig, make_algorithm
    from comix.models import LoRAConfig
    from comix.models.devices import assign_devices
    specs = ["base", "prune:2:32", "random-gpt2:2:64"]
    method = make_algorithm("deepfusion", LoRAConfig(), TrainConfig(rounds=1), 7, devices=specs, assign_seed=3)
    assert method.spec_of == assign_devices(specs, 7, 3) != assign_devices(specs, 7, 4)  # the label's draw is the method's
