"""How much of SmolLM2-135M a pruned device model keeps (DeepFusion's heterogeneous devices,
``comix/models/prune.py``), measured and printed, not asserted.

    python bench/prune_quality.py

For each spec prune:<layers>:<ffn>: the loss (nats per token) of the pruned model, before any
training, on 16 x 256 tokens of the built-in Python docs (``topics/docs``; the calibration text
is ``topics/literature``, so this is held out), for the criteria in the code (blocks by Block
Influence, FFN neurons by mean contribution on the calibration text) and for the data-free
ones they replaced (evenly spaced blocks, first and last kept; neurons by weight norms
||gate_i|| ||up_i|| ||down_:,i||), and the unpruned model. Then the width-pruned specs
prune:<layers>:<ffn>:<width> of the heterogeneous DeepFusion recipes (narrower than the
student, so VAA has widths to bridge), by the code's criteria.
"""
from __future__ import annotations

import footprint  # noqa: F401  (prints wall time and peak RSS at exit)

import math

import torch
from transformers import AutoTokenizer

from comix.data.corpora import builtin, calibration_docs
from comix.models import load_base_model
import comix.models.prune as P  # the module: its criteria are swapped below
from comix.models.base import tokenizer_source

SPECS = [(30, 1024), (30, 768), (24, 1536), (20, 1536), (15, 1536), (15, 1024), (10, 768)]
# the width-pruned devices of configs/deepfusion/*-hetero-*.yaml
WIDTH_SPECS = [(30, 1536, 512), (24, 1536, 448), (20, 1536, 512), (30, 1024, 384)]


def evenly_spaced(influence: torch.Tensor, keep: int) -> list[int]:
    n = len(influence)
    return [n - 1] if keep == 1 else sorted({round(i * (n - 1) / (keep - 1)) for i in range(keep)})


def weight_norms(mean_abs_activation: torch.Tensor, mlp) -> torch.Tensor:
    return mlp.gate_proj.weight.norm(dim=1) * mlp.up_proj.weight.norm(dim=1) * mlp.down_proj.weight.norm(dim=0)


def main() -> None:
    base = load_base_model("smollm2-135m")[0].float()
    tok = AutoTokenizer.from_pretrained(tokenizer_source(base))
    ids = tok("\n".join(builtin("topics")["docs"][:80]))["input_ids"][:16 * 256]
    ids = torch.tensor(ids).view(16, 256)
    calibration = P.calibration_ids(tok, calibration_docs())

    @torch.no_grad()
    def loss(model) -> float:
        return model(input_ids=ids, labels=ids).loss.item()

    print(f"unpruned SmolLM2-135M: {loss(base):.3f} nats (uniform over the vocabulary: {math.log(49152):.3f})")
    print("spec            influence + contribution (code) | evenly spaced + weight norms (data-free)")
    code = (P.kept_layers, P.neuron_importance)
    for layers, ffn in SPECS:
        row = []
        for kept, importance in (code, (evenly_spaced, weight_norms)):
            P.kept_layers, P.neuron_importance = kept, importance
            row.append(loss(P.prune(base, calibration, layers, ffn)))
        P.kept_layers, P.neuron_importance = code
        print(f"prune:{layers}:{ffn:<6d} {row[0]:12.3f} {row[1]:34.3f}")
    print("width-pruned (residual channels of largest mean |h| kept), influence + contribution:")
    for layers, ffn, width in WIDTH_SPECS:
        print(f"prune:{layers}:{ffn}:{width:<4d} {loss(P.prune(base, calibration, layers, ffn, width)):8.3f}")


if __name__ == "__main__":
    main()
