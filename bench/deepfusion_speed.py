"""DeepFusion's costs (its speed and size targets), measured and printed, not asserted.

    python bench/deepfusion_speed.py [--device cuda --precision bf16]

(a) one server-side KD step (forward of the proxy teacher, forward + backward + AdamW of the
    SmolLM2-135M student, batch 4 x 128) with View-Aligned Attention (CE + FM + KL, eq. 11) / the
    same step with logits only (CE + KL: FedKMT); configurations warmed up, timed in turn,
    medians, two runs (target <= 1.2);
(b) total upload of N devices (eq. 5: one model each, fp32, devices drawn as the recipes draw
    them) against FedJETS-style training of the upcycled MoE (every round each device downloads
    and uploads its compact MoE: non-expert weights + 2 of the 4 experts), N = 16..128;
(c) on-device training state per device model (parameters + gradients + AdamW's two moments,
    fp32) and, on CUDA, the measured peak memory of one training step (batch 4 x 128): the
    devices' models against FedJETS's compact MoE (Fig. 7).
"""
from __future__ import annotations

import footprint  # noqa: F401  (prints wall time and peak RSS at exit)

import argparse
import random
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from layer_speed import interleaved, paired_ratio  # noqa: E402

from comix.data import calibration_docs  # noqa: E402
from comix.models.kd import kd_loss  # noqa: E402
from comix.models import load_base_model  # noqa: E402
from comix.models.devices import build_device_model  # noqa: E402
from comix.models.upcycle import moe_config  # noqa: E402
from comix.models.vaa import ViewAlignedAttention  # noqa: E402
from comix.runtime import resolve  # noqa: E402

DEVICES = ["base", "prune:24:1536", "prune:30:1024", "prune:20:1536", "random-gpt2:6:384"]  # configs/deepfusion/paper-*


def kd_step(student, teacher, vaa, runtime, batch, seq):
    params = [*student.parameters(), *(vaa.parameters() if vaa is not None else [])]
    opt = torch.optim.AdamW(params, lr=1e-5)
    x = torch.randint(0, student.config.vocab_size, (batch, seq + 1), device=runtime.device)
    inp, y = x[:, :-1], x[:, 1:]

    def step():
        opt.zero_grad(set_to_none=True)
        with runtime.autocast():
            s = student(input_ids=inp, output_hidden_states=True)
            with torch.no_grad():
                t = teacher(input_ids=inp, output_hidden_states=True)
            loss = kd_loss(s, t, y, vaa, 4, alpha=1.0 if vaa is not None else 0.0, beta=1.0)["total"]
        loss.backward()
        opt.step()
    return step


def n_params(model) -> int:
    return sum(p.numel() for p in model.parameters())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--precision", default="fp32", choices=("fp32", "bf16", "fp16"))
    args = ap.parse_args()
    runtime = resolve(args.device, args.precision)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {runtime.device}, {runtime.precision}")
    base = load_base_model("smollm2-135m")[0]
    # (a)
    teacher = build_device_model("prune:20:1536", base, calibration_docs()).to(runtime.device).eval().requires_grad_(False)
    steps = {}
    for key in ("logits", "vaa"):
        student = build_device_model("base", base).to(runtime.device).train()
        vaa = ViewAlignedAttention([576] * 4, [576] * 4).to(runtime.device) if key == "vaa" else None
        steps[key] = kd_step(student, teacher, vaa, runtime, args.batch, args.seq)
    for i in (1, 2):
        r = interleaved(steps, args.reps, runtime, warmup=1)
        print(f"(a) run {i}: KD step logits only {statistics.median(r['logits']):.2f} s, with VAA "
              f"{statistics.median(r['vaa']):.2f} s, VAA / logits {paired_ratio(r['vaa'], r['logits']):.3f} "
              "(target <= 1.2)")
    del steps
    # (b) and (c)
    sizes = {spec: n_params(build_device_model(spec, base, calibration_docs())) for spec in DEVICES}
    from transformers import MixtralForCausalLM
    with torch.device("meta"):
        compact_moe = MixtralForCausalLM(moe_config(base.config, 2, 2))
    compact = sum(p.numel() for p in compact_moe.parameters())
    mb = 4 / 2**20
    print("(b) total upload, MB (fp32): DeepFusion = one model per device once; FedJETS-style = R rounds x "
          "(download + upload) of the compact MoE per device")
    for n in (16, 32, 64, 128):
        rng = random.Random(0)
        deepfusion = sum(sizes[rng.choice(DEVICES)] for _ in range(n)) * mb
        fedjets = {r: 2 * n * r * compact * mb for r in (1, 5, 10)}
        print(f"    N = {n:3d}: DeepFusion {deepfusion:,.0f}; FedJETS-style 1 / 5 / 10 rounds "
              + " / ".join(f"{v:,.0f}" for v in fedjets.values()))
    print("(c) on-device training state (parameters + gradients + 2 AdamW moments, fp32), MB:")
    for spec, n in {**sizes, "FedJETS compact MoE (2 of 4 experts)": compact}.items():
        line = f"    {spec}: {n / 1e6:.1f} M parameters, {16 * n / 2**20:,.0f} MB"
        if runtime.device.type == "cuda" and not spec.startswith("FedJETS"):
            model = build_device_model(spec, base, calibration_docs()).to(runtime.device)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
            torch.cuda.reset_peak_memory_stats(runtime.device)
            x = torch.randint(0, base.config.vocab_size, (args.batch, args.seq), device=runtime.device)
            with runtime.autocast():
                model(input_ids=x, labels=x).loss.backward()
            opt.step()
            line += f"; peak memory of one step {torch.cuda.max_memory_allocated(runtime.device) / 2**20:,.0f} MB"
            del model, opt
        print(line)


if __name__ == "__main__":
    main()
