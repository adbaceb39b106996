"""What the engine hands an algorithm: a client its turn's context, the server its own."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..data import UserData
from ..runtime import Runtime
from .training import TrainConfig


@dataclass
class ClientContext:
    """What the engine hands a client for its turn: the model with this client's architecture
    (frozen base shared by all clients, on the run's device), its private data, the run's
    training config and where/in which precision it computes (``Runtime``)."""
    client: int
    model: nn.Module
    data: UserData | list[UserData]
    train: TrainConfig
    runtime: Runtime = field(default_factory=Runtime)
    # what the turn's steps measure besides the training loss, one value a step by name (CoMiGS's
    # router steps: the validation CE each reads before it steps); the round's metrics carry each
    # name's mean (``turn_metrics``)
    log: dict[str, list[torch.Tensor]] = field(default_factory=dict)


def turn_metrics(ctx: ClientContext) -> dict[str, float]:
    """The round's mean of each measurement its steps logged in ``ctx.log`` (one device sync)."""
    return {k: float(torch.stack(v).float().mean()) for k, v in ctx.log.items() if v}


@dataclass
class ServerContext:
    """What an algorithm's server may use besides the uploads, handed to every algorithm before a
    run (``Algorithm.server``): the run's base model (on the run's device), the server's own
    data (``data.splits.ServerData``: public and test streams; None unless the config asks for
    it), the runtime, the method's output folder and the seed. Most methods ignore it; DeepFusion
    distils into copies of the base on the public data and scores its global model on the test."""
    base: nn.Module | None
    data: Any = None
    runtime: Runtime = field(default_factory=Runtime)
    out_dir: Any = None
    seed: int = 0
