"""HetLoRA (Cho et al. 2024): heterogeneous LoRA ranks, zero-padding aggregation, truncation
redistribution, rank self-pruning (CoMiGS Sec. 4.3, App. C.3).

  * Server: each client's A (r_k x in) and B (out x r_k) are zero-padded to the largest rank and
    averaged with HetLoRA's *sparsity weights* w_k proportional to ||dW_k||_F = ||s_k B_k A_k||_F
    (``aggregation="uniform"`` for plain means); client k gets the first r_k components back.
  * Client: local loss + reg * sum_modules ||B[:, t:r] A[t:r]||_F, the norm of the rank tail
    beyond t = floor(gamma * r) (r: the client's current rank). After its local steps, if that
    tail norm has shrunk since the previous round, the client prunes its rank to
    max(1, floor(gamma * r)): the tail is zeroed and held at zero, and no longer uploaded.
Defaults follow App. C.3: gamma = 0.99, reg swept over {5e-2, 5e-3, 5e-4} (method specs
``hetlora:reg=0.05`` etc.; 5e-3 by default).
"""
from __future__ import annotations

import math

import torch

from .base import ClientContext, ClientState, Tensors

from .training import load_adapters
from .hetero import HeteroRank, is_hetero, lora_pairs, truncate


def product_norm(a: torch.Tensor, b: torch.Tensor, eps: float = 1e-12) -> torch.Tensor:
    """||B A||_F without forming B A: ||BA||^2 = trace(B^T B A A^T) (r x r matrices); the eps
    keeps the gradient finite at 0 (a zero tail, e.g. B's initialisation)."""
    return ((b.t() @ b) * (a @ a.t())).sum().clamp_min(0).add(eps).sqrt()


class HetLoRA(HeteroRank):
    name = "hetlora"
    section = "hetlora"

    def __init__(self, lora, train, n_clients, ranks=None, reg: float = 5e-3, gamma: float = 0.99,
                 aggregation: str = "sparsity"):
        super().__init__(lora, train, n_clients, ranks)
        if not 0 < gamma <= 1 or reg < 0 or aggregation not in ("sparsity", "uniform"):
            raise ValueError("hetlora: gamma must be in (0, 1], reg >= 0, aggregation sparsity|uniform")
        self.reg, self.gamma, self.aggregation = reg, gamma, aggregation

    # -- server ------------------------------------------------------------------------------------
    def weights(self, uploads: dict[int, Tensors]) -> dict[int, float]:
        if self.aggregation == "uniform":
            return {k: 1 / len(uploads) for k in uploads}
        norms = {k: self.scaling(k) * math.sqrt(sum(float(product_norm(up[a].float(), up[b].float(), 0.0)) ** 2
                                                    for a, b in lora_pairs(up).values()))
                 for k, up in uploads.items()}
        total = sum(norms.values())
        return {k: (v / total if total > 0 else 1 / len(uploads)) for k, v in norms.items()}

    def aggregate(self, uploads: dict[int, Tensors]) -> Tensors:
        """Zero-pad every client's MLP factors to the largest rank, then the weighted sum (the
        attention LoRA has one rank for all: the same weighted sum, nothing to pad)."""
        width = max(self.ranks)  # uploads may be narrower (pruned); payloads have the initial ranks
        w = self.weights(uploads)
        out: Tensors = {}
        for k, up in uploads.items():
            for n, t in up.items():
                if not is_hetero(n):
                    pad = [0, 0]
                elif n.endswith("lora_A"):
                    pad = [0, 0, 0, width - t.shape[0]]
                else:
                    pad = [0, width - t.shape[1]]
                out[n] = out.get(n, 0) + w[k] * torch.nn.functional.pad(t.float(), pad)
        return out

    def server_round(self, server_state, uploads: dict[int, Tensors]):
        glob = self.aggregate(uploads)
        return server_state, {c: truncate(glob, self.ranks[c]) for c in range(self.n_clients)}

    def shape_ok(self, name: str, shape: tuple, expected: tuple) -> bool:
        # a pruned client uploads only its active components: fewer rows of A / columns of B
        if not is_hetero(name):
            return shape == expected
        rank_dim = 0 if name.endswith("lora_A") else 1
        return len(shape) == 2 and 1 <= shape[rank_dim] <= expected[rank_dim] and \
            shape[1 - rank_dim] == expected[1 - rank_dim]

    # -- client ------------------------------------------------------------------------------------
    def _rank(self, state: ClientState, client: int) -> int:
        return state.extra.setdefault("rank", self.ranks[client])

    def _tail_norm(self, model, rank: int) -> torch.Tensor:
        params = dict(model.named_parameters())
        t = math.floor(self.gamma * rank)
        return sum(product_norm(params[a][t:rank], params[b][:, t:rank]) for a, b in lora_pairs(params).values())

    def regularizer(self, ctx: ClientContext, state: ClientState) -> torch.Tensor:
        return self.reg * self._tail_norm(ctx.model, self._rank(state, ctx.client))

    def _zero_tail(self, tensors, rank: int) -> None:
        with torch.no_grad():
            for a, b in lora_pairs(tensors).values():
                tensors[a][rank:] = 0
                tensors[b][:, rank:] = 0

    def after_expert_step(self, ctx: ClientContext, state: ClientState, gen) -> None:
        # Adam's moments would move a pruned tail again: hold it at zero after every step.
        self._zero_tail(dict(ctx.model.named_parameters()), self._rank(state, ctx.client))

    def apply_payload(self, state: ClientState, payload: Tensors) -> ClientState:
        state = super().apply_payload(state, payload)
        self._zero_tail(state.adapters, state.extra.get("rank", self.rank_of(state.adapters)))
        return state

    def client_round(self, ctx: ClientContext, state: ClientState, payload: Tensors):
        rank = self._rank(state, ctx.client)
        state, _, metrics = super().client_round(ctx, state, payload)
        load_adapters(ctx.model, state.adapters)
        with torch.no_grad():
            tail = float(self._tail_norm(ctx.model, rank))
        previous = state.extra.get("tail_norm")
        if previous is not None and tail < previous and math.floor(self.gamma * rank) >= 1:
            rank = math.floor(self.gamma * rank)  # self-pruning
            self._zero_tail(state.adapters, rank)
            load_adapters(ctx.model, state.adapters)
            with torch.no_grad():  # the next round compares the new tail with this one
                tail = float(self._tail_norm(ctx.model, rank))
        state.extra.update(rank=rank, tail_norm=tail)
        # Only the active components travel; the server zero-pads them again.
        upload = truncate(self.upload_of(state.adapters), rank)
        return state, upload, {**metrics, "rank": rank}
