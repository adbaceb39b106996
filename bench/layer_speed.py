"""Speed of the mixture-of-LoRA MLP against one LoRA of the same rank (forward + backward).

  python bench/layer_speed.py                  # CPU: blocks (8 x 128 rows), whole model (2 x 128) at n = 2, 8
  python bench/layer_speed.py --full           # whole model at 8 x 128, n = 2, 4, 8 (~20 min, ~15 GB)
  python bench/layer_speed.py --quick          # blocks only, fewer repeats
  python bench/layer_speed.py --device cuda --precision bf16

Every configuration is built and warmed up first; then the configurations are timed in turn
(A B C, C B A, A B C, ...), so a slow start, a busy neighbour or a clock change hits all of them
alike, and each ratio is the median over rounds of the ratio within a round. The whole
measurement runs twice and both runs' ratios are printed with their largest disagreement (the
ratios are trustworthy when that is below 5 %).

(a) one MLP block, SmolLM2-sized (d=576, d_ff=1536, gated) and GPT-2-sized (768, 3072, GELU):
    mixture (top-2, n = 2, 4, 8) / one LoRA: compiled (the fused form with its d_ff-sized slot
    work through torch.compile, ``compile=true``), fused (eager) and naive;
(b) a whole SmolLM2-135M training step (forward, backward, AdamW) with the mixture on every MLP
    (top-2; compiled and eager fused) / the same step with plain LoRA, and the same ratios on
    GPT-2-124M shapes (random weights; GPT-2 itself is not available offline). By default a batch
    of 2 x 128 at n = 2, 8; --full: 8 x 128 at n = 2, 4, 8.

Footprint (a bench fits the 24 GB, 2-core machine it runs on). One model's configurations
are in memory at a time and share its frozen weights, but their steps interleave in one glibc
heap, and each configuration's freed activations are the wrong sizes for the next one's: the heap
grows to ~4x one step's live memory (SmolLM2 at 8 x 128: 14.7 GB resident for ~4 GB live, measured
with MALLOC_MMAP_THRESHOLD_=65536, which returns every large block at once but makes each step
page-fault its activations in anew, ~50 % slower: no fit for timing). So the default whole-model
batch is 2 x 128 (4.8 GB peak); --full keeps 8 x 128 for a machine with ~16 GB to spare. Wall
time and peak RSS are printed at the end; docs/benchmarks.md has the figures.
"""
from __future__ import annotations

import footprint  # noqa: F401  (prints wall time and peak RSS at exit)

import argparse
import copy
import statistics
import time

import torch
from torch import nn
from transformers import AutoModelForCausalLM, GPT2Config, LlamaConfig
from transformers.models.gpt2.modeling_gpt2 import GPT2MLP
from transformers.models.llama.modeling_llama import LlamaMLP

from comix.models import AdapterConfig, LoRAConfig, LoRALinear, MixtureOfLoRAMLP, inject_adapters, load_base_model
from comix.models.mixture import detect_mlp_layout, set_compiled
from comix.runtime import Runtime, resolve


def sync(runtime: Runtime) -> None:
    if runtime.device.type == "cuda":
        torch.cuda.synchronize(runtime.device)


def interleaved(steps: dict, reps: int, runtime: Runtime, warmup: int = 2) -> dict[str, list[float]]:
    """Seconds of each call of each step, timed in rounds A B C, C B A, A B C, ... after warming
    each up: the order alternates so that a drift within a round hits no configuration more
    than another, and round i of every configuration can be paired with round i of the others."""
    for step in steps.values():
        for _ in range(warmup):
            step()
    sync(runtime)
    times = {k: [] for k in steps}
    keys = list(steps)
    for i in range(reps):
        for k in keys if i % 2 == 0 else keys[::-1]:
            t0 = time.perf_counter()
            steps[k]()
            sync(runtime)
            times[k].append(time.perf_counter() - t0)
    return times


def paired_ratio(times: list[float], base: list[float]) -> float:
    """Median over rounds of (this configuration / the base) timed in the same round: a slow
    stretch of the machine cancels in each round's ratio instead of shifting one median."""
    return statistics.median(t / b for t, b in zip(times, base))


def train_step(module: nn.Module, make_input, runtime: Runtime, loss=lambda out: out.float().square().mean()):
    params = [p for p in module.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-4)
    x = make_input()

    def step():
        opt.zero_grad(set_to_none=True)
        with runtime.autocast():
            out = module(x)
        loss(out).backward()
        opt.step()
    return step


def plain_lora_mlp(mlp: nn.Module, r: int) -> nn.Module:
    for name in detect_mlp_layout(mlp).projections:
        setattr(mlp, name, LoRALinear(getattr(mlp, name), LoRAConfig(r=r)))
    return mlp


def block_steps(runtime: Runtime, batch: int, seq: int) -> dict:
    shapes = {"SmolLM2 block": (lambda: LlamaMLP(LlamaConfig(hidden_size=576, intermediate_size=1536)), 576),
              "GPT-2 block": (lambda: GPT2MLP(3072, GPT2Config(n_embd=768)), 768)}
    steps = {}
    for label, (make, d) in shapes.items():
        torch.manual_seed(0)
        x = lambda d=d: torch.randn(batch * seq, d, device=runtime.device)  # noqa: E731
        prep = lambda m: m.to(runtime.device)  # noqa: E731  (adapters stay fp32: the masters)

        def frozen(make=make):
            return runtime.prepare_base(make())
        steps[(label, "lora")] = train_step(plain_lora_mlp(frozen(), 8).to(runtime.device), x, runtime)
        for n in (2, 4, 8):
            for kind in ("compiled", "fused", "naive"):
                layer = MixtureOfLoRAMLP(frozen(), d, n, 2, LoRAConfig(r=8), fused=kind != "naive")
                set_compiled(layer, kind == "compiled")
                steps[(label, f"n={n} {kind}")] = train_step(prep(layer), x, runtime)
    return steps


