"""A model's training step run by ExecuTorch's training runtime, the program a phone would run.

ExecuTorch 1.5 trains through a joint forward-backward program (executorch/extension/training,
its XOR and CIFAR examples): the model with its loss as the first output is exported
(``torch.export``), ``torch.export.experimental._export_forward_backward`` adds the backward graph
for the parameters that require a gradient, and the runtime's ``TrainingModule.forward_backward``
returns the loss and fills ``named_gradients``. Here the model is a frozen base with comix's
adapters (models/inject.py) and the loss is the one a local step minimises: the mean next-token
cross-entropy over the targets not -100 (``algorithms.training.lm_loss``) plus the method's term of
the same forward (``extra``: CoMiGS's load balance over the routing of that forward, eq. 7-8).

Every trainable tensor of the model is a parameter of the one program (a mixture's experts *and*
its routers): CoMiGS alternates expert steps and router steps over the same forward, each step
reading the gradients of its own tensors only, so one program serves both, and the gradient the
runtime also computes for the other set is dropped, not applied. Before each forward-backward the
program takes every trainable tensor's current value (``load_from``): a router step changes what
the next expert step's forward computes, and a program that kept a stale router would train the
experts behind a router the device no longer has.

What the runtime does not have is AdamW: its only optimiser is SGD (``get_sgd_optimizer``). So the
step's update is PyTorch's AdamW over the gradients the program returns (the caller's
``apply_step``), and the new adapter values are copied into the program before its next
forward-backward (``load``: the program's parameters are views of its own memory, so an in-place
copy reaches it).

One lowering fix: the exported backward of the MLP allocates autograd buffers with
``aten.empty_permuted`` at the identity permutation, which the edge dialect (core ATen) lacks;
``_plain_empty`` rewrites those to ``aten.empty``, the same allocation.
"""
from __future__ import annotations

import tempfile
import weakref
from pathlib import Path
from typing import Callable

import torch
from torch import nn


class _WithLoss(nn.Module):
    """The model with its training loss as the first output (the runtime trains on it) and the
    cross-entropy alone as the second (what a step reports, as ``train_step`` does)."""

    def __init__(self, model: nn.Module, extra: Callable[[], torch.Tensor] | None):
        super().__init__()
        self.model, self.extra = model, extra

    def forward(self, x: torch.Tensor, y: torch.Tensor):
        logits = self.model(input_ids=x, use_cache=False).logits[:, -x.shape[1]:]
        ce = nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1))
        return (ce + self.extra() if self.extra is not None else ce), ce.detach()


def _plain_empty(program) -> None:
    """``aten.empty_permuted`` at the identity permutation as ``aten.empty`` (the module's docstring)."""
    for node in program.graph.nodes:
        if node.target is torch.ops.aten.empty_permuted.default:
            size, perm = node.args[:2]
            if list(perm) != list(range(len(perm))):
                raise NotImplementedError(f"aten.empty_permuted with permutation {list(perm)} has no edge-dialect form here")
            node.target, node.args = torch.ops.aten.empty.memory_format, (size,)
    program.graph.lint()
    program.graph_module.recompile()


class ExecuTorchTraining:
    """``model``'s training step (forward and backward of ``lm_loss`` plus ``extra()``, a term of the
    same forward) as an ExecuTorch training program, for batches shaped as ``x`` (token ids) and
    ``y`` (targets). The trained tensors are the model's parameters that require a gradient, by
    their names in ``model``, held in the program's external weights (``weights``, a .ptd's bytes);
    everything else (the frozen base) is baked into the program (``buffer``, the .pte) as constants. Eager attention: the exported backward of SDPA is not one the portable kernels run
    here. The mixture's eager slot function (``compiled`` off while exporting): the compiled one is
    the same function (models/mixture.py), and export traces Python, not a compiled graph."""

    def __init__(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor,
                 extra: Callable[[], torch.Tensor] | None = None):
        from executorch.extension.pybindings.portable_lib import _load_for_executorch_from_buffer
        from executorch.extension.training.pybindings._training_module import TrainingModule
        self.names = [n for n, p in model.named_parameters() if p.requires_grad]
        if not self.names:
            raise ValueError("the model has no parameter to train (none requires a gradient)")
        manager = lower(model, x, y, extra)
        self.buffer = manager.buffer
        with tempfile.TemporaryDirectory() as folder:
            manager.write_tensor_data_to_file(folder)
            files = list(Path(folder).glob("*.ptd"))
            if len(files) != 1:
                raise RuntimeError(f"the training program's export wrote {len(files)} weight files, not one .ptd")
            self.weights = files[0].read_bytes()  # held here: the runtime reads its tensors from this buffer
        # the memory ExecuTorch's planner gives the step's non-constant tensors (activations kept
        # for the backward, its transients, the gradients): what the runtime allocates for a step,
        # the measure a device's ``activation_mb`` takes on this path (engines/footprint.py)
        self.planned_bytes = sum(sum(plan.non_const_buffer_sizes) for plan in manager.executorch_program.execution_plan
                                 if plan.name == "forward")
        # the training module's own loader takes no data file: the portable runtime's does, and
        # TrainingModule wraps any loaded module (executorch/extension/training/pybindings/_training_module.py)
        self.module = TrainingModule(_load_for_executorch_from_buffer(self.buffer, self.weights))
        self.module.forward_backward("forward", (x, y))  # the runtime lists its parameters only after one
        self.params = {n.removeprefix("model."): t for n, t in self.module.named_parameters().items()}
        missing = set(self.names) - set(self.params)
        if missing:
            raise RuntimeError(f"the training program lacks trained tensors {sorted(missing)[:3]}")

    @torch.no_grad()
    def load(self, named: list[tuple[str, torch.Tensor]]) -> None:
        """The program's trained tensors named in ``named`` set to its values."""
        for n, p in named:
            self.params[n].copy_(p.detach().to(self.params[n].dtype))

    def load_from(self, model: nn.Module) -> None:
        """Every trained tensor of the program set to ``model``'s current value (the module's
        docstring: the tensors one step does not train are read by its forward all the same)."""
        own = dict(model.named_parameters())
        self.load([(n, own[n]) for n in self.names])

    def forward_backward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """(the batch's cross-entropy, each trained tensor's gradient of the whole loss by name),
        both computed by the runtime; copies (the program reuses its buffers on the next call)."""
        _, ce = self.module.forward_backward("forward", (x, y))
        grads = {n.removeprefix("model."): g.clone() for n, g in self.module.named_gradients().items()}
        return ce.clone(), grads


