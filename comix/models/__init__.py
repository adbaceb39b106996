"""Base models, LoRA, mixtures of LoRA experts and their injection into HF models."""
from .base import load_base_model
from .inject import (AdapterConfig, inject_adapters, mixtures, param_role, routing_stats, select,
                     set_record_stats, trainable_state, transformer_blocks)
from .lora import LoRAConfig, LoRALinear, LoRAWeights
from .mixture import MixtureOfLoRA, MixtureOfLoRAMLP, Routing, load_balance_loss

__all__ = ["load_base_model", "AdapterConfig", "inject_adapters", "mixtures", "param_role",
           "routing_stats", "select", "set_record_stats", "trainable_state", "transformer_blocks",
           "LoRAConfig", "LoRALinear", "LoRAWeights", "MixtureOfLoRA", "MixtureOfLoRAMLP",
           "Routing", "load_balance_loss"]
