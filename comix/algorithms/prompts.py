"""FedPrompt and FedPTuning (FedAMoLE Sec. V-A-1's baselines, as Kuang et al.'s FederatedScope-LLM
implements them): FedAvg over a soft prompt instead of LoRA; the backbone is frozen and carries no
other adapter. Built with PEFT (``PromptTuningConfig`` / ``PromptEncoderConfig``,
models/inject.add_soft_prompt), configured as the reference's model/common.py:
  * FedPrompt: prompt tuning, virtual tokens initialised from the paper's soft prompt text
    (Sec. V-A-4; SNLI's for classification sets), as many as the text has tokens;
  * FedPTuning: P-tuning, 20 virtual tokens through an MLP encoder of hidden size 1024.
The "-FT" variants add post-aggregation fine-tuning (algorithms/base.py, ``evaluate_local``).
"""
from __future__ import annotations

from ..data.instructions import SOFT_PROMPT_GENERATION
from ..models import AdapterConfig
from ..models.inject import PromptConfig
from .fedavg import FedAvg
from .training import FEDAMOLE_OPTIMIZER, FEDAMOLE_OPTIMIZER_SOURCE


class FedPrompt(FedAvg):
    name = "fedprompt"
    train_defaults, train_defaults_source = FEDAMOLE_OPTIMIZER, FEDAMOLE_OPTIMIZER_SOURCE
    section = "fedprompt"
    kind = "tuning"

    def __init__(self, lora, train, n_clients, init_text: str = SOFT_PROMPT_GENERATION, virtual_tokens: int = 0,
                 encoder_hidden: int = 1024):
        super().__init__(lora, train, n_clients)
        self.prompt = PromptConfig(self.kind, init_text, virtual_tokens, encoder_hidden)

    def adapter_config(self, client: int) -> AdapterConfig:
        return AdapterConfig(attention=False, mlp="none", prompt=self.prompt)


class FedPromptFT(FedPrompt):
    name = "fedprompt-ft"
    evaluate_local = True


class FedPTuning(FedPrompt):
    name = "fedptuning"
    section = "fedptuning"
    kind = "ptuning"


class FedPTuningFT(FedPTuning):
    name = "fedptuning-ft"
    evaluate_local = True
