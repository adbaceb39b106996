"""PCL (Wagner, Fan & Jaggi 2024), the validation-performance strategy (CoMiGS Sec. 4.2, "PCL:
aggregating LoRA parameters using a client-level collaboration graph ... updated using
validation performances").

Each client holds plain LoRA (2x modules, as FedAvg) and uploads all of it. The server does not
average: it relays every client's LoRA to every client. Each client i scores each peer j's model
on a few of *its own* validation batches (the validation data never leaves the device) and sets
its trust weights w_ij = softmax_j(-L_ij / T) (non-negative, summing to 1); its next starting
point is sum_j w_ij theta_j, after which it trains locally. The trust weights (one row of the
collaboration graph) are refreshed every ``period`` rounds and reused in between.

Choices where the papers are thin: the softmax temperature T = 0.1 (losses differ by tenths
of a nat between related users; T = 1 would make the graph nearly uniform, i.e. FedAvg), 2
validation batches per score, refresh every round.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..data import sample_batch
from .base import Algorithm, ClientContext, ClientState, Tensors, load_adapters, lm_loss


@dataclass
class PCLConfig:
    period: int = 1             # refresh the trust weights every `period` rounds
    temperature: float = 0.1    # T in softmax(-L / T)
    eval_batches: int = 2       # validation batches per peer score

    def __post_init__(self):
        if self.period < 1 or self.eval_batches < 1 or self.temperature <= 0:
            raise ValueError("pcl.period and pcl.eval_batches must be >= 1 and pcl.temperature > 0")


PEER = "peer{}/"


class PCL(Algorithm):
    name = "pcl"
    section = "pcl"

    def __init__(self, lora, train, n_clients, period: int = 1, temperature: float = 0.1, eval_batches: int = 2):
        super().__init__(lora, train, n_clients)
        self.cfg = PCLConfig(period, temperature, eval_batches)

    def is_shared(self, name: str) -> bool:
        return True

    def server_round(self, server_state, uploads: dict[int, Tensors]):
        relay = {PEER.format(j) + n: t for j, up in uploads.items() for n, t in up.items()}
        return server_state, {c: dict(relay) for c in range(self.n_clients)}

    @staticmethod
    def peers(payload: Tensors) -> dict[int, Tensors]:
        out: dict[int, Tensors] = {}
        for key, t in payload.items():
            head, name = key.split("/", 1)
            out.setdefault(int(head[len("peer"):]), {})[name] = t
        return out

    def trust(self, ctx: ClientContext, state: ClientState, peers: dict[int, Tensors]) -> torch.Tensor:
        """w_i = softmax(-L_i / T) over peers, L_ij = validation loss of peer j's LoRA on client i."""
        gen = torch.Generator().manual_seed(1000 * state.step + ctx.client)  # same batches for all peers
        batches = [sample_batch(ctx.data.valid, self.train.batch_size, self.train.seq_len, gen)
                   for _ in range(self.cfg.eval_batches)]
        losses = []
        ctx.model.eval()
        with torch.no_grad():
            for j in sorted(peers):
                load_adapters(ctx.model, peers[j])
                losses.append(sum(lm_loss(ctx.model, x, y).item() for x, y in batches) / len(batches))
        ctx.model.train()
        return torch.softmax(-torch.tensor(losses) / self.cfg.temperature, 0)

    def apply_payload(self, state: ClientState, payload: Tensors) -> ClientState:
        if not any("/" in k for k in payload):  # round 1: the common initialisation
            return super().apply_payload(state, payload)
        peers = self.peers(payload)
        w = state.extra["trust"]
        for n in state.adapters:
            state.adapters[n] = sum(w[k] * peers[j][n] for k, j in enumerate(sorted(peers)))
        return state

    def client_round(self, ctx: ClientContext, state: ClientState, payload: Tensors):
        peers = self.peers(payload) if any("/" in k for k in payload) else {}
        rnd = state.step // self.train.local_steps
        stale = state.extra.get("trust_peers") != sorted(peers)  # e.g. a peer missed a round
        if peers and (stale or rnd % self.cfg.period == 0):
            state.extra["trust"] = self.trust(ctx, state, peers)
            state.extra["trust_peers"] = sorted(peers)
        state, upload, metrics = super().client_round(ctx, state, payload)
        if "trust" in state.extra:
            metrics["trust"] = [round(v, 4) for v in state.extra["trust"].tolist()]
        return state, upload, metrics
