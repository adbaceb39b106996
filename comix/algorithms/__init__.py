"""One module per method; ``make_algorithm(name, ...)`` builds one from its name."""
from __future__ import annotations

from ..models import LoRAConfig
from .base import Algorithm, ClientContext, ClientState, TrainConfig, average, one_cycle_lr, tensor_bytes
from .centralized import Centralized
from .comigs import CoMiGS
from .fedavg import FedAvg
from .local import Local
from .pretrained import Pretrained

COMIGS_VARIANTS = {
    "comigs-1g1s": dict(experts=2, generalists=1),
    "comigs-2g": dict(experts=2, generalists=2),
    "comigs-2s": dict(experts=2, generalists=0),
    "comigs-1gxs": dict(generalists=1),             # experts: per-user list from the config
    "comigs-1g1s-tr": dict(experts=2, generalists=1, router_data="train"),
}
SIMPLE = {"pretrained": Pretrained, "local": Local, "fedavg": FedAvg, "centralized": Centralized}
METHODS = (*SIMPLE, *COMIGS_VARIANTS)


def make_algorithm(name: str, lora: LoRAConfig, train: TrainConfig, n_clients: int,
                   experts=None, top_k: int = 2) -> Algorithm:
    if name in SIMPLE:
        return SIMPLE[name](lora, train, n_clients)
    if name in COMIGS_VARIANTS:
        kw = dict(COMIGS_VARIANTS[name])
        if name == "comigs-1gxs":
            if experts is None:
                raise ValueError("comigs-1gxs needs comigs.experts, a list of expert counts per user")
            kw["experts"] = experts
        algo = CoMiGS(lora, train, n_clients, top_k=top_k, **kw)
        algo.name = name
        return algo
    raise ValueError(f"unknown method {name!r}: choose from {', '.join(METHODS)}")


__all__ = ["Algorithm", "ClientContext", "ClientState", "TrainConfig", "average", "one_cycle_lr",
           "tensor_bytes", "make_algorithm", "METHODS", "CoMiGS", "FedAvg", "Local", "Pretrained",
           "Centralized"]
