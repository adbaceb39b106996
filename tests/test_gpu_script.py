"""bench/gpu.sh, the script a lent GPU runs first, rehearsed on the CPU (``--dry-run``: a tiny
model, the same steps and files), and bench/cohort.py's result file rendered by bench/tables.py."""
import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(not Path("/usr/bin/timeout").exists(), reason="needs coreutils' timeout")
def test_the_gpu_script_runs_every_step_and_packs_its_results(tmp_path):
    env = {**os.environ, "OUT": str(tmp_path / "out"), "GPU_WORK": str(tmp_path / "work"),
           "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    proc = subprocess.run(["bash", str(ROOT / "bench" / "gpu.sh"), "--dry-run", "--budget", "400"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    steps = dict(line.split("\t")[:2] for line in (tmp_path / "out" / "steps.tsv").read_text().splitlines()[1:])
    assert [s for s, status in steps.items() if s != "total" and status != "0"] == [], steps
    assert set(steps) >= {"tests", "main-cohort1", "main-cohort-auto", "cohort-bench", "paper-table1",
                          "paper-fedamole-table3"}
    with tarfile.open(tmp_path / "out" / "results.tar.xz") as tar:
        names = tar.getnames()
    assert "./cohort-bench.json" in names and "./env.txt" in names and "./main-job-profile.json" in names
    assert any(n.endswith("main-cohort-auto/local/results.json") for n in names)
    assert not any("checkpoint.pt" in n or n.endswith(".safetensors") for n in names)  # nothing heavy comes back
    bench = json.loads((tmp_path / "work" / "cohort-bench.json").read_text())
    assert {r["cohort"] for r in bench["results"]} == {1, 2} and all(r["flops"] > 0 for r in bench["results"])


# (FedAMoLE's first try: time to build the instruction clients and finish a round, ~5 s each here)
@pytest.mark.parametrize("step,limit,seconds,prefix,server", [
    ("paper-table1", "PAPER_LIMIT", 15, "paper-resume", "paper-table1-multilingual/seed42/local/server.jsonl"),
    ("paper-fedamole-table3", "FEDAMOLE_LIMIT", 30, "fedamole-resume",
     "paper-fedamole-table3-task/seed42/fedamole/server.jsonl")])
def test_a_paper_run_cut_short_by_the_budget_continues_from_the_parts_it_packed(tmp_path, step, limit, seconds, prefix,
                                                                                server):
    env = {**os.environ, "OUT": str(tmp_path / "out"), "GPU_WORK": str(tmp_path / "work"), "DRY_ROUNDS": "5000",
           limit: str(seconds), "GPU_ONLY": step, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    gpu = ROOT / ".gpu"
    assert not list(gpu.glob(f"{prefix}*")), "a rehearsal must not meet real resume parts in .gpu/"
    run = lambda: subprocess.run(["bash", str(ROOT / "bench" / "gpu.sh"), "--dry-run"], cwd=ROOT, env=env,  # noqa: E731
                                 capture_output=True, text=True, timeout=600)
    assert run().returncode == 0
    parts = sorted((tmp_path / "out").glob(f"{prefix}.tar.xz.part-*"))
    assert parts, (tmp_path / "out" / "steps.tsv").read_text()
    server = tmp_path / "work" / server
    first = len(server.read_text().splitlines())
    gpu.mkdir(exist_ok=True)
    try:
        for p in parts:
            (gpu / p.name).write_bytes(p.read_bytes())
        import shutil
        shutil.rmtree(tmp_path / "work")
        env[limit] = str(seconds + 25)  # time to start, read the parts back and train some more rounds
        assert run().returncode == 0
    finally:
        for p in gpu.glob(f"{prefix}*"):
            p.unlink()
    rounds = [json.loads(ln)["round"] for ln in server.read_text().splitlines()]
    assert rounds[:first] == list(range(1, first + 1)) and len(rounds) > first  # continued, not restarted


def test_the_gpu_script_refuses_an_unknown_argument():
    proc = subprocess.run(["bash", str(ROOT / "bench" / "gpu.sh"), "--budgte", "5"], capture_output=True, text=True)
    assert proc.returncode == 2 and "--budgte" in proc.stderr


def test_the_cohort_bench_table_shows_speedups_mfu_and_the_mixture_ratio():
    sys.path.insert(0, str(ROOT / "bench"))
    from bench_tables import cohort_table
    result = {"command": "python bench/cohort.py", "machine": "x", "date": "2026-11-27", "torch": "2", "model": "m",
              "device": "cuda", "precision": "bf16", "rows": 8, "seq": 128, "reps": 5, "gemm_peak_flops": 7e14,
              "nominal_peak_flops": 9.89e14, "seconds": 60, "peak_rss_mb": 2048,
              "results": [{"adapters": "LoRA", "cohort": 1, "step_s": 0.2, "tokens_per_s": 5120.0, "flops": 1e12,
                           "mfu_gemm": 0.007, "mfu_nominal": 0.005, "peak_mem_mb": 900, "speedup_tokens_per_s": 1.0},
                          {"adapters": "mixture n=8", "cohort": 16, "step_s": 0.3, "tokens_per_s": 54613.3,
                           "flops": 1.6e13, "mfu_gemm": 0.076, "mfu_nominal": 0.054, "peak_mem_mb": 9000,
                           "speedup_tokens_per_s": 10.67, "step_over_lora": 1.08}]}
    text = cohort_table(json.dumps(result))
    assert "| mixture n=8 | 16 | 300.0 | 54,613 | 10.67 | 16,000 | 7.6% | 5.4% | 1.08 | 9,000 |" in text
    assert "MFU of nominal peak" in text and "0.70 TFLOP/s" not in text and "700.00 TFLOP/s" in text


def test_the_cohort_bench_counts_grouped_query_attention_as_its_heads_broadcast():
    """SmolLM2 attends with 3 KV heads for 9 query heads; torch 2.11's fused-attention formulas
    (the H200 image's) raised on those shapes and the H200's cohort bench died there (2026-12-04).
    bench/cohort.py's formulas count each KV head once for every query head it serves: the
    forward's two products (QK^T, PV) and the backward's at h_q heads, as torch counts equal
    heads (on torch 2.11 the unpatched count raises here; a backward counted as a forward fails)."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode
    sys.path.insert(0, str(ROOT / "bench"))
    from cohort import gqa_sdpa_formulas
    aten = torch.ops.aten
    registry = FlopCounterMode(display=False, custom_mapping=gqa_sdpa_formulas()).flop_registry
    q = torch.empty(2, 9, 16, 64, device="meta")
    kv = torch.empty(2, 3, 16, 64, device="meta")
    for kind in ("flash", "efficient", "cudnn"):
        fwd = registry[getattr(aten, f"_scaled_dot_product_{kind}_attention")]
        bwd = registry[getattr(aten, f"_scaled_dot_product_{kind}_attention_backward")]
        assert fwd(q, kv, kv, out_val=None) == 2 * (2 * 2 * 9 * 16 * 16 * 64)
        assert fwd(q, kv, kv, out_val=None) == fwd(q, q, q, out_val=None)
        assert bwd(q, q, kv, kv, out_val=None) == bwd(q, q, q, q, out_val=None) > fwd(q, q, q, out_val=None)
