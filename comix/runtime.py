"""Where and in which precision a run computes: ``device`` and ``precision`` of the run config.

* ``device``: ``auto`` (CUDA when present, else the CPU), ``cpu``, ``cuda`` or ``cuda:N``.
* ``precision``: ``fp32``; ``bf16`` (the usual choice on GPUs since Ampere): the frozen base
  weights are stored in bfloat16 and forward passes run under ``torch.autocast`` in bfloat16,
  while every trainable adapter keeps an fp32 master copy and AdamW keeps fp32 moments, so
  small LoRA updates are not lost to bf16's 8-bit mantissa (as PEFT + Trainer do with
  ``bf16=True``); ``fp16``: the same with float16 and a dynamic loss scale (CUDA only; fp16's
  range needs the scaling, bf16's does not).
* ``compile``: run the d_ff-sized per-slot work of every mixture MLP through ``torch.compile``
  (``models/mixture.py``: one fused kernel per pass instead of six); ``auto`` = on CUDA only,
  because on the CPU each new process and shape first pays some seconds of compilation (worth
  it for long runs: ``compile=true``; docs/benchmarks.md "Speed of the mixture").
* ``graphs``: capture a cohort's training step (forward, backward, clip, AdamW) as one CUDA graph
  and replay it (algorithms/cohort.py ``CohortStep``); ``auto`` = on CUDA. The CPU runs the
  same step eagerly.
Client states, uploads and payloads always live on the CPU between turns: device memory holds
the shared frozen base and the one client that is training.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch


def process_memory_mb(pid: int | str = "self", field: str = "VmRSS") -> float:
    """A process's resident memory (``VmRSS``) or its peak so far (``VmHWM``) in MiB, from Linux's
    /proc; 0 where there is none (the process gone, or not Linux)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


_RUNTIME_MB: list[float] = []


def note_runtime() -> float:
    """The runtime a device holds beside its model and its training step, in MiB: this process's
    resident memory the first time it is asked, which ``load_base_model`` does before it loads a
    model (the interpreter, torch, transformers and comix; 429 MiB on the CPU wheels, measured).
    Counted in every device's ``memory_mb`` (engines/device.py), since a budget must hold it too."""
    if not _RUNTIME_MB:
        _RUNTIME_MB.append(round(process_memory_mb(), 1))
    return _RUNTIME_MB[0]


PRECISIONS = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
QUANTS = ("none", "int8", "q4", "nf4")  # the frozen base's block linears (models/quant.py)


@dataclass(frozen=True)
class Runtime:
    device: torch.device = torch.device("cpu")
    precision: str = "fp32"
    compile: bool = False
    # the frozen base's linears: none | int8 | q4 | nf4 (models/quant.py), or one per client (a fleet's
    # plan, comix/fleet.py: each device's base at the precision its memory budget allows)
    quant: str | tuple[str, ...] = "none"
    # slices a training batch is computed in (gradient accumulation, one step per batch), or one
    # per client (a fleet's plan: a device whose one-step activations exceed its memory budget)
    micro_batches: int | tuple[int, ...] = 1
    graphs: bool = False  # a cohort's step captured as a CUDA graph (CohortStep)

    def quant_of(self, client: int) -> str:
        """The precision of client ``client``'s frozen base."""
        return self.quant if isinstance(self.quant, str) else self.quant[client]

    def micro_batches_of(self, client: int) -> int:
        """How many slices client ``client`` computes each training batch in."""
        return self.micro_batches if isinstance(self.micro_batches, int) else self.micro_batches[client]

    @property
    def base_quant(self) -> str:
        """The precision the run's shared base is loaded at: the one every client has, or full
        precision when they differ (each client's model then quantises a copy: engines/inprocess.py)."""
        kinds = {self.quant} if isinstance(self.quant, str) else set(self.quant)
        return kinds.pop() if len(kinds) == 1 else "none"

    @property
    def dtype(self) -> torch.dtype:
        """The compute dtype of forward passes and the storage dtype of frozen base weights."""
        return PRECISIONS[self.precision]

    def autocast(self):
        """The run's autocast, *without* its cast cache. torch's autocast keeps the low-precision copy
        of every fp32 leaf tensor that requires grad (exactly the trainable weights) until the
        outermost autocast block exits, and an optimiser step updates the weight in place, so under
        a cached autocast that spans a client's round every later forward of a weight used
        directly (``F.linear(x, weight)``: CoMiGS's routers, FedALT's mixer, a one-shot device's
        whole model) would reuse the copy made at the round's start (tests/test_precision.py).
        Frozen weights are never cached (they do not require grad), so turning the cache off costs
        one cast of each trainable tensor per use, the cost of training it at all."""
        if self.precision == "fp32":
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.dtype, cache_enabled=False)

    def grad_scaler(self) -> "torch.amp.GradScaler | None":
        """A dynamic loss scale for fp16 (None otherwise)."""
        return torch.amp.GradScaler(self.device.type) if self.precision == "fp16" else None

    def prepare_base(self, model: torch.nn.Module) -> torch.nn.Module:
        """Move the frozen base model to the device, in the compute dtype (``quant`` is applied by
        models/quant.py ``on_device``, which calls this first)."""
        return model.to(device=self.device, dtype=self.dtype)


