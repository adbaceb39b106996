"""Where an ExecuTorch training step's time and memory go, beside the same step in PyTorch: the
CoMiGS-1G1S device step of bench/executorch_step.py (SmolLM2-135M, the main job's 4 x 128 tokens).

    python bench/executorch_profile.py [--model smollm2-135m] [--reps 3] [--out bench/results/executorch-profile.json]

Time: the program run with ExecuTorch's event tracer (``enable_etdump``; read back with
``executorch.devtools.Inspector``): each kernel's milliseconds a step, summed by operator; the same
forward and backward under ``torch.profiler``: each aten operator's self time a step. Both after a
warm-up step, over ``--reps`` steps, with the thread count each runtime used, and each step's time
without its profiler beside (what the tracers add). Run it alone: a runtime whose kernels split
their work over both cores waits on whichever thread another process holds up.
Memory: the program's memory plan (the forward method's non-constant arena, what the runtime
allocates for a step), the bytes of planned tensors alive at the plan's busiest instruction (from
each tensor's lifetime in the plan), and those bytes by the operator that writes them. A view in
PyTorch (a weight's transpose, an expand, an unsqueeze) is a copy in ExecuTorch's edge dialect
(``permute_copy``, ``expand_copy``, ...), which is what the copy rows measure. Written, not asserted.
"""
from __future__ import annotations

import footprint  # noqa: F401  (prints wall time and peak RSS at exit)

import argparse
import collections
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from executorch_step import client_step  # noqa: E402

from comix.algorithms.training import lm_loss  # noqa: E402
from comix.models.executorch_training import lower  # noqa: E402

# edge-dialect copies of what PyTorch computes as views (or as no-ops), and the clones the lowering adds
COPIES = ("permute_copy", "expand_copy", "view_copy", "alias_copy", "unsqueeze_copy", "squeeze_copy", "slice_copy",
          "select_copy", "transpose_copy", "t_copy", "_clone_dim_order", "clone", "_to_copy", "_to_dim_order_copy")


def _op(name: str) -> str:
    """One operator's name on both sides: 'native_call_mm.out', 'aten.mm.out' and 'aten::mm' -> 'mm'."""
    name = name.removeprefix("native_call_").removeprefix("aten::").removeprefix("aten.")
    name = name.removeprefix("dim_order_ops.")
    for suffix in (".out", "_out", ".Tensor_Scalar_out", ".Tensor_out", ".Scalar_out", ".IntList_out", ".start_out"):
        name = name.removesuffix(suffix)
    return name.split(".")[0]


def plan_at_peak(manager) -> dict:
    """The forward method's planned arena and its busiest instruction's live bytes, by writer."""
    gm = manager.exported_program().graph_module
    writer = {}
    for node in gm.graph.nodes:
        if node.op == "call_function":
            out = node.kwargs.get("out")
            for o in out if isinstance(out, (list, tuple)) else [out]:
                if isinstance(o, torch.fx.Node):
                    writer[o] = _op(str(node.target))
    tensors = []  # (writer, bytes, first, last)
    for node in gm.graph.nodes:
        if node.op == "call_function" and "alloc" in str(node.target):
            spec = node.meta["spec"]
            for s in spec if isinstance(spec, (list, tuple)) else [spec]:
                tensors.append((writer.get(node, "other"), s.allocated_memory, *s.lifetime))
    last = max(e for *_, e in tensors)
    live = [0] * (last + 2)
    for _, size, a, e in tensors:
        for i in range(a, e + 1):
            live[i] += size
    peak = max(range(len(live)), key=live.__getitem__)
    at = collections.Counter()
    for op, size, a, e in tensors:
        if a <= peak <= e:
            at[op] += size
    arena = sum(sum(p.non_const_buffer_sizes) for p in manager.executorch_program.execution_plan if p.name == "forward")
    mb = 2 ** 20
    return {"arena_mb": arena / mb, "peak_live_mb": live[peak] / mb, "tensors_planned": len(tensors),
            "peak_live_by_writer_mb": {k: round(v / mb, 1) for k, v in at.most_common()},
            "peak_live_copies_mb": sum(v for k, v in at.items() if k in COPIES) / mb}


