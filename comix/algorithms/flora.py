"""FLoRA (Wang et al., NeurIPS 2024): stacking-based, noise-free aggregation of heterogeneous
LoRAs, as its authors' code runs it (ATP-1010/FederatedLLM: main.py, fed_utils/model_aggregation.py).

What differs from FedIT (one LoRA on q and v, averaged A and B apart):
  * Client k trains a fresh LoRA of its own rank r_k each round (main.py builds ``get_peft_model``
    on a copy of the global model every round: A kaiming-uniform, B = 0), scaling 2 for every
    rank (``lora_alpha = 2 * r_k``; r 16, alpha 32 when homogeneous).
  * The server *stacks* the uploads instead of averaging them: A = [p_1 A_1; ...; p_K A_K] (rank
    axis), B = [B_1 | ... | B_K], so s B A = sum_k p_k s B_k A_k exactly: the mean of the clients'
    updates, not the product of mean factors (model_aggregation.py, ``stacking``).
  * The stacked LoRA is merged into the global model (``merge_and_unload`` after each round),
    and the next round's clients start from the merged model. Here each client keeps that merged
    update as ``lora_merged`` (models/lora.py) beside the shared frozen base; the download is the
    stacked A and B of sum_k r_k ranks, what the paper counts. A client that missed rounds gets
    every stack since the last round it replied in (concatenated in rank, still exact); each
    stack carries its round so none is merged twice.
  * Scored: the global model after the aggregation (main.py ``global_evaluation(model, ...)`` on
    the merged model), the same for every client: the new stacks merged, the client's LoRA at B = 0.
  * p_k: the authors weigh by local dataset size; comix weighs the round's repliers uniformly as
    its FedAvg and FedIT do (CoMiGS eq. 4), so FLoRA and FedIT differ only by the aggregation.
Defaults (main.py, README): r 16 (``ranks`` gives heterogeneous ones, e.g. the authors'
[64, 32, 16, 16, 8, 8, 4, 4, 4, 4]), dropout 0.05, q and v; AdamW at 3e-4 with transformers'
linear decay, a new Trainer each round; 3 rounds of 1 local epoch.
"""
from __future__ import annotations

import math

import torch

from ..models import AdapterConfig, LoRAConfig, param_role
from .base import Algorithm, ClientContext, ClientState, Tensors
from .fedalt import FEDALT_OPTIMIZER, TRAINER_PER_ROUND

FLORA_OPTIMIZER = dict(FEDALT_OPTIMIZER, weight_decay=0.0)  # transformers' AdamW default decay: 0
STACK = ".lora_stack."  # payload names: <module>.lora_stack.<round>.lora_A|lora_B


