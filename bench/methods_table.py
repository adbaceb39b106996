"""docs/methods.md's table of every method, read from the algorithm classes (``bench/tables.py``
writes it between ``<!-- table: methods -->`` markers, so it cannot drift from the code).

Per method: what it is (its module's or class's first sentence), what leaves a client each round
and what stays (parameter roles from ``Algorithm.is_shared`` over the client's adapters), the
floats uploaded per round and the parameters a client trains, counted on SmolLM2-135M's
architecture built on torch's meta device (shapes only, no weights, nothing downloaded), and
where its default optimiser comes from, and whether its clients can train together in one step
(``train.cohort``; ``Algorithm.cohort_refusal`` says why not) and whether it takes a server optimiser
and a robust rule (``server.*``; ``Algorithm.server_refusal``). Counts are client 0's at the run defaults (lora r 8, each
method's own options) with 10 clients (FedAMoLE's setting); one-shot methods send their model once.
"""
from __future__ import annotations

import inspect
import re
import sys

MODEL = "smollm2-135m"
CLIENTS = 10
ROLE_WORDS = {"attention_lora": "attention LoRA", "mlp_lora": "MLP LoRA", "generalist": "generalist expert",
              "specialist": "specialist experts", "router": "router", "personal_lora": "personal LoRA",
              "fusion": "fusion weights", "mixer": "token mixer", "merged": "merged global update",
              "amole_shared": "shared expert", "amole_router": "token projection", "amole_slots": "expert slots",
              "domain_expert": "assigned experts", "embedding": "data embeddings", "prompt": "soft prompt",
              "lease_expert": "cluster experts", "lease_router": "adaptive router", "lease_state": "(M, g)"}


def _first_sentence(obj) -> str:
    doc = inspect.getdoc(obj) or ""
    text = " ".join(doc.split("\n\n")[0].split())
    # the first full stop that ends a sentence, not an abbreviation (et al., Sec., Fig., App., e.g.)
    m = re.match(r"(.+?(?<!\bal)(?<!\bSec)(?<!\bFig)(?<!\bApp)(?<!\bEq)(?<!e\.g)(?<!i\.e)[.:])(\s|$)", text)
    return (m.group(1) if m else text).rstrip(":.")


def _what(cls, variant: dict) -> str:
    own = cls.__dict__.get("__doc__")
    text = _first_sentence(cls) if own else _first_sentence(sys.modules[cls.__module__])
    if variant:
        text += "; " + ", ".join(f"{k}={v}" for k, v in variant.items())
    return text.replace("|", "/").replace("``", "`")


def _roles(names) -> str:
    from comix.models import param_role
    roles = sorted({param_role(n) for n in names}, key=list(ROLE_WORDS).index)
    return ", ".join(ROLE_WORDS[r] for r in roles) or "nothing"


def _tokenizer() -> str:
    """The folder of the base's tokenizer: in a fresh environment the first call builds comix's
    cache of the offline model (its GGUF's tokenizer converted once, as any run's first load)."""
    from comix.models.base import cache_dir, load_tokenizer
    load_tokenizer(MODEL)
    return str(cache_dir() / MODEL)


