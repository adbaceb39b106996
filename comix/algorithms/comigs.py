"""CoMiGS (Fan et al., ICML 2025): a mixture of generalist and specialist LoRA experts, Alg. 1.

Per user, every MLP carries n_i LoRA experts and a token-level top-k router (comix.models).
Experts 0..G-1 are *generalists*: with the attention LoRA they are averaged across users by the
server each round (eq. 4); the other experts (*specialists*) and the router never leave the
device. Variants: 1G1S (n=2, G=1), 2G (n=2, G=2), 2S (n=2, G=0: nothing shared, the attention LoRA
included), 1GXS (G=1, n_i per user, e.g. [2, 2, 4, 4]; a user with n_i = 1 has the generalist only).

Bi-level, alternating updates (Sec. 3.2-3.3, Alg. 1): expert steps minimise training loss +
lambda * load balance (eq. 7) with the router fixed; every tau expert iterations, s router steps
minimise *validation* loss + lambda * load balance (eq. 8) with the experts fixed, with their own
constant-lr optimizer. ``router_update="train"`` is the ``-tr`` ablation (router steps on fresh
training batches); ``"joint"`` trains router and experts together on the training loss (the
baselines pFedMoE, Local-MoE, FedAvg-MoE of Table 5). Gradients never cross: each step
differentiates only its own parameter set.
"""
from __future__ import annotations

import re

from ..models import AdapterConfig, LoRAConfig
from .base import Algorithm
from .training import InterleavedSteps, TrainConfig, router_params

_EXPERT = re.compile(r"\.mlp\.experts\.(\d+)\.")


class CoMiGS(Algorithm):
    name = "comigs"
    section = "comigs"
    # CoMiGS-1GxS (Sec. 3.4, Table 2): each user as many experts as its resources allow, 1G + (n-1)S
    capacity = ("experts", (2, 3, 4, 6, 8))

    def __init__(self, lora: LoRAConfig, train: TrainConfig, n_clients: int,
                 experts: int | list[int] = 2, generalists: int = 1, top_k: int = 2,
                 router_update: str = "valid", share_router: bool = False):
        super().__init__(lora, train, n_clients)
        self.experts = list(experts) if isinstance(experts, (list, tuple)) else [experts] * n_clients
        if len(self.experts) != n_clients:
            raise ValueError(f"comigs.experts lists {len(self.experts)} expert counts for {n_clients} users")
        if any(not 1 <= n <= 16 for n in self.experts):
            raise ValueError(f"comigs.experts must be in 1..16 per user, got {self.experts}")
        if router_update not in ("valid", "train", "joint"):
            raise ValueError(f"router_update must be valid, train or joint; got {router_update!r}")
        self.generalists, self.top_k = generalists, top_k
        self.router_update, self.share_router = router_update, share_router

    def adapter_config(self, client: int) -> AdapterConfig:
        return AdapterConfig(lora=self.lora, mlp="mixture", n_experts=self.experts[client], top_k=self.top_k)

    def is_shared(self, name: str) -> bool:
        if self.generalists == 0:
            return False
        m = _EXPERT.search(name)
        if m:
            return int(m.group(1)) < self.generalists
        if ".mlp.router." in name:
            return self.share_router
        return ".lora." in name  # attention LoRA is shared with the generalists

    def train_params(self, model):
        # "joint" (pFedMoE, Local-/FedAvg-MoE): the router is one more parameter of the training
        # loss; otherwise it has its own steps below and the expert optimizer never sees it.
        if self.router_update == "joint":
            return [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        return super().train_params(model)

    def interleaved(self) -> InterleavedSteps | None:
        # Alg. 1: every tau expert iterations, s router steps on validation batches (eq. 8) with the
        # router's own constant-lr AdamW (App. B.1); "-tr": on fresh training batches; "joint": none
        if self.router_update == "joint":
            return None
        return InterleavedSteps("router", self.train.tau, self.train.router_steps,
                                "valid" if self.router_update == "valid" else "train", self.train.router_lr,
                                router_params)
