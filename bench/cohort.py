"""Cohorts of clients in one step (algorithms/cohort.py): training tokens/s, FLOPs counted per step
and the share of the device's peak (MFU), for cohorts of 1 / 4 / 16 / 64 clients, plain LoRA and
the n = 8 mixture (top-2), SmolLM2-135M.

  python bench/cohort.py                                   # CPU fp32: cohorts 1, 4, 16; 1 x 128 tokens a client
  python bench/cohort.py --device cuda --precision bf16 --cohorts 1 4 16 64 --rows 8
  python bench/cohort.py --model tiny-llama --cohorts 1 2 --reps 2     # seconds: the dry run's

Cohort 1 is the sequential executor's own step (``train_step`` with torch's AdamW on 2-D
adapters); cohort C > 1 is ``cohort_step`` on adapters stacked for C clients, each client's rows
its own batch. The configurations are built and warmed up first, then timed in alternating order
(A B C, C B A, ...), so a drift hits none more than another; each figure is the median over the
rounds. FLOPs are counted once per configuration by torch's ``FlopCounterMode`` (every matmul of
the forward and backward, the frozen base's and the adapters'); MFU divides the FLOPs a second
by the device's peak: on CUDA the card's nominal dense bf16 / fp32 peak (NVIDIA's data sheets,
``NOMINAL``), and on every device the rate of one large matmul in the compute dtype timed here
(``gemm_peak``: what this machine's BLAS reaches, the honest ceiling on a CPU). Peak memory: on
CUDA torch's peak allocation in one step of the configuration; on the CPU the most bytes the
step's tensors hold at once (``Footprint``; files measured before 2026-11-28 give the bytes the
forward kept for the backward instead) and the process's peak RSS at the end. Writes
bench/results/cohort-<device>-<precision>.json (``--out`` to change), which bench/tables.py renders.
"""
from __future__ import annotations

import footprint  # noqa: F401  (prints wall time and peak RSS at exit)

import argparse
import json
import platform
import statistics
import sys
import time
from datetime import date
from pathlib import Path

import torch
from torch.utils.flop_counter import FlopCounterMode

from comix.algorithms.cohort import CohortAdamW, CohortMasters, CohortStep
from comix.algorithms.training import TrainConfig, train_step
from comix.engines.device import fresh_adapters
from comix.engines.footprint import Footprint
from comix.models import AdapterConfig, LoRAConfig, inject_adapters, load_base_model
from comix.models.cohort import stack_clients
from comix.runtime import resolve

ROOT = Path(__file__).resolve().parents[1]
# dense (no sparsity) peak FLOP/s from NVIDIA's data sheets, SXM parts: name fragment -> {dtype: peak}
NOMINAL = {"H200": {"bf16": 989e12, "fp32": 67e12}, "H100": {"bf16": 989e12, "fp32": 67e12},
           "A100": {"bf16": 312e12, "fp32": 19.5e12}, "L4": {"bf16": 121e12, "fp32": 30e12}}
ADAPTERS = {  # Local's / FedAvg's adapters (attention LoRA + 2x LoRA on the MLP) and CoMiGS's n = 8 mixture
    "LoRA": AdapterConfig(mlp="lora", mlp_lora=LoRAConfig(modules=2)),
    "mixture n=8": AdapterConfig(mlp="mixture", n_experts=8, top_k=2),
}


