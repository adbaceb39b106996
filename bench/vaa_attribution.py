"""Whose step lowers DeepFusion's feature loss: the student's or VAA's own? Measured, not asserted.

    python bench/vaa_attribution.py --teacher runs/df-devices/<key>.safetensors --spec prune:30:1536:512

In the alpha sweep (docs/deepfusion.md) the feature loss FM fell along the same curve at alpha = 10
and alpha = 100, while CE paid five times more at 100: the student's extra pull bought no closer
match. This bench takes one trained device from the DeepFusion device cache as the teacher, the
dense SmolLM2-135M as the student and the server's public text (the built-in literature corpus),
and runs eq. 11's KD steps as ``DeepFusion.distill`` does (AdamW, student at ``kd_lr`` 1e-4, VAA at
``feature_lr`` 1e-3, batch 4 x 128, J = 4, P_q = 64, d = 256), at alpha = 10 and 100 and, to see
what a slower adapter leaves to the student, at alpha = 10 with VAA at the student's 1e-4. After each step it re-scores FM on
the same batch with the student's and VAA's weights from before and after the step, so the
step's change in FM splits into the student's part, FM(new student, old VAA) - FM(old, old), and
VAA's, FM(old student, new VAA) - FM(old, old); and CE's change on the batch is the student's
move's cost. Each run starts from the same student, VAA and batches. Writes
``bench/results/vaa-attribution.json`` (per step), which ``python bench/tables.py`` turns into the
table in docs/deepfusion.md.
"""
from __future__ import annotations

import footprint  # noqa: F401  (prints wall time and peak RSS at exit)

import argparse
import copy
import json
import os
import platform
import time
from pathlib import Path

import torch
from safetensors.torch import load_file
from transformers import AutoTokenizer

from comix.data import calibration_docs, sample_batch
from comix.data.corpora import builtin
from comix.models import load_base_model
from comix.models.base import tokenizer_source
from comix.models.devices import build_device_model
from comix.models.kd import hidden_width, kd_loss
from comix.models.vaa import ViewAlignedAttention, stage_features

OUT = Path(__file__).parent / "results" / "vaa-attribution.json"
STAGES, QUERIES, VAA_DIM, HEADS = 4, 64, 256, 4     # DeepFusion's defaults (comix/algorithms/deepfusion.py)
KD_LR, BATCH, SEQ = 1e-4, 4, 128  # the alpha-sweep recipe's server settings


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").exists() else []:
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.machine()


def run(student0, teacher, tokens, alpha: float, feature_lr: float, steps: int, seed: int) -> list[dict]:
    torch.manual_seed(seed)
    student = copy.deepcopy(student0).train().requires_grad_(True)
    vaa = ViewAlignedAttention([hidden_width(student)] * STAGES, [hidden_width(teacher)] * STAGES, QUERIES, VAA_DIM, HEADS)
    opt = torch.optim.AdamW([{"params": list(student.parameters()), "lr": KD_LR},
                             {"params": list(vaa.parameters()), "lr": feature_lr}], weight_decay=0.0)
    gen, rows = torch.Generator().manual_seed(seed), []
    for step in range(steps):
        x, y = sample_batch(tokens, BATCH, SEQ, gen)
        out = student(input_ids=x, output_hidden_states=True)
        with torch.no_grad():
            t_out = teacher(input_ids=x, output_hidden_states=True)
        terms = kd_loss(out, t_out, y, vaa, STAGES, alpha, 1.0)
        before_s, before_v = [f.detach() for f in stage_features(out.hidden_states, STAGES)], copy.deepcopy(vaa)
        opt.zero_grad(set_to_none=True)
        terms["total"].backward()
        opt.step()
        with torch.no_grad():
            new = student(input_ids=x, output_hidden_states=True)
            after_s, t_feat = stage_features(new.hidden_states, STAGES), stage_features(t_out.hidden_states, STAGES)
            fm0 = float(terms["fm"])
            rows.append({"step": step + 1, "fm": fm0, "ce": float(terms["ce"]), "kl": float(terms["kl"]),
                         "fm_by_student": float(before_v.loss(after_s, t_feat)) - fm0,
                         "fm_by_vaa": float(vaa.loss(before_s, t_feat)) - fm0,
                         "fm_by_both": float(vaa.loss(after_s, t_feat)) - fm0,
                         "ce_by_student": float(torch.nn.functional.cross_entropy(
                             new.logits.float().flatten(0, 1), y.flatten())) - float(terms["ce"])})
        print(f"alpha {alpha:g}, VAA's lr {feature_lr:g}, step {step + 1}: FM {fm0:.3f}, its change by the student {rows[-1]['fm_by_student']:+.4f}, "
              f"by VAA {rows[-1]['fm_by_vaa']:+.4f}; CE's change {rows[-1]['ce_by_student']:+.4f}", flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--teacher", required=True, help="a device upload in the DeepFusion device cache (.safetensors)")
    ap.add_argument("--spec", required=True, help="that device's model spec (its cache file's metadata says it)")
    ap.add_argument("--runs", nargs="+", default=["10:1e-3", "100:1e-3", "10:1e-4"], metavar="ALPHA:VAA_LR",
                    help="alpha and VAA's own lr of each run (DeepFusion's feature_lr is 1e-3; 1e-4 is the student's)")
    ap.add_argument("--steps", type=int, default=25)
    ap.add_argument("--seed", type=int, default=42)
    args = ap.parse_args()
    if not Path(args.teacher).is_file():
        raise SystemExit(f"--teacher: no such file {args.teacher}")
    try:
        settings = [tuple(map(float, r.split(":"))) for r in args.runs]
    except ValueError:
        raise SystemExit(f"--runs: each is ALPHA:VAA_LR, e.g. 10:1e-3, not {' '.join(args.runs)}") from None
    torch.set_num_threads(os.cpu_count() or 1)
    student = load_base_model("smollm2-135m")[0].float()
    teacher = build_device_model(args.spec, student, calibration_docs())
    weights = {k[len("upload.weights."):]: v for k, v in load_file(args.teacher).items() if k.startswith("upload.weights.")}
    teacher.load_state_dict(weights, strict=False)
    teacher.eval().requires_grad_(False)
    tok = AutoTokenizer.from_pretrained(tokenizer_source(student))
    tokens = torch.tensor(tok("\n\n".join(builtin("topics")["literature"]))["input_ids"])
    t0, runs = time.perf_counter(), {}
    for alpha, feature_lr in settings:
        runs[f"{alpha:g}:{feature_lr:g}"] = run(student, teacher, tokens, alpha, feature_lr, args.steps, args.seed)
    result = {"teacher": Path(args.teacher).name, "spec": args.spec, "steps": args.steps, "seed": args.seed,
              "settings": {"kd_lr": KD_LR, "batch": BATCH, "seq_len": SEQ,
                           "stages": STAGES, "queries": QUERIES, "vaa_dim": VAA_DIM, "heads": HEADS},
              "machine": f"{cpu_name()}, {os.cpu_count()} cores, torch {torch.__version__}",
              "date": time.strftime("%Y-%m-%d"), "seconds": round(time.perf_counter() - t0, 1), "runs": runs}
    tmp = OUT.with_suffix(".tmp")
    tmp.write_text(json.dumps(result, indent=1) + "\n")
    tmp.rename(OUT)
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
