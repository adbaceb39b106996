"""From a config to results, the one path every entry point takes (the CLI's ``run`` and
``compare``, the Flower ServerApp and ClientApp): method specs, inputs checked and loaded, one
spec run on an engine.

A *method spec* is a method name with optional options, ``name[:key=value,key=value]``: bare keys
belong to the method's config section, dotted keys are any config key. Examples:
``hetlora:reg=0.05``, ``comigs-1gxs:experts=[1,2,4,8]``, ``comigs-1gxs:train.load_balance=none``.
"""
from __future__ import annotations

import copy
import json
import re
from pathlib import Path

import yaml

from .config import ConfigError, RunConfig, _set


def split_spec(spec: str) -> tuple[str, list[str]]:
    """``"hetlora:reg=0.05,gamma=0.9"`` -> ("hetlora", ["reg=0.05", "gamma=0.9"]); commas inside
    brackets stay (``experts=[1,2,4,8]``)."""
    name, _, opts = spec.partition(":")
    items, depth, cur = [], 0, ""
    for ch in opts:
        depth += ch == "["
        depth -= ch == "]"
        if ch == "," and depth == 0:
            items.append(cur)
            cur = ""
        else:
            cur += ch
    items += [cur] if cur else []
    return name.strip(), [i.strip() for i in items if i.strip()]


def spec_config(cfg: RunConfig, spec: str) -> RunConfig:
    """A copy of ``cfg`` with the spec's options applied."""
    from .algorithms import section_of
    name, items = split_spec(spec)
    out = copy.deepcopy(cfg)
    section = section_of(name)
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
    n_clients = 1 if REGISTRY[name][0].pooled else n_users
    algo = make_algorithm(name, mcfg.lora, mcfg.train, n_clients, **mcfg.options(name))
    algo.name = spec
    return algo


def count_users(cfg: RunConfig, corpus) -> int:
    if hasattr(corpus, "examples"):  # an instruction set: its partition decides
        return cfg.data.clients or len(cfg.data.users or {ex.category for ex in corpus.examples})
    return cfg.data.clients or len(cfg.data.users or corpus)


def load_inputs(cfg: RunConfig):
    """(base model, tokenizer, users, their token table, the server's own data or None) for
    ``cfg``, inputs checked cheapest first: the model spec and the corpus fail with one line
    before the model loads."""
    import torch

    from .data import check_seq_len, load_corpus, make_user_data, token_table
    from .data.splits import make_server_data
    from .models import load_base_model
    from .models.base import check_model_spec
    from .runtime import resolve

    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    runtime = resolve(cfg.device, cfg.precision, cfg.compile)
    check_model_spec(cfg.model)
    corpus = load_corpus(cfg.corpus)
    for spec in cfg.methods:  # every method's options checked before the model loads
        if build_algorithm(cfg, spec, count_users(cfg, corpus)).needs_server_data and not cfg.data.public_frac:
            raise ValueError(f"{spec} needs the server's own public and test data: set data.public_frac (e.g. 0.1)")
    public = public_corpus_of(cfg)  # its categories checked before the model loads
    model, tok = load_base_model(cfg.model, dropout=cfg.dropout)
    context = getattr(model.config, "max_position_embeddings", None) or getattr(model.config, "n_positions", None)
    if context and cfg.train.seq_len > context:
        raise ValueError(f"train.seq_len = {cfg.train.seq_len} exceeds the context of model {cfg.model} "
                         f"({context} tokens)")
    users = make_user_data(corpus, tok, cfg.data)
    check_seq_len(users, cfg.train.seq_len)
    server_data = make_server_data(corpus, tok, cfg.data, public)  # None unless data.public_frac
    return runtime.prepare_base(model), tok, users, token_table(users), server_data


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

    runtime = resolve(cfg.device, cfg.precision, cfg.compile)
    if not cfg.data.public_frac:  # no model or data, but the run's seed (FedAMoLE's pool draws from it)
        return ServerContext(None, None, runtime, out, seed)
    from .data import load_corpus
    from .data.splits import make_server_data
    from .models import load_base_model
    model, tok = load_base_model(cfg.model, dropout=cfg.dropout)
    return ServerContext(runtime.prepare_base(model), make_server_data(load_corpus(cfg.corpus), tok, cfg.data,
                                                                      public_corpus_of(cfg)),
                         runtime, out, seed)


def run_spec(cfg, spec: str, seed: int, out: Path, model, users, console, server_data=None) -> dict:
    """Run one method spec with one seed into ``out`` (skipped when finished, resumed when not)."""
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

    from .engines import run_method
    from .runtime import resolve

    if (out / "results.json").exists():  # finished earlier: keep it
        res = json.loads((out / "results.json").read_text())
        console.print(f"{spec} (seed {seed}): done earlier, mean {res.get('metric', 'test_ppl')} "
                      f"{res.get('mean', res.get('mean_test_ppl')):.2f}")
        return res
    mcfg = spec_config(cfg, spec)
    algo = build_algorithm(cfg, spec, len(users))
    n_clients = algo.n_clients
    if cfg.engine == "flower-sim" and algo.trains and not algo.pooled:
        from .config import to_dict
        from .engines.flower.simulation import simulate
        from .files import atomic_write
        recipe = out.parent / f".{out.name}.flower-sim.yaml"
        text = yaml.safe_dump(to_dict(cfg), sort_keys=False)
        atomic_write(recipe, lambda p: Path(p).write_text(text))
        console.print(f"{spec}: Flower simulation (Ray on 127.0.0.1) with {n_clients} virtual devices")
        res = simulate(recipe, spec, out.parent, n_clients, seed=seed, cpus=cfg.threads or None,
                       gpus=cfg.gpus_per_client)
        if not cfg.keep_checkpoints:
            (out / "checkpoint.pt").unlink(missing_ok=True)
        return res
    label = spec if len(cfg.seeds) <= 1 else f"{spec} seed {seed}"
    with Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.fields[info]}"),
                  TimeElapsedColumn(), TimeRemainingColumn(), console=console) as bar:
        task = bar.add_task(label, total=mcfg.train.rounds if algo.trains else 1, info="")

        def progress(p):
            xs = [x for x in p["scores"] if x is not None]
            shown = " ".join(f"{x:.1f}" for x in xs) if len(xs) <= 8 else f"mean {sum(xs) / len(xs):.2f}"
            name = (p["metric"] or "").replace("_", " ")
            info = f"round {p['round']}/{p['rounds']} loss {p['train_loss']:.3f}" + (f" {name} {shown}" if xs else "")
            bar.update(task, completed=p["round"], info=info)
            bar.console.log(f"{label} {info} ({p['seconds']:.0f}s)")

        res = run_method(algo, model, users, out, seed=seed, resume=True, offload=mcfg.offload, progress=progress,
                         keep_checkpoints=mcfg.keep_checkpoints, runtime=resolve(cfg.device, cfg.precision, cfg.compile),
                         server_data=server_data)
        bar.update(task, completed=bar.tasks[0].total)
    return res


