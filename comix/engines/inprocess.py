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
import logging
import shutil
import time
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from ..algorithms import Algorithm, ClientContext, ClientState
from ..algorithms.base import ServerContext, Tensors
from ..algorithms.cohort import CohortMember, cohort_round
from ..data import UserData
from ..models import inject_adapters
from ..models.cohort import stack_clients
from ..models.mixture import set_compiled
from ..models.quant import quant_of_base, quantize_base, shared_objects
from ..runtime import Runtime
from ..progress import step as phase_step
from ..files import atomic_write
from .device import Device, evaluate, evaluate_cohort
from .footprint import Footprint
from .states import RoundStore, StateStore, pack, unpack
from .server import finish_run, serve

log = logging.getLogger("comix")


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


CPU_COHORT_MB = 1536  # the CPU's largest cohort step, MB beyond the base (cohort_size)


def cohort_fit(free_mb: float, train_mb: float, activation_mb: float, eval_mb: float, graphs: bool,
               cpu_cap_mb: float | None = None) -> int:
    """How many clients fit in 80 % of ``free_mb``, each needing ``train_mb`` to train (its trainable
    state and one eager step's peak, of which ``activation_mb`` is the step's activations) and
    ``eval_mb`` to be scored. A captured step (``graphs``: algorithms/cohort.py CohortStep) keeps
    its activations in the graph's private pool for the whole round, and the warm-ups and
    interleaved steps (CoMiGS's router steps) run eagerly beside that pool: one more step's
    activations. An evaluation cohort scores ``eval_batch_size`` windows a client with fp32
    logits, sized apart from training (it may need more a client). On the CPU at most
    ``cpu_cap_mb`` of training need in all."""
    per_client = max(1.0, train_mb + (activation_mb if graphs else 0.0), eval_mb)
    fits = int(0.8 * free_mb / per_client)
    if cpu_cap_mb is not None:
        fits = min(fits, int(cpu_cap_mb / max(1.0, train_mb)))
    return max(1, fits)


def evaluation_memory(base: nn.Module, user: UserData, train, runtime: Runtime) -> float:
    """MB one client's scoring forward needs beyond the model (``StepPeak``): ``eval_batch_size``
    windows of ``seq_len`` tokens through the frozen base, the logits in fp32, as the perplexity
    of a split computes it (eval/perplexity.py); a client's adapters add little beside the logits."""
    from ..eval import perplexity
    from .footprint import StepPeak
    windows = train.eval_batch_size * train.seq_len + 1
    tokens = user.tokens("valid") if user.task == "lm" else None
    if tokens is None or len(tokens) < windows:
        return 0.0
    with torch.no_grad(), runtime.autocast(), StepPeak() as peak:
        perplexity(base, tokens[:windows], train.seq_len, train.eval_batch_size)
    return peak.peak / 2**20


def cohort_size(algorithm: Algorithm, base: nn.Module, users: list[UserData], runtime: Runtime) -> tuple[int, str]:
    """How many clients train together in one step (``train.cohort``; algorithms/cohort.py) and,
    when a cohort was asked for but cannot be, why (one line). ``auto``: as many of the clients
    as 80 % of the device's free memory holds (``cohort_fit``: one client's measured training need
    beyond the frozen base, ``training_memory``, with a captured graph's pool and the eager steps
    beside it, and its scoring forward, ``evaluation_memory``); on the CPU at most
    ``CPU_COHORT_MB`` of that need in all, since there a larger step is slower, not faster
    (bench/results/cohort-cpu-fp32*.json: SmolLM2-135M's tokens/s gain 1.05-1.44x at a cohort of
    4 x 128 tokens, 0.9-1.5 GB a step, and no more, or less, at 16 clients' 3.5-5.9 GB). A plan
    that still runs out of device memory is retried with smaller cohorts (``InProcess``)."""
    want = algorithm.train.cohort
    if want == 1:
        return 1, ""
    config = getattr(base, "config", None)
    dropouts = {k: v for k, v in (vars(config) if config is not None else {}).items()
                if ("dropout" in k or k.endswith("pdrop")) and isinstance(v, float) and v > 0}
    reason = algorithm.cohort_refusal() or (
        "fp16 scales each client's loss on its own (a skipped step is per client)" if runtime.precision == "fp16" else
        "its devices compute their batches in slices (micro_batches)" if runtime.micro_batches != 1 else
        f"the base model's dropout ({', '.join(dropouts)}) draws per client turn" if dropouts else None)
    if reason:
        return 1, reason
    if want != "auto":
        return min(want, len(users)), ""
    from ..runtime import note_runtime
    from .device import planned_base_bytes, training_memory
    quant = runtime.quant_of(0)
    firsts = {repr(algorithm.adapter_config(c)): c for c in reversed(range(len(users)))}  # one client an architecture
    train_mb = activation_mb = 0.0
    for c in firsts.values():
        peaks: dict = {}
        need = training_memory(base, algorithm, users[c], c, micro_batches=(1,), precisions=(quant,),
                               activations=peaks)[(quant, 1)]
        # MB beyond the base and the process's runtime (both held once, whatever the cohort), the largest client
        train_mb = max(train_mb, need - note_runtime() - planned_base_bytes(base)[quant] / 2**20)
        activation_mb = max(activation_mb, peaks[(quant, 1)])
    eval_mb = max(evaluation_memory(base, users[c], algorithm.train, runtime) for c in firsts.values())
    if runtime.device.type == "cuda":
        free = torch.cuda.mem_get_info(runtime.device)[0] / 2**20
    else:  # Linux: what the kernel can give without swapping
        meminfo = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines())
        free = int(meminfo["MemAvailable"].split()[0]) / 1024
    fits = cohort_fit(free, train_mb, activation_mb, eval_mb, runtime.graphs,
                      CPU_COHORT_MB if runtime.device.type == "cpu" else None)
    return min(len(users), fits), ""


