"""FedAMoLE's costs against FedIT's (its speed and size targets), measured, not asserted.

    python bench/fedamole_speed.py [--device cuda --precision bf16]

(a) one training step (forward, backward, AdamW) of SmolLM2-135M with AMoLE on q and v (8
    assigned experts per module, top-2, shared expert, token projection) / the same step with
    FedIT's one LoRA on q and v (batch 8 x 128; configurations warmed up, timed in turn,
    medians; target <= 1.3, the paper's own figure for a round is 3.4);
(b) RSEA for 30 experts x 10 clients on every q/v module of SmolLM2 (60 MILPs), with SCIP and
    with HiGHS (target < 5 s per round on 2 cores).
"""
from __future__ import annotations

import footprint  # noqa: F401  (prints wall time and peak RSS at exit)

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from layer_speed import interleaved, paired_ratio, train_step  # noqa: E402

from comix.algorithms.rsea import assign  # noqa: E402
from comix.models import AdapterConfig, LoRAConfig, inject_adapters, load_base_model  # noqa: E402
from comix.models.amole import AMoLEConfig, AMoLELinear  # noqa: E402
from comix.runtime import resolve  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--reps", type=int, default=6)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--precision", default="fp32", choices=("fp32", "bf16", "fp16"))
    args = ap.parse_args()
    runtime = resolve(args.device, args.precision)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {runtime.device}, {runtime.precision}")
    fedit = AdapterConfig(lora=LoRAConfig(dropout=0.05, rslora=False), mlp="none", attention_targets=("q_proj", "v_proj"))
    amole = AdapterConfig(attention=False, mlp="none", amole=AMoLEConfig())
    steps = {}
    for key, adapter in (("fedit", fedit), ("amole", amole)):
        model = inject_adapters(runtime.prepare_base(load_base_model("smollm2-135m")[0]), adapter).to(runtime.device)
        for m in model.modules():
            if isinstance(m, AMoLELinear):
                m.assign(list(range(8)))
        ids = lambda: torch.randint(0, 49152, (args.batch, args.seq), device=runtime.device)  # noqa: E731
        steps[key] = train_step(model.train(), ids, runtime, loss=lambda out: out.logits.float().mean())
    runs = [interleaved(steps, args.reps, runtime, warmup=1) for _ in range(2)]
    for i, r in enumerate(runs, 1):
        print(f"(a) run {i}: FedIT step {statistics.median(r['fedit']):.2f} s, AMoLE step "
              f"{statistics.median(r['amole']):.2f} s, AMoLE / FedIT {paired_ratio(r['amole'], r['fedit']):.3f} "
              "(target <= 1.3)")
    gen = torch.Generator().manual_seed(0)
    for solver in ("scip", "highs"):
        t0 = time.perf_counter()
        for _ in range(60):
            assign(torch.randn(10, 8, generator=gen), torch.randn(30, 8, generator=gen), 576, 2, 2, 8, solver)
        print(f"(b) RSEA, 60 MILPs (10 clients x 30 experts, k_c 2, k_e 2, b 8) with {solver}: "
              f"{time.perf_counter() - t0:.2f} s (target < 5 s)")


if __name__ == "__main__":
    main()
