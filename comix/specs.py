"""Method specs and building what a method needs from a config: the layer below the engines and
the runner, so both (and the Flower apps) import it and nothing imports upward.

A *method spec* is a method name with optional options, ``name[:key=value,key=value]``: bare keys
belong to the method's config section, dotted keys are any config key. Examples:
``hetlora:reg=0.05``, ``comigs-1gxs:experts=[1,2,4,8]``, ``comigs-1gxs:train.load_balance=none``.
"""
from __future__ import annotations

import copy
import re
from pathlib import Path

import yaml

from .config import ConfigError, RunConfig, _set, split_outside_brackets
from .privacy import resolve_privacy


def split_spec(spec: str) -> tuple[str, list[str]]:
    """``"hetlora:reg=0.05,gamma=0.9"`` -> ("hetlora", ["reg=0.05", "gamma=0.9"]); commas inside
    brackets stay (``experts=[1,2,4,8]``)."""
    name, _, opts = spec.partition(":")
    return name.strip(), [i for i in split_outside_brackets(opts) if i]


def sized_option(spec: str) -> tuple[str, tuple[int, ...]] | None:
    """(the option ``spec`` leaves to the fleet, ``experts=auto`` / ``ranks=auto``, and the values
    the fleet may give it: ``Algorithm.capacity``), or None; one line if the method has no such
    option or its variant fixes it."""
    from .algorithms import REGISTRY, section_of
    name, items = split_spec(spec)
    auto = [i.split("=", 1)[0].split(".")[-1] for i in items if i.replace(" ", "").endswith("=auto")]
    if not auto:
        return None
    section_of(name)
    cls, fixed = REGISTRY[name]
    if cls.capacity is None or auto != [cls.capacity[0]] or cls.capacity[0] in fixed:
        what = f"{cls.capacity[0]}=auto" if cls.capacity and cls.capacity[0] not in fixed else "nothing"
        raise ConfigError(f"method {spec!r}: {name} can size {what} from the devices' budgets "
                          f"(per-client options a fleet sizes: comigs-1gxs experts, hetlora / flexlora / flora ranks)")
    return cls.capacity


def with_option(spec: str, option: str, value) -> str:
    """``spec`` with ``option`` set to ``value`` (a list is written as ``[a,b,...]``)."""
    name, items = split_spec(spec)
    text = f"[{','.join(map(str, value))}]" if isinstance(value, (list, tuple)) else str(value)
    items = [f"{option}={text}" if i.split("=", 1)[0].split(".")[-1] == option else i for i in items]
    return f"{name}:{','.join(items)}"


def spec_config(cfg: RunConfig, spec: str) -> RunConfig:
    """A copy of ``cfg`` with the spec's options applied."""
    from .algorithms import section_of
    from .algorithms import REGISTRY
    name, items = split_spec(spec)
    out = copy.deepcopy(cfg)
    section = section_of(name)
    for key, value in REGISTRY[name][0].train_defaults.items():  # the method's authors' optimiser,
        if key not in cfg.explicit_train:                         # unless the user set the key
            setattr(out.train, key, copy.deepcopy(value))
    if REGISTRY[name][0].fresh_optimizer_each_round:  # the authors' loop, whatever a recipe shares (Algorithm)
        out.train.optimizer_state = "round"
    for item in items:
        if "=" not in item:
            raise ConfigError(f"method {spec!r}: option {item!r} must look like key=value")
        key, value = item.split("=", 1)
        if key.split(".")[0] in ("data", "model", "corpus", "seed", "seeds", "methods", "run_dir", "device",
                                 "precision", "dropout"):
            raise ConfigError(f"method {spec!r}: option {key!r} would change the data, the base model or the grid; "
                              "set it for the whole run instead")
        if "." not in key:
            if not section:
                raise ConfigError(f"method {spec!r}: {name} has no options; use a dotted key (e.g. train.lr=...)")
            key = f"{section}.{key}"
        _set(out, key.strip(), yaml.safe_load(value))
    return out.validate()


def spec_dirname(spec: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.=-]+", "_", spec.replace(":", "__")).strip("_")


