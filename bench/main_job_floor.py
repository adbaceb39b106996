"""How fast the main job could be at best on this machine: every matrix product it performs (forward
and backward, training, router steps and evaluation), timed where it runs and alone at its own
shape, summed.

    python bench/main_job_floor.py [key=value ...]     # the same overrides as `comix run`

The goal was the main job 2x faster with the same printed numbers. Nothing that keeps
the numbers can skip a product the algorithms need, so the sum of their times is a lower bound on
the wall time (everything else -- normalisation, attention softmax, the optimiser, data, I/O --
only adds to it). The run is executed once in-process under a ``TorchDispatchMode`` that records
the shape, strides and dtype of every ``mm``/``addmm``/``bmm``/``baddbmm`` and the time each
call took where it ran (the run's own wall time is slowed by the recording, so it is not a
measurement here; the products' in-job time is). Then each distinct product
is rebuilt with the same layout and timed (median of repeats after a warm-up) with nothing else
running, and the floor is sum(count x time). Prints the table and writes
bench/results/main-job-floor.md.
"""
from __future__ import annotations

import footprint  # noqa: F401  (prints wall time and peak RSS at exit)

import collections
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parent))
from main_job import publish  # noqa: E402

PRODUCTS = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default,
            torch.ops.aten.baddbmm.default}


def layout(t: torch.Tensor) -> tuple:
    return tuple(t.shape), tuple(t.stride()), t.dtype


class RecordProducts(TorchDispatchMode):
    """Counts every matrix product by (op, layout of each tensor argument) and times it where it
    runs (``in_job_s``: the products' own time inside the job, caches as the job leaves them)."""

    def __init__(self):
        super().__init__()
        self.counts: collections.Counter = collections.Counter()
        self.in_job_s = 0.0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func not in PRODUCTS:
            return func(*args, **(kwargs or {}))
        self.counts[(func, tuple(layout(a) for a in args if isinstance(a, torch.Tensor)))] += 1
        t0 = time.perf_counter()
        out = func(*args, **(kwargs or {}))
        self.in_job_s += time.perf_counter() - t0
        return out


def flops(func, layouts) -> int:
    *_, (a_shape, _, _), (b_shape, _, _) = layouts  # the two factors are the last two tensors
    batch = a_shape[0] if len(a_shape) == 3 else 1
    m, k = a_shape[-2:]
    return 2 * batch * m * k * b_shape[-1]


def time_product(func, layouts, reps: int = 15) -> float:
    """Median seconds of one product with these exact shapes and strides (random values)."""
    args = []
    for shape, stride, dtype in layouts:
        size = 1 + sum((n - 1) * s for n, s in zip(shape, stride)) if all(shape) else 0
        args.append(torch.randn(size, dtype=dtype).as_strided(shape, stride))
    for _ in range(3):
        func(*args)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        func(*args)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    from comix.cli import main as comix_main

    overrides = sys.argv[1:]
    recorder = RecordProducts()
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="comix-floor-") as run_dir, recorder:
        comix_main(["run", f"run_dir={run_dir}", *overrides])
    recorded_s = time.perf_counter() - t0
    rows, floor, total_flops = [], 0.0, 0
    for (func, layouts), count in recorder.counts.items():
        seconds = time_product(func, layouts)
        f = flops(func, layouts)
        floor += count * seconds
        total_flops += count * f
        rows.append((count * seconds, func, layouts, count, seconds, f))
    rows.sort(key=lambda r: -r[0])
    threads = torch.get_num_threads()
    command = " ".join(["python bench/main_job_floor.py", *overrides])
    lines = [f"# Lower bound of the main job: its matrix products alone (`{command}`)", "",
             f"Machine: {platform.machine()}, {os.cpu_count()} CPUs, {threads} torch threads; torch {torch.__version__}; "
             f"{platform.platform()}. Each distinct product (op, shapes, strides, dtype) of one `comix run` was "
             "recorded, then timed alone (median of 15 after 3 warm-ups).", "",
             f"- products: {sum(recorder.counts.values()):,} calls of {len(recorder.counts)} distinct layouts, "
             f"{total_flops / 1e12:.2f} TFLOP",
             f"- their time alone: **{floor / 60:.2f} min** (mean rate {total_flops / floor / 1e9:.0f} GFLOP/s)",
             f"- their time inside the job: {recorder.in_job_s / 60:.2f} min "
             f"(mean rate {total_flops / recorder.in_job_s / 1e9:.0f} GFLOP/s)",
             f"- (the recorded run itself, slowed by the recording: {recorded_s / 60:.2f} min; not a measurement)", "",
             "Largest contributions:", "", "| op | shapes | calls | ms each | GFLOP/s | share of floor |",
             "|---|---|---|---|---|---|",
             *(f"| {func.__name__} | "
               f"{' x '.join(str(list(s)) for s, _, _ in layouts)} | {count:,} | {seconds * 1e3:.2f} | "
               f"{f / seconds / 1e9:.0f} | {100 * total / floor:.1f} % |"
               for total, func, layouts, count, seconds, f in rows[:12]), ""]
    publish(lines, "main-job-floor.md")


if __name__ == "__main__":
    main()