def row(name: str) -> str:
    import torch
    from transformers import AutoModelForCausalLM

    from comix.algorithms import REGISTRY, TrainConfig, make_algorithm
    from comix.config import RunConfig
    from comix.models import LoRAConfig, inject_adapters, param_role
    from comix.models.base import model_config
    cls, variant = REGISTRY[name]
    one_shot = cls.needs_server_data or name == "fedjets"
    train = TrainConfig(rounds=1) if one_shot else TrainConfig()
    algo = make_algorithm(name, LoRAConfig(), train, CLIENTS, **RunConfig().options(name))
    source = cls.train_defaults_source.split(" (")[0]
    if algo.device_spec(0) is not None or not algo.trains:
        sent = "nothing" if not algo.trains else "its own model, once (docs/deepfusion.md)"
        return f"| `{name}` | {_what(cls, variant)} | {sent} | - | - | - | {source} | {_cohort(algo)} |"
    config = model_config(MODEL)
    config.comix_tokenizer = _tokenizer()  # soft prompts count their TEXT init's tokens with it
    with torch.device("meta"):
        model = inject_adapters(AutoModelForCausalLM.from_config(config), algo.adapter_config(0))
    for module in model.modules():  # the state a method reads to pick what it trains (FedLEASE's
        for pn, p in list(module.named_parameters(recurse=False)):  # (M, g)) as real zeros, not meta
            if param_role(f"x.{pn}") == "lease_state":
                setattr(module, pn, torch.nn.Parameter(torch.zeros(p.shape), requires_grad=False))
    params = {n: p for n, p in model.named_parameters() if param_role(n) != "base"}
    adapters = algo.adapters_of(params)  # as a client's state names them (FedAMoLE: experts by global id)
    shared = [n for n in adapters if algo.is_shared(n)]
    stays = [n for n in adapters if n not in shared]
    up = sum(adapters[n].numel() for n in shared)
    # what the local optimiser updates (Algorithm.train_params: FedALT's frozen rest-of-world,
    # FFA-LoRA's frozen A and FedLEASE's other clusters' experts excluded) and routers' own steps
    from comix.algorithms.training import router_params
    names = {n for n, _ in algo.train_params(model)} | {n for n, _ in router_params(model)}
    trained = sum(p.numel() for n, p in params.items() if n in names)
    return (f"| `{name}` | {_what(cls, variant)} | {_roles(shared) if not algo.pooled else 'nothing'} | "
            f"{_roles(stays) if not algo.pooled else 'every adapter (one pooled model)'} | "
            f"{up if not algo.pooled else 0:,} | {trained:,} | {source} | {_cohort(algo)} | {_server(algo)} | {_client(algo)} |")


def _server(algo) -> str:
    """Whether the method takes a server optimiser and a robust rule (``server.*``), or why not."""
    from comix.aggregation import ServerConfig
    reason = algo.server_refusal(ServerConfig(optimizer="fedadam"))
    if reason is not None:
        return f"no: {reason}"
    krum = algo.server_refusal(ServerConfig(aggregate="krum"))
    return "yes" if krum is None else "yes, but not krum: its clients upload different tensors"


def _client(algo) -> str:
    """Whether the method takes FedProx's term and SCAFFOLD's variates (``train.prox_mu``,
    ``train.scaffold``), or why not."""
    prox, scaffold = algo.prox_refusal(), algo.scaffold_refusal()
    if prox is None and scaffold is None:
        return "both"
    if prox is not None and scaffold is not None:
        return f"neither: {prox}" if prox == scaffold else f"neither: FedProx, {prox}; SCAFFOLD, {scaffold}"
    return f"FedProx only: {scaffold}" if prox is None else f"SCAFFOLD only: {prox}"


def _cohort(algo) -> str:
    """Whether the method's clients train together in a cohort (``train.cohort``), or why not."""
    reason = algo.cohort_refusal()
    return "yes" if reason is None else f"no: {reason}"


def methods_table() -> str:
    from comix.algorithms import METHODS
    head = ["| method | what it is | leaves the device each round | stays on the device | floats up per round | "
            "trained per client | default optimiser from | clients in one step (`train.cohort`) | "
            "server optimiser and robust rule (`server.*`) | FedProx and SCAFFOLD (`train.prox_mu`, `train.scaffold`) |",
            "|---|---|---|---|---:|---:|---|---|---|---|"]
    return "\n".join(head + [row(m) for m in METHODS]) + \
        f"\n\n*Generated by `python bench/tables.py` from the algorithm classes ({MODEL}'s shapes on the meta " \
        f"device, {CLIENTS} clients, client 0, run defaults).*\n"
