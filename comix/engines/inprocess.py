"""In-process engine (the default): every client takes its turn on one machine.

One frozen base model is held in memory; each distinct adapter architecture (1GXS users differ)
gets a model whose frozen tensors *share storage* with that base. For its turn a client's adapters,
optimizer states and RNG state are loaded, and saved back afterwards, so no state crosses clients.
With ``offload`` idle clients' states live on disk, one file per client and round written
(so RAM stays flat in the number of clients, and resume finds each client's state after the
checkpointed round). The server loop (``engines.server.serve``)
is the one the Flower engine runs too; here its requests are plain calls.
"""
from __future__ import annotations

import copy
import shutil
from pathlib import Path
from typing import Callable

from torch import nn

from ..algorithms import Algorithm
from ..algorithms.base import ServerContext, Tensors
from ..data import UserData
from ..models import inject_adapters
from ..models.mixture import set_compiled
from ..models.quant import quant_of_base, quantize_base, shared_objects
from ..runtime import Runtime
from ..progress import step as phase_step
from ..files import atomic_write
from .device import Device, RoundStore, StateStore, evaluate
from .server import finish_run, serve


class ClientModels:
    """Models per adapter architecture over one shared frozen base (on the run's device; the
    adapters are created in fp32 there: the master weights of mixed precision)."""

    def __init__(self, base: nn.Module, algorithm: Algorithm, runtime: Runtime = Runtime()):
        self.base, self.algorithm, self.runtime, self.models = base, algorithm, runtime, {}
        self.bases = {quant_of_base(base): base}

    def base_at(self, quant: str) -> nn.Module:
        """The frozen base at ``quant``: the run's own, or (a fleet whose devices differ in
        precision, or a base the run keeps in full precision for another method's own device
        models) a copy of the full-precision base quantised once and shared by those clients."""
        if quant not in self.bases:
            if "none" not in self.bases:
                raise ValueError(f"a client's base at quant={quant} cannot be made from the run's "
                                 f"{quant_of_base(self.base)} base (quantise copies of a full-precision one)")
            self.bases[quant] = quantize_base(copy.deepcopy(self.bases["none"]), quant, self.runtime.dtype,
                                              self.runtime.device)
        return self.bases[quant]

    def for_client(self, client: int) -> nn.Module:
        spec, quant = self.algorithm.device_spec(client), self.runtime.quant_of(client)
        if spec is not None:  # the client's own model (DeepFusion), one per spec and precision: clients take turns
            if (spec, quant) not in self.models:
                self.models[spec, quant] = self.algorithm.build_device_model(spec, self.base, quant).to(self.runtime.device)
            return self.models[spec, quant]
        cfg = self.algorithm.adapter_config(client)
        key = (repr(cfg), quant)
        if key not in self.models:
            # the copy reuses the base's frozen tensors themselves (memo): no second copy in memory
            base = self.base_at(quant)
            shared = {id(t): t for t in (*base.parameters(), *base.buffers(), *shared_objects(base))}
            model = copy.deepcopy(base, memo=shared)
            self.models[key] = set_compiled(inject_adapters(model, cfg), self.runtime.compile).to(self.runtime.device)
        return self.models[key]


