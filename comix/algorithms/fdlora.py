"""FDLoRA (Qi et al. 2024) as CoMiGS's baseline (``fdlora-comigs``): a *global* and a *personal*
LoRA on every adapted linear layer, and client-wise fusion weights learned at the end (CoMiGS
Sec. 4.2), parameter-matched to CoMiGS-1G1S. FedAMoLE's baseline is ``fdlora-fedamole``
(fdlora_fedamole.py: LoRA on q and v, lagging private adapter, fusion every round).

  * Local steps alternate between the two adapters (even steps: the global LoRA alone, odd
    steps: the personal LoRA alone, each with its own AdamW state), so each learns a model of
    its own and the compute per round equals the other methods'.
  * Only the global LoRA leaves the device. The server treats the mean of the uploads as an
    inner-loop result and takes an *outer* SGD step (lr 1.0, momentum 0.5):
        g = theta - mean_k theta_k;  m <- 0.5 m + g;  theta <- theta - 1.0 m
    (with momentum 0 this is FedAvg).
  * After the last round each client fuses its adapters, y = W x + w_g dW_global x + w_p dW_personal x,
    with (w_g, w_p) found by gradient-free search (nevergrad NGOpt, bounds [-1.5, 1.5]) on a
    few validation batches, minimising validation loss + 0.05 * (|w_g| + |w_p|) (AdaFusion).
    Before that the two are averaged (0.5, 0.5), which is also where the search starts.
The personal LoRA sits on the MLP linears only; the attention linears carry the global LoRA
alone (trained on the global steps, fusion weight fixed at 1). Each adapter is one rank-r LoRA,
so a client trains as many parameters as CoMiGS-1G1S (attention r, MLP 2r) and the 2x LoRA
baselines (tests/test_algorithms.py checks the counts).
"""
from __future__ import annotations

import numpy as np
import torch

from ..data import sample_batch
from ..models import AdapterConfig, LoRAConfig, param_role
from ..models.lora import LoRALinear
from .base import Algorithm, ClientContext, ClientState, Tensors
from .training import adapter_tensors, keep_optimizer, load_adapters, lm_loss, make_optimizer, expert_lr, train_step

START = (0.5, 0.5)


def set_fusion(model, weights) -> None:
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, LoRALinear) and m.lora_fusion is not None:
                m.lora_fusion.copy_(torch.as_tensor(weights, dtype=m.lora_fusion.dtype))


class FDLoRA(Algorithm):
    name = "fdlora-comigs"
    dp_aggregate = True  # the outer step starts from the (noisy) mean of the uploads
    server_optimizer_reason = "its server already steps an optimiser of its own on the mean (the outer SGD with " \
                              "momentum of its authors)"
    section = "fdlora"
    lora_modules = 1

    def __init__(self, lora, train, n_clients, outer_lr: float = 1.0, outer_momentum: float = 0.5,
                 l1: float = 0.05, budget: int = 40, fewshot_batches: int = 2):
        super().__init__(lora, train, n_clients)
        if budget < 1 or fewshot_batches < 1:
            raise ValueError("fdlora.budget and fdlora.fewshot_batches must be >= 1")
        self.outer_lr, self.outer_momentum, self.l1 = outer_lr, outer_momentum, l1
        self.budget, self.fewshot_batches = budget, fewshot_batches

    def adapter_config(self, client: int) -> AdapterConfig:
        lora = LoRAConfig(r=self.lora.r, alpha=self.lora.alpha, dropout=self.lora.dropout)
        return AdapterConfig(lora=lora, mlp="lora", personal=True)

    def is_shared(self, name: str) -> bool:
        return param_role(name) in ("attention_lora", "mlp_lora")  # the global LoRA only

    # -- server: outer SGD with momentum on the global LoRA -----------------------------------------
    def server_init(self, initial: dict[int, Tensors]):
        theta = dict(initial[0])
        state = {"global": theta, "momentum": {n: torch.zeros_like(t) for n, t in theta.items()}}
        return state, {c: dict(theta) for c in range(self.n_clients)}

    def server_round(self, server_state, uploads: dict[int, Tensors]):
        mean, theta, mom = self.aggregate(uploads), server_state["global"], server_state["momentum"]
        for n in theta:
            mom[n] = self.outer_momentum * mom[n] + (theta[n] - mean[n])
            theta[n] = theta[n] - self.outer_lr * mom[n]
        return server_state, {c: dict(theta) for c in range(self.n_clients)}

    # -- client ------------------------------------------------------------------------------------
    def local_training(self, ctx: ClientContext, state: ClientState, gen: torch.Generator) -> list[float]:
        named = self.train_params(ctx.model)
        groups = {"global": [(n, p) for n, p in named if param_role(n) != "personal_lora"],
                  "personal": [(n, p) for n, p in named if param_role(n) == "personal_lora"]}
        opts = {k: make_optimizer(ps, state, k, self.train) for k, ps in groups.items()}
        scaler = ctx.runtime.grad_scaler()
        total = self.train.rounds * self.train.local_steps
        losses = []
        for _ in range(self.train.local_steps):
            which = "global" if state.step % 2 == 0 else "personal"
            set_fusion(ctx.model, (1.0, 0.0) if which == "global" else (0.0, 1.0))
            for g in opts[which].param_groups:
                g["lr"] = expert_lr(state.step, total, self.train)
            x, y = self.train_batch(ctx, gen)
            loss = train_step(ctx.model, x, y, [p for _, p in groups[which]], opts[which], self.train.grad_clip, scaler,
                              ctx.runtime.micro_batches_of(ctx.client))
            losses.append(loss.item())
            state.step += 1
        set_fusion(ctx.model, state.extra.get("fusion", START))
        for k, o in opts.items():
            keep_optimizer(state, k, o, self.train)
        return losses

    def fuse(self, ctx: ClientContext, state: ClientState) -> tuple[float, float]:
        """AdaFusion: argmin_w  L_valid(w) + l1 * |w|_1 over few-shot validation batches."""
        import nevergrad as ng

        gen = torch.Generator().manual_seed(ctx.client)
        batches = [sample_batch(ctx.data.valid, self.train.batch_size, self.train.seq_len, gen)
                   for _ in range(self.fewshot_batches)]
        ctx.model.eval()

        def objective(w) -> float:
            set_fusion(ctx.model, [float(v) for v in w])
            with torch.no_grad():
                loss = sum(lm_loss(ctx.model, x, y).item() for x, y in batches) / len(batches)
            return loss + self.l1 * float(np.abs(w).sum())

        param = ng.p.Array(init=np.array(START)).set_bounds(-1.5, 1.5)
        param.random_state = np.random.RandomState(ctx.client)
        found = ng.optimizers.NGOpt(parametrization=param, budget=self.budget).minimize(objective).value
        best = min((tuple(START), tuple(float(v) for v in found)), key=lambda w: objective(np.array(w)))
        ctx.model.train()
        return best

    def client_finish(self, ctx: ClientContext, state: ClientState, payload: Tensors) -> ClientState:
        state = self.apply_payload(state, payload)
        load_adapters(ctx.model, state.adapters)
        state.extra["fusion"] = self.fuse(ctx, state)
        set_fusion(ctx.model, state.extra["fusion"])
        state.adapters = adapter_tensors(ctx.model)
        return state