def build_algorithm(cfg: RunConfig, spec: str, n_users: int):
    """The algorithm of ``spec`` for ``n_users`` users (one client when it pools their data);
    its constructor checks its options (e.g. FedAMoLE's assignment feasibility)."""
    from .algorithms import REGISTRY, make_algorithm
    mcfg = spec_config(cfg, spec)
    name = split_spec(spec)[0]
    why = REGISTRY[name][0].dp_refusal() if mcfg.privacy.active else None
    if why:
        raise ConfigError(f"method {name} cannot run with privacy.* (clip, noise or target epsilon): {why}")
    why = REGISTRY[name][0].secure_aggregation_refusal() if mcfg.privacy.secure_aggregation else None
    if why:
        raise ConfigError(f"method {name} cannot run with privacy.secure_aggregation: {why}")
    why = REGISTRY[name][0].prox_refusal() if mcfg.train.prox_mu > 0 else None
    if why:
        raise ConfigError(f"method {name} cannot run with train.prox_mu (FedProx): {why}")
    why = REGISTRY[name][0].scaffold_refusal() if mcfg.train.scaffold else None
    if why:
        raise ConfigError(f"method {name} cannot run with train.scaffold (SCAFFOLD): {why}")
    why = REGISTRY[name][0].server_refusal(mcfg.server)
    if why:
        raise ConfigError(f"method {name} cannot run with server.optimizer={mcfg.server.optimizer}, "
                          f"server.aggregate={mcfg.server.aggregate}: {why}")
    n_clients = 1 if REGISTRY[name][0].pooled else n_users
    algo = make_algorithm(name, mcfg.lora, mcfg.train, n_clients, **mcfg.options(name))
    why = algo.executorch_refusal() if "executorch" in mcfg.train.runtimes else None
    if why:
        raise ConfigError(f"method {name} cannot run with train.client_runtime=executorch: {why}")
    algo.name = spec
    from .aggregation import ServerOptimizer
    algo.server_config = mcfg.server
    algo.server_optimizer = ServerOptimizer(mcfg.server) if mcfg.server.steps else None
    algo.privacy = resolve_privacy(mcfg.privacy, n_clients, mcfg.train)  # the noise calibrated to a target
    from .fleet import load_fleet
    algo.fleet = load_fleet(cfg.fleet)  # devices' availability and the round's deadline (comix/fleet.py)
    return algo


def calibrated_noise(cfg: RunConfig, n_users: int) -> dict[str, float]:
    """{spec: the noise multiplier calibrated to its privacy.target_epsilon} for every method of
    ``cfg`` that gives a target and no noise (printed, and kept in the run's config.lock.json)."""
    out = {}
    for spec in cfg.methods:
        privacy = spec_config(cfg, spec).privacy
        if privacy.target_epsilon > 0 and privacy.noise_multiplier == 0:
            out[spec] = build_algorithm(cfg, spec, n_users).privacy.noise_multiplier
    return out


def count_users(cfg: RunConfig, corpus) -> int:
    if hasattr(corpus, "examples"):  # an instruction set: its partition decides
        return cfg.data.clients or len(cfg.data.users or {ex.category for ex in corpus.examples})
    return cfg.data.clients or len(cfg.data.users or corpus)


def public_corpus_of(cfg: RunConfig):
    """The corpus of ``data.public_corpus`` (None: the test domains' public share is public); a
    category it lacks fails in one line naming it."""
    from .data import load_corpus
    if not cfg.data.public_corpus:
        return None
    corpus = load_corpus(cfg.data.public_corpus)
    missing = sorted(set(cfg.data.public_categories or []) - set(corpus))
    if missing:
        raise ValueError(f"data.public_categories: {missing} not in data.public_corpus {cfg.data.public_corpus!r} "
                         f"(it has {sorted(corpus)})")
    return corpus


def server_context(cfg: RunConfig, out: Path, seed: int):
    """What a server process (Flower's ServerApp) gives the algorithm of ``cfg`` besides the
    uploads: the run's seed and output folder, and the base model and the server's own data,
    loaded only when the config gives the server data (``data.public_frac``; DeepFusion); the
    in-process engine builds the same from what the CLI loaded once."""
    from .algorithms.base import ServerContext
    from .runtime import resolve

    runtime = resolve(cfg.device, cfg.precision, cfg.compile, cfg.quant)
    if not cfg.data.public_frac:  # no model or data, but the run's seed (FedAMoLE's pool draws from it)
        return ServerContext(None, None, runtime, out, seed)
    from .data import load_corpus
    from .data.splits import make_server_data
    from .models import load_base_model
    model, tok = load_base_model(cfg.model, dropout=cfg.dropout)
    return ServerContext(runtime.prepare_base(model), make_server_data(load_corpus(cfg.corpus), tok, cfg.data,
                                                                      public_corpus_of(cfg)),
                         runtime, out, seed)