def executorch_ops(manager, x, y, reps: int) -> tuple[dict, float, float, int]:
    """(each operator's ms a step, the method's ms a step under the event tracer, a step's wall ms
    without it, the runtime's threads)."""
    from executorch.devtools import Inspector
    from executorch.extension.pybindings.portable_lib import _load_for_executorch_from_buffer, _threadpool_get_thread_count
    with tempfile.TemporaryDirectory() as folder:
        manager.write_tensor_data_to_file(folder)
        weights = next(Path(folder).glob("*.ptd")).read_bytes()
        plain = _load_for_executorch_from_buffer(manager.buffer, weights)  # the step as comix runs it, untraced
        plain.run_method("forward", (x, y), clone_outputs=False)
        t0 = time.perf_counter()
        for _ in range(reps):
            plain.run_method("forward", (x, y), clone_outputs=False)
        untraced = (time.perf_counter() - t0) / reps * 1e3
        del plain
        module = _load_for_executorch_from_buffer(manager.buffer, weights, enable_etdump=True)
        module.run_method("forward", (x, y), clone_outputs=False)  # warm-up, its events dropped below
        for _ in range(reps):
            module.run_method("forward", (x, y), clone_outputs=False)
        module.write_etdump_result_to_file(f"{folder}/step.etdp")
        inspector = Inspector(etdump_path=f"{folder}/step.etdp")
    ops, method = collections.Counter(), []
    for block in inspector.event_blocks:
        for event in block.events:
            if event.perf_data is None:
                continue
            runs = event.perf_data.raw
            if event.name == "Method::execute":
                method = runs
            elif event.name.startswith("native_call_"):
                ops[_op(event.name)] += sum(runs[1:]) if len(runs) > reps else sum(runs)  # the warm-up's dropped
    return ({k: v / reps for k, v in ops.most_common()}, sum(method[-reps:]) / reps, untraced,
            _threadpool_get_thread_count())


def pytorch_ops(model, lb, x, y, reps: int) -> tuple[dict, float, float]:
    """(each aten operator's self ms a step, the step's ms under the profiler, without it) of the same
    forward and backward in PyTorch."""
    from torch.profiler import ProfilerActivity, profile

    def step():
        loss = lm_loss(model, x, y) + lb()
        loss.backward()
        model.zero_grad(set_to_none=True)
    step()
    t0 = time.perf_counter()
    for _ in range(reps):
        step()
    plain = (time.perf_counter() - t0) / reps
    t0 = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(reps):
            step()
    wall = (time.perf_counter() - t0) / reps
    ops = collections.Counter()
    for e in prof.key_averages():
        if e.key.startswith("aten::"):
            ops[_op(e.key)] += e.self_cpu_time_total / 1e3  # us -> ms
    return {k: v / reps for k, v in ops.most_common()}, wall * 1e3, plain * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--method", default="comigs-1g1s")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--out", default="bench/results/executorch-profile.json")
    args = ap.parse_args()
    model, train, named, batches, lb = client_step(args.model, args.method, args.batch, args.seq, 1)
    x, y = batches[0]
    t0 = time.perf_counter()
    manager = lower(model, x, y, lb[0])
    export_s = time.perf_counter() - t0
    plan = plan_at_peak(manager)
    et_ops, et_ms, et_untraced_ms, et_threads = executorch_ops(manager, x, y, args.reps)
    del manager
    pt_ops, pt_ms, pt_plain_ms = pytorch_ops(model, lb[0], x, y, args.reps)
    top = sorted(set(list(et_ops)[:12]) | set(list(pt_ops)[:8]), key=lambda k: -et_ops.get(k, 0.0))
    fig = {"model": args.model, "method": args.method, "batch": [args.batch, args.seq], "reps": args.reps,
           "export_s": export_s, "plan": plan,
           "step_ms": {"executorch": et_ms, "pytorch": pt_ms},  # each under its profiler
           "step_ms_unprofiled": {"executorch": et_untraced_ms, "pytorch": pt_plain_ms},
           "threads": {"executorch": et_threads, "pytorch": torch.get_num_threads()},
           "op_ms_per_step": {k: {"executorch": round(et_ops.get(k, 0.0), 1), "pytorch": round(pt_ops.get(k, 0.0), 1)}
                              for k in top},
           "kernels_ms": {"executorch": sum(et_ops.values()), "pytorch": sum(pt_ops.values())},
           "copies_ms": {"executorch": sum(v for k, v in et_ops.items() if k in COPIES),
                         "pytorch": sum(v for k, v in pt_ops.items() if k in COPIES + ("copy_", "contiguous"))},
           "command": "python bench/executorch_profile.py " + " ".join(sys.argv[1:]), "date": time.strftime("%Y-%m-%d"),
           "torch": torch.__version__, "machine": f"{os.cpu_count()} cores of an {footprint.cpu_name()}",
           "bench_peak_rss_mb": round(footprint.peak_rss_mb(), 1)}
    footprint.write_result(Path(args.out), fig)
    for k in ("step_ms", "step_ms_unprofiled", "threads", "kernels_ms", "copies_ms", "plan", "op_ms_per_step"):
        print(f"{k}: {fig[k]}")


if __name__ == "__main__":
    main()
