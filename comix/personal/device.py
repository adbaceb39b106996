"""A user's personalised model as an ExecuTorch program: the model a phone runs.

The whole model — the frozen base, the user's adapters, a mixture's experts and its routers, an
AMoLE's token projection — is one graph: ``torch.export`` traces it with a static KV cache
(transformers' ``TorchExportableModuleWithStaticCache``, the recipe optimum-executorch exports
decoder-only LMs with) and ExecuTorch lowers it to its XNNPACK backend (the CPU delegate of
Android, iOS and Linux builds). The program takes ``(input_ids (1, n), cache_position (n,))`` and
returns the logits of those n tokens: a prompt is prefilled in one call from position 0, then one
token a call; calling it again from position 0 starts a new text (the cache's earlier rows are not
read: attention is masked by position).

Precisions:
  * ``fp32``: the weights as comix holds them (logits equal comix's to float rounding);
  * ``int8``: ExecuTorch's XNNPACK quantiser (PT2E): every linear's weight int8 per output channel,
    its input int8 per call (dynamic), the recipe of the ExecuTorch XNNPACK docs. The embedding
    table stays fp32 (the quantiser has no embedding pattern).
"""
from __future__ import annotations

import contextlib
import importlib.util
import os
import sys
import tempfile
from pathlib import Path

import torch
from torch import nn

PTE = "model.pte"
PRECISIONS = ("fp32", "int8")
INSTALL = 'pip install -e ".[device]"'


def executorch_missing() -> str | None:
    """One line when ExecuTorch is not installed (checked before any work)."""
    if importlib.util.find_spec("executorch") is None:
        return f"--format executorch needs ExecuTorch: {INSTALL}"
    return None


def default_max_len(model_config) -> int:
    """The static cache's length: the model's context, at most 512 tokens (a phone's prompt plus
    its answer; 30 layers x 512 positions of SmolLM2-135M's cache is 24 MB in fp32)."""
    return min(int(getattr(model_config, "max_position_embeddings", 512)), 512)


def _exportable(model: nn.Module, max_len: int) -> nn.Module:
    from transformers.integrations.executorch import TorchExportableModuleWithStaticCache

    for module in model.modules():  # layers whose structure lives in a tensor (FedLEASE's (M, g))
        if hasattr(module, "fix_structure"):
            module.fix_structure()
    for p in model.parameters():
        p.requires_grad_(False)
    model.eval()
    model.generation_config.use_cache = True
    model.generation_config.cache_implementation = "static"
    return TorchExportableModuleWithStaticCache(model, batch_size=1, max_cache_len=max_len).eval()


def _export(module, max_len: int, example: dict | None = None):
    """``torch.export`` of the program's signature, 1 to ``max_len - 1`` tokens a call."""
    from torch.export import Dim, export
    n = Dim("tokens", min=1, max=max_len - 1)
    example = example or {"input_ids": torch.zeros(1, 4, dtype=torch.long), "cache_position": torch.arange(4)}
    # strict (dynamo) tracing: the non-strict trace of the static cache's in-place writes lowers to
    # a graph torch 2.13's decompositions reject ("expected compiled_fn to be GraphModule")
    return export(module, (), example, dynamic_shapes={"input_ids": {1: n}, "cache_position": {0: n}},
                  strict=True), example


def _quantise(program, example, max_len: int):
    """ExecuTorch's XNNPACK quantiser on the exported graph, re-exported for lowering."""
    from executorch.backends.xnnpack.quantizer.xnnpack_quantizer import (XNNPACKQuantizer,
                                                                         get_symmetric_quantization_config)
    from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e
    quantizer = XNNPACKQuantizer().set_global(get_symmetric_quantization_config(is_per_channel=True, is_dynamic=True))
    graph = prepare_pt2e(program.module(), quantizer)
    graph(**example)  # dynamic activations: no calibration statistics, one call initialises the observers
    return _export(convert_pt2e(graph), max_len, example)[0]


