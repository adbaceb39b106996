"""A DeepFusion device's full fine-tuning step (forward, backward, AdamW at batch 4 x 128, the
Gemma-teacher case's devices), as DeepFusion trains it (fused AdamW, the tied embedding's gradient
as sparse rows: comix/algorithms/training.py) against the plain step (the for-loop AdamW, a dense
vocabulary x width zero table added to the output projection's gradient). The same model and
batches, the two steps timed in turn after a warm-up; the paired ratio (fast / plain) is the
target (< 1), measured and written, not asserted.

    python bench/device_step.py [--model gemma3-270m] [--reps 4] [--out bench/results/device-step.json]
"""
from __future__ import annotations

import footprint  # noqa: F401  (prints wall time and peak RSS at exit)

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from layer_speed import interleaved, paired_ratio  # noqa: E402

from comix.algorithms.training import TrainConfig, make_optimizer, sparse_tied_embedding_grads, train_step  # noqa: E402
from comix.algorithms.base import ClientState  # noqa: E402
from comix.models import load_base_model  # noqa: E402
from comix.runtime import resolve  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="gemma3-270m")
    ap.add_argument("--reps", type=int, default=4)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--out", default="bench/results/device-step.json")
    args = ap.parse_args()
    runtime = resolve("auto", "fp32")
    model, _ = load_base_model(args.model)
    model = model.to(runtime.device).float().train()
    for p in model.parameters():
        p.requires_grad_(True)
    params = list(model.named_parameters())
    train = TrainConfig(lr=1e-4)
    gen = torch.Generator().manual_seed(0)
    x = torch.randint(0, model.config.vocab_size, (args.batch, args.seq + 1), generator=gen)
    opts = {"plain": make_optimizer(params, ClientState(adapters={}), "model", train, fused=False),
            "fast": make_optimizer(params, ClientState(adapters={}), "model", train, fused=True)}

    def step(kind: str):
        def run():
            if kind == "fast":
                with sparse_tied_embedding_grads(model) as tied:
                    assert tied, f"{args.model}: its embedding is not tied to its output projection"
                    train_step(model, x[:, :-1], x[:, 1:], [p for _, p in params], opts[kind], 0.0)
            else:
                train_step(model, x[:, :-1], x[:, 1:], [p for _, p in params], opts[kind], 0.0)
        return run
    times = interleaved({"plain": step("plain"), "fast": step("fast")}, args.reps, runtime, warmup=1)
    ratio = paired_ratio(times["fast"], times["plain"])
    result = {"model": args.model, "params": sum(p.numel() for _, p in params), "batch": [args.batch, args.seq],
              "device": str(runtime.device), "threads": torch.get_num_threads(), "torch": torch.__version__,
              "machine": f"{footprint.cpu_name()}, {torch.get_num_threads()} threads",
              "date": time.strftime("%Y-%m-%d"), "reps": args.reps,
              "plain_s": [round(t, 3) for t in times["plain"]], "fast_s": [round(t, 3) for t in times["fast"]],
              "plain_median_s": round(statistics.median(times["plain"]), 3),
              "fast_median_s": round(statistics.median(times["fast"]), 3), "paired_ratio": round(ratio, 4),
              "peak_rss_mb": round(footprint.peak_rss_mb())}
    footprint.write_result(Path(args.out), result)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