class InProcess:
    """The transport of ``serve``: direct calls into every client's ``Device``, one at a time."""

    def __init__(self, algorithm: Algorithm, base: nn.Module, users: list[UserData], seed: int,
                 store: StateStore, runtime: Runtime = Runtime()):
        models = ClientModels(base, algorithm, runtime)
        n = 1 if algorithm.pooled else len(users)
        data_of = (lambda c: users) if algorithm.pooled else (lambda c: users[c])
        self.devices = [Device(algorithm, models.for_client(c), data_of(c), c, seed, store, runtime)
                        for c in range(n)]
        self.users, self.store, self.pooled = users, store, algorithm.pooled
        self.round = 0

    def _rounds(self, read: int, write: int) -> None:
        if isinstance(self.store, RoundStore):  # offloaded states are files per client and round
            self.store.read, self.store.write = read, write

    def init(self) -> dict[int, Tensors]:
        self._rounds(0, 0)
        return {d.client: d.init() for d in self.devices}

    def train(self, payloads):
        self.round += 1
        self._rounds(self.round - 1, self.round)
        out = {}
        for i, (c, p) in enumerate(payloads.items()):
            out[c] = self.devices[c].train(p)
            phase_step(f"round {self.round}: clients trained", i + 1, len(payloads))
        return out

    def finish(self, payloads) -> None:
        self._rounds(self.round, self.round)
        for c, p in payloads.items():
            self.devices[c].finish(p)

    def evaluate(self, payloads) -> dict[str, dict]:
        self._rounds(self.round, self.round)
        return {u.name: self.devices[0 if self.pooled else i].evaluate(payloads[0 if self.pooled else i], u)
                for i, u in enumerate(self.users)}

    def snapshot(self):
        """What resume needs of the clients: in memory, their states; offloaded, the round (each
        client's files are kept per round, so the states after it are still on disk)."""
        if isinstance(self.store, RoundStore):
            return {"round": self.round}
        return {"round": self.round, "states": {d.client: self.store[d.client] for d in self.devices}}

    def restore(self, snapshot) -> None:
        self.round = snapshot["round"]
        for c, state in (snapshot.get("states") or {}).items():
            self.store[c] = state


def save_adapters(store: StateStore, clients: dict[int, str], directory: Path) -> None:
    """Each client's final adapters (specialists and routers included) as
    ``<directory>/<user>.safetensors``; in-process only: on a real federation they stay on the
    devices."""
    from safetensors.torch import save_file

    for c, user in clients.items():
        tensors = {n: t.detach().contiguous() for n, t in store[c].adapters.items()}
        if not tensors:  # a method whose devices keep no adapters (DeepFusion): no empty files
            continue
        atomic_write(directory / f"{user}.safetensors", lambda p: save_file(tensors, p))


def run_method(algorithm: Algorithm, base: nn.Module, users: list[UserData], out_dir: Path,
               seed: int = 42, resume: bool = False, offload: bool = False,
               progress: Callable[[dict], None] | None = None, keep_checkpoints: bool = False,
               runtime: Runtime = Runtime(), server_data=None) -> dict:
    """Run one method to the end on this machine; writes metrics.jsonl, results.json and the final
    adapters (adapters/<user>.safetensors). checkpoint.pt (and, with ``offload``, the client
    states) hold what resume needs while it runs; they are deleted when the method finishes
    unless ``keep_checkpoints``. ``base`` is on ``runtime.device`` already (``Runtime.prepare_base``);
    ``server_data`` is what the server itself holds (``data.make_server_data``), for the algorithms
    that use it."""
    names = [u.name for u in users]
    algorithm.server = ServerContext(base, server_data, runtime, out_dir, seed)
    if not algorithm.trains:  # Pretrained: the frozen base on every user's splits
        t = algorithm.train
        per_user = {u.name: evaluate(base, u, t, runtime) for u in users}
        return finish_run(out_dir, algorithm, names, per_user, bytes_up=0, rounds=0)
    if offload and not (resume and (out_dir / "checkpoint.pt").exists()):
        for stale in (out_dir / "clients").glob("client*.pt"):  # a fresh run starts from scratch
            stale.unlink()
    store = RoundStore(out_dir / "clients", 0, 0) if offload else StateStore()
    transport = InProcess(algorithm, base, users, seed, store, runtime)
    result = serve(algorithm, transport, names, out_dir, seed=seed, resume=resume, progress=progress)
    owners = {0: "all-users"} if algorithm.pooled else dict(enumerate(names))
    save_adapters(store, owners, out_dir / "adapters")
    if not keep_checkpoints:
        (out_dir / "checkpoint.pt").unlink(missing_ok=True)
        shutil.rmtree(out_dir / "clients", ignore_errors=True)
    return result
