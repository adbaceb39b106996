"""A quantised frozen base, QLoRA's idea (Dettmers et al. 2023): every ``nn.Linear`` of the
transformer blocks becomes a bitsandbytes layer, the adapters around it stay as they are.

  * ``nf4``: ``bnb.nn.Linear4bit``, 4-bit NormalFloat with double quantisation of the block
    scales (QLoRA Sec. 3: NF4 + double quantisation, blocks of 64), computing in the run's
    dtype (``compute_dtype``);
  * ``int8``: ``bnb.nn.Linear8bitLt`` without fp16 master weights (LLM.int8(), Dettmers et al.
    2022), outlier threshold 6.0 (the bitsandbytes / transformers default).
  * ``q4``: HQQ's ``HQQLinear`` (Badri & Shaji 2023), 4 bits on an asymmetric grid per group of 32
    weights with a scale (16 bits, as GGUF stores it) and a zero each, the zero not rounded
    (``round_zero=False``). Why it is the
    4-bit step of ``quant=auto``: the offline SmolLM2 weights come from a Q4_1 GGUF, i.e. they lie on
    exactly such a grid, and HQQ's optimiser finds it again (relative error 1.6e-7 on the model's
    down_proj, measured); NF4's fixed 16 levels cost +40 % perplexity on the same weights
    (bench/quant.py). NF4 stays for QLoRA fidelity. Its forward dequantises and multiplies
    (HQQ's PyTorch backend): gradients reach its input on the CPU.
Embeddings, norms and the LM head stay in the compute dtype (transformers' BitsAndBytesConfig
skips ``lm_head`` too). Every LoRA, mixture and AMoLE wrapper calls its base linear as a module,
so adapters, routers and uploads keep their own (fp32 master) precision. GPT-2's blocks hold
``Conv1D`` layers, which have no bitsandbytes form: ``quant`` is refused for them in one line
(``quant_refusal``), so that no run names a precision its base does not have.

Why bitsandbytes: the field's library for QLoRA (PEFT's and FlowerTune's templates), with a
CPU backend since 0.46 (measured here: NF4 and int8 forward and backward on this machine's CPU,
tests/test_quant.py) and its CUDA kernels on a GPU, one code path for both. torchao's NF4 also
runs on this CPU but needs its own linear function and warns at import through PEFT.
"""
from __future__ import annotations

import logging

import torch
from torch import nn

from ..runtime import QUANTS, Runtime


def check_quant(quant: str) -> str | None:
    """Why ``quant`` cannot run here (one line), or None."""
    if quant not in QUANTS:
        return f"quant must be one of {', '.join(QUANTS)}, auto (with a fleet) or one per client, got {quant!r}"
    if quant == "q4":
        import importlib.util
        if importlib.util.find_spec("hqq") is None:
            return "quant=q4 needs hqq: pip install 'comix[quant]'"
    elif quant != "none":
        try:
            _bitsandbytes()
        except ImportError:
            return f"quant={quant} needs bitsandbytes: pip install 'comix[quant]'"
    return None


# model types whose transformer blocks compute with transformers' Conv1D (weight in x out), not
# nn.Linear: nothing in them for bitsandbytes to quantise
CONV1D_MODEL_TYPES = ("gpt2",)


def quant_refusal(model_type: str, model: str, quants: set[str]) -> str | None:
    """Why ``model`` (of ``model_type``) cannot have its base at the precisions ``quants``, or None."""
    asked = sorted(set(quants) - {"none", "auto"})
    if asked and model_type in CONV1D_MODEL_TYPES:
        return (f"quant={asked[0]}: model {model} is a GPT-2, whose blocks compute with Conv1D layers that "
                "bitsandbytes cannot quantise; use quant=none (quant=auto keeps it in full precision)")
    return None


def _bitsandbytes():
    # its CPU backend tries to fetch a faster 4-bit kernel from the Hugging Face hub (the `kernels`
    # package) and warns when it cannot; comix runs offline and uses the built-in kernel
    logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)
    import bitsandbytes
    return bitsandbytes


def on_device(model: nn.Module, runtime: Runtime) -> nn.Module:
    """The frozen base as a run holds it: on the run's device, in its dtype, quantised as ``runtime.quant`` says."""
    return quantize_base(runtime.prepare_base(model), runtime.base_quant, runtime.dtype, runtime.device)


def quant_of_base(model: nn.Module) -> str:
    """The precision ``model``'s block linears are stored at: nf4, int8 or none."""
    kinds = {type(m).__name__ for m in model.modules()}
    return "nf4" if "Linear4bit" in kinds else "int8" if "Linear8bitLt" in kinds else "q4" if "HQQLinear" in kinds \
        else "none"