MODELS = ("SmolLM2-135M step", "GPT-2-124M step")


def model_steps(label: str, runtime: Runtime, batch: int, seq: int, ns: tuple[int, ...]) -> dict:
    """One whole model's configurations; they share its frozen weights (as ClientModels does)."""
    if "Smol" in label:
        base, vocab = load_base_model("smollm2-135m")[0], 49152
    else:
        torch.manual_seed(0)  # GPT-2 itself is not available offline: its shapes, random weights
        base = AutoModelForCausalLM.from_config(GPT2Config(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))
        vocab = 50257
    base = runtime.prepare_base(base)
    frozen = {id(t): t for t in (*base.parameters(), *base.buffers())}
    ids = lambda: torch.randint(0, vocab, (batch, seq), device=runtime.device)  # noqa: E731
    ce = lambda out: out.logits.float().mean()  # noqa: E731  (the loss's value does not matter here)
    steps = {}
    for key, adapter in (("lora", AdapterConfig(mlp="lora")),
                         *((f"n={n} {kind}", AdapterConfig(n_experts=n, top_k=2))
                           for n in ns for kind in ("compiled", "fused"))):
        model = inject_adapters(copy.deepcopy(base, memo=dict(frozen)), adapter).to(runtime.device).train()
        set_compiled(model, key.endswith("compiled"))
        steps[(label, key)] = train_step(model, ids, runtime, loss=ce)
    return steps


def report(runs: list[dict[tuple, list[float]]]) -> None:
    labels = dict.fromkeys(label for label, _ in runs[0])
    worst = 0.0
    for label in labels:
        base = [r[(label, "lora")] for r in runs]
        print(f"\n{label}: one LoRA r=8, fwd+bwd+AdamW {statistics.median(base[0]) * 1e3:.1f} / "
              f"{statistics.median(base[1]) * 1e3:.1f} ms (run 1 / 2, medians)")
        for (lab, key) in runs[0]:
            if lab != label or key == "lora":
                continue
            ratios = [paired_ratio(r[(lab, key)], b) for r, b in zip(runs, base)]
            worst = max(worst, abs(ratios[0] - ratios[1]) / ratios[0])
            print(f"    {key:12s} / LoRA: {ratios[0]:.3f}  {ratios[1]:.3f}")
    print(f"\nlargest disagreement between the two runs: {100 * worst:.1f} %")


def profile(steps: dict, runtime: Runtime, calls: int = 5) -> None:
    """The operators that take the time of one LoRA's and the n = 8 fused mixture's steps (after a
    warm-up): the host's time beside the device's shows whether the step waits on kernel launches."""
    from torch.profiler import ProfilerActivity, profile as torch_profile
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if runtime.device.type == "cuda" else [])
    for key in [k for k in steps if k[1] in ("lora", "n=8 fused")]:
        for _ in range(2):
            steps[key]()
        sync(runtime)
        t0 = time.perf_counter()
        with torch_profile(activities=activities) as prof:
            for _ in range(calls):
                steps[key]()
            sync(runtime)
        print(f"\n{' '.join(key)}: {(time.perf_counter() - t0) / calls * 1e3:.1f} ms a step under the profiler")
        for sort in ("self_cpu_time_total", *(("self_device_time_total",) if len(activities) > 1 else ())):
            print(prof.key_averages().table(sort_by=sort, row_limit=12, max_name_column_width=48))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="blocks only, fewer repeats")
    ap.add_argument("--full", action="store_true", help="whole model at n = 2, 4, 8 with 8 repeats (~20 min)")
    ap.add_argument("--batch", type=int, default=8, help="blocks: batch x seq rows")
    ap.add_argument("--model-batch", type=int, default=0, help="whole-model step's batch (default 2, 8 with --full)")
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--reps", type=int, default=0, help="timed calls per configuration (default 10 blocks, 8 models)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--precision", default="fp32", choices=("fp32", "bf16", "fp16"))
    ap.add_argument("--profile", choices=MODELS, help="instead: torch.profiler over that model's one LoRA and n=8 "
                    "fused steps (where the time goes when a ratio misses its target)")
    args = ap.parse_args()
    runtime = resolve(args.device, args.precision)
    model_batch = args.model_batch or (8 if args.full else 2)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {runtime.device}, {runtime.precision}, "
          f"blocks {args.batch}x{args.seq}, whole model {model_batch}x{args.seq}")
    if args.profile:
        return profile(model_steps(args.profile, runtime, model_batch, args.seq, (8,)), runtime)
    steps = block_steps(runtime, args.batch, args.seq)
    runs = [interleaved(steps, args.reps or (4 if args.quick else 10), runtime) for _ in range(2)]
    del steps
    for label in () if args.quick else MODELS:  # one model at a time: its configurations in memory together
        models = model_steps(label, runtime, model_batch, args.seq, (2, 4, 8) if args.full else (2, 8))
        for run in runs:
            run.update(interleaved(models, args.reps or 8, runtime, warmup=1))
        del models
    report(runs)


if __name__ == "__main__":
    main()