def resolve(device: str = "auto", precision: str = "fp32", compile: bool | None = None,
            quant: str | list[str] | tuple[str, ...] = "none",
            micro_batches: int | list[int] | tuple[int, ...] = 1, graphs: bool | None = None) -> Runtime:
    """A Runtime from the config's strings, with a one-line error naming the bad value."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        dev = torch.device(device)
    except RuntimeError:
        raise ValueError(f"device must be auto, cpu, cuda or cuda:N, got {device!r}") from None
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"device must be auto, cpu, cuda or cuda:N, got {device!r}")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device {device!r}: no CUDA device is available here (use device=cpu or auto)")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ValueError(f"device {device!r}: only {torch.cuda.device_count()} CUDA device(s) here")
    if graphs and dev.type != "cuda":
        raise ValueError(f"graphs=true captures CUDA graphs: it needs a CUDA device, not {device!r}")
    if precision == "fp16" and dev.type != "cuda":
        raise ValueError("precision fp16 needs a CUDA device (on the CPU use bf16 or fp32)")
    for q in [quant] if isinstance(quant, str) else quant:
        if q not in QUANTS:
            raise ValueError(f"quant must be one of {', '.join(QUANTS)} (or one per client), got {q!r}")
    quant = quant if isinstance(quant, str) else tuple(quant)
    for m in [micro_batches] if isinstance(micro_batches, int) else micro_batches:
        if not isinstance(m, int) or isinstance(m, bool) or m < 1:
            raise ValueError(f"micro_batches must be a whole number >= 1 (or one per client), got {m!r}")
    micro_batches = micro_batches if isinstance(micro_batches, int) else tuple(micro_batches)
    on_cuda = dev.type == "cuda"
    return Runtime(dev, precision, on_cuda if compile is None else bool(compile), quant, micro_batches,
                   on_cuda if graphs is None else bool(graphs))


def to_cpu(obj):
    """``obj`` (tensors in dicts / lists, e.g. an optimizer's state_dict) with every tensor on the
    CPU: what stays with a client between turns never holds device memory."""
    if isinstance(obj, torch.Tensor):
        return obj.to("cpu")
    if isinstance(obj, dict):
        return {k: to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_cpu(v) for v in obj)
    return obj


def at_least_fp32(t: torch.Tensor) -> torch.Tensor:
    """``t`` in fp32 where its dtype is narrower (bf16, fp16, an integer count), else unchanged:
    losses, balances and optimiser masters are computed in fp32 under mixed precision
    (Micikevicius et al. 2018, Sec. 3), and an fp64 model keeps fp64 throughout, which the
    executors' exact-arithmetic tests use (tests/test_cohort.py: fp32's last bits differ between
    CPUs' kernels, and Adam's m / sqrt(v) enlarges them)."""
    return t if t.dtype == torch.float64 else t.float()


def offload(module: torch.nn.Module) -> torch.nn.Module:
    """``module`` moved to the CPU: what a server keeps between uses (DeepFusion's K distilled
    students wait there while the next one trains on the device)."""
    return module.to("cpu")