class FLoRA(Algorithm):
    name = "flora"
    section = "flora"
    lora_modules = 1
    train_defaults = FLORA_OPTIMIZER
    train_defaults_source = "ATP-1010/FederatedLLM main.py (lr 3e-4; transformers' Trainer per round: AdamW, " \
                            "no decay, linear schedule, max_grad_norm 1.0)"
    fresh_optimizer_each_round = f"ATP-1010/FederatedLLM main.py: {TRAINER_PER_ROUND}, for a LoRA made anew each round"
    dp_refusal_reason = ("its server stacks the uploads instead of summing them, so every client's own LoRA reaches "
                         "every client as it is; a noisy sum would have to be of the dense products B_k A_k, which "
                         "gives up FLoRA's low-rank payload")
    # heterogeneous ranks, the authors' README case (64, 32, 16, 16, 8, 8, 4, 4, 4, 4)
    capacity = ("ranks", (4, 8, 16, 32, 64))

    def __init__(self, lora, train, n_clients, ranks: list[int] | None = None, scaling: float = 2.0,
                 dropout: float = 0.05, targets: list[str] | None = None):
        super().__init__(lora, train, n_clients)
        self.ranks = list(ranks or [lora.r] * n_clients)
        if len(self.ranks) != n_clients or min(self.ranks) < 1:
            raise ValueError(f"flora.ranks: one rank >= 1 per client ({n_clients}), got {self.ranks}")
        self.scaling, self.dropout, self.targets = scaling, dropout, tuple(targets or ("q_proj", "v_proj"))

    def adapter_config(self, client: int) -> AdapterConfig:
        r = self.ranks[client]  # alpha = scaling * r with PEFT's alpha / r: the same scaling at every rank
        lora = LoRAConfig(r=r, alpha=self.scaling * r, dropout=self.dropout, rslora=False)
        return AdapterConfig(lora=lora, mlp="none", attention_targets=self.targets, merged=True)

    def is_shared(self, name: str) -> bool:
        return param_role(name) == "attention_lora"

    def shape_ok(self, name: str, shape: tuple, expected: tuple) -> bool:
        return shape == expected  # each client its own rank: checked against its own declaration

    # -- server: stack, and keep what each client has not merged yet ----------------------------
    def server_init(self, initial: dict[int, Tensors]):
        state = {"round": 0, "stacks": {}, "merged_through": {c: 0 for c in range(self.n_clients)}}
        return state, {c: {} for c in range(self.n_clients)}

    def server_round(self, server_state, uploads: dict[int, Tensors]):
        uploads = {c: u for c, u in uploads.items() if u}
        if not uploads:
            return server_state, self.payloads(server_state)
        server_state["round"] += 1
        t = server_state["round"]
        server_state["stacks"][t] = stack(uploads)
        for c in uploads:  # a replier had merged every stack before this round's
            server_state["merged_through"][c] = t - 1
        oldest = min(server_state["merged_through"].values())
        server_state["stacks"] = {r: s for r, s in server_state["stacks"].items() if r > oldest}
        return server_state, self.payloads(server_state)

    def payloads(self, server_state) -> dict[int, Tensors]:
        return {c: {f"{module}{STACK}{r}.{ab}": x for r, s in server_state["stacks"].items() if r > through
                    for (module, ab), x in s.items()}
                for c, through in server_state["merged_through"].items()}

    # -- client: merge what arrived, then train a fresh LoRA ------------------------------------
    def apply_payload(self, state: ClientState, payload: Tensors) -> ClientState:
        done = state.extra.get("merged_through", 0)
        rounds = sorted({int(n.split(STACK)[1].split(".")[0]) for n in payload})
        for r in (r for r in rounds if r > done):
            for n in payload:
                module, rest = n.split(STACK)
                if rest == f"{r}.lora_A":
                    merged = f"{module}.lora_merged"
                    if merged not in state.adapters:
                        raise ValueError(f"payload tensor {n!r} names no adapted layer of this client")
                    b = payload[f"{module}{STACK}{r}.lora_B"]
                    state.adapters[merged] = state.adapters[merged] + self.scaling * (b.float() @ payload[n].float())
            done = r
        if rounds:
            state.extra["merged_through"] = done
            for n in state.adapters:  # the merged LoRA is in lora_merged now: this one restarts at B = 0
                if n.endswith(".lora.lora_B"):
                    state.adapters[n] = torch.zeros_like(state.adapters[n])
        return state

    def personal_adapters(self, ctx: ClientContext, state: ClientState, payload: Tensors) -> Tensors:
        personal = ClientState(adapters=dict(state.adapters), extra=dict(state.extra))
        return self.apply_payload(personal, payload).adapters

    def client_round(self, ctx: ClientContext, state: ClientState, payload: Tensors):
        state = self.apply_payload(state, payload)
        fresh_lora_a(state, seed=ctx.client * 1_000_003 + state.step)  # a new LoRA each round (main.py)
        return super().client_round(ctx, state, {})


def stack(uploads: dict[int, Tensors]) -> dict[tuple[str, str], torch.Tensor]:
    """{(module, "lora_A"|"lora_B"): stacked factor}: A's rows p_k A_k and B's columns B_k, in
    client order, p_k uniform over the uploads (model_aggregation.py, ``stacking``)."""
    p = 1.0 / len(uploads)
    out = {}
    for name in sorted(next(iter(uploads.values()))):
        module, ab = name.rsplit(".lora.", 1)
        parts = [uploads[c][name].float() for c in sorted(uploads)]
        out[(module, ab)] = torch.cat([p * a for a in parts]) if ab == "lora_A" else torch.cat(parts, dim=1)
    return out


def fresh_lora_a(state: ClientState, seed: int) -> None:
    """Every LoRA A of ``state`` drawn anew as PEFT initialises it (kaiming-uniform, a = sqrt(5))."""
    gen = torch.Generator().manual_seed(seed)
    for n, t in state.adapters.items():
        if n.endswith(".lora.lora_A"):
            bound = 1.0 / math.sqrt(t.shape[1])  # kaiming_uniform_(a=sqrt(5)): gain sqrt(1/3) * sqrt(3 / fan_in)
            state.adapters[n] = (torch.rand(t.shape, generator=gen) * 2 - 1).mul_(bound).to(t.dtype)
