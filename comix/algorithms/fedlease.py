"""FedLEASE (Wang, Bian et al., NeurIPS 2025): LoRA experts allocated by clustering the clients'
updates and selected per token by an adaptive top-M router, as its authors' code runs it
(lei-wang-link/FedLEASE: main.py, client.py, server.py, utils.py, peft/tuners/lora.py). The layer
is models/lease.py.

  * Warm-up (``warmup`` rounds, the authors' 5): each client trains one LoRA of its own and the
    server sends each its own back (server.py aggregation_warmup), so nothing it receives depends
    on the others: here nothing leaves the device in those rounds but the last, whose upload is
    the LoRA B of every adapted module, what the clustering reads.
  * Clustering (end of the warm-up, utils.py compute_lora_client_map): the distance of clients i, j
    is 1 - cos(B_i, B_j) per layer, averaged over the layers of a projection, then over the
    projections (q and v); agglomerative clustering on it (average linkage, precomputed), for
    M = 2 .. ``max_clusters`` clusters, keeping the M of the highest silhouette score (the authors
    compute Davies-Bouldin too but rank by silhouette alone). Cluster g's members share expert g.
  * Each client then holds M experts and a router with 2M - 1 outputs (models/lease.py); its
    warmed LoRA moves into its own expert's slot, the other slots and the router start fresh (the
    first clustered round loads no aggregate: main.py ``if round_idx > round_warmup``). It trains
    its own expert and the router only (client.py local_training: ``lora_A{group}``,
    ``lora_B{group}``, ``lora_route``).
  * What leaves a client: its own expert and its router. The server averages expert g over the
    members of cluster g and the router over the client's cluster (server.py aggregation with
    ``route_aggregation=True``) and sends every client all M experts and its cluster's router.
    (The authors' clients send every LoRA tensor; the server reads only these.)
  * Scored: each client with the experts and router it receives after the aggregation (main.py
    evaluates after ``client.load_params(aggregated_params[client_id])``); in the warm-up, its own LoRA.
For a causal LM (the authors fine-tune RoBERTa-large for classification, with a trained
classifier head that travels with the LoRA): the same layer on q_proj and v_proj and no head;
scored by perplexity or the task metric as every comix method.
Defaults (main.py, client.py): r 4, alpha 16, dropout 0.05, at most 4 experts, 5 warm-up rounds of
25, AdamW at 3e-3 with weight decay 0.05 and transformers' linear decay, a new Trainer per round.
The authors' extra "dummy" warm-up client trains on client 0's data and is never read; it is left out.
"""
from __future__ import annotations

import math

import numpy as np
import torch

from ..models import AdapterConfig, LoRAConfig, param_role
from ..models.lease import LeaseConfig
from .base import Algorithm, ClientContext, ClientState, Tensors
from .fedalt import TRAINER_PER_ROUND
from .training import average

FEDLEASE_OPTIMIZER = dict(lr=3e-3, schedule="round_linear", weight_decay=0.05, betas=[0.9, 0.999], grad_clip=1.0)
EXPERT = ".lease_experts."


def module_of(name: str) -> str:
    return name.split(".lease_")[0]


def expert_of(name: str) -> int:
    return int(name.split(EXPERT)[1].split(".")[0])


def client_distances(b_uploads: dict[int, Tensors], clients: list[int]) -> np.ndarray:
    """The authors' distance (utils.py calculate_B_similarity_matrix, compute_lora_client_map):
    mean over a projection's layers of 1 - cos(B_i, B_j), then mean over the projections."""
    names = sorted(b_uploads[clients[0]])
    projections = sorted({module_of(n).rsplit(".", 1)[1] for n in names})
    d = np.zeros((len(clients), len(clients)))
    for proj in projections:
        mine = [n for n in names if module_of(n).rsplit(".", 1)[1] == proj]
        flat = {c: torch.stack([b_uploads[c][n].flatten().float() for n in mine]) for c in clients}
        for i, ci in enumerate(clients):
            for j, cj in enumerate(clients[i + 1:], i + 1):
                bi, bj = flat[ci], flat[cj]
                cos = (bi * bj).sum(1) / (bi.norm(dim=1) * bj.norm(dim=1) + 1e-8)
                d[i, j] = d[j, i] = d[i, j] + float((1 - cos).mean()) / len(projections)
    return d


