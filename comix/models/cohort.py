"""A cohort: one model whose adapters carry a leading *client* axis, so that C clients' local
steps run as one forward and backward over the one frozen base.

The batch of a cohort forward is the clients' batches concatenated in client order (client-major
rows: rows [c*B, (c+1)*B) are client c's). The frozen base's products run once over all C*B rows;
every adapter product is a batched matmul of client c's rows by client c's own factors
(``client_linear``), so a client's rows never meet another client's adapter and, since each
client's loss depends only on its own rows, the gradient of the sum of the clients' losses with
respect to client c's factors is exactly client c's own gradient. This is mLoRA's BatchLoRA
(TUDB-Labs/mLoRA, several adapter jobs over one frozen base) applied to the clients of one
federated round, with torch.func's model-ensembling idea of stacked parameters
(``stack_module_state``), written with plain ``bmm`` so that autograd, autocast and the
optimiser see ordinary tensors.

Only adapters made of ``LoRAWeights``, the linear routers of ``MixtureOfLoRA`` and FedAMoLE's
AMoLE layers (``AMoLELinear.stack``: slots, token projection or router, each client's slot ids)
are stacked; the layers read the client axis from their weights' shape (``LoRAWeights.delta``,
``MixtureOfLoRAMLP._fused``, ``MixtureOfLoRA.route``, ``AMoLELinear.route``), so a model with
2-D weights computes exactly as before.
"""
from __future__ import annotations

import copy

import torch
from torch import nn

from .lora import LoRAWeights, client_linear  # noqa: F401 (client_linear: the cohort's product)


def clients_of(model: nn.Module) -> int:
    """How many clients the model's adapters are stacked for (1: an ordinary model)."""
    return getattr(model, "comix_cohort", 1)


def stack_clients(model: nn.Module, clients: int) -> nn.Module:
    """A copy of ``model`` (its frozen base shared, not copied) whose every LoRA factor and
    mixture router has a leading axis of ``clients``; parameter names are unchanged, so client
    c's adapters are ``{name: param[c]}`` (``unstack``) and a cohort loads its clients' states
    by name (``load_stacked``)."""
    from .amole import AMoLELinear
    from .mixture import MixtureOfLoRA

    from .quant import shared_objects

    adapters = {id(p) for m in model.modules() if isinstance(m, LoRAWeights) for p in m.parameters()}
    adapters |= {id(m.router.weight) for m in model.modules() if isinstance(m, MixtureOfLoRA) and m.router is not None}
    # the frozen base's tensors (and quantised storage objects) are the copy's own: memory once
    shared = {id(t): t for t in (*model.parameters(), *model.buffers(), *shared_objects(model)) if id(t) not in adapters}
    for m in model.modules():  # the last forward's routing (graph tensors, which deepcopy refuses) stays behind
        if isinstance(m, MixtureOfLoRA):
            shared[id(m.last_routing)] = None
    stacked = copy.deepcopy(model, memo=shared)
    with torch.no_grad():
        for m in stacked.modules():
            if isinstance(m, LoRAWeights):
                for name in ("lora_A", "lora_B"):
                    p = getattr(m, name)
                    setattr(m, name, nn.Parameter(p.detach().unsqueeze(0).repeat(clients, 1, 1)))
            elif isinstance(m, AMoLELinear):  # its slots, token projection or router, and slot ids
                m.stack(clients)
            elif isinstance(m, MixtureOfLoRA) and m.router is not None:
                w = m.router.weight
                m.router.weight = nn.Parameter(w.detach().unsqueeze(0).repeat(clients, 1, 1))
    stacked.comix_cohort = clients
    return stacked


def load_stacked(model: nn.Module, adapters: list[dict[str, torch.Tensor]]) -> None:
    """Client c's adapters (``adapters[c]``, by name) into slot c of each stacked parameter."""
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name in adapters[0]:
            params[name].copy_(torch.stack([a[name] for a in adapters]))


def unstack(model: nn.Module, names) -> list[dict[str, torch.Tensor]]:
    """Each client's adapters (CPU copies) from the stacked parameters ``names``."""
    params = dict(model.named_parameters())
    cpu = {n: params[n].detach().to("cpu", copy=True) for n in names}
    return [{n: t[c].clone() for n, t in cpu.items()} for c in range(clients_of(model))]
