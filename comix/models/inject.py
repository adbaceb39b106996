"""Put adapters into a Hugging Face causal LM and name their roles.

``inject_adapters(model, AdapterConfig(...))`` freezes the base model, wraps attention linears
with LoRA and replaces each block's MLP by a plain-LoRA MLP or a ``MixtureOfLoRAMLP``. Roles are
read from parameter names alone, so they survive state dicts and the wire:
  ``...mlp.experts.0.*``         generalist (CoMiGS's shared expert)
  ``...mlp.experts.<j>=1..>.*``  specialists
  ``...mlp.router.*``            router
  ``...mlp.<proj>.lora.*``       plain LoRA on the MLP (Local / FedAvg / ...)
  other ``*.lora.*``             attention LoRA
  ``*.lora_local.*``             the personal LoRA of a pair (FDLoRA, FedDPA, FedALT); ``*.lora_fusion``
                                 the pair's weights, ``*.lora_mixer.*`` FedALT's per-token mixer
  ``*.lora_merged``              FLoRA's merged global update of an attention linear (frozen)
  ``*.shared.lora_*``            AMoLE's shared expert; ``*.token_proj`` / ``*.vanilla_router.*``
                                 its router; ``*.expert_A|B`` its expert slots (in the model);
  ``*.experts.<id>.lora_*``      FedAMoLE's domain expert <id> of an attention module (in states,
                                 uploads and payloads); ``rsea.*`` RSEA's embedding uploads
  ``prompt_encoder.*``           a soft prompt (PEFT prompt tuning / P-tuning)
  ``*.lease_A|B``, ``*.lease_experts.<j>.*``  FedLEASE's experts (slots in the model, by id on the
                                 wire); ``*.lease_router.*`` its router; ``*.lease_state`` its (M, g)
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field

import torch
from torch import nn

from .amole import AMoLEConfig, AMoLELinear
from .lease import LeaseConfig, LeaseLinear
from .lora import LoRAConfig, LoRALinear
from .mixture import MixtureOfLoRA, MixtureOfLoRAMLP, detect_mlp_layout

ATTENTION_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "c_attn", "c_proj")


@dataclass
class PromptConfig:
    """Soft prompts through PEFT (FedAMoLE's FedPrompt / FedPTuning baselines, reference
    model/common.py): ``tuning`` = PEFT's PromptTuningConfig, initialised from ``init_text``
    (TEXT init) with as many virtual tokens as that text has (``virtual_tokens`` = 0); ``ptuning``
    = PromptEncoderConfig, ``virtual_tokens`` 20 through an MLP encoder of ``encoder_hidden`` 1024."""
    kind: str = "tuning"               # tuning | ptuning
    init_text: str = ""
    virtual_tokens: int = 0            # 0: the init text's token count (tuning) / 20 (ptuning)
    encoder_hidden: int = 1024

    def __post_init__(self):
        if self.kind not in ("tuning", "ptuning"):
            raise ValueError(f"prompt kind must be tuning or ptuning, got {self.kind!r}")


@dataclass
class AdapterConfig:
    """Which adapters a model carries. ``lora`` is the attention LoRA and each expert's LoRA;
    ``mlp_lora`` (default: ``lora``) is the plain LoRA on the MLP linears when ``mlp="lora"``.
    The "2x LoRA modules" baselines of CoMiGS Sec. 4.2 double only the MLP's LoRA, as the
    authors' code does (attention LoRA rank fixed at 8 in models/model.py of epfml/CoMiGS), so
    they train exactly as many parameters as CoMiGS-1G1S (two rank-r experts per MLP) minus
    its router (tests/test_algorithms.py asserts the counts)."""
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    attention: bool = True           # LoRA on every attention linear (CoMiGS Sec. 4.1.2)
    mlp: str = "mixture"             # "mixture" | "lora" | "none"
    n_experts: int = 2
    top_k: int = 2
    fused: bool = True
    personal: bool = False           # a second, personal LoRA beside each plain MLP one (FDLoRA)
    attention_personal: bool = False  # a second, personal LoRA beside each attention LoRA (FedDPA, FedALT)
    mixer: bool = False              # the pair mixed per token by a learnt softmax (FedALT), not by weights
    merged: bool = False             # a frozen matrix the server's merges add to each attention linear (FLoRA)
    mlp_lora: LoRAConfig | None = None
    amole: AMoLEConfig | None = None  # AMoLE modules on these attention linears (FedAMoLE)
    lease: LeaseConfig | None = None  # FedLEASE's experts and adaptive router on these attention linears
    attention_targets: tuple[str, ...] = ()  # attention linears with LoRA (default: all of them)
    prompt: PromptConfig | None = None  # soft prompt (PEFT prompt learning) instead of weight adapters

    def __post_init__(self):
        if self.mlp not in ("mixture", "lora", "none"):
            raise ValueError(f"adapter.mlp must be mixture, lora or none; got {self.mlp!r}")


def transformer_blocks(model: nn.Module) -> list[nn.Module]:
    """The decoder blocks of a HF causal LM (Llama/Qwen2/Gemma: model.layers; GPT-2: transformer.h)."""
    for path in ("model.layers", "transformer.h", "gpt_neox.layers", "model.decoder.layers"):
        obj = model
        try:
            for part in path.split("."):
                obj = getattr(obj, part)
        except AttributeError:
            continue
        return list(obj)
    raise TypeError(f"cannot find transformer blocks in {type(model).__name__}")


def _attention(block: nn.Module) -> nn.Module:
    for name in ("self_attn", "attn", "attention"):
        if hasattr(block, name):
            return getattr(block, name)
    raise TypeError(f"cannot find attention in {type(block).__name__}")


def inject_adapters(model: nn.Module, cfg: AdapterConfig, n_experts: int | None = None) -> nn.Module:
    """Freeze ``model`` and add adapters in place; ``n_experts`` overrides cfg (1GXS users)."""
    for p in model.parameters():
        p.requires_grad_(False)
    d_model = model.config.hidden_size
    n = n_experts or cfg.n_experts
    # the attention layers of a method's own kind (FedAMoLE's AMoLE, FedLEASE's experts), by config section
    own = [(section, layer, sub) for section, layer, sub in (("fedamole", AMoLELinear, cfg.amole),
                                                             ("fedlease", LeaseLinear, cfg.lease)) if sub is not None]
    for block in transformer_blocks(model):
        for section, layer, sub in own:
            attn = _attention(block)
            for name in sub.targets:
                if not hasattr(attn, name):
                    raise ValueError(f"{section}.targets: {type(attn).__name__} has no {name!r}")
                setattr(attn, name, layer(getattr(attn, name), sub))
        if cfg.attention:
            attn = _attention(block)
            for name in cfg.attention_targets or ATTENTION_TARGETS:
                if hasattr(attn, name) and not isinstance(getattr(attn, name), LoRALinear):
                    setattr(attn, name, LoRALinear(getattr(attn, name), cfg.lora, cfg.attention_personal, cfg.mixer,
                                                   cfg.merged))
        if cfg.mlp == "mixture":
            block.mlp = MixtureOfLoRAMLP(block.mlp, d_model, n, cfg.top_k, cfg.lora, cfg.fused)
        elif cfg.mlp == "lora":
            for name in detect_mlp_layout(block.mlp).projections:
                setattr(block.mlp, name, LoRALinear(getattr(block.mlp, name), cfg.mlp_lora or cfg.lora,
                                                    cfg.personal))
    if cfg.prompt is not None:
        model = add_soft_prompt(model, cfg.prompt)
    return model


def add_soft_prompt(model: nn.Module, cfg: PromptConfig) -> nn.Module:
    """``model`` wrapped by PEFT's prompt learning (its forward prepends the virtual tokens; its
    logits cover them too, which lm_loss and the evaluators drop). The tokenizer for the TEXT
    init is the base model's (``config.comix_tokenizer``, set by load_base_model)."""
    from peft import PromptEncoderConfig, PromptTuningConfig, PromptTuningInit, TaskType, get_peft_model
    from transformers import AutoTokenizer

    if cfg.kind == "tuning":
        from .base import tokenizer_source
        tok_path = tokenizer_source(model)
        n = cfg.virtual_tokens or len(AutoTokenizer.from_pretrained(tok_path)(cfg.init_text)["input_ids"])
        peft_cfg = PromptTuningConfig(task_type=TaskType.CAUSAL_LM, num_virtual_tokens=n,
                                      prompt_tuning_init=PromptTuningInit.TEXT, prompt_tuning_init_text=cfg.init_text,
                                      tokenizer_name_or_path=tok_path)
    else:
        peft_cfg = PromptEncoderConfig(task_type=TaskType.CAUSAL_LM, num_virtual_tokens=cfg.virtual_tokens or 20,
                                       encoder_reparameterization_type="MLP", encoder_hidden_size=cfg.encoder_hidden)
    model = get_peft_model(model, peft_cfg)
    for module in model.prompt_encoder.modules():  # fp32 master weights whatever the base's dtype
        module.float()
    encoder = model.prompt_encoder["default"]
    encoder.comix_init = {n: p.detach().clone() for n, p in encoder.named_parameters()}  # fresh_adapters restores it
    return model


