"""A CoMiGS-1G1S device's local step on SmolLM2-135M trained by ExecuTorch's training runtime
(``train.client_runtime=executorch``, models/executorch_training.py) against the same step in
PyTorch: the main job's batch (4 x 128 tokens), the same client model, the same AdamW.

    python bench/executorch_step.py [--model smollm2-135m] [--reps 6] [--out bench/results/executorch-step.json]

Measured: the export (``torch.export`` + ``_export_forward_backward`` + lowering) once, its wall
time and the process's resident-memory rise over it; the program's size (its frozen base baked in
as constants), its external weights file (the .ptd of the trained tensors) and the trained tensors'
bytes (what a device holds and uploads from); one expert
step's time in each runtime, interleaved after a warm-up (paired ratio ExecuTorch / PyTorch); each
step's memory: PyTorch's as comix measures every device's (engines/footprint.py StepPeak, the
bytes its tensors hold at once), ExecuTorch's as its memory planner allots (the program's
non-constant buffers). Both steps' losses on the first batch, from the same adapters, must agree
(printed and written, the bench's own check). Written, not asserted.
"""
from __future__ import annotations

import footprint  # noqa: F401  (prints wall time and peak RSS at exit)

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from layer_speed import interleaved, paired_ratio  # noqa: E402

from comix.algorithms import TrainConfig, make_algorithm  # noqa: E402
from comix.algorithms.base import ClientState  # noqa: E402
from comix.algorithms.training import executorch_step, expert_params, make_optimizer, model_load_balance, train_step  # noqa: E402
from comix.engines.device import fresh_adapters  # noqa: E402
from comix.engines.footprint import StepPeak  # noqa: E402
from comix.engines.inprocess import ClientModels  # noqa: E402
from comix.models import LoRAConfig, load_base_model  # noqa: E402
from comix.models.executorch_training import program_for  # noqa: E402
from comix.runtime import Runtime, process_memory_mb  # noqa: E402


def client_step(model_name: str, method: str, batch: int, seq: int, n_batches: int):
    """A device's client model of ``method`` over ``model_name`` with fresh adapters, its expert
    parameters, ``n_batches`` random (inputs, targets) batches and its load balance (the term, its
    settings): what both runtimes' steps take, the main job's rates (lr 2e-3, load balance 0.01)."""
    base, _ = load_base_model(model_name)
    train = TrainConfig()
    algo = make_algorithm(method, LoRAConfig(), train, 4)
    model = ClientModels(base, algo).for_client(0)
    adapters = fresh_adapters(model, 0)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n in adapters:
                p.copy_(adapters[n])
    gen = torch.Generator().manual_seed(0)
    batches = [(lambda t: (t[:, :-1].contiguous(), t[:, 1:].contiguous()))(
        torch.randint(0, model.config.vocab_size, (batch, seq + 1), generator=gen)) for _ in range(n_batches)]
    lb = (lambda: train.lb_weight * model_load_balance(model, train.load_balance)), (train.lb_weight, train.load_balance)
    return model, train, expert_params(model), batches, lb


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--method", default="comigs-1g1s")
    ap.add_argument("--reps", type=int, default=6)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--out", default="bench/results/executorch-step.json")
    args = ap.parse_args()
    model, train, named, batches, lb = client_step(args.model, args.method, args.batch, args.seq, 2 * args.reps + 4)
    x, y = batches[0]

    rss0, t0 = process_memory_mb(), time.perf_counter()
    program = program_for(model, x, y, *lb)
    export_s, export_rss = time.perf_counter() - t0, process_memory_mb() - rss0

    # the same first step both ways from the same adapters: the bench's own check
    start = {n: p.detach().clone() for n, p in named}
    opts = {k: make_optimizer(named, ClientState(adapters={}), "experts", train) for k in ("pytorch", "executorch")}
    et_loss = float(executorch_step(model, x, y, named, opts["executorch"], train.grad_clip, *lb))
    with torch.no_grad():
        for n, p in named:
            p.copy_(start[n])
    with StepPeak() as peak:
        pt_loss = float(train_step(model, x, y, [p for _, p in named], opts["pytorch"], train.grad_clip, None, 1, lb[0]))

    feed = iter(batches[1:])
    steps = {"pytorch": lambda: train_step(model, *next(feed), [p for _, p in named], opts["pytorch"], train.grad_clip,
                                           None, 1, lb[0]),
             "executorch": lambda: executorch_step(model, *next(feed), named, opts["executorch"], train.grad_clip, *lb)}
    times = interleaved(steps, args.reps, Runtime(), warmup=1)
    trained = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    fig = {"model": args.model, "method": args.method, "batch": [args.batch, args.seq],
           "first_step_loss": {"pytorch": pt_loss, "executorch": et_loss},
           "step_s": {k: statistics.median(v) for k, v in times.items()}, "step_s_all": times,
           "paired_ratio_executorch_over_pytorch": paired_ratio(times["executorch"], times["pytorch"]),
           "export_s": export_s, "export_rss_rise_mb": export_rss,
           "program_mb": len(program.buffer) / 2**20, "weights_file_mb": len(program.weights) / 2**20,
           "trained_tensors_mb": trained / 2**20,
           "step_memory_mb": {"pytorch_step_peak": peak.peak / 2**20, "executorch_planned": program.planned_bytes / 2**20},
           "command": "python bench/executorch_step.py " + " ".join(sys.argv[1:]), "date": time.strftime("%Y-%m-%d"),
           "torch": torch.__version__, "machine": f"{os.cpu_count()} cores of an {footprint.cpu_name()}",
           "threads": torch.get_num_threads(), "bench_peak_rss_mb": round(footprint.peak_rss_mb(), 1)}
    footprint.write_result(Path(args.out), fig)
    for k in ("first_step_loss", "step_s", "paired_ratio_executorch_over_pytorch", "export_s", "export_rss_rise_mb",
              "program_mb", "weights_file_mb", "trained_tensors_mb", "step_memory_mb"):
        print(f"{k}: {fig[k]}")


if __name__ == "__main__":
    main()
