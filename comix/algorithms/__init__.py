"""One module per method; ``make_algorithm(name, lora, train, n_clients, **options)`` builds one.

``options`` are the method's config section (``comigs``, ``pcl``, ``fdlora`` (fdlora-comigs),
``fdlora_fedamole``, ``hetlora``, ``flexlora``, ...); a variant's fixed settings (e.g. CoMiGS-2S: two experts, no generalist) win over
them, except that ``comigs-1gxs`` takes its per-user expert counts from ``comigs.experts``.
"""
from __future__ import annotations

import inspect

from ..models import LoRAConfig
from .base import Algorithm, ClientContext, ClientState
from .training import TrainConfig, average, expert_lr, tensor_bytes
from .centralized import Centralized
from .comigs import CoMiGS
from .central_moe import CentralMoE
from .deepfusion import DeepFusion
from .deepfusion_ce import CEOnly
from .fedkmt import FedKMT
from .ofa_kd import OFAKD
from .fdlora import FDLoRA
from .fdlora_fedamole import FDLoRAFedAMoLE
from .fedamole import FedAMoLE
from .fedalt import FedALT
from .fedavg import FedAvg, FedIT, FedITFT
from .feddpa import FedDPA
from .fedlease import FedLEASE
from .fedjets import FedJETS
from .fedsa_lora import FedSALoRA
from .ffa_lora import FFALoRA
from .flexlora import FlexLoRA
from .flora import FLoRA
from .hetlora import HetLoRA
from .local import Local
from .moe_baselines import FedAvgMoE, FedAvgMoETr, LocalMoE, LocalMoETr
from .pcl import PCL
from .pfedmoe import PFedMoE
from .pretrained import Pretrained
from .prompts import FedPrompt, FedPromptFT, FedPTuning, FedPTuningFT

COMIGS_VARIANTS = {
    "comigs-1g1s": dict(experts=2, generalists=1),
    "comigs-2g": dict(experts=2, generalists=2),
    "comigs-2s": dict(experts=2, generalists=0),
    "comigs-1gxs": dict(generalists=1),              # experts: per-user list from comigs.experts
    "comigs-1g1s-tr": dict(experts=2, generalists=1, router_update="train"),
    "comigs-tr": dict(experts=2, generalists=1, router_update="train"),  # Table 5's name
}
FEDAMOLE_VARIANTS = {  # Table III's ablations: the journal's names, then the arXiv version's (Table 3)
    "fedamole-random": dict(assignment="random"),                          # "FedAMoLE (random)"
    "fedamole-vanilla": dict(router="vanilla"),                            # "FedAMoLE (vanilla router)"
    "fedamole-vanilla-random": dict(router="vanilla", assignment="random"),  # "(vanilla router, random)"
    "fedamole-r": dict(assignment="random"),                               # arXiv: = FedAMoLE (random)
    # arXiv Sec. 5.5: "replaces the AMoLE module with a vanilla MoLE" and nothing else, so RSEA
    # stays; the journal's "FedAMoLE (vanilla router)", the same 86.90 in both papers' tables
    "fedamole-a": dict(router="vanilla"),
    "fedmole": dict(assignment="fixed"),                                   # arXiv: round 1's assignment kept
    "fedamole-s": dict(shared=False),                                      # arXiv: no shared expert
    "fedamole-h": dict(homogeneous=True),  # in neither table: the authors' --homo_arch (optimize.py)
}
CLASSES = (Pretrained, Local, FedAvg, Centralized, FFALoRA, FedSALoRA, PCL, FDLoRA, FDLoRAFedAMoLE, HetLoRA, FlexLoRA,
           PFedMoE, LocalMoE, FedAvgMoE, LocalMoETr, FedAvgMoETr, FedAMoLE, FedIT, FedITFT, FedPrompt,
           FedPromptFT, FedPTuning, FedPTuningFT, DeepFusion, CEOnly, FedKMT, OFAKD,
           CentralMoE, FedJETS, FLoRA, FedALT, FedDPA, FedLEASE)
REGISTRY: dict[str, tuple[type[Algorithm], dict]] = {
    **{cls.name: (cls, getattr(cls, "variant", {})) for cls in CLASSES},
    **{name: (CoMiGS, kw) for name, kw in COMIGS_VARIANTS.items()},
    **{name: (FedAMoLE, kw) for name, kw in FEDAMOLE_VARIANTS.items()},
    "feddpa-f": (FedDPA, dict(iterative=False)),  # the paper's sequential variant (feddpa.py)
}
METHODS = tuple(REGISTRY)


def section_of(name: str) -> str | None:
    """The config section holding ``name``'s options (None: it has none)."""
    if name not in REGISTRY:
        raise ValueError(f"unknown method {name!r}: choose from {', '.join(METHODS)}")
    return REGISTRY[name][0].section


def make_algorithm(name: str, lora: LoRAConfig, train: TrainConfig, n_clients: int, **options) -> Algorithm:
    section_of(name)
    cls, fixed = REGISTRY[name]
    accepted = inspect.signature(cls.__init__).parameters
    kw = {k: v for k, v in options.items() if k in accepted}
    unknown = set(options) - set(kw)
    if unknown:
        raise ValueError(f"method {name!r} has no option(s) {', '.join(sorted(unknown))}")
    algo = cls(lora, train, n_clients, **{**kw, **fixed})
    algo.name = name
    return algo


__all__ = ["Algorithm", "ClientContext", "ClientState", "TrainConfig", "average", "expert_lr",
           "tensor_bytes", "make_algorithm", "section_of", "METHODS", "REGISTRY", *(c.__name__ for c in CLASSES),
           "CoMiGS"]
