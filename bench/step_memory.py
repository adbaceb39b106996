"""A training step's memory as comix counts it against what the operating system sees.

    python bench/step_memory.py            # SmolLM2-135M, a LoRA step of 4 x 128 tokens, and tiny Llama at 512 x 256

Each measurement runs tests/memory_probe.py in a process of its own, with glibc told to return
freed memory at once (MALLOC_TRIM_THRESHOLD_=0, MALLOC_MMAP_THRESHOLD_=65536) so that the resident
set follows what is allocated: the step peak comix counts (``Footprint``, engines/footprint.py)
beside the resident memory the step adds, and the fleet planner's need (``training_memory``:
runtime + base + trainable state + step) beside the process's peak during the step.
tests/test_footprint.py asserts both within 10 %; this file keeps the numbers docs/devices.md quotes.

Writes ``bench/results/step-memory.json``.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import footprint  # prints wall time and peak RSS at exit

ROOT = Path(__file__).resolve().parents[1]
PROBE = ROOT / "tests" / "memory_probe.py"
CASES = [("smollm2-135m", 4, 128), ("tiny-llama", 512, 256)]


def probe(model: str, batch: int, seq: int) -> dict:
    env = {**os.environ, "MALLOC_TRIM_THRESHOLD_": "0", "MALLOC_MMAP_THRESHOLD_": "65536"}
    out = subprocess.run([sys.executable, str(PROBE), model, str(batch), str(seq)], env=env, capture_output=True,
                         text=True, check=True).stdout
    m = json.loads(out.splitlines()[-1])
    rise = m["rss_peak_mb"] - m["rss_before_mb"]
    return {"model": model, "batch": batch, "seq": seq, **{k: round(v, 1) for k, v in m.items()},
            "rss_rise_mb": round(rise, 1), "step_over_rise": round(m["step_mb"] / rise, 4),
            "planned_over_peak": round(m["planned_mb"] / m["rss_peak_mb"], 4)}


def main() -> None:
    import torch
    results = [probe(*case) for case in CASES]
    for r in results:
        print(json.dumps(r))
    footprint.write_result(ROOT / "bench" / "results" / "step-memory.json", {
        "command": "python bench/step_memory.py", "date": time.strftime("%Y-%m-%d"), "torch": torch.__version__,
        "machine": f"{os.cpu_count()} cores of an {footprint.cpu_name()}",
        "results": results})


if __name__ == "__main__":
    main()