def mixtures(model: nn.Module) -> list[MixtureOfLoRA]:
    return [m for m in model.modules() if isinstance(m, MixtureOfLoRA)]


_EXPERT = re.compile(r"\.mlp\.experts\.(\d+)\.")
_DOMAIN_EXPERT = re.compile(r"\.experts\.(\d+)\.lora_[AB]$")


def param_role(name: str) -> str:
    """generalist | specialist | router | mlp_lora | attention_lora | personal_lora | fusion | mixer | merged |
    amole_shared | amole_router | amole_slots | domain_expert | embedding | prompt | base."""
    if name.startswith("rsea."):
        return "embedding"
    if name.startswith("prompt_encoder."):
        return "prompt"
    if ".lease_" in name:  # FedLEASE: lease_A / lease_B (slots), lease_experts.<j>.* (on the wire), router, state
        kind = name.split(".lease_")[1].split(".")[0]  # A | B | experts | router | state
        return {"router": "lease_router", "state": "lease_state"}.get(kind, "lease_expert")
    if name.endswith((".expert_A", ".expert_B")):
        return "amole_slots"
    if name.endswith(".token_proj") or ".vanilla_router." in name:
        return "amole_router"
    if ".shared.lora_" in name:
        return "amole_shared"
    if ".mlp." not in name and _DOMAIN_EXPERT.search(name):
        return "domain_expert"
    if ".lora_local." in name:
        return "personal_lora"
    if name.endswith("lora_fusion"):
        return "fusion"
    if ".lora_mixer." in name:
        return "mixer"
    if name.endswith(".lora_merged"):
        return "merged"
    m = _EXPERT.search(name)
    if m:
        return "generalist" if m.group(1) == "0" else "specialist"
    if ".mlp.router." in name:
        return "router"
    if ".lora." in name or ".lora_" in name:
        return "mlp_lora" if ".mlp." in name else "attention_lora"
    return "base"


def trainable_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every adapter tensor (detached views) keyed by its stable name."""
    return {n: p.detach() for n, p in model.named_parameters() if param_role(n) != "base"}


def select(state: dict[str, torch.Tensor], *roles: str) -> dict[str, torch.Tensor]:
    """The subset of a state dict whose names have one of ``roles``."""
    return {n: t for n, t in state.items() if param_role(n) in roles}


def routing_stats(model: nn.Module) -> list[dict[str, torch.Tensor]]:
    """Per block (in depth order): mean gate per expert over the last batch and each token's
    top-1 expert; enable with ``set_record_stats(model, True)`` before the forward."""
    return [m.stats for m in mixtures(model)]


def set_record_stats(model: nn.Module, on: bool = True) -> None:
    for m in mixtures(model):
        m.record_stats = on
