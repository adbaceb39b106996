"""The device side of the Flower engine: a ClientApp answering the server loop's requests.

Node config (``flower-supernode --node-config``): ``client-id`` (this device's index in the
run), ``data`` (a directory holding this user's ``.txt``/``.jsonl`` files, or a corpus: a
built-in name or a directory of user folders, with ``user`` naming the folder) and
``state-dir`` (where private state persists); optional ``device`` (this node's accelerator,
e.g. ``cuda:1``; default: the recipe's ``device``). Every message starts a fresh process, so the
device rebuilds base model (from the safetensors cache), data (token cache) and algorithm from
the run description the server sends, and keeps its private state in files keyed by client id
and round: a train message for round r starts from the state after round r - 1, so a round the
server re-sends after a restart is replayed, never applied twice, and a restarted device
continues where it stopped. Only the algorithm's upload leaves this process.
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
from pathlib import Path

import torch
import yaml
import flwr.compat.common.recorddict_compat as compat
from flwr.app import Context, Message, RecordDict
from flwr.client.mod import secaggplus_mod
from flwr.clientapp import ClientApp
from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS

from ...algorithms import REGISTRY
from ...specs import build_algorithm, split_spec
from ...combinations import combination_problem
from ...config import load_config
from ...data import load_corpus, make_user_data
from ...data.corpora import user_folder
from ...fleet import DEADLINE_MISSED
from ...models import load_base_model
from ...runtime import resolve
from ..device import Device
from ..states import RoundStore
from ..inprocess import ClientModels
from .wire import from_arrays, from_json, from_parameters, secure_fitres, to_arrays, to_json

app = ClientApp()


@functools.lru_cache(maxsize=2)
def _recipe_users(model: str, corpus: str, data_yaml: str) -> list:
    """Every user of a recipe's corpus, built once per process: a simulation's worker answers
    many virtual devices' messages (Dirichlet splits of 1000 clients included)."""
    from ...data import SplitConfig
    _, tok = load_base_model(model)
    return make_user_data(load_corpus(corpus), tok, SplitConfig(**yaml.safe_load(data_yaml)))


@functools.lru_cache(maxsize=2)
def _base(model: str, dropout: float, device: str, precision: str, quant: str = "none"):
    """The frozen base model, loaded once per process and device (shared by every client model)."""
    from ...models.quant import on_device
    return on_device(load_base_model(model, dropout=dropout)[0], resolve(device, precision, quant=quant))


def node_user(cfg, node: dict, client: int):
    """This device's UserData. With ``user``: that user of the corpus ``data`` (a built-in name
    or a directory of user folders), split exactly as the in-process engine splits it. Without:
    ``data`` is this user's own folder (in-distribution splits only; OOD needs every user's data)."""
    if "data" not in node:  # a simulated device: user number ``client`` of the recipe's corpus
        return _recipe_users(cfg.model, cfg.corpus, yaml.safe_dump(dataclasses.asdict(cfg.data)))[client]
    _, tok = load_base_model(cfg.model)
    if "user" in node:
        users = make_user_data(load_corpus(str(node["data"])), tok, cfg.data)
        match = [u for u in users if u.name == str(node["user"])]
        if not match:
            raise ValueError(f"node config user={node['user']!r} is not a user of {node['data']}")
        return match[0]
    if cfg.data.mode != "in":
        raise ValueError("data.mode 'ood' tests on every user's data: give the device a corpus and user=")
    folder = Path(str(node["data"]))
    budget = [cfg.data.train_tokens[client]] if cfg.data.train_tokens else None
    split = dataclasses.replace(cfg.data, users=[folder.name], train_tokens=budget)
    return make_user_data({folder.name: user_folder(folder)}, tok, split)[0]


def device_for(run: dict, context: Context, read: int, write: int) -> Device:
    """This node's Device for the run description ``run`` (the server's), its private state read
    from round ``read`` and written as round ``write``."""
    node = context.node_config
    client = int(node["client-id"] if "client-id" in node else node["partition-id"])  # partition-id: simulation
    cfg = load_config(text=run["config"])
    if "client-runtime" in node:  # where this device trains, its own: a phone whose steps run in ExecuTorch
        own = str(node["client-runtime"])
        if own not in ("pytorch", "executorch"):
            raise ValueError(f"node config client-runtime must be pytorch or executorch, got {own!r}")
        runtimes = [cfg.train.runtime_of(c) for c in range(run["n_clients"])]
        runtimes[client] = own
        cfg.train.client_runtime = runtimes
        why = combination_problem(cfg)
        if why:
            raise ValueError(f"node config client-runtime={own}: {why}")
    name = split_spec(run["method"])[0]
    torch.set_num_threads(int(node.get("threads", 1)))
    algo = build_algorithm(cfg, run["method"], run["n_clients"])
    if REGISTRY[name][0].pooled or not algo.trains:
        raise ValueError(f"method {name} does not run on devices")
    # each SuperNode computes on its own device: node config `device` (e.g. cuda:1) or the recipe's
    # this device's base precision: the run's, or its own of a fleet's plan (one per client)
    quant = cfg.quant if isinstance(cfg.quant, str) else cfg.quant[client]
    micro = cfg.micro_batches if isinstance(cfg.micro_batches, int) else cfg.micro_batches[client]
    runtime = resolve(str(node.get("device", cfg.device)), cfg.precision, cfg.compile, quant, micro)
    # a device with its own model (DeepFusion's) builds it from the full-precision base and
    # quantises that itself (Algorithm.quant_refusal_reason)
    own = algo.device_spec(client) is not None
    base = _base(cfg.model, cfg.dropout, str(node.get("device", cfg.device)), cfg.precision, "none" if own else quant)
    key = hashlib.sha1(f"{run['config']}|{run['method']}|{run['seed']}".encode()).hexdigest()[:12]
    state_dir = node.get("state-dir") or run.get("state_dir") or "comix-device-state"
    store = RoundStore(Path(str(state_dir)) / key, read, write)
    return Device(algo, ClientModels(base, algo, runtime).for_client(client), node_user(cfg, node, client), client,
                  run["seed"], store, runtime)


