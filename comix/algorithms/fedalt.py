"""FedALT (Bian, Wang et al., AAAI 2026) as its authors' code runs it (jmbian/FedALT: main.py,
client.py, server.py, peft/tuners/lora.py, config.py).

What differs from FedIT (one LoRA on q and v, PEFT's alpha / r):
  * Each adapted linear carries two LoRAs and a mixer: LoRA 0, the *rest-of-world* (RoW) LoRA,
    frozen; LoRA 1, the client's own, trained; and ``lora_route``, a bias-free linear map of the
    token to two logits whose softmax weighs the pair per token (lora.py forward). Only LoRA 1 and
    the mixer train (client.py local_training); here LoRA 0 is ``lora``, LoRA 1 ``lora_local``
    and the mixer ``lora_mixer`` (models/lora.py).
  * What leaves a client: LoRA 1. The authors' client returns every LoRA tensor, but the server
    reads only LoRA 1 and skips the mixer (``route_aggregation=False`` in main.py), so comix
    uploads LoRA 1 alone: the same algorithm, less leaving the device.
  * The server gives client c the mean of the *other* clients' LoRA 1, A and B averaged apart,
    as its new LoRA 0 (server.py aggregation: ``for i in range(num_clients) if i != client_idx``),
    uniformly weighted. A client whom no other client's reply reaches keeps its LoRA 0.
  * Round 1 starts from each client's own fresh LoRAs (B = 0, so LoRA 0 adds nothing until the
    first aggregation), as the authors' clients each build their model.
  * Client-level DP (comix's, not the paper's): each upload clipped whole on the device, one
    Gaussian noise on the round's sum of uploads, every rest-of-world that noised sum minus the
    receiver's own upload (``server_round``).
  * Scored: each client after it loads its new LoRA 0 (main.py evaluates after the aggregation,
    ``client.load_params(aggregated_params[client_id])``) with its own LoRA 1 and mixer.
Defaults (config.py, client.py, main.py): r 8, alpha 32 (scaling alpha / r = 4), dropout 0.05, q
and v; AdamW at 3e-4 with weight decay 0.05 and transformers' linear decay to 0, a new Trainer
(so a new optimiser) each round; 20 rounds of 5 local epochs, batch 8.
"""
from __future__ import annotations

import torch

from ..models import AdapterConfig, LoRAConfig, param_role
from .base import Algorithm, Tensors

# transformers' Trainer defaults where the authors set nothing: max_grad_norm 1.0, betas (0.9, 0.999)
FEDALT_OPTIMIZER = dict(lr=3e-4, schedule="round_linear", weight_decay=0.05, betas=[0.9, 0.999], grad_clip=1.0)
TRAINER_PER_ROUND = "a transformers Trainer built every round, its AdamW with it"


class FedALT(Algorithm):
    name = "fedalt"
    section = "fedalt"
    lora_modules = 1
    # client-level DP (not in the paper): one noised sum of the uploads a round, each client's
    # rest-of-world that sum minus its own upload (server_round): the only release is the sum
    dp_aggregate = True
    train_defaults = FEDALT_OPTIMIZER
    train_defaults_source = "jmbian/FedALT client.py (AdamW 3e-4, decay 0.05, a Trainer per round: linear decay, " \
                            "max_grad_norm 1.0)"
    fresh_optimizer_each_round = f"jmbian/FedALT client.py: {TRAINER_PER_ROUND}"

    def __init__(self, lora, train, n_clients, alpha: float = 32.0, dropout: float = 0.05,
                 targets: list[str] | None = None):
        super().__init__(lora, train, n_clients)
        self.alpha, self.dropout, self.targets = alpha, dropout, tuple(targets or ("q_proj", "v_proj"))

    def adapter_config(self, client: int) -> AdapterConfig:
        lora = LoRAConfig(r=self.lora.r, alpha=self.alpha, dropout=self.dropout, rslora=False)
        return AdapterConfig(lora=lora, mlp="none", attention_targets=self.targets, attention_personal=True, mixer=True)

    def is_shared(self, name: str) -> bool:
        return param_role(name) == "personal_lora"  # LoRA 1, the client's own

    def train_params(self, model):
        """LoRA 1 and the mixer; LoRA 0 is frozen (it takes no gradient either)."""
        out = []
        for n, p in model.named_parameters():
            role = param_role(n)
            p.requires_grad_(role in ("personal_lora", "mixer"))
            if p.requires_grad:
                out.append((n, p))
        return out

    # -- server: each client's rest of the world -----------------------------------------------
    def server_init(self, initial: dict[int, Tensors]):
        return None, {c: {} for c in range(self.n_clients)}

    def server_round(self, server_state, uploads: dict[int, Tensors]):
        """Client c's rest-of-world: the mean of the others' LoRA 1, computed as (sum of every
        upload - c's own) / (uploads - 1). Under DP the sum is noised once (its tensors in sorted
        name order, as ``average`` draws them) and every payload is that one release minus the
        receiver's own upload: post-processing, so a round costs one Gaussian mechanism of
        sensitivity ``privacy.clip`` (each upload clipped whole on the device), as DP-FedAvg's
        mean does. One sum for n payloads is also what lets this server scale to many clients."""
        live = {j: u for j, u in uploads.items() if u}
        if not live:
            return server_state, {c: {} for c in range(self.n_clients)}
        names = sorted({n for u in live.values() for n in u})
        total = {n: torch.stack([u[n].float() for u in live.values()]).sum(0) for n in names}
        if self.aggregation_noise is not None:
            total = {n: self.aggregation_noise(total[n]) for n in names}
        payloads = {}
        for c in range(self.n_clients):
            own = live.get(c, {})
            others = len(live) - (c in live)
            dtype = next(u[n].dtype for u in live.values() for n in u)
            payloads[c] = {row_world_name(n): ((total[n] - own[n].float() if n in own else total[n]) / others).to(dtype)
                           for n in names} if others else {}
        return server_state, payloads

    # -- client ----------------------------------------------------------------------------------
    def apply_payload(self, state, payload: Tensors):
        for n, t in payload.items():
            if n not in state.adapters or param_role(n) != "attention_lora":
                raise ValueError(f"payload tensor {n!r} is not a rest-of-world LoRA tensor of this client")
            state.adapters[n] = t.detach().clone().to(state.adapters[n].dtype)
        return state


def row_world_name(name: str) -> str:
    """Where another client's LoRA 1 tensor lands in this client: its LoRA 0 (``lora``)."""
    return name.replace(".lora_local.", ".lora.")
