"""From a config to results, the one path the CLI's ``run`` and ``compare`` take: inputs checked
and loaded, one spec run on an engine (in-process or Flower's simulation). Method specs and
building an algorithm from a config live one layer below, in ``specs.py``."""
from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import yaml

from .config import RunConfig, first_split_seed, with_data_seed
from .specs import build_algorithm, count_users, public_corpus_of, sized_option, spec_config, with_option


def load_inputs(cfg: RunConfig):
    """(base model, tokenizer, users, their token table, the server's own data or None) for
    ``cfg``, inputs checked cheapest first: the model spec and the corpus fail with one line
    before the model loads."""
    import torch

    from .data import check_seq_len, load_corpus, make_user_data, token_table
    from .data.splits import make_server_data
    from .models import load_base_model
    from .models.base import check_model_spec, model_config
    from .runtime import resolve

    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    resolve(cfg.device, cfg.precision, cfg.compile, "none" if cfg.quant == "auto" else cfg.quant,
            graphs=cfg.graphs)  # one line if bad
    check_model_spec(cfg.model)
    corpus = load_corpus(cfg.corpus)
    shape = model_config(cfg.model)  # sizes only, no weights
    problems, full_precision_base = [], cfg.quant == "auto"
    from .models.quant import quant_refusal
    refused = quant_refusal(shape.model_type, cfg.model, {cfg.quant} if isinstance(cfg.quant, str) else set(cfg.quant))
    if refused:
        problems.append(refused)
    for spec in cfg.methods:  # every method's options checked before the model loads, all problems at once
        sized = sized_option(spec)
        if sized and not cfg.fleet:
            problems.append(f"{spec}: {sized[0]}=auto sizes each device from a fleet's memory budgets: give a fleet "
                            "(fleet=<file> or a built-in fleet)")
            continue
        if sized:  # checked at the smallest value the fleet may give
            spec = with_option(spec, sized[0], [sized[1][0]] * count_users(cfg, corpus))
        algo = build_algorithm(cfg, spec, count_users(cfg, corpus))
        if algo.privacy.secure_aggregation and cfg.engine == "inprocess":
            problems.append("privacy.secure_aggregation runs on Flower (engine=flower-sim or a deployment): the "
                            "in-process engine holds every upload in one process, there is nothing to hide them from")
        if cfg.quant != "none" and algo.quant_refusal_reason:
            problems.append(f"quant={cfg.quant} with {spec}: {algo.quant_refusal_reason}; use quant=none")
        if algo.device_spec(0) is not None:  # its devices build their own models from the full-precision
            full_precision_base = True       # base and quantise those (Algorithm.quant_refusal_reason)
        if algo.needs_server_data and not cfg.data.public_frac:
            problems.append(f"{spec} needs the server's own public and test data: set data.public_frac (e.g. 0.1)")
        problems += [f"{p} (model {cfg.model})" for p in algo.check_model(shape) if f"{p} (model" not in problems]
    if problems:
        raise ValueError("; ".join(dict.fromkeys(problems)))
    public = public_corpus_of(cfg)  # its categories checked before the model loads
    model, tok = load_base_model(cfg.model, dropout=cfg.dropout)
    context = getattr(model.config, "max_position_embeddings", None) or getattr(model.config, "n_positions", None)
    if context and cfg.train.seq_len > context:
        raise ValueError(f"train.seq_len = {cfg.train.seq_len} exceeds the context of model {cfg.model} "
                         f"({context} tokens)")
    users = make_user_data(corpus, tok, with_data_seed(cfg, first_split_seed(cfg)).data)
    check_seq_len(users, cfg.train.seq_len)
    if not isinstance(cfg.quant, str) and len(cfg.quant) != len(users):
        raise ValueError(f"quant gives {len(cfg.quant)} precisions for {len(users)} clients: one per client")
    if isinstance(cfg.micro_batches, list) and len(cfg.micro_batches) != len(users):
        raise ValueError(f"micro_batches gives {len(cfg.micro_batches)} values for {len(users)} clients: one per client")
    if isinstance(cfg.train.client_runtime, list) and len(cfg.train.client_runtime) != len(users):
        raise ValueError(f"train.client_runtime gives {len(cfg.train.client_runtime)} runtimes for {len(users)} clients: "
                         "one per client")
    if cfg.fleet:
        # experts=auto / ranks=auto become each device's own value, written so into the run's
        # config.yaml (resume, export and Flower's devices read the sized spec)
        cfg.methods = [size_from_budgets(cfg, spec, model, users) for spec in cfg.methods]
        for spec in cfg.methods:  # every device fits, before any work (the plan is made again per run)
            fleet_plan(cfg, spec, model, users)
    server_data = make_server_data(corpus, tok, with_data_seed(cfg, first_split_seed(cfg)).data, public)  # None unless data.public_frac
    from .models.quant import on_device
    # the shared base: at the run's precision, or in full precision when devices differ (quant=auto
    # or one per client: each client's model quantises a copy, engines/inprocess.py ClientModels)
    # or build their own models from it (device_spec: DeepFusion's devices quantise their own)
    runtime = resolve(cfg.device, cfg.precision, cfg.compile, "none" if full_precision_base else cfg.quant,
                      graphs=cfg.graphs)
    return on_device(model, runtime), tok, users, token_table(users), server_data


