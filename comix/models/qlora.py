"""A device's own model trained QLoRA's way (Dettmers et al. 2023): a frozen copy of it quantised
(``models/quant.py``), LoRA on every linear of its blocks, and, where what leaves the device must
be its whole model (DeepFusion's one-shot upload), the adapters merged into the dequantised
weights, W' = deq(W_q) + scaling * B A, in full precision.

The adapter's defaults are QLoRA's for models up to 13B (the authors' artidoro/qlora
scripts/finetune_guanaco_7b.sh: --lora_r 64 --lora_alpha 16 --lora_dropout 0.1 --lora_modules all):
r = 64, alpha = 16, dropout 0.1, on every linear layer of the transformer blocks ("LoRA on all
linear transformer block layers are required to match full finetuning performance", Sec. 4),
scaled alpha / r (PEFT's rule, which QLoRA's code uses).
"""
from __future__ import annotations

import copy

import torch
from torch import nn

from .inject import transformer_blocks
from .lora import LoRAConfig, LoRALinear
from .quant import dequantized_weight, quantize_base

QLORA = LoRAConfig(r=64, alpha=16.0, dropout=0.1, rslora=False)


def qlora_model(model: nn.Module, quant: str, cfg: LoRAConfig, compute_dtype: torch.dtype,
                device: torch.device) -> nn.Module:
    """A copy of ``model`` with its block linears frozen at ``quant`` and a LoRA (``cfg``) on each;
    the LoRA factors are its only trainable parameters (embeddings, norms and head stay frozen, as
    in QLoRA). ``model`` itself is left as it is."""
    q = quantize_base(copy.deepcopy(model), quant, compute_dtype, device).requires_grad_(False)
    for block in transformer_blocks(q):
        for parent in list(block.modules()):
            for name, child in list(parent.named_children()):
                if isinstance(child, nn.Linear) or type(child).__name__ == "HQQLinear":  # bnb's subclass nn.Linear
                    setattr(parent, name, LoRALinear(child, cfg).to(device))
    return q


def lora_layers(model: nn.Module) -> dict[str, LoRALinear]:
    """The LoRA-wrapped linears of ``model`` by name ({} for a model trained whole)."""
    return {n: m for n, m in model.named_modules() if isinstance(m, LoRALinear)}


def reset_lora(model: nn.Module) -> None:
    """Fresh adapters (A kaiming-uniform from torch's generator, B = 0) over the frozen base."""
    for m in lora_layers(model).values():
        m.lora.reset_parameters()


def own_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    """What a device holds as its model, under the names of the model it was made from: its
    parameters, or, for a model from ``qlora_model``, ``merged_weights``."""
    if not lora_layers(model):
        return {n: p.detach() for n, p in model.named_parameters()}
    return merged_weights(model)


def merged_weights(q: nn.Module) -> dict[str, torch.Tensor]:
    """The parameters of the model ``q`` was made from (its names), in fp32: each LoRA-wrapped
    linear's dequantised weight plus scaling * B A (exact: LoRA's dropout is off at inference),
    every other parameter as it is."""
    wrapped = lora_layers(q)
    out = {}
    with torch.no_grad():
        for n, m in wrapped.items():
            lora = m.lora
            out[f"{n}.weight"] = dequantized_weight(m.base) + m.scaling * (lora.lora_B @ lora.lora_A).float()
            if m.base.bias is not None:
                out[f"{n}.bias"] = m.base.bias.detach().float()
        inside = tuple(f"{n}." for n in wrapped)
        out.update({n: p.detach().float() for n, p in q.named_parameters() if not n.startswith(inside)})
    return out
