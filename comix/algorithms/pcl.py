"""PCL (Wagner, Fan & Jaggi 2024), the validation-performance strategy (CoMiGS Sec. 4.2, "PCL:
aggregating LoRA parameters using a client-level collaboration graph ... updated using
validation performances").

Each client holds plain LoRA (2x modules on the MLP, as FedAvg) and trains locally. Every
``period`` rounds from round ``start_round`` on it uploads all of its LoRA, the server relays
every client's LoRA to every client, and client i scores each peer j's model on
``eval_batches`` batches of *its own* validation data (which never leaves the device):
w_ij = softmax_j(-PPL_ij / T). Its model becomes sum_j w_ij theta_j (one row of the
collaboration graph), then local training goes on. In the other rounds nothing is sent.

Defaults follow the authors' code (epfml/CoMiGS collab_run_client_level.py, where the paper is
silent): trust = softmax of minus the validation *perplexity* (T = 1) over 20 batches, mixing
after rounds 5, 7, 9, ... (``epoch > 3 and epoch % 2 == 0`` with epochs from 0). With T = 1
on perplexities that differ by several points the graph is close to one-hot: usually a client
keeps its own model unless a peer is clearly better on its validation data. After a mixing
round the evaluation scores the relayed peers and the next round's training scores them again
(same batches, same weights): twice the scoring of one mixing, kept simple because evaluation
must not change a client's state.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..data import sample_batch
from .base import Algorithm, ClientContext, ClientState, Tensors
from .training import load_adapters, lm_loss


@dataclass
class PCLConfig:
    start_round: int = 5        # first round (from 1) after which the clients mix
    period: int = 2             # then every `period` rounds
    temperature: float = 1.0    # T in softmax(-PPL / T)
    eval_batches: int = 20      # validation batches per peer score

    def __post_init__(self):
        if self.start_round < 1 or self.period < 1 or self.eval_batches < 1 or self.temperature <= 0:
            raise ValueError("pcl.start_round, pcl.period and pcl.eval_batches must be >= 1 and "
                             "pcl.temperature > 0")


PEER = "peer{}/"


class PCL(Algorithm):
    name = "pcl"
    section = "pcl"

    def __init__(self, lora, train, n_clients, start_round: int = 5, period: int = 2,
                 temperature: float = 1.0, eval_batches: int = 20):
        super().__init__(lora, train, n_clients)
        self.cfg = PCLConfig(start_round, period, temperature, eval_batches)

    def is_shared(self, name: str) -> bool:
        return True

    def mixes_after(self, rnd: int) -> bool:
        """Whether the clients mix after round ``rnd`` (counted from 1)."""
        return rnd >= self.cfg.start_round and (rnd - self.cfg.start_round) % self.cfg.period == 0

    def check_upload(self, upload: Tensors, reference: Tensors) -> str | None:
        return None if not upload else super().check_upload(upload, reference)  # {}: a round without mixing

    def server_round(self, server_state, uploads: dict[int, Tensors]):
        relay = {PEER.format(j) + n: t for j, up in uploads.items() for n, t in up.items()}
        return server_state, {c: dict(relay) for c in range(self.n_clients)}

    @staticmethod
    def peers(payload: Tensors) -> dict[int, Tensors]:
        out: dict[int, Tensors] = {}
        for key, t in payload.items():
            if "/" in key:
                head, name = key.split("/", 1)
                out.setdefault(int(head[len("peer"):]), {})[name] = t
        return out

    def trust(self, ctx: ClientContext, state: ClientState, peers: dict[int, Tensors]) -> torch.Tensor:
        """w_i = softmax(-PPL_i / T) over peers, PPL_ij = validation perplexity of peer j's LoRA on
        client i's own validation batches (the same batches for every peer)."""
        gen = torch.Generator().manual_seed(1000 * state.step + ctx.client)
        batches = [sample_batch(ctx.data.valid, self.train.batch_size, self.train.seq_len, gen)
                   for _ in range(self.cfg.eval_batches)]
        ppl = []
        was_training = ctx.model.training
        ctx.model.eval()
        with torch.inference_mode():
            for j in sorted(peers):
                load_adapters(ctx.model, peers[j])
                loss = sum(lm_loss(ctx.model, x, y).item() for x, y in batches) / len(batches)
                ppl.append(float(torch.tensor(loss).exp()))
        ctx.model.train(was_training)
        return torch.softmax(-torch.tensor(ppl) / self.cfg.temperature, 0)

    def mix(self, ctx: ClientContext, state: ClientState, payload: Tensors) -> tuple[Tensors, list[float] | None]:
        """This client's adapters after taking ``payload``: the trust-weighted mean of the relayed
        peers, or the common start of round 1, or its own (a round without mixing)."""
        peers = self.peers(payload)
        if not peers:
            return self.apply_payload(ClientState(adapters=dict(state.adapters)), payload).adapters, None
        w = self.trust(ctx, state, peers)
        mixed = {n: sum(w[k] * peers[j][n].float() for k, j in enumerate(sorted(peers))).to(t.dtype)
                 for n, t in state.adapters.items()}
        return mixed, [round(v, 4) for v in w.tolist()]

    def personal_adapters(self, ctx: ClientContext, state: ClientState, payload: Tensors) -> Tensors:
        return self.mix(ctx, state, payload)[0]

    def client_finish(self, ctx: ClientContext, state: ClientState, payload: Tensors) -> ClientState:
        """After the last round: a last mixing round's relayed peers mixed as at the start of a
        round (the model the final evaluation scored, ``personal_adapters``); a payload of peers
        is not this client's own LoRA, which ``apply_payload`` alone would expect."""
        state.adapters = self.mix(ctx, state, payload)[0]
        return state

    def client_round(self, ctx: ClientContext, state: ClientState, payload: Tensors):
        state.adapters, trust = self.mix(ctx, state, payload)
        rnd = state.step // self.train.local_steps + 1  # the round being trained, from 1
        state, upload, metrics = super().client_round(ctx, state, {})
        if trust is not None:
            metrics["trust"] = trust
        return state, (upload if self.mixes_after(rnd) else {}), metrics