def micro_batch_options(cfg, spec: str) -> tuple[int, ...]:
    """The slice counts the plan may choose from: with micro_batches=auto, 1 and the powers of 2
    up to the method's batch size; otherwise the asked one(s)."""
    if cfg.micro_batches == "auto":
        batch = spec_config(cfg, spec).train.batch_size
        return tuple(2 ** k for k in range(batch.bit_length()) if 2 ** k <= batch)
    return tuple(sorted({cfg.micro_batches} if isinstance(cfg.micro_batches, int) else set(cfg.micro_batches)))


def fleet_plan(cfg, spec: str, model, users) -> tuple[str | tuple[str, ...], int | tuple[int, ...]]:
    """Each device's base precision and micro-batches for ``spec`` (comix/fleet.py ``plan``), from
    the memory one measured training step of each client's model needs on the full-precision
    ``model`` quantised to each precision: every device fits, or one line names the one that does not."""
    from .engines.device import training_memory
    from .fleet import load_fleet, plan
    algo = build_algorithm(cfg, spec, len(users))
    if not algo.trains or algo.pooled or algo.device_spec(0) is not None:  # no device trains an adapter
        return (cfg.quant if cfg.quant != "auto" else "none",
                cfg.micro_batches if cfg.micro_batches != "auto" else 1)
    measured, options = {}, micro_batch_options(cfg, spec)  # clients alike are measured once
    needs = [training_memory(model, algo, users[c], c, measured, options) for c in range(algo.n_clients)]
    settings = plan(load_fleet(cfg.fleet), needs, cfg.quant, spec, cfg.micro_batches)
    return tuple(q for q, _ in settings), tuple(m for _, m in settings)


def size_from_budgets(cfg, spec: str, model, users) -> str:
    """``spec`` with its ``<option>=auto`` (Algorithm.capacity) replaced by each device's value:
    one measured training step per candidate value on the full-precision ``model`` gives what each
    client needs, comix/fleet.py ``plan_capacity`` picks."""
    from .engines.device import training_memory
    from .fleet import load_fleet, plan_capacity
    sized = sized_option(spec)
    if sized is None:
        return spec
    (option, values), n, measured, needs = sized, len(users), {}, {}
    options = micro_batch_options(cfg, spec)
    for v in values:
        algo = build_algorithm(cfg, with_option(spec, option, [v] * n), n)
        needs[v] = [training_memory(model, algo, users[c], c, measured, options) for c in range(n)]
    sized = with_option(spec, option, plan_capacity(load_fleet(cfg.fleet), needs, cfg.quant, spec, cfg.micro_batches))
    print(f"{spec} -> {sized} (fleet {cfg.fleet})")
    return sized