def _round(msg: Message) -> int:
    return int(msg.content["round"]["round"])


@app.query("init")
def init(msg: Message, context: Context) -> Message:
    device = device_for(from_json(msg.content["run"]), context, 0, 0)
    shared = device.init()
    info = {"client": device.client, "user": device.data.name}
    return Message(RecordDict({"shared": to_arrays(shared), "info": to_json(info)}), reply_to=msg)


def secure_aggregation_mod(msg: Message, context: Context, call_next) -> Message:
    """Flower's ``secaggplus_mod`` on the train messages of the SecAgg+ protocol (they carry its
    config record), nothing on the others: one ClientApp serves runs with and without it."""
    if RECORD_KEY_CONFIGS in msg.content.config_records:
        return secaggplus_mod(msg, context, call_next)
    return call_next(msg, context)


def secure_upload_problem(upload: dict, clip_range: float) -> str | None:
    """Why this device refuses to mask its upload (the server cannot check a masked vector, so the
    device checks what the server would have): non-finite values, or values outside the range
    SecAgg+ quantises (Flower would clip them silently and corrupt the sum)."""
    for n, t in sorted(upload.items()):
        if not torch.isfinite(t).all():
            return f"tensor {n} holds NaN or inf"
        if t.abs().max() > clip_range:
            return f"tensor {n} has values beyond privacy.secagg_clip_range = {clip_range:g} ({t.abs().max():.3g})"
    return None


def _secure_train(msg: Message, context: Context) -> Message:
    """The train step inside SecAgg+'s 'collect masked vectors' stage: the request and the reply are
    legacy FitIns / FitRes records; secaggplus_mod masks the reply's parameters and clears them
    before the reply leaves, so the upload itself never does."""
    ins = compat.recorddict_to_fitins(msg.content, keep_input=True)
    run, r = json.loads(ins.config["run"]), int(ins.config["round"])
    payload = from_parameters(ins.parameters, json.loads(ins.config["payload"]))
    device = device_for(run, context, r - 1, r)
    upload, metrics = device.train(payload)
    fleet = device.algorithm.fleet
    if fleet and fleet.late(device.client, run["n_clients"], metrics.get("tokens", 0)):
        # past the round's deadline the device misses the masked-vector stage, a SecAgg+ dropout:
        # the server, which cannot see a masked upload, would otherwise sum it (comix/fleet.py)
        raise ValueError(f"client {device.client} {DEADLINE_MISSED} "
                         f"({fleet.seconds(device.client, run['n_clients'], metrics.get('tokens', 0)):.1f} s)")
    problem = secure_upload_problem(upload, device.algorithm.privacy.secagg_clip_range)
    if problem:
        raise ValueError(f"client {device.client} refuses to mask its upload: {problem}")
    # what leaves: one int64 per value and the weight, masked (Flower's _collect_masked_vectors)
    metrics["bytes_up"] = 8 * (1 + sum(t.numel() for t in upload.values()))
    return Message(compat.fitres_to_recorddict(secure_fitres(upload, metrics), keep_input=True), reply_to=msg)


@app.train(mods=[secure_aggregation_mod])
def train(msg: Message, context: Context) -> Message:
    if "fitins.parameters" in msg.content.array_records:  # inside SecAgg+
        return _secure_train(msg, context)
    r = _round(msg)
    device = device_for(from_json(msg.content["run"]), context, r - 1, r)
    upload, metrics = device.train(from_arrays(msg.content["payload"]))
    return Message(RecordDict({"upload": to_arrays(upload), "metrics": to_json(metrics)}), reply_to=msg)


@app.train("finish")
def finish(msg: Message, context: Context) -> Message:
    r = _round(msg)
    device_for(from_json(msg.content["run"]), context, r, r).finish(from_arrays(msg.content["payload"]))
    return Message(RecordDict({"info": to_json({"finished": r})}), reply_to=msg)


@app.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    r = _round(msg)
    device = device_for(from_json(msg.content["run"]), context, r, r)
    metrics = device.evaluate(from_arrays(msg.content["payload"]), device.data)
    return Message(RecordDict({"metrics": to_json({"user": device.data.name, **metrics})}), reply_to=msg)