class InProcess:
    """The transport of ``serve``: direct calls into every client's ``Device``, one at a time, or
    (``train.cohort`` > 1, for the methods a cohort can run: ``Algorithm.cohort_refusal``) a
    cohort of clients at a time in lockstep over the one base (algorithms/cohort.py)."""

    def __init__(self, algorithm: Algorithm, base: nn.Module, users: list[UserData], seed: int,
                 store: StateStore, runtime: Runtime = Runtime()):
        self.models = models = ClientModels(base, algorithm, runtime)
        n = 1 if algorithm.pooled else len(users)
        data_of = (lambda c: users) if algorithm.pooled else (lambda c: users[c])
        self.devices = [Device(algorithm, models.for_client(c), data_of(c), c, seed, store, runtime)
                        for c in range(n)]
        self.users, self.store, self.pooled = users, store, algorithm.pooled
        self.algorithm, self.runtime, self.round = algorithm, runtime, 0
        self.cohort, why = cohort_size(algorithm, base, users, runtime) if not algorithm.pooled else (1, "")
        if why:
            log.warning("%s: train.cohort=%s, but its clients train one at a time: %s", algorithm.name,
                        algorithm.train.cohort, why)
        self.stacked: dict = {}  # (client model, cohort size) -> its stacked copy (models/cohort.py)

    def _cohorts(self, clients: list[int]) -> list[list[tuple[int, ClientState | None]]]:
        """The round's clients in cohorts of at most ``self.cohort``: clients alike in adapter
        architecture, base precision and steps taken (their schedules and interleaved steps then
        agree), each with its state; one client alone trains as a ``Device`` does (state None)."""
        if self.cohort == 1:
            return [[(c, None)] for c in clients]
        groups: dict = {}
        for c in clients:
            state = self.store[c]
            key = (id(self.devices[c].model), self.runtime.quant_of(c), state.step)
            groups.setdefault(key, []).append((c, state))
        out = [g[i:i + self.cohort] for g in groups.values() for i in range(0, len(g), self.cohort)]
        return [g if len(g) > 1 else [(g[0][0], None)] for g in out]

    def _stacked_for(self, client: int, size: int) -> nn.Module:
        """The model of ``client``'s architecture stacked for ``size`` clients (kept for reuse)."""
        key = (id(self.devices[client].model), size)
        if key not in self.stacked:
            if len(self.stacked) >= 4:  # bounded: drop the oldest (sampled rounds vary the last cohort's size)
                self.stacked.pop(next(iter(self.stacked)))
            self.stacked[key] = stack_clients(self.devices[client].model, size)
        return self.stacked[key]

    def _smaller(self, size: int, what: str, err: Exception) -> int:
        """After a cohort of ``size`` ran out of device memory: the size to retry with (half, at
        least 1), kept for the rest of the run, and said in the run's log with the error's first line."""
        smaller = max(1, size // 2)
        self.cohort = min(self.cohort, smaller)
        if self.runtime.device.type == "cuda":
            torch.cuda.empty_cache()  # the failed cohort's cached blocks, before the smaller ones
        log.warning("round %d: %s a cohort of %d clients ran out of device memory (%s); retried in cohorts of "
                    "at most %d, kept for the rest of the run", self.round, what, size,
                    str(err).splitlines()[0][:120] if str(err) else type(err).__name__, smaller)
        return smaller

    def _train_cohort(self, group: list[tuple[int, ClientState]], payloads) -> dict:
        """One cohort's round; one that runs out of device memory is retried in smaller cohorts
        (halves, down to one client alone: ``Device.train``), its clients' states untouched by the
        failed try (cohort_round works on copies), and each retried client's metrics say so
        (``cohort_retry``: the size that failed; serve copies it into server.jsonl)."""
        try:
            return self._train_cohort_once(group, payloads)
        except torch.OutOfMemoryError as err:
            smaller = self._smaller(len(group), "training", err)
        out = {}
        for i in range(0, len(group), smaller):
            part = group[i:i + smaller]
            if len(part) == 1:
                c = part[0][0]
                out[c] = self.devices[c].train(payloads[c])
            else:
                out.update(self._train_cohort(part, payloads))
        for c, (_, metrics) in out.items():
            metrics.setdefault("cohort_retry", len(group))
        return out

    def _train_cohort_once(self, group: list[tuple[int, ClientState]], payloads) -> dict:
        clients = [c for c, _ in group]
        model, a, rt = self._stacked_for(clients[0], len(group)), self.algorithm, self.runtime
        members = [CohortMember(c, self.devices[c].data, state, payloads[c], self.devices[c].seed) for c, state in group]
        contexts = [ClientContext(c, model, self.devices[c].data, a.train, rt) for c in clients]
        if rt.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(rt.device)
        t0 = time.perf_counter()
        with rt.autocast(), Footprint(model) as footprint:
            results = cohort_round(a, model, members, contexts, self.devices[clients[0]].model)
        seconds = (time.perf_counter() - t0) / len(group)  # the cohort's wall time, shared
        out = {}
        for c, (state, upload, metrics) in zip(clients, results):
            self.store[c] = state
            metrics["cohort"] = len(group)
            out[c] = self.devices[c].reply(payloads[c], upload, metrics, seconds, footprint.peak // len(group))
        return out

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
        for group in self._cohorts(list(payloads)):
            if group[0][1] is None:
                c = group[0][0]
                out[c] = self.devices[c].train(payloads[c])
            else:
                out.update(self._train_cohort(group, payloads))
            phase_step(f"round {self.round}: clients trained", len(out), len(payloads))
        return out

    def finish(self, payloads) -> None:
        self._rounds(self.round, self.round)
        for c, p in payloads.items():
            self.devices[c].finish(p)

    def evaluate(self, payloads) -> dict[str, dict]:
        """Every client in ``payloads`` scores the model it holds (a pooled model: every user)."""
        self._rounds(self.round, self.round)
        if self.pooled:
            return {u.name: self.devices[0].evaluate(payloads[0], u) for u in self.users}
        if self.cohort > 1:
            return self._evaluate_cohorts(payloads)
        return {self.users[c].name: self.devices[c].evaluate(payloads[c], self.users[c]) for c in sorted(payloads)}

    def _evaluate_cohorts(self, payloads) -> dict[str, dict]:
        """Each client's personal model scored as ``Device.evaluate`` scores it, a cohort of them
        in each forward (``evaluate_cohort``); a group whose data a cohort cannot score (instruction
        tasks) is scored one client at a time."""
        results = {}
        groups: dict = {}
        for c in sorted(payloads):
            groups.setdefault(id(self.devices[c].model), []).append(c)
        for clients in groups.values():
            for i in range(0, len(clients), self.cohort):
                self._score(clients[i:i + self.cohort], payloads, results)
        return {u.name: results[u.name] for u in self.users if u.name in results}

    def _score(self, part: list[int], payloads, results: dict) -> None:
        """``part``'s clients scored in one cohort (or alone); a cohort that runs out of device
        memory is scored again in halves, as training retries (``_train_cohort``)."""
        a, rt = self.algorithm, self.runtime
        t0 = time.perf_counter()
        scored = None
        if len(part) > 1:
            model = self._stacked_for(part[0], len(part))
            with rt.autocast():
                adapters = [a.personal_adapters(self.devices[c].context(), self.store[c], payloads[c]) for c in part]
            a.load_cohort(model, adapters)
            try:
                scored = evaluate_cohort(model, [self.users[c] for c in part], a.train, rt)
            except torch.OutOfMemoryError as err:
                smaller = self._smaller(len(part), "scoring", err)
                for i in range(0, len(part), smaller):
                    self._score(part[i:i + smaller], payloads, results)
                return
        if scored is None:
            for c in part:
                results[self.users[c].name] = self.devices[c].evaluate(payloads[c], self.users[c])
            return
        seconds = (time.perf_counter() - t0) / len(part)  # the cohort's wall time, shared
        for c, metrics in zip(part, scored):
            results[self.users[c].name] = {**metrics, "eval_s": round(seconds, 4)}

    def snapshot(self):
        """What resume needs of the clients: in memory, their states; offloaded, the round (each
        client's files are kept per round, so the states after it are still on disk)."""
        if isinstance(self.store, RoundStore):
            return {"round": self.round}
        return {"round": self.round, "states": {d.client: pack(self.store[d.client]) for d in self.devices}}

    def restore(self, snapshot) -> None:
        self.round = snapshot["round"]
        for c, state in (snapshot.get("states") or {}).items():
            self.store[c] = unpack(state)


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