def lower(model: nn.Module, x: torch.Tensor, y: torch.Tensor, extra: Callable[[], torch.Tensor] | None = None):
    """``model``'s step (CE + ``extra``) as an ExecuTorch program manager: exported, its backward
    joined (``_export_forward_backward``), lowered to the edge dialect and to ExecuTorch, the
    trained tensors as external mutable weights (``ExecuTorchTraining``'s docstring says why each)."""
    from executorch.exir import ExecutorchBackendConfig, to_edge
    from torch.export.experimental import _export_forward_backward
    attention = model.config._attn_implementation
    model.config._attn_implementation = "eager"
    compiled = [m for m in model.modules() if getattr(m, "compiled", False)]
    for m in compiled:
        m.compiled = False
    try:
        program = _export_forward_backward(torch.export.export(_WithLoss(model, extra), (x, y), strict=False))
    finally:
        model.config._attn_implementation = attention
        for m in compiled:
            m.compiled = True
    _plain_empty(program)
    # the trained tensors as the program's external mutable weights (a .ptd file beside the .pte,
    # executorch/exir/capture/_config.py ``external_mutable_weights``): the program a device keeps
    # for its architecture, and the small file of adapters a round rewrites
    return to_edge(program).to_executorch(config=ExecutorchBackendConfig(external_mutable_weights=True))


_PROGRAMS: dict[tuple, ExecuTorchTraining] = {}

# Who watches the steps a program runs for a model (engines/footprint.py's Footprint: a step in the
# runtime calls no PyTorch forward, so the hook that counts a PyTorch step's tokens never fires)
STEP_WATCHERS: list[Callable[[nn.Module, torch.Tensor, ExecuTorchTraining], None]] = []


def watch_step(model: nn.Module, x: torch.Tensor, program: ExecuTorchTraining) -> None:
    """Tell every watcher that ``program`` ran a step of ``model`` on the token ids ``x``."""
    for watch in STEP_WATCHERS:
        watch(model, x, program)


def program_for(model: nn.Module, x: torch.Tensor, y: torch.Tensor, extra: Callable[[], torch.Tensor] | None = None,
                extra_key: tuple = ()) -> ExecuTorchTraining:
    """The training program of ``model``'s architecture for batches of ``x``'s shape, exported once
    per run: keyed by the frozen base's tensors themselves (every client model of a run shares
    them: engines/inprocess.py copies the base with its tensors as they are), the trained tensors'
    names and shapes, the batch shape and ``extra_key`` (what ``extra`` computes: its settings, as
    the load balance's weight and weighting); each step loads the client's own adapters into it."""
    base = next(t for t in model.parameters() if not t.requires_grad)
    key = (id(base), tuple((n, tuple(p.shape)) for n, p in model.named_parameters() if p.requires_grad),
           tuple(x.shape), tuple(y.shape), extra is not None, extra_key)
    program = _PROGRAMS.get(key)
    if program is None or program.base() is not base:  # (a freed base's id reused by another tensor)
        program = _PROGRAMS[key] = ExecuTorchTraining(model, x, y, extra)
        program.base = weakref.ref(base)
    return program
