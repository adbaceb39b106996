"""Whose step lowers DeepFusion's feature loss: the student's or VAA's own? Measured, not asserted.

    python bench/vaa_attribution.py --teacher $COMIX_CACHE/deepfusion-devices/<key>.safetensors
    python bench/vaa_attribution.py --teacher ... --steps 100 --runs 10:1e-3 10:1e-4 \
        --out bench/results/vaa-attribution-long.json    # a whole domain's KD steps: does the student catch up?

In the alpha sweep (docs/deepfusion-cases.md) the feature loss FM fell along the same curve at alpha = 10
and alpha = 100, while CE paid five times more at 100: the student's extra pull bought no closer
match. This bench takes one trained device from the DeepFusion device cache as the teacher, the
dense SmolLM2-135M as the student and the server's public text (the built-in literature corpus),
and runs eq. 11's KD steps as ``DeepFusion.distill`` does (AdamW, student at ``kd_lr`` 1e-4, VAA at
``feature_lr`` 1e-3, batch 4 x 128, J = 4, P_q = 64, d = 256), at alpha = 10 and 100; to see what a
slower adapter leaves to the student, at alpha = 10 with VAA at the student's 1e-4; and with a VAA
warm-up (25 steps of VAA alone before the joint steps: the student then meets an adapter that
already maps it). After each joint step it re-scores FM on the same batch with the student's and
VAA's weights from before and after the step, so the step's change in FM splits into the
student's part, FM(new student, old VAA) - FM(old, old), and VAA's, FM(old student, new VAA) -
FM(old, old); CE's change on the batch is the student's move's cost. At the end, on 8 fixed
batches of the same text drawn by a generator of their own (held out as batches; windows may
overlap a training batch's), FM under the final VAA with the final student and
with the starting one says how much of the student's per-batch progress stayed. Each run starts
from the same student, VAA and batches. Writes ``bench/results/vaa-attribution.json``, which
``python bench/tables.py`` turns into the table in docs/deepfusion-cases.md.
"""
from __future__ import annotations

import footprint  # prints wall time and peak RSS at exit

import argparse
import copy
import inspect
import json
import os
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import load_file
from transformers import AutoTokenizer

from comix.algorithms.deepfusion import DeepFusion
from comix.algorithms.deepfusion_clusters import uploaded_models
from comix.data import sample_batch
from comix.data.corpora import builtin
from comix.models import load_base_model
from comix.models.base import tokenizer_source
from comix.models.kd import hidden_width, kd_loss
from comix.models.vaa import ViewAlignedAttention, stage_features

OUT = Path(__file__).parent / "results" / "vaa-attribution.json"
# DeepFusion's own defaults, read from its signature so the bench follows the code; seq_len 128 is the recipe's
_DEFAULTS = {k: v.default for k, v in inspect.signature(DeepFusion.__init__).parameters.items()}
STAGES, QUERIES, VAA_DIM, HEADS = (_DEFAULTS[k] for k in ("stages", "queries", "vaa_dim", "vaa_heads"))
KD_LR, BATCH, SEQ = _DEFAULTS["kd_lr"], _DEFAULTS["kd_batch"], 128


def features(model, x):
    with torch.no_grad():
        out = model(input_ids=x, output_hidden_states=True)
    return out, stage_features(out.hidden_states, STAGES)


