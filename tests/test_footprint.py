"""What each device spends per round (engines/footprint.py Footprint): tokens, the frozen base's
bytes at its precision, the activations a training step keeps, and the training memory."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from comix.cli import main

COMMON = ["model=tiny-llama", "train.rounds=1", "train.local_steps=3", "train.seq_len=32", "data.valid_tokens=512",
          "data.test_tokens=512"]


def _first(run, method):
    return json.loads((run / method / "metrics.jsonl").read_text().splitlines()[0])


def test_tokens_memory_and_time_per_round_are_present_and_grow_with_the_batch(tmp_path):
    rows = {}
    for batch in (2, 4):
        assert main(["run", *COMMON, "methods=[fedavg]", f"train.batch_size={batch}",
                     f"run_dir={tmp_path / str(batch)}"]) == 0
        rows[batch] = _first(tmp_path / str(batch), "fedavg")
    for batch, r in rows.items():
        assert r["tokens"] == 3 * batch * 32  # local steps x batch x sequence
        assert r["memory_mb"] == pytest.approx(r["runtime_mb"] + r["base_mb"] + r["trainable_mb"] + r["activation_mb"],
                                               abs=2e-3)
        assert r["train_s"] > 0 and r["base_mb"] > 0 and r["runtime_mb"] > 100  # torch alone is more
    assert rows[4]["activation_mb"] == pytest.approx(2 * rows[2]["activation_mb"], rel=0.15)  # linear in the batch
    assert rows[4]["base_mb"] == rows[2]["base_mb"] and rows[4]["trainable_mb"] == rows[2]["trainable_mb"]


def test_a_quantised_base_is_counted_at_its_storage_size(tmp_path):
    pytest.importorskip("bitsandbytes")
    base = {}
    for quant in ("none", "nf4"):
        assert main(["run", *COMMON, "methods=[comigs-1g1s]", "train.batch_size=2", f"quant={quant}",
                     f"run_dir={tmp_path / quant}"]) == 0
        base[quant] = _first(tmp_path / quant, "comigs-1g1s")["base_mb"]
    assert base["nf4"] < 0.7 * base["none"]  # tiny-llama: embeddings (not quantised) are most of it


def test_results_sum_what_the_devices_spent(tmp_path):
    assert main(["run", *COMMON, "methods=[fedavg]", "train.batch_size=2", "train.rounds=2",
                 f"run_dir={tmp_path}"]) == 0
    rows = [json.loads(x) for x in (tmp_path / "fedavg" / "metrics.jsonl").read_text().splitlines()]
    spent = json.loads((tmp_path / "fedavg" / "results.json").read_text())["devices"]
    assert spent["bytes_up"] == sum(r["bytes_up"] for r in rows) > 0 and spent["device_rounds"] == len(rows) == 8
    assert spent["tokens"] == sum(r["tokens"] for r in rows) == 8 * 3 * 2 * 32
    assert spent["memory_mb_max"] == max(r["memory_mb"] for r in rows)
    md = (tmp_path / "results.md").read_text()
    assert "What the devices spent" in md and f"| fedavg | {spent['bytes_up'] / 2**20:.2f} |" in md


def test_the_report_shows_what_each_device_spent(tmp_path):
    from comix.reporting import build_page
    assert main(["run", *COMMON, "methods=[fedavg,comigs-1g1s]", "train.batch_size=2", "micro_batches=[2,1,1,1]",
                 f"run_dir={tmp_path}"]) == 0
    page = build_page(tmp_path, routing=False)
    text, images = page.markdown("files")
    section = text[text.index("## What each device spent"):]
    assert "| fedavg | de | none, 2 slices |" in section and "| comigs-1g1s | nl | none |" in section
    assert "devices.png" in images
    assert not page.overlaps


def test_the_planned_base_counts_the_run_s_bytes_per_weight():
    """A bf16 run stores its full-precision base in 2 bytes a weight: the fleet's plan must count
    2, not fp32's 4 (devices were quantised more than they needed)."""
    import torch

    from comix.engines.device import planned_base_bytes
    from comix.models import load_base_model
    from comix.models.quant import base_bytes
    model, _ = load_base_model("tiny-llama")
    fp32 = planned_base_bytes(model)
    assert fp32["none"] == base_bytes(model)
    half = planned_base_bytes(model.to(torch.bfloat16))
    assert half["none"] == base_bytes(model) and half["none"] < 0.6 * fp32["none"]
    assert half["nf4"] < half["int8"] < half["none"]


def test_a_step_peak_counts_each_storage_from_creation_to_free_and_nothing_held_before():
    from comix.engines.footprint import StepPeak
    held = torch.zeros(2**20)  # 4 MiB that existed before: never counted, nor its views
    mib = 2**20 // 4
    with StepPeak() as peak:
        held.view(-1)[:10].add_(1)
        a = torch.ones(mib)
        b = torch.ones(2 * mib)
        view = b[: mib]  # a view: the same storage, counted once
        del a
        c = torch.ones(mib)
        assert peak.now == 3 * 2**20
        del b, view, c
    assert peak.peak == 3 * 2**20 and peak.now == 0 and not peak.live


def _probe(model: str, batch: int, seq: int) -> dict:
    env = {**os.environ, "MALLOC_TRIM_THRESHOLD_": "0", "MALLOC_MMAP_THRESHOLD_": "65536"}
    out = subprocess.run([sys.executable, str(Path(__file__).with_name("memory_probe.py")), model, str(batch), str(seq)],
                         env=env, capture_output=True, text=True, check=True).stdout
    return json.loads(out.splitlines()[-1])


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux's /proc to reset the peak RSS")
@pytest.mark.parametrize("model,batch,seq", [("tiny-llama", 128, 256),
                                             pytest.param("smollm2-135m", 4, 128, marks=pytest.mark.real_model)])
def test_training_memory_is_what_the_process_really_holds_within_ten_percent(model, batch, seq):
    """The resident memory a training step adds (glibc made to return freed memory at once) is
    the step peak comix counts, backward transients included; and the planner's need (runtime +
    base + trainable state + step) is the process's peak during the step."""
    m = _probe(model, batch, seq)
    rise = m["rss_peak_mb"] - m["rss_before_mb"]
    assert m["step_mb"] == pytest.approx(rise, rel=0.10)
    assert m["planned_mb"] == pytest.approx(m["rss_peak_mb"], rel=0.10)