def cluster_clients(distances: np.ndarray, max_clusters: int) -> list[int]:
    """Each client's cluster: average-linkage clustering on the precomputed distances, at the
    cluster count in 2..max_clusters with the highest silhouette score (the first on ties)."""
    from sklearn.cluster import AgglomerativeClustering
    from sklearn.metrics import silhouette_score
    best, best_score = None, -math.inf
    for k in range(2, min(max_clusters, len(distances) - 1) + 1):
        labels = AgglomerativeClustering(n_clusters=k, metric="precomputed", linkage="average").fit_predict(distances)
        score = silhouette_score(distances, labels, metric="precomputed") if len(set(labels)) > 1 else -1.0
        if score > best_score:
            best, best_score = labels, score
    return [int(g) for g in best]


class FedLEASE(Algorithm):
    name = "fedlease"
    section = "fedlease"
    train_defaults = FEDLEASE_OPTIMIZER
    train_defaults_source = "lei-wang-link/FedLEASE client.py (AdamW 3e-3, decay 0.05, a Trainer per round: " \
                            "linear decay, max_grad_norm 1.0)"
    fresh_optimizer_each_round = f"lei-wang-link/FedLEASE client.py: {TRAINER_PER_ROUND}"
    dp_refusal_reason = "its experts are averaged within clusters found from the uploads and each router within " \
                        "its client's cluster, not the one mean DP-FedAvg's noisy sum protects"

    def __init__(self, lora, train, n_clients, warmup: int = 5, max_clusters: int = 4, r: int = 4,
                 alpha: float = 16.0, dropout: float = 0.05, targets: list[str] | None = None):
        super().__init__(lora, train, n_clients)
        if not 1 <= warmup < train.rounds:
            raise ValueError(f"fedlease.warmup must be in [1, train.rounds) (the rounds after it train the experts), "
                             f"got {warmup} with train.rounds {train.rounds}")
        if max_clusters < 2 or n_clients < 3:
            raise ValueError("fedlease: max_clusters >= 2 and at least 3 clients (a silhouette needs 2 clusters "
                             "of a client set larger than 2)")
        if train.client_fraction < 1 or 0 < train.clients_per_round < n_clients:
            raise ValueError("fedlease clusters every client at the end of the warm-up: it needs every client every "
                             "round (train.client_fraction 1, train.clients_per_round 0)")
        self.warmup, self.max_clusters = warmup, max_clusters
        self.cfg = LeaseConfig(targets=list(targets or ["q_proj", "v_proj"]), r=r, alpha=alpha, dropout=dropout,
                               slots=max_clusters)

    def adapter_config(self, client: int) -> AdapterConfig:
        return AdapterConfig(lora=LoRAConfig(r=self.cfg.r), attention=False, mlp="none", lease=self.cfg)

    def is_shared(self, name: str) -> bool:
        return param_role(name) in ("lease_expert", "lease_router")  # what some round uploads (expected_upload)

    def expected_upload(self, server_state, client: int, reference: Tensors) -> Tensors:
        t = server_state["round"] + 1  # the round being uploaded
        if t < self.warmup:
            return {}
        if t == self.warmup:
            return {n: s for n, s in reference.items() if n.endswith(f"{EXPERT}0.lora_B")}
        g = server_state["groups"][client]
        return {n: s for n, s in reference.items()
                if param_role(n) == "lease_router" or EXPERT in n and expert_of(n) == g}

    def upload_of(self, adapters: Tensors, rnd: int | None = None, group: int | None = None) -> Tensors:
        if rnd is None:  # the declaration: every tensor some round may send
            return super().upload_of(adapters)
        if rnd < self.warmup:
            return {}
        if rnd == self.warmup:
            return {n: t.detach().clone() for n, t in adapters.items() if n.endswith(f"{EXPERT}0.lora_B")}
        return {n: t.detach().clone() for n, t in adapters.items()
                if param_role(n) == "lease_router" or EXPERT in n and expert_of(n) == group}

    # -- server ------------------------------------------------------------------------------------
    def server_init(self, initial: dict[int, Tensors]):
        state = {"round": 0, "groups": None, "experts": {}, "routers": {}}
        return state, {c: {} for c in range(self.n_clients)}

    def server_round(self, server_state, uploads: dict[int, Tensors]):
        server_state["round"] += 1
        t = server_state["round"]
        if t < self.warmup:
            return server_state, {c: {} for c in range(self.n_clients)}
        if t == self.warmup:
            clients = sorted(uploads)
            labels = cluster_clients(client_distances(uploads, clients), self.max_clusters)
            groups = dict(zip(clients, labels))
            server_state["groups"] = [groups.get(c, 0) for c in range(self.n_clients)]
            server_state["n_experts"] = max(labels) + 1
            return server_state, {c: self.plan(server_state, c) for c in range(self.n_clients)}
        groups = server_state["groups"]
        for g in set(groups):
            members = {c: {n: x for n, x in u.items() if EXPERT in n} for c, u in uploads.items() if groups[c] == g}
            if members:
                server_state["experts"].update(average(members))
                server_state["routers"][g] = average({c: {n: x for n, x in uploads[c].items()
                                                          if param_role(n) == "lease_router"} for c in members})
        return server_state, {c: {**self.plan(server_state, c), **server_state["experts"],
                                  **server_state["routers"].get(groups[c], {})} for c in range(self.n_clients)}

    def plan(self, server_state, client: int) -> Tensors:
        """(M, g) for every module, as the client's layers hold it."""
        return {"lease.plan": torch.tensor([float(server_state["n_experts"]), float(server_state["groups"][client])])}

    def server_report(self, server_state) -> dict:
        return {"clusters": server_state["groups"]} if server_state.get("groups") else {}

    # -- client ------------------------------------------------------------------------------------
    def apply_payload(self, state: ClientState, payload: Tensors) -> ClientState:
        for n, t in payload.items():
            if n == "lease.plan":
                state.extra["plan"] = [int(v) for v in t.tolist()]
                continue
            if n not in state.adapters or param_role(n) not in ("lease_expert", "lease_router"):
                raise ValueError(f"payload tensor {n!r} is not an expert or router tensor of this client")
            state.adapters[n] = t.detach().clone().to(state.adapters[n].dtype)
        return state

    def personal_adapters(self, ctx: ClientContext, state: ClientState, payload: Tensors) -> Tensors:
        personal = ClientState(adapters=dict(state.adapters), extra=dict(state.extra))  # scoring changes no state
        return self.apply_payload(personal, payload).adapters

    def train_params(self, model):
        """The client's own expert and the router; the other experts are frozen."""
        own = int(next(p for n, p in model.named_parameters() if param_role(n) == "lease_state")[1])
        out = []
        for n, p in model.named_parameters():
            role = param_role(n)
            p.requires_grad_(role == "lease_router" or role == "lease_expert" and expert_of(n) == own)
            if p.requires_grad:
                out.append((n, p))
        return out

    def client_round(self, ctx: ClientContext, state: ClientState, payload: Tensors):
        state = self.apply_payload(state, payload)
        plan = state.extra.get("plan")
        if plan and not state.extra.get("clustered"):
            self.move_into_group(state, plan, seed=ctx.client * 1_000_003 + state.step)
        state.extra["round"] = state.extra.get("round", 0) + 1
        state, _, metrics = super().client_round(ctx, state, {})
        group = state.extra["plan"][1] if state.extra.get("clustered") else None
        return state, self.upload_of(state.adapters, state.extra["round"], group), metrics

    def move_into_group(self, state: ClientState, plan: list[int], seed: int) -> None:
        """The warmed LoRA (slot 0) moves into the client's expert slot g; the other slots and the
        router start afresh (main.py's transition: warmed ``lora_A0`` renamed ``lora_A{group}``,
        ``lora_route`` not loaded), and the layers take (M, g)."""
        m, g = plan
        gen = torch.Generator().manual_seed(seed)
        warmed = {n: t for n, t in state.adapters.items() if EXPERT in n and expert_of(n) == 0}
        for n, t in list(state.adapters.items()):
            role = param_role(n)
            if role == "lease_expert":
                state.adapters[n] = _kaiming(t, gen) if n.endswith("lora_A") else torch.zeros_like(t)
            elif role == "lease_router":
                state.adapters[n] = _kaiming(t, gen)
            elif role == "lease_state":
                state.adapters[n] = torch.tensor([float(m), float(g)], dtype=t.dtype)
        for n, t in warmed.items():
            state.adapters[n.replace(f"{EXPERT}0.", f"{EXPERT}{g}.")] = t.clone()
        state.extra["clustered"] = True


def _kaiming(t: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """kaiming_uniform_(a=sqrt(5)) as PEFT and the authors initialise A and the router: U(+-1/sqrt(fan_in))."""
    bound = 1.0 / math.sqrt(t.shape[1])
    return ((torch.rand(t.shape, generator=gen) * 2 - 1) * bound).to(t.dtype)