def device_settings(cfg, spec: str, model, users) -> tuple[str | tuple[str, ...], int | tuple[int, ...]]:
    """Each device's frozen-base precision and micro-batches for ``spec`` (a Runtime's ``quant``
    and ``micro_batches``): the config's, or (auto) its fleet's plan, made on the full-precision
    base the run keeps."""
    if "auto" in (cfg.quant, cfg.micro_batches):
        return fleet_plan(cfg, spec, model, users)
    return (cfg.quant if isinstance(cfg.quant, str) else tuple(cfg.quant),
            cfg.micro_batches if isinstance(cfg.micro_batches, int) else tuple(cfg.micro_batches))


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
    quant, micro = device_settings(cfg, spec, model, users)
    if cfg.fleet and not isinstance(quant, str):
        console.print(f"{spec}: each device's base precision (fleet plan): "
                      + ", ".join(f"{q} x{quant.count(q)}" for q in dict.fromkeys(quant)))
    if cfg.fleet and not isinstance(micro, int):
        console.print(f"{spec}: each device's micro-batches (fleet plan): "
                      + ", ".join(f"{m} x{micro.count(m)}" for m in dict.fromkeys(micro)))
    if cfg.engine == "flower-sim" and algo.trains and not algo.pooled:
        import dataclasses

        from .config import to_dict
        from .engines.flower.simulation import simulate
        from .files import atomic_write
        recipe = out.parent / f".{out.name}.flower-sim.yaml"
        # the devices read their own precision and micro-batches from the recipe: the plan, one per client
        planned = dataclasses.replace(cfg, quant=list(quant) if not isinstance(quant, str) else quant,
                                      micro_batches=list(micro) if not isinstance(micro, int) else micro)
        text = yaml.safe_dump(to_dict(planned), sort_keys=False)
        atomic_write(recipe, lambda p: Path(p).write_text(text))
        console.print(f"{spec}: Flower simulation (Ray on 127.0.0.1) with {n_clients} virtual devices")
        res = simulate(recipe, spec, out.parent, n_clients, seed=seed, cpus=cfg.threads or None,
                       gpus=cfg.gpus_per_client)
        if not cfg.keep_checkpoints:
            (out / "checkpoint.pt").unlink(missing_ok=True)
        return res
    label = spec if len(cfg.seeds) <= 1 else f"{spec} seed {seed}"
    # the live bar only on a terminal (piped, its fixed width cut the times to "0:0..."); it is
    # transient, so Ctrl-C or the end leaves the per-round log lines, not a second copy of the bar
    with Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.fields[info]}"),
                  TimeElapsedColumn(), TimeRemainingColumn(), console=console, transient=True,
                  disable=not console.is_terminal) as bar:
        task = bar.add_task(label, total=mcfg.train.rounds if algo.trains else 1, info="")

        def progress(p):
            xs = [x for x in p["scores"] if x is not None]
            shown = " ".join(f"{x:.1f}" for x in xs) if len(xs) <= 8 else f"mean {sum(xs) / len(xs):.2f}"
            name = (p["metric"] or "").replace("_", " ")
            info = f"round {p['round']}/{p['rounds']} loss {p['train_loss']:.3f}" + (f" {name} {shown}" if xs else "")
            if p.get("epsilon") is not None:  # DP: the privacy spent so far (privacy.delta)
                info += f" epsilon {p['epsilon']:.2f}"
            bar.update(task, completed=p["round"], info=info)
            bar.console.log(f"{label} {info} ({p['seconds']:.0f}s)")

        last_line = _clock()

        def phase(name, done, total):  # inside a round: clients trained, distillation steps, ...
            bar.update(task, info=f"{name} {done}/{total}")
            # piped (a log file, no bar): a line when a phase ends, and at most one a minute within it
            nonlocal last_line
            if not console.is_terminal and (done == total or _clock() - last_line >= 60):
                last_line = _clock()
                bar.console.log(f"{label} {name} {done}/{total}")

        from .progress import listen
        listen(phase)
        # what the methods log (DeepFusion's clusters and the premise, a cohort's fallback) into the
        # same console, so a run's log file says what a multi-hour round is doing
        to_console, logger = _ConsoleHandler(bar.console, label), logging.getLogger("comix")
        level = logger.level
        logger.addHandler(to_console)
        if logger.getEffectiveLevel() > logging.INFO:
            logger.setLevel(logging.INFO)
        try:
            res = run_method(algo, model, users, out, seed=seed, resume=True, offload=mcfg.offload,
                             progress=progress, keep_checkpoints=mcfg.keep_checkpoints,
                             runtime=resolve(cfg.device, cfg.precision, cfg.compile, quant, micro, cfg.graphs),
                             server_data=server_data)
        finally:
            listen(None)
            logger.removeHandler(to_console)
            logger.setLevel(level)
        bar.update(task, completed=bar.tasks[0].total)
    return res


_clock = time.monotonic  # the phase lines' clock (a test steps it)


class _ConsoleHandler(logging.Handler):
    """comix's INFO lines and above onto a run's console, each under its method's label."""

    def __init__(self, console, label: str):
        super().__init__(logging.INFO)
        self.console, self.label = console, label

    def emit(self, record: logging.LogRecord) -> None:
        self.console.log(f"{self.label} {record.getMessage()}")