def gqa_sdpa_formulas() -> dict:
    """FLOP formulas for the fused attention ops (CUDA's flash, efficient and cuDNN kernels) that
    count grouped-query attention: torch 2.11's own (the H200 image's, 2026-12-04) assert that key
    and value have the query's heads, and SmolLM2 attends with 3 KV heads for 9 query heads, so
    the count raised there ("query/key/value shapes are incompatible"). Each KV head serves
    h_q / h_kv query heads, so a step's products are those of the KV heads broadcast to h_q, the
    rule torch 2.12's formulas adopted (torch/utils/flop_counter.py, ``sdpa_flop_count``)."""
    from torch.utils import flop_counter as fc
    aten = torch.ops.aten

    def broadcast(query_shape, *kv_shapes):
        return [(s[0], query_shape[1], *s[2:]) for s in kv_shapes]

    def forward(query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
        return fc.sdpa_flop_count(query_shape, *broadcast(query_shape, key_shape, value_shape))

    def backward(grad_out_shape, query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
        return fc.sdpa_backward_flop_count(grad_out_shape, query_shape, *broadcast(query_shape, key_shape, value_shape))
    kinds = ("efficient", "flash", "cudnn")
    return {**{getattr(aten, f"_scaled_dot_product_{k}_attention"): forward for k in kinds},
            **{getattr(aten, f"_scaled_dot_product_{k}_attention_backward"): backward for k in kinds}}


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def cpu_name() -> str:
    try:
        return next(ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or "cpu"


def gemm_peak(runtime, n: int) -> float:
    """FLOP/s of an n x n x n matmul in the compute dtype on the device (median of 5 after 2 warm-ups)."""
    a = torch.randn(n, n, device=runtime.device, dtype=runtime.dtype)
    b = torch.randn(n, n, device=runtime.device, dtype=runtime.dtype)
    times = []
    for i in range(7):
        sync(runtime.device)
        t0 = time.perf_counter()
        a @ b
        sync(runtime.device)
        if i >= 2:
            times.append(time.perf_counter() - t0)
    return 2 * n ** 3 / statistics.median(times)


def make_step(base, cfg: AdapterConfig, clients: int, rows: int, seq: int, runtime, train: TrainConfig,
              capture: bool = False):
    """A closure running one training step of ``clients`` clients (each ``rows`` x ``seq`` tokens);
    a cohort's step is the engine's (``CohortStep``: fp32 masters under compute-dtype copies, and
    with ``capture`` one CUDA graph)."""
    model = inject_adapters(_shared_copy(base), cfg).to(runtime.device)
    fresh_adapters(model, 0)
    for n, p in model.named_parameters():  # B = 0 at init: give every factor a gradient
        if p.requires_grad:
            torch.nn.init.normal_(p, std=0.02)
    gen = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    x = torch.randint(0, vocab, (clients * rows, seq), generator=gen)
    y = torch.randint(0, vocab, (clients * rows, seq), generator=gen)
    cohort_step = None
    if clients == 1:  # the sequential executor's step
        params = [p for p in model.parameters() if p.requires_grad]
        opt = torch.optim.AdamW(params, lr=train.lr, betas=tuple(train.betas), weight_decay=train.weight_decay)
        step = lambda: train_step(model, x, y, params, opt, 0.0)  # noqa: E731
    else:
        model = stack_clients(model, clients)
        params = [p for p in model.parameters() if p.requires_grad]
        masters = CohortMasters(params, runtime.dtype)
        cohort_step = CohortStep(model, params, CohortAdamW(params, train, master=masters.of(params)), train, capture)
        step = lambda: cohort_step(x, y, [train.lr] * clients)  # noqa: E731
    model.train()

    def run():
        with runtime.autocast():
            step()
    return model, run, cohort_step


def _shared_copy(base):
    """A copy of ``base`` whose frozen tensors are the base's own (each configuration adds only adapters)."""
    import copy
    return copy.deepcopy(base, memo={id(t): t for t in (*base.parameters(), *base.buffers())})


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--precision", default="fp32")
    ap.add_argument("--cohorts", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--rows", type=int, default=1, help="sequences of each client in a step")
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--adapters", nargs="+", default=list(ADAPTERS), choices=list(ADAPTERS))
    ap.add_argument("--out", default="")
    args = ap.parse_args(argv)
    runtime = resolve(args.device, args.precision)
    base, _ = load_base_model(args.model)
    base = runtime.prepare_base(base)
    train = TrainConfig()
    t0 = time.perf_counter()
    peak = gemm_peak(runtime, 4096 if runtime.device.type == "cuda" else 1536)
    name = torch.cuda.get_device_name(runtime.device) if runtime.device.type == "cuda" else cpu_name()
    nominal = next((v.get(args.precision) for k, v in NOMINAL.items() if k in name), None) \
        if runtime.device.type == "cuda" else None
    configs, results = {}, {}
    # on CUDA each cohort twice: its step captured as one CUDA graph (the engine's default there) and eager
    variants = [(c, capture) for c in args.cohorts for capture in ((True, False) if runtime.graphs and c > 1 else (False,))]
    for kind in args.adapters:
        for c, capture in variants:
            key = f"{kind}, cohort {c}" + (", eager" if runtime.graphs and c > 1 and not capture else "")
            model, run, stepper = make_step(base, ADAPTERS[kind], c, args.rows, args.seq, runtime, train, capture)
            if runtime.device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(runtime.device)
            with Footprint(model) as fp:
                run()  # warm-up 1, and the most one step's tensors hold at once
            sync(runtime.device)
            mem = torch.cuda.max_memory_allocated(runtime.device) / 2**20 if runtime.device.type == "cuda" else None
            with FlopCounterMode(display=False, custom_mapping=gqa_sdpa_formulas()) as counter:
                run()
            run()  # warm-up 2
            run()  # warm-up 3: a captured step's capture (CohortStep.WARMUP eager steps first)
            configs[key] = run
            # "graph": whether the step was captured (a capture that fails runs eagerly and says why)
            results[key] = {"adapters": kind, "cohort": c, "graph": bool(stepper and stepper.captured),
                            "tokens": c * args.rows * args.seq,
                            "flops": counter.get_total_flops(), "step_peak_mb": round(fp.peak / 2**20, 1),
                            **({"peak_mem_mb": round(mem, 1)} if mem is not None else {})}
            print(f"built {key}: {results[key]['flops'] / 1e9:.1f} GFLOP a step", flush=True)
    times = {k: [] for k in configs}
    keys = list(configs)
    for i in range(args.reps):
        for k in keys if i % 2 == 0 else keys[::-1]:
            sync(runtime.device)
            t = time.perf_counter()
            configs[k]()
            sync(runtime.device)
            times[k].append(time.perf_counter() - t)
    for k, r in results.items():
        s = statistics.median(times[k])
        r.update(step_s=round(s, 5), tokens_per_s=round(r["tokens"] / s, 1),
                 mfu_gemm=round(r["flops"] / s / peak, 5), **({"mfu_nominal": round(r["flops"] / s / nominal, 5)}
                                                             if nominal else {}))
        one = results.get(f"{r['adapters']}, cohort 1")
        if one:
            r["speedup_tokens_per_s"] = round(r["tokens_per_s"] / (one["tokens"] / statistics.median(
                times[f"{r['adapters']}, cohort 1"])), 3)
        twin = k.replace(r["adapters"], "LoRA", 1)  # the plain LoRA's step of the same cohort, graph or eager
        if twin in results and r["adapters"] != "LoRA":
            r["step_over_lora"] = round(statistics.median(m / b for m, b in zip(times[k], times[twin])), 3)
        print(f"{k:24s} {s * 1e3:9.1f} ms  {r['tokens_per_s']:10.1f} tok/s  MFU {r['mfu_gemm']:.1%} of the GEMM rate"
              + (f", {r['mfu_nominal']:.1%} of nominal" if nominal else ""), flush=True)
    out = {"command": " ".join(["python bench/cohort.py", *(argv if argv is not None else sys.argv[1:])]),
           "machine": f"{name}, {torch.get_num_threads()} threads" if runtime.device.type == "cpu" else name,
           "date": date.today().isoformat(), "torch": torch.__version__, "model": args.model,
           "device": runtime.device.type, "precision": args.precision, "rows": args.rows, "seq": args.seq,
           "reps": args.reps, "gemm_peak_flops": peak, "nominal_peak_flops": nominal,
           "seconds": round(time.perf_counter() - t0, 1), "peak_rss_mb": round(footprint.peak_rss_mb(), 1),
           "results": list(results.values())}
    path = Path(args.out) if args.out else ROOT / "bench" / "results" / f"cohort-{runtime.device.type}-{args.precision}.json"
    path.write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