def run(student0, teacher, tokens, held_out, alpha: float, feature_lr: float, warmup: int, steps: int,
        seed: int) -> dict:
    """``warmup`` steps of VAA alone (the student's features detached, so only VAA learns), then
    ``steps`` joint steps of eq. 11, each attributed; at the end, on the held-out batches, FM with
    the final VAA over the final and over the starting student (what the student's moves left)."""
    torch.manual_seed(seed)
    student = copy.deepcopy(student0).train().requires_grad_(True)
    vaa = ViewAlignedAttention([hidden_width(student)] * STAGES, [hidden_width(teacher)] * STAGES, QUERIES, VAA_DIM, HEADS)
    opt = torch.optim.AdamW([{"params": list(student.parameters()), "lr": KD_LR},
                             {"params": list(vaa.parameters()), "lr": feature_lr}], weight_decay=0.0)
    gen, rows = torch.Generator().manual_seed(seed), []
    for _ in range(warmup):
        x, _y = sample_batch(tokens, BATCH, SEQ, gen)
        loss = vaa.loss(features(student, x)[1], features(teacher, x)[1])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    for step in range(steps):
        x, y = sample_batch(tokens, BATCH, SEQ, gen)
        out = student(input_ids=x, output_hidden_states=True)
        t_out, t_feat = features(teacher, x)
        terms = kd_loss(out, t_out, y, vaa, STAGES, alpha, 1.0)
        before_s, before_v = [f.detach() for f in stage_features(out.hidden_states, STAGES)], copy.deepcopy(vaa)
        opt.zero_grad(set_to_none=True)
        terms["total"].backward()
        opt.step()
        with torch.no_grad():
            new, after_s = features(student, x)
            fm0 = float(terms["fm"])
            rows.append({"step": step + 1, "fm": fm0, "ce": float(terms["ce"]), "kl": float(terms["kl"]),
                         "fm_by_student": float(before_v.loss(after_s, t_feat)) - fm0,
                         "fm_by_vaa": float(vaa.loss(before_s, t_feat)) - fm0,
                         "fm_by_both": float(vaa.loss(after_s, t_feat)) - fm0,
                         "ce_by_student": float(F.cross_entropy(new.logits.float().flatten(0, 1), y.flatten()))
                         - float(terms["ce"])})
        print(f"alpha {alpha:g}, VAA's lr {feature_lr:g}, warm-up {warmup}, step {step + 1}: FM {fm0:.3f}, its change "
              f"by the student {rows[-1]['fm_by_student']:+.4f}, by VAA {rows[-1]['fm_by_vaa']:+.4f}; CE's change "
              f"{rows[-1]['ce_by_student']:+.4f}", flush=True)
    held = {"fm_final": 0.0, "fm_start_student": 0.0, "ce_final": 0.0, "ce_start": 0.0}
    with torch.no_grad():
        for x, y, start_out, start_feat, t_feat in held_out:
            out, feat = features(student, x)
            held["fm_final"] += float(vaa.loss(feat, t_feat)) / len(held_out)
            held["fm_start_student"] += float(vaa.loss(start_feat, t_feat)) / len(held_out)
            held["ce_final"] += float(F.cross_entropy(out.logits.float().flatten(0, 1), y.flatten())) / len(held_out)
            held["ce_start"] += float(F.cross_entropy(start_out.logits.float().flatten(0, 1), y.flatten())) / len(held_out)
    print(f"  held out: FM {held['fm_final']:.4f} (starting student under the final VAA {held['fm_start_student']:.4f}), "
          f"CE {held['ce_final']:.4f} (start {held['ce_start']:.4f})", flush=True)
    return {"alpha": alpha, "feature_lr": feature_lr, "warmup": warmup, "steps": rows, "held_out": held}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--teacher", required=True, help="a device upload in the DeepFusion device cache (.safetensors)")
    ap.add_argument("--spec", help="that device's model spec (default: the one its cache file's metadata names)")
    ap.add_argument("--runs", nargs="+", default=["10:1e-3", "100:1e-3", "10:1e-4", "10:1e-3:25"],
                    metavar="ALPHA:VAA_LR[:WARMUP]", help="alpha, VAA's own lr (DeepFusion's feature_lr is 1e-3; 1e-4 "
                    "is the student's) and the steps VAA trains alone first (0 in DeepFusion) of each run")
    ap.add_argument("--held-out", type=int, default=8, help="fixed batches, drawn by a generator of their own")
    ap.add_argument("--steps", type=int, default=25)
    ap.add_argument("--seed", type=int, default=42)
    ap.add_argument("--out", type=Path, default=OUT, help=f"the result file (default {OUT.relative_to(OUT.parents[2])}; "
                    "bench/results/vaa-attribution-long.json is the long runs' table in docs/deepfusion-cases.md)")
    args = ap.parse_args()
    if not args.out.parent.is_dir():
        raise SystemExit(f"--out {args.out}: no such folder {args.out.parent}")
    if not Path(args.teacher).is_file():
        raise SystemExit(f"--teacher: no such file {args.teacher}")
    with safe_open(args.teacher, "pt") as fh:  # the device cache keeps each device's model spec
        named = json.loads((fh.metadata() or {}).get("metrics", "{}")).get("device_model")
    if args.spec and named and args.spec != named:
        raise SystemExit(f"--spec {args.spec}: --teacher {args.teacher} holds a {named} device")
    args.spec = args.spec or named
    if args.spec is None:
        raise SystemExit(f"--teacher {args.teacher}: its metadata names no device model; give --spec")
    try:
        settings = [(float(r.split(":")[0]), float(r.split(":")[1]), int((r.split(":") + ["0"])[2])) for r in args.runs]
    except (ValueError, IndexError):
        raise SystemExit(f"--runs: each is ALPHA:VAA_LR[:WARMUP], e.g. 10:1e-3 or 10:1e-3:25, not {' '.join(args.runs)}") \
            from None
    torch.set_num_threads(os.cpu_count() or 1)
    student = load_base_model("smollm2-135m")[0].float()
    upload = {k[len("upload."):]: v for k, v in load_file(args.teacher).items() if k.startswith("upload.")}
    try:
        teacher = uploaded_models({0: upload}, [args.spec], student)[0]
    except (ValueError, RuntimeError):  # the file's weights do not fit the spec's shapes
        raise SystemExit(f"--spec {args.spec} does not fit --teacher {args.teacher}") from None
    tok = AutoTokenizer.from_pretrained(tokenizer_source(student))
    tokens = torch.tensor(tok("\n\n".join(builtin("topics")["literature"]))["input_ids"])
    gen = torch.Generator().manual_seed(args.seed + 1)
    held_out = []
    for _ in range(args.held_out):
        x, y = sample_batch(tokens, BATCH, SEQ, gen)
        held_out.append((x, y, *features(student, x), features(teacher, x)[1]))
    t0, runs = time.perf_counter(), {}
    for alpha, feature_lr, warmup in settings:
        runs[f"{alpha:g}:{feature_lr:g}:{warmup}"] = run(student, teacher, tokens, held_out, alpha, feature_lr, warmup,
                                                         args.steps, args.seed)
    result = {"teacher": Path(args.teacher).name, "spec": args.spec, "steps": args.steps, "seed": args.seed,
              "settings": {"kd_lr": KD_LR, "batch": BATCH, "seq_len": SEQ,
                           "stages": STAGES, "queries": QUERIES, "vaa_dim": VAA_DIM, "heads": HEADS},
              "machine": f"{footprint.cpu_name()}, {os.cpu_count()} cores, torch {torch.__version__}",
              "date": time.strftime("%Y-%m-%d"), "seconds": round(time.perf_counter() - t0, 1), "runs": runs}
    footprint.write_result(args.out, result)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