def _lower(program, per_op: bool, quantised: bool = False):
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import (XnnpackDynamicallyQuantizedPartitioner,
                                                                           XnnpackPartitioner)
    from executorch.exir import to_edge_transform_and_lower
    # a quantised graph: its dynamically quantised linears first, one delegate each, then the rest
    # whole (the partitioners of ExecuTorch's LLM export, examples/models/llama/export_llama_lib.py)
    partitioners = [XnnpackDynamicallyQuantizedPartitioner()] if quantised and not per_op else []
    partitioners.append(XnnpackPartitioner(per_op_mode=per_op))
    return to_edge_transform_and_lower(program, partitioner=partitioners).to_executorch()


def write_pte(model: nn.Module, path: Path, precision: str = "fp32", max_len: int = 512) -> dict:
    """``model`` as an ExecuTorch program at ``path``; returns what the manifest records."""
    import warnings
    with warnings.catch_warnings():
        # what tracing says of comix's layers keeping their last routing for the balance loss, and
        # that the KV cache is a mutated buffer (ExecuTorch stores its shape only: what a cache needs)
        warnings.filterwarnings("ignore", message="While compiling, we found certain side effects")
        warnings.filterwarnings("ignore", message="Mutation on a buffer")
        warnings.filterwarnings("ignore", category=FutureWarning)
        program, example = _export(_exportable(model, max_len), max_len)
        quantised = precision == "int8"
        if quantised:
            program = _quantise(program, example, max_len)
        # XNNPACK takes the graph whole where its partitioner can; executorch 1.5.1's partitioner fails
        # on some graphs (a PT2E-quantised one given to it alone: "found dependency cycles"; FedALT's
        # mixer: "pass through arguments"), where one delegate call per operator is what it can lower
        # (and slowly: each partition recompiles the graph, so a 30-layer model takes the better part
        # of an hour)
        try:
            lowered, mode = _lower(program, per_op=False, quantised=quantised), "whole-graph"
        except (RuntimeError, AssertionError):
            lowered, mode = _lower(program, per_op=True), "per-op"
    path.write_bytes(lowered.buffer)
    return {"pte": path.name, "precision": precision, "max_len": max_len, "xnnpack": mode,
            "bytes": path.stat().st_size}


@contextlib.contextmanager
def _quiet_stderr():
    """ExecuTorch's C++ runtime logs what it reads of the CPU to the process's stderr when a program
    loads; kept back, and given out only if the load fails."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as held:
        os.dup2(held.fileno(), 2)
        try:
            yield
        except BaseException:
            os.dup2(saved, 2)
            held.seek(0)
            sys.stderr.write(held.read().decode(errors="replace"))
            raise
        finally:
            os.dup2(saved, 2)
            os.close(saved)


class PteModel:
    """An ExecuTorch program written by ``write_pte``, run by ExecuTorch's Python runtime."""

    def __init__(self, path: str | Path, max_len: int):
        from executorch.runtime import Runtime
        self.path, self.max_len = Path(path), max_len
        with _quiet_stderr():
            self.method = Runtime.get().load_program(str(path)).load_method("forward")

    def logits(self, ids: torch.Tensor) -> torch.Tensor:
        """(1, n, vocab) logits of the token ids ``ids`` (n,) as one text from position 0."""
        ids = ids.reshape(1, -1).long()
        if ids.shape[1] >= self.max_len:
            raise ValueError(f"{ids.shape[1]} tokens: the program's cache holds {self.max_len - 1} ({self.path})")
        return self.method.execute([ids, torch.arange(ids.shape[1])])[0]

    def generate(self, ids: torch.Tensor, max_new_tokens: int, eos: int | None = None) -> list[int]:
        """Greedy continuation of ``ids`` (n,): the prompt prefilled in one call, then a token a call."""
        ids = ids.reshape(-1).long()
        last = self.logits(ids)[0, -1]
        out: list[int] = []
        while len(out) < max_new_tokens:
            token = int(last.argmax())
            if token == eos:
                break
            out.append(token)
            pos = len(ids) + len(out) - 1  # where the new token sits in the cache
            if len(out) == max_new_tokens or pos >= self.max_len - 1:
                break
            last = self.method.execute([torch.tensor([[token]]), torch.tensor([pos])])[0][0, -1]
        return out
