"""What one client's training step holds in memory, measured where it runs: ``StepPeak`` counts
every storage a step's operators allocate from creation to free (a ``TorchDispatchMode``: the CPU
allocator keeps no statistics), ``Footprint`` measures a round's first step with it (once per model
and batch shape) and counts the round's training tokens. engines/device.py reports both per round
and the fleet planner (``training_memory``) needs them before any round."""
from __future__ import annotations

import weakref

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from ..models.executorch_training import STEP_WATCHERS


def _storage(t) -> tuple[torch.UntypedStorage | None, int]:
    """A tensor's storage and its address; (None, 0) for anything else, a meta tensor or a tensor
    without storage of its own (sparse, wrapped)."""
    if not isinstance(t, torch.Tensor) or t.device.type == "meta":
        return None, 0
    try:
        storage = t.untyped_storage()
    except (RuntimeError, NotImplementedError):
        return None, 0
    return storage, storage.data_ptr()


class StepPeak(TorchDispatchMode):
    """The most bytes the tensors created under it hold at once: every operator's newly allocated
    outputs (the forward's activations, the backward's transient gradients, the optimiser step's
    moments), each storage counted from its creation until it is freed. An output that shares an
    input's storage (a view, an in-place op) allocates nothing: the parameters, the data and
    whatever existed before are never counted. What torch's allocator would report as the step's
    peak on CUDA, measured the same way on every device (the CPU allocator keeps no stats)."""

    def __init__(self):
        super().__init__()
        self.live, self.now, self.peak = {}, 0, 0

    def _freed(self, ptr: int) -> None:
        self.now -= self.live.pop(ptr, (0, None))[0]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {_storage(t)[1] for t in _tensors((*args, *(kwargs or {}).values()))}
        for t in _tensors(out if isinstance(out, (list, tuple)) else (out,)):
            storage, ptr = _storage(t)
            if ptr and ptr not in self.live and ptr not in inputs:
                # a weak reference whose callback runs when the storage is freed (kept in ``live``)
                self.live[ptr] = (storage.nbytes(), weakref.ref(storage, lambda _, p=ptr: self._freed(p)))
                self.now += storage.nbytes()
                self.peak = max(self.peak, self.now)
        return out


def _tensors(xs):
    """The tensors among ``xs`` and in its lists and tuples (an operator's arguments or outputs), without
    pytree's generality: this runs on every operator of a measured step."""
    for x in xs:
        if isinstance(x, torch.Tensor):
            yield x
        elif isinstance(x, (list, tuple)):
            yield from (y for y in x if isinstance(y, torch.Tensor))


# each model's measured step peaks by batch shape (Footprint), forgotten with the model
_STEP_PEAKS: "weakref.WeakKeyDictionary[nn.Module, dict]" = weakref.WeakKeyDictionary()


class Footprint:
    """What one client's round spends, measured on the device (both engines run ``Device.train``):
    ``tokens`` fed to its training forwards (padding included) and ``peak``, the most bytes its first
    training step's tensors hold at once (``StepPeak``, from that step's forward until the next
    training forward): the activations kept for the backward pass and the backward's transients
    (the logits' gradients are as large as the logits), which grow with the batch. Counting only
    what the forward saves for the backward missed those transients: 18-26 % of a SmolLM2 step's
    memory. The step's gradients are in it, also counted in ``trainable_mb`` (4 bytes a trainable
    parameter too many, against the activations' hundreds of MB). A step is measured once per model
    and batch shape (``_STEP_PEAKS``; a step of the same shapes allocates the same, up to how a
    mixture routes its tokens): measuring costs Python work on every operator of that step."""

    def __init__(self, model: nn.Module):
        self.model, self.tokens, self.peak = model, 0, 0
        self.mode, self.measured, self.handle, self.shape = None, False, None, None

    def forward(self, module, args, kwargs):
        if not module.training or torch.compiler.is_compiling() or torch.compiler.is_exporting():
            return  # (an export tracing the model: the ExecuTorch step's program, models/executorch_training.py)
        ids = kwargs.get("input_ids", args[0] if args else None)
        if isinstance(ids, torch.Tensor):
            self.tokens += ids.numel()
        if self.mode is not None:  # a second training forward: the first step is over
            self._stop()
        elif not self.measured:
            self.shape = tuple(ids.shape) if isinstance(ids, torch.Tensor) else None
            known = _STEP_PEAKS.setdefault(self.model, {})
            if self.shape in known:
                self.peak, self.measured = known[self.shape], True
            else:
                self.mode = StepPeak()
                self.mode.__enter__()

    def executorch_step(self, model: nn.Module, ids: torch.Tensor, program) -> None:
        """A step of this client's model run by ExecuTorch's training runtime
        (models/executorch_training.py): its tokens, and as its peak the memory the program's
        planner gives the step's non-constant tensors, what the runtime allocates for it."""
        if model is self.model:
            self.tokens += ids.numel()
            self.peak, self.measured = max(self.peak, program.planned_bytes), True

    def _stop(self):
        self.mode.__exit__(None, None, None)
        self.peak, self.mode, self.measured = self.mode.peak, None, True
        _STEP_PEAKS[self.model][self.shape] = self.peak

    def __enter__(self):
        self.handle = self.model.register_forward_pre_hook(self.forward, with_kwargs=True)
        STEP_WATCHERS.append(self.executorch_step)
        return self

    def __exit__(self, *exc):
        if self.mode is not None:
            self._stop()
        self.handle.remove()
        STEP_WATCHERS.remove(self.executorch_step)
