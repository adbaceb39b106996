"""FedAvg (McMahan et al. 2017) over LoRA: every adapter tensor is uploaded and averaged with
uniform weights (CoMiGS Sec. 4.2); 2x LoRA modules to match CoMiGS-1G1S's trainable size."""
from ..models import AdapterConfig, LoRAConfig
from .base import Algorithm
from .training import FEDAMOLE_OPTIMIZER, FEDAMOLE_OPTIMIZER_SOURCE


class FedAvg(Algorithm):
    name = "fedavg"

    def is_shared(self, name: str) -> bool:
        return True


class FedIT(FedAvg):
    """FedIT (Zhang et al. 2024), FedAMoLE's baseline: one LoRA on q and v of every attention
    block (r 8, alpha 16, PEFT's scaling alpha / r, dropout 0.05: FedAMoLE Sec. V-A-4), averaged
    with FedAvg; no adapter on the MLP."""
    name = "fedit"
    train_defaults, train_defaults_source = FEDAMOLE_OPTIMIZER, FEDAMOLE_OPTIMIZER_SOURCE
    lora_modules = 1

    def adapter_config(self, client: int) -> AdapterConfig:
        lora = LoRAConfig(r=self.lora.r, alpha=self.lora.alpha, dropout=0.05, rslora=False)
        return AdapterConfig(lora=lora, mlp="none", attention_targets=("q_proj", "v_proj"))


class FedITFT(FedIT):
    """FedIT-FT: FedIT with post-aggregation fine-tuning (algorithms/base.py, ``evaluate_local``)."""
    name = "fedit-ft"
    evaluate_local = True
