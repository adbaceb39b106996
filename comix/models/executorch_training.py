"""A model's training step run by ExecuTorch's training runtime, the program a phone would run.

ExecuTorch 1.5 trains through a joint forward-backward program (executorch/extension/training,
its XOR and CIFAR examples): the model with its loss as the first output is exported
(``torch.export``), ``torch.export.experimental._export_forward_backward`` adds the backward graph
for the parameters that require a gradient, and the runtime's ``TrainingModule.forward_backward``
returns the loss and fills ``named_gradients``. Here the model is a frozen base with comix's
adapters (models/inject.py) and the loss is the one every local step minimises for plain LoRA
(``algorithms.training.lm_loss``: mean next-token cross-entropy over the targets not -100).

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

import weakref

import torch
from torch import nn


class _WithLoss(nn.Module):
    """The model with ``lm_loss`` as its output (the runtime trains on a program's first output)."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor, y: torch.Tensor):
        logits = self.model(input_ids=x, use_cache=False).logits[:, -x.shape[1]:]
        return (nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1)),)


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
    """``model``'s training step (forward and backward of ``lm_loss``) as an ExecuTorch training
    program, for batches shaped as ``x`` (token ids) and ``y`` (targets). The trained tensors are
    the model's parameters that require a gradient, by their names in ``model``; everything else
    (the frozen base) is baked into the program as constants. Eager attention: the exported
    backward of SDPA is not one the portable kernels run here."""

    def __init__(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor):
        from executorch.exir import ExecutorchBackendConfig, to_edge
        from executorch.extension.training import _load_for_executorch_for_training_from_buffer
        from torch.export.experimental import _export_forward_backward
        self.names = [n for n, p in model.named_parameters() if p.requires_grad]
        if not self.names:
            raise ValueError("the model has no parameter to train (none requires a gradient)")
        attention = model.config._attn_implementation
        model.config._attn_implementation = "eager"
        try:
            program = _export_forward_backward(torch.export.export(_WithLoss(model), (x, y), strict=False))
        finally:
            model.config._attn_implementation = attention
        _plain_empty(program)
        self.buffer = to_edge(program).to_executorch(config=ExecutorchBackendConfig()).buffer
        self.module = _load_for_executorch_for_training_from_buffer(self.buffer)
        self.module.forward_backward("forward", (x, y))  # the runtime lists its parameters only after one
        self.params = {n.removeprefix("model."): t for n, t in self.module.named_parameters().items()}
        missing = set(self.names) - set(self.params)
        if missing:
            raise RuntimeError(f"the training program lacks trained tensors {sorted(missing)[:3]}")

    @torch.no_grad()
    def load(self, named: list[tuple[str, torch.Tensor]]) -> None:
        """The program's trained tensors set to ``named``'s values (the adapters after a step)."""
        for n, p in named:
            self.params[n].copy_(p.detach().to(self.params[n].dtype))

    def forward_backward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """(the batch's loss, each trained tensor's gradient by name), both computed by the runtime;
        the gradients are copies (the program reuses its buffers on the next call)."""
        loss = self.module.forward_backward("forward", (x, y))[0]
        grads = {n.removeprefix("model."): g.clone() for n, g in self.module.named_gradients().items()}
        return loss.clone(), grads


_PROGRAMS: dict[tuple, ExecuTorchTraining] = {}


def program_for(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> ExecuTorchTraining:
    """The training program of ``model``'s architecture for batches of ``x``'s shape, exported once
    per run: keyed by the frozen base's tensors themselves (every client model of a run shares
    them: engines/inprocess.py copies the base with its tensors as they are), the trained tensors'
    names and shapes and the batch shape; each step loads the client's own adapters into it."""
    base = next(t for t in model.parameters() if not t.requires_grad)
    key = (id(base), tuple((n, tuple(p.shape)) for n, p in model.named_parameters() if p.requires_grad),
           tuple(x.shape), tuple(y.shape))
    program = _PROGRAMS.get(key)
    if program is None or program.base() is not base:  # (a freed base's id reused by another tensor)
        program = _PROGRAMS[key] = ExecuTorchTraining(model, x, y)
        program.base = weakref.ref(base)
    return program
