"""In-process engine (the default): every client takes its turn on one machine.

One frozen base model is held in memory; each distinct adapter architecture (1GXS users differ)
gets a model whose frozen tensors *share storage* with that base. For its turn a client's adapters,
optimizer states and RNG state are loaded, and saved back afterwards, so no state crosses clients.
With ``offload_dir`` idle clients' states live on disk. A checkpoint is written atomically after
every round; ``resume=True`` continues from it and gives the same numbers as an uninterrupted run.
"""
from __future__ import annotations

import copy
import json
import os
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from ..algorithms import Algorithm, ClientContext, ClientState, tensor_bytes
from ..algorithms.base import adapter_tensors, load_adapters
from ..data import UserData
from ..eval import perplexity
from ..models import inject_adapters, mixtures, routing_stats, set_record_stats
from ..models.lora import LoRALinear, LoRAWeights


def atomic_write(path: Path, write: Callable[[str], None]) -> None:
    """Write through a temp file in the same directory, then rename: never a half-written file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


class ClientModels:
    """Models per adapter architecture over one shared frozen base."""

    def __init__(self, base: nn.Module, algorithm: Algorithm):
        self.base, self.algorithm, self.models = base, algorithm, {}

    def for_client(self, client: int) -> nn.Module:
        cfg = self.algorithm.adapter_config(client)
        key = repr(cfg)
        if key not in self.models:
            model = copy.deepcopy(self.base)
            for (_, new), (_, old) in zip(model.named_parameters(), self.base.named_parameters()):
                new.data = old.data  # share the frozen weights, do not copy them
            self.models[key] = inject_adapters(model, cfg)
        return self.models[key]


def fresh_adapters(model: nn.Module, seed: int) -> dict[str, torch.Tensor]:
    """Re-initialise every adapter of ``model`` from ``seed`` and return them."""
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        for m in model.modules():
            if isinstance(m, LoRAWeights):
                m.reset_parameters()
            if isinstance(m, LoRALinear) and m.lora_fusion is not None:
                m.lora_fusion.data.fill_(1.0)
        for m in mixtures(model):
            if m.router is not None:
                m.router.reset_parameters()
    return adapter_tensors(model)


class StateStore:
    """Client states in memory, or on disk when ``offload_dir`` is set."""

    def __init__(self, offload_dir: Path | None = None):
        self.dir, self.mem = offload_dir, {}

    def __setitem__(self, c: int, state: ClientState):
        if self.dir is None:
            self.mem[c] = state
        else:
            atomic_write(self.dir / f"client{c}.pt", lambda p: torch.save(state, p))

    def __getitem__(self, c: int) -> ClientState:
        if self.dir is None:
            return self.mem[c]
        return torch.load(self.dir / f"client{c}.pt", weights_only=False)

    def all(self, n: int) -> dict[int, ClientState]:
        return {c: self[c] for c in range(n)}


def evaluate(model: nn.Module, user: UserData, seq_len: int, batch_size: int, splits=("valid", "test")):
    out = {f"{s}_ppl": perplexity(model, user.tokens(s), seq_len, batch_size) for s in splits}
    if mixtures(model):  # mean gate per layer and expert on one validation batch
        set_record_stats(model, True)
        rows = max(1, min(4, (len(user.valid) - 1) // seq_len))
        with torch.no_grad():
            model.eval()
            model(input_ids=user.valid[:rows * seq_len].long().reshape(rows, seq_len))
        out["gates"] = [[round(v, 4) for v in s["mean_gate"].tolist()] for s in routing_stats(model)]
        set_record_stats(model, False)
    return out


def run_method(algorithm: Algorithm, base: nn.Module, users: list[UserData], out_dir: Path,
               seed: int = 42, resume: bool = False, offload: bool = False,
               progress: Callable[[dict], None] | None = None) -> dict:
    """Run one method to the end; writes metrics.jsonl, checkpoint.pt and results.json."""
    train = algorithm.train
    out_dir.mkdir(parents=True, exist_ok=True)
    metrics_path, ckpt_path = out_dir / "metrics.jsonl", out_dir / "checkpoint.pt"
    n_clients = 1 if algorithm.pooled else len(users)
    models = ClientModels(base, algorithm)

    if not algorithm.trains:  # Pretrained: the frozen base on every user's splits
        per_user = {u.name: evaluate(base, u, train.seq_len, train.eval_batch_size, train.eval_splits)
                    for u in users}
        return _finish(out_dir, algorithm, users, per_user, bytes_up=0, rounds=0)

    store = StateStore(out_dir / "clients" if offload else None)
    start = 0
    if resume and ckpt_path.exists():
        ck = torch.load(ckpt_path, weights_only=False)
        start, server_state, payloads = ck["round"], ck["server_state"], ck["payloads"]
        for c, s in ck["states"].items():
            store[c] = s
        torch.set_rng_state(ck["torch_rng"])
        kept = [ln for ln in metrics_path.read_text().splitlines() if json.loads(ln)["round"] <= start]
        atomic_write(metrics_path, lambda p: Path(p).write_text("".join(ln + "\n" for ln in kept)))
    else:
        torch.manual_seed(seed)
        initial = {c: algorithm.upload_of(fresh_adapters(models.for_client(c), seed)) for c in range(n_clients)}
        for c in range(n_clients):
            init_seed = seed + 1 if algorithm.common_init else seed + 1 + c
            store[c] = ClientState(adapters=fresh_adapters(models.for_client(c), init_seed),
                                   rng=torch.Generator().manual_seed(seed * 1000 + c).get_state())
        server_state, payloads = algorithm.server_init(initial)
        metrics_path.write_text("")

    data_of = (lambda c: users) if algorithm.pooled else (lambda c: users[c])
    total_up = sum(json.loads(ln).get("bytes_up", 0) for ln in metrics_path.read_text().splitlines())
    for rnd in range(start, train.rounds):
        t0 = time.time()
        uploads, client_metrics = {}, {}
        for c in range(n_clients):
            ctx = ClientContext(c, models.for_client(c), data_of(c), train)
            state, upload, m = algorithm.client_round(ctx, store[c], payloads[c])
            store[c] = state
            uploads[c] = upload
            client_metrics[c] = {**m, "bytes_up": tensor_bytes(upload), "bytes_down": tensor_bytes(payloads[c])}
        server_state, payloads = algorithm.server_round(server_state, uploads)
        if rnd + 1 == train.rounds:  # the clients take the final payload (FDLoRA fuses here)
            for c in range(n_clients):
                ctx = ClientContext(c, models.for_client(c), data_of(c), train)
                store[c] = algorithm.client_finish(ctx, store[c], payloads[c])
                payloads[c] = {}
        evaluate_now = (rnd + 1) % train.eval_every == 0 or rnd + 1 == train.rounds
        lines = []
        for u_idx, user in enumerate(users):
            c = 0 if algorithm.pooled else u_idx
            row = {"round": rnd + 1, "iteration": (rnd + 1) * train.local_steps, "user": user.name,
                   **client_metrics[c]}
            if algorithm.pooled:
                row["bytes_up"] = row["bytes_down"] = 0
            if evaluate_now:
                row.update(evaluate(_personal_model(algorithm, models, store[c], payloads[c], c), user,
                                    train.seq_len, train.eval_batch_size, train.eval_splits))
            lines.append(row)
        total_up += sum(r["bytes_up"] for r in lines)
        with open(metrics_path, "a") as fh:
            fh.writelines(json.dumps(r) + "\n" for r in lines)
        ck = {"round": rnd + 1, "server_state": server_state, "payloads": payloads,
              "states": store.all(n_clients), "torch_rng": torch.get_rng_state()}
        atomic_write(ckpt_path, lambda p: torch.save(ck, p))
        if progress:
            progress({"round": rnd + 1, "rounds": train.rounds, "seconds": time.time() - t0,
                      "train_loss": sum(r["train_loss"] for r in lines) / len(lines),
                      "test_ppl": [r.get("test_ppl") for r in lines]})
    last = [json.loads(ln) for ln in metrics_path.read_text().splitlines()][-len(users):]
    per_user = {r["user"]: {k: r[k] for k in ("valid_ppl", "test_ppl", "gates") if k in r} for r in last}
    return _finish(out_dir, algorithm, users, per_user, total_up, train.rounds)


def _personal_model(algorithm, models, state: ClientState, payload, client: int) -> nn.Module:
    """The model this client holds after the round: its own state with the new payload applied."""
    personal = ClientState(adapters=dict(state.adapters), extra=state.extra)
    algorithm.apply_payload(personal, payload)
    model = models.for_client(client)
    load_adapters(model, personal.adapters)
    return model


def _finish(out_dir: Path, algorithm: Algorithm, users, per_user: dict, bytes_up: int, rounds: int) -> dict:
    tests = [per_user[u.name]["test_ppl"] for u in users]
    result = {"method": algorithm.name, "rounds": rounds, "per_user": per_user,
              "mean_test_ppl": sum(tests) / len(tests), "bytes_up_total": bytes_up,
              "train": asdict(algorithm.train)}
    atomic_write(out_dir / "results.json", lambda p: Path(p).write_text(json.dumps(result, indent=2)))
    return result