def quantize_linear(linear: nn.Linear, quant: str, compute_dtype: torch.dtype, device: torch.device) -> nn.Module:
    """``linear`` as a frozen quantised layer (bitsandbytes', or HQQ's for q4) on ``device``."""
    if quant == "q4":
        return _hqq_linear(linear, compute_dtype, device)
    bnb = _bitsandbytes()
    bias = linear.bias is not None
    w = linear.weight.data.to("cpu", torch.float32)
    if quant == "nf4":
        q = bnb.nn.Linear4bit(linear.in_features, linear.out_features, bias=bias, compute_dtype=compute_dtype,
                              compress_statistics=True, quant_type="nf4")
        q.weight = bnb.nn.Params4bit(w, requires_grad=False, compress_statistics=True, quant_type="nf4")
        # bitsandbytes' CPU inference path (AVX512-BF16 CPUs, no grad) repacks the weight with bf16
        # block scales in place: scoring would then compute with other numbers than training, and
        # it needs in_features >= 64; one numeric path for both
        q.support_avx512bf16_for_cpu = False
    else:
        q = bnb.nn.Linear8bitLt(linear.in_features, linear.out_features, bias=bias, has_fp16_weights=False,
                                threshold=6.0)
        q.weight = bnb.nn.Int8Params(w, requires_grad=False, has_fp16_weights=False)
    if bias:
        q.bias = nn.Parameter(linear.bias.data.to(compute_dtype), requires_grad=False)
    q = q.to(device)  # bitsandbytes quantises as the weight moves to a device
    if quant == "int8":  # the int8 weight and its scales move into the layer's state now, once
        q.init_8bit_state()  # (lazily, the first copy to run would take them from the shared weight)
    return q


HQQ_GROUP = 32  # the GGUF Q4_1 block the offline weights come from (and HQQ's 4-bit group sizes)


def _hqq_linear(linear: nn.Linear, compute_dtype: torch.dtype, device: torch.device) -> nn.Module:
    from hqq.core.quantize import BaseQuantizeConfig, HQQLinear
    if linear.in_features % HQQ_GROUP:
        raise ValueError(f"quant=q4 quantises groups of {HQQ_GROUP} inputs: a linear of {linear.in_features} cannot")
    cfg = BaseQuantizeConfig(nbits=4, group_size=HQQ_GROUP, axis=1)
    # HQQ rounds the *starting* zero for 4 bits (AutoAWQ's habit); its optimiser then moves the zero off
    # the integers anyway, so on a Q4_1 grid both find the grid (relative error 1.3e-7, measured):
    # the grid's own zero is the start here, not a rounded one
    cfg["weight_quant_params"]["round_zero"] = False
    bias = linear.bias
    q = HQQLinear(linear, cfg, compute_dtype=compute_dtype, device=str(device))  # del_orig: drops its fp32 copy
    # the scales in 16 bits, as GGUF's Q4_1 stores its blocks' (ggml's block_q4_1: ggml_half d): HQQ's
    # scale of a Q4_1 block is its d, so nothing is lost, and a weight costs 0.6875 bytes instead of 0.75
    # on an fp32 run. The zero (-m / d in HQQ's form, not a 16-bit number) stays in the compute dtype,
    # and dequantisation promotes the scale to it
    if compute_dtype == torch.float32:
        q.meta["scale"] = q.meta["scale"].to(torch.float16)
    # HQQ keeps the bias as a clone (not a leaf: no deepcopy of a client's base copy), trainable
    q.bias = None if bias is None else nn.Parameter(bias.detach().to(device, compute_dtype), requires_grad=False)
    return q


def quantize_base(model: nn.Module, quant: str, compute_dtype: torch.dtype, device: torch.device) -> nn.Module:
    """``model`` with each linear of its blocks replaced by its ``quant`` form, on ``device``."""
    if quant == "none":
        return model
    from .inject import transformer_blocks
    for block in transformer_blocks(model):
        for parent in list(block.modules()):
            for name, child in list(parent.named_children()):
                if type(child) is nn.Linear:
                    setattr(parent, name, quantize_linear(child, quant, compute_dtype, device))
    return model


def shared_objects(model: nn.Module) -> list:
    """What a copy of the quantised base must share with it, not duplicate (copy.deepcopy's memo):
    bitsandbytes' int8 layer states, which hold the int8 weight and its scales."""
    return [m.state for m in model.modules() if type(m).__name__ == "Linear8bitLt"]


def dequantized_weight(layer: nn.Module) -> torch.Tensor:
    """The (out, in) float weight a quantised layer computes with (its library's own dequantisation)."""
    if type(layer).__name__ == "HQQLinear":
        return layer.dequantize().float()
    bnb = _bitsandbytes()
    w = layer.weight
    if isinstance(w, bnb.nn.Params4bit):
        return bnb.functional.dequantize_4bit(w.data, w.quant_state).float()
    return (w.data.float() * layer.state.SCB.float()[:, None] / 127.0) if layer.state.SCB is not None else w.data.float()


def base_bytes(model: nn.Module) -> int:
    """Bytes of the frozen base's tensors (quantised weights at their storage size, with their
    quantisation statistics), adapters excluded."""
    from .inject import param_role
    total = 0
    for n, p in model.named_parameters():
        if param_role(n) == "base":
            total += p.numel() * p.element_size()
            state = getattr(p, "quant_state", None)
            if state is not None:
                total += sum(t.numel() * t.element_size() for t in _state_tensors(state))
    for m in model.modules():
        scb = getattr(getattr(m, "state", None), "SCB", None)
        if isinstance(scb, torch.Tensor):
            total += scb.numel() * scb.element_size()
        if type(m).__name__ == "HQQLinear":  # its scales and zeros live in a dict, not as tensors of the module
            total += sum(t.numel() * t.element_size() for t in m.meta.values() if isinstance(t, torch.Tensor))
    return total + sum(b.numel() * b.element_size() for b in model.buffers())


def _state_tensors(state) -> list[torch.Tensor]:
    out = [t for t in (state.absmax, getattr(state, "code", None)) if isinstance(t, torch.Tensor)]
    nested = getattr(state, "state2", None)
    return out + (_state_tensors(nested) if nested is not None else [])
