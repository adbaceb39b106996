"""The Python face of comix: what the ``comix`` command line itself calls.

    import comix
    results = comix.run("configs/small/table1-multilingual.yaml", methods=["fedavg"], train={"rounds": 2})
    print(results.run_dir)  # the run's folder
    grid = comix.compare(methods=["local", "fedavg"], seeds=[42, 45])
    model, tokenizer = comix.load_personal(comix.export("runs/x", user="de", out="de-model", method="fedavg"))

Keyword settings are config keys: ``train={"rounds": 2}`` or ``**{"train.rounds": 2}`` (both become
``train.rounds=2``, exactly as on the command line); positional strings are ``key=value`` overrides.
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Callable

import yaml


def _console(quiet: bool = False):
    from rich.console import Console
    return Console(stderr=True, quiet=quiet)


def overrides_of(overrides=(), settings: dict | None = None) -> list[str]:
    """``key=value`` strings from positional overrides and keyword settings (a dict value of a
    section becomes one override per key; values as JSON, which YAML reads)."""
    out = list(overrides)
    for key, value in (settings or {}).items():
        key = key.replace("__", ".")
        if isinstance(value, dict):
            out += [f"{key}.{k}={json.dumps(v)}" for k, v in value.items()]
        else:
            out.append(f"{key}={json.dumps(value)}")
    return out


def results_table(results: list[dict], users: list[str]) -> str:
    """Each method's test metric per user and its mean over users (``comparison.user_table``'s
    layout), and epsilon after the last round when any method ran with DP noise."""
    from .comparison import metric_of, user_table
    private = any(r.get("epsilon") is not None for r in results)
    cells = {}
    for r in results:
        key, mean = metric_of(r)
        cells[r["method"]] = [f"{r['per_user'][u][key]:.2f}" if key in r["per_user"].get(u, {}) else "-"
                              for u in users] + [f"{mean:.2f}"]
        if private:
            cells[r["method"]].append("-" if r.get("epsilon") is None else f"{r['epsilon']:.3g}")
    return user_table(cells, [*users, "mean", *(["epsilon"] if private else [])])


def devices_table(results: list[dict]) -> str:
    """What each method's devices spent over the run (results.json ``devices``), one row a method."""
    rows = ["| method | MB up | MB down | tokens | train s | max memory MB |", "|---|---:|---:|---:|---:|---:|"]
    for r in results:
        d = r.get("devices")
        if d:
            mem = "-" if d["memory_mb_max"] is None else f"{d['memory_mb_max']:.1f}"
            rows.append(f"| {r['method']} | {d['bytes_up'] / 2**20:.2f} | {d['bytes_down'] / 2**20:.2f} | "
                        f"{d['tokens']:,} | {d['train_s']:.1f} | {mem} |")
    return "\n".join(rows) if len(rows) > 2 else ""


def results_summary(results: list[dict]) -> str:
    """What the console shows for many users: per method the mean, min and max over users."""
    from .comparison import metric_of
    rows = ["| method | users | mean | min | max |", "|---|---|---|---|---|"]
    for r in results:
        key, mean = metric_of(r)
        xs = [v[key] for v in r["per_user"].values() if key in v]
        spread = f"{min(xs):.2f} | {max(xs):.2f}" if xs else "- | -"
        rows.append(f"| {r['method']} | {len(xs)} | {mean:.2f} | {spread} |")
    return "\n".join(rows)


class _WithRunDir:
    """The folder a call wrote, kept beside its results (to export, report or resume from)."""

    def __init__(self, results, run_dir: Path):
        super().__init__(results)
        self.run_dir = Path(run_dir)


class RunResults(_WithRunDir, list):
    """``comix.run``'s answer: each method's results in the order of ``methods``, and ``run_dir``."""


class CompareResults(_WithRunDir, dict):
    """``comix.compare``'s answer: {spec: {seed: results}}, and ``run_dir``, the grid's folder."""


CONFIG_LOCK = "config.lock.json"  # the settings a run started with: --resume must match them
# keys that change no number of the run; explicit_train is derived from config.yaml (a run saved
# before it existed reloads with every train key explicit: its own optimiser, not a method default)
RESUME_MAY_CHANGE = {"threads", "keep_checkpoints", "run_dir", "train.tensorboard", "explicit_train"}
CALIBRATED = "calibrated."  # lock keys of what the run derived (e.g. the noise of a target epsilon), not set


def flat_config(cfg) -> dict:
    """Every config key as a dotted name -> its JSON value."""
    from .config import to_dict

    def walk(d, prefix=""):
        for k, v in d.items():
            if isinstance(v, dict):
                yield from walk(v, f"{prefix}{k}.")
            else:
                yield f"{prefix}{k}", v
    return json.loads(json.dumps(dict(walk(to_dict(cfg))), default=str))


def check_resume_config(run_dir: Path, cfg) -> None:
    """--resume continues the run it names, not another: the config (config.yaml with the
    command line's overrides) must equal the one the run started with, but for keys that change
    no number (threads, keep_checkpoints). One line naming every differing key."""
    lock = run_dir / CONFIG_LOCK
    if not lock.exists():  # a run started before this check existed
        return
    started, now = json.loads(lock.read_text()), flat_config(cfg)
    # a key comix gained after the run started is absent from its lock; at its default it is the
    # behaviour the run had (a new key's default never changes what an existing one did)
    from .config import RunConfig
    defaults = flat_config(RunConfig())
    added = sorted(k for k in now.keys() - started.keys() if k in defaults and now[k] == defaults[k])
    if added:
        print(f"--resume {run_dir}: keys added to comix since the run started, at their defaults: {', '.join(added)}")
    diff = sorted(k for k in started.keys() | now.keys() if k not in RESUME_MAY_CHANGE and not k.startswith(CALIBRATED)
                  and k not in added and started.get(k) != now.get(k))
    if diff:
        shown = ", ".join(f"{k} ({started.get(k)!r} -> {now.get(k)!r})" for k in diff[:4])
        raise ValueError(f"--resume {run_dir}: the config differs from the one the run started with: {shown}"
                         f"{f' and {len(diff) - 4} more' if len(diff) > 4 else ''}; resume with the run's own "
                         "settings, or start a new run")


def check_writable(run_dir: Path) -> None:
    """The run directory can be made and written, checked before anything loads."""
    parent = run_dir
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise ValueError(f"run_dir {run_dir}: {parent} is a file, not a directory")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ValueError(f"run_dir {run_dir}: {parent} is not writable")


def scored_names(results: list[dict], users) -> list[str]:
    """The columns of a results table: the users the results score, in the run's order, then the
    server's test domains (DeepFusion's and FedJETS's global model is scored per domain)."""
    scored = {k for r in results for k in r["per_user"]}
    return [u.name for u in users if u.name in scored] + sorted(scored - {u.name for u in users})


def print_calibration(cfg, users, console) -> None:
    """One line per method whose noise was calibrated to a target epsilon: the sigma it runs with
    (kept in config.lock.json), and why fixed-k sampling reports a larger epsilon."""
    from .privacy import FIXED_K_NOTE, sampling_of
    from .specs import calibrated_noise, spec_config
    for spec, sigma in calibrated_noise(cfg, len(users)).items():
        mcfg = spec_config(cfg, spec)
        kind = sampling_of(len(users), mcfg.train)[0]
        console.print(f"privacy: {spec}: target epsilon {mcfg.privacy.target_epsilon:g} -> noise multiplier "
                      f"{sigma:g} ({kind} sampling, {mcfg.train.rounds} rounds, dp-accounting RDP)"
                      + (f". {FIXED_K_NOTE}" if kind == "fixed" else ""), highlight=False)


def _report(run_dir: Path, console) -> None:
    """The run's report.html / report.md (without the token routing maps, which rebuild every user's
    model: `comix report DIR` adds them). A report that cannot be drawn costs the run nothing."""
    from .reporting import write_report
    try:
        page, _ = write_report(run_dir, routing=False)
        console.print(f"report: {page} (without token routing maps; to add them: comix report {run_dir})")
    except Exception as err:  # noqa: BLE001  (the results are written; the page is a view of them)
        console.print(f"report not written ({type(err).__name__}: {str(err).splitlines()[0][:120]}); "
                      f"try: comix report {run_dir}")


def prepare(config=None, overrides=(), resume=None, default_name: str = "", methods=None, seeds=None,
            on_run_dir: Callable[[Path], None] | None = None):
    """Load (or, with ``resume``, reload) the config and load data and model; only then create the
    run directory with config.yaml, so a bad input leaves nothing behind. ``on_run_dir`` hears the
    run directory as soon as it is known (the CLI names it in its resume hint)."""
    from .config import check_data_seeds, load_config, to_dict
    from .files import atomic_write
    from .runner import load_inputs

    if resume:
        run_dir = Path(resume)
        if methods or seeds:  # silently running another grid than the one asked for would mislead
            raise ValueError(f"--resume {run_dir} continues the grid it started (its config.yaml's methods and seeds); "
                             f"drop {'--methods' if methods else '--seeds'}, or start a new run_dir for another grid")
        if not (run_dir / "config.yaml").exists():
            raise ValueError(f"--resume: {run_dir} holds no config.yaml (not a comix run directory)")
        cfg = load_config(str(run_dir / "config.yaml"), list(overrides))
        check_resume_config(run_dir, cfg)
        check_data_seeds(cfg)
        if on_run_dir:
            on_run_dir(run_dir)
        return (cfg, run_dir, *load_inputs(cfg))
    cfg = load_config(str(config) if config else None, list(overrides))
    if methods:
        cfg.methods = list(methods)
    if seeds:
        cfg.seeds = list(seeds)
    cfg.validate()
    check_data_seeds(cfg)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    run_dir = Path(cfg.run_dir or f"runs/{default_name}{cfg.corpus.strip('/').split('/')[-1]}-{stamp}")
    cfg.run_dir = str(run_dir)
    check_writable(run_dir)
    loaded = load_inputs(cfg)
    run_dir.mkdir(parents=True, exist_ok=True)
    if on_run_dir:
        on_run_dir(run_dir)
    text = yaml.safe_dump(to_dict(cfg), sort_keys=False)
    from .specs import calibrated_noise
    sigmas = {f"{CALIBRATED}{spec}.privacy.noise_multiplier": s for spec, s in calibrated_noise(cfg, len(loaded[2])).items()}
    lock = json.dumps({**flat_config(cfg), **sigmas}, indent=1)
    atomic_write(run_dir / CONFIG_LOCK, lambda p: Path(p).write_text(lock))
    atomic_write(run_dir / "config.yaml", lambda p: Path(p).write_text(text))
    from .data import describe_partition
    part = json.dumps(describe_partition(loaded[2]), indent=1)  # the same for every method of the run
    atomic_write(run_dir / "partition.json", lambda p: Path(p).write_text(part))
    return (cfg, run_dir, *loaded)


def seeded_data(cfg, seed: int, seed_dir: Path):
    """(config, users, server data) of one seed of a grid whose partition follows the seed
    (``data.seed``: run or a mapping); the seed's partition.json is written beside its runs."""
    from .config import with_data_seed
    from .data import check_seq_len, describe_partition, load_corpus, make_user_data
    from .data.splits import make_server_data
    from .files import atomic_write
    from .models.base import load_tokenizer
    from .specs import public_corpus_of
    seed_cfg = with_data_seed(cfg, seed)
    corpus, tok = load_corpus(cfg.corpus), load_tokenizer(cfg.model)
    users = make_user_data(corpus, tok, seed_cfg.data)
    check_seq_len(users, cfg.train.seq_len)
    seed_dir.mkdir(parents=True, exist_ok=True)
    part = json.dumps(describe_partition(users), indent=1)
    atomic_write(seed_dir / "partition.json", lambda p: Path(p).write_text(part))
    return seed_cfg, users, make_server_data(corpus, tok, seed_cfg.data, public_corpus_of(cfg))


def run(config=None, *overrides: str, resume=None, quiet: bool = False, on_run_dir=None, **settings) -> RunResults:
    """Run every method of ``config`` (a YAML path; None: the main job) with the given overrides;
    returns each method's results (``results.json``: per-user metrics, mean, bytes, config), in
    the order of ``methods``, with the run folder as ``.run_dir``. Writes the run directory (``run_dir``, default runs/<corpus>-<time>)
    and prints the per-user table unless ``quiet``."""
    from .comparison import MANY_USERS, metric_title
    from .files import atomic_write
    from .runner import run_spec
    from .specs import spec_dirname

    console = _console(quiet)
    cfg, run_dir, model, _, users, table, server_data = prepare(config, overrides_of(overrides, settings), resume,
                                                                 "", on_run_dir=on_run_dir)
    console.print(f"[bold]comix run[/] {run_dir}  model={cfg.model} corpus={cfg.corpus} "
                  f"device={model.device} precision={cfg.precision}\n{table}")
    print_calibration(cfg, users, console)
    if len(cfg.seeds) > 1:
        console.print(f"seeds {cfg.seeds} make a grid: `comix run` runs seed {cfg.seed} only; "
                      "`comix compare` runs every seed")
    results = [run_spec(cfg, spec, cfg.seed, run_dir / spec_dirname(spec), model, users, console, server_data)
               for spec in cfg.methods]
    names = scored_names(results, users)
    md = results_table(results, names)
    spent = devices_table(results)
    atomic_write(run_dir / "results.md", lambda p: Path(p).write_text(
        f"{metric_title(results)} per user ({cfg.model}, {cfg.corpus}, seed {cfg.seed})\n\n{md}\n"
        + (f"\nWhat the devices spent (totals over devices and rounds; memory: the largest device round, "
           f"base + trainable state + activations)\n\n{spent}\n" if spent else "")))
    atomic_write(run_dir / "results.json", lambda p: Path(p).write_text(json.dumps(results, indent=2)))
    if not quiet:
        print(md if len(names) <= MANY_USERS else results_summary(results) + f"\n(per user: {run_dir}/results.md)")
        if spent:
            print(spent)
    console.print(f"results: {run_dir}/results.md (per method: metrics.jsonl, results.json, privacy.md"
                  f"{', adapters/' if not cfg.keep_checkpoints else ', checkpoint.pt'})")
    _report(run_dir, console)
    return RunResults(results, run_dir)


def compare(config=None, *overrides: str, methods=None, seeds=None, resume=None, quiet: bool = False,
            on_run_dir=None, **settings) -> CompareResults:
    """A resumable grid of method specs x seeds (finished runs are skipped); writes compare.md,
    compare.json and the figures, returns {spec: {seed: results}} with the grid's folder as ``.run_dir``."""
    from .comparison import (MANY_USERS, collect, curves, global_model_tables, metric_title, overhead_table,
                             privacy_table, references, summary_tables, trivial_baselines)
    from .reporting.figures import plot_assignment, plot_curves, plot_global_model, plot_privacy
    from .files import atomic_write
    from .runner import run_spec
    from .specs import spec_dirname

    console = _console(quiet)
    cfg, run_dir, model, _, users, table, server_data = prepare(config, overrides_of(overrides, settings), resume,
                                                                 "compare-", methods, seeds, on_run_dir)
    seeds = cfg.seeds or [cfg.seed]
    from .config import first_split_seed, per_seed_split
    from .data import token_table
    shown = f"the split of seed {first_split_seed(cfg)}, each seed splits its own\n" if per_seed_split(cfg.data) else ""
    console.print(f"[bold]comix compare[/] {run_dir}  methods={' '.join(cfg.methods)} seeds={seeds}\n{shown}{table}")
    print_calibration(cfg, users, console)
    if per_seed_split(cfg.data):  # no one partition for the grid: each seed folder holds its own
        (run_dir / "partition.json").unlink(missing_ok=True)
    for seed in seeds:
        seed_cfg, seed_users, seed_server = cfg, users, server_data
        if per_seed_split(cfg.data):  # each seed its own partition and test set (data.seed: run or a mapping)
            seed_cfg, seed_users, seed_server = seeded_data(cfg, seed, run_dir / f"seed{seed}")
            console.print(f"seed {seed}: data seed {seed_cfg.data.seed}\n{token_table(seed_users)}")
        for spec in cfg.methods:
            run_spec(seed_cfg, spec, seed, run_dir / f"seed{seed}" / spec_dirname(spec), model, seed_users, console,
                     seed_server)
    results = collect(run_dir, cfg.methods, seeds)
    names = scored_names([r for by in results.values() for r in by.values()], users)
    md = summary_tables(results, names)
    trivial = trivial_baselines(run_dir, results, seeds)
    md = md.replace("\n\n", f"\n\n{trivial}\n\n", 1) if trivial else md
    title = metric_title([r for by in results.values() for r in by.values()])
    setup = f"mode {cfg.data.mode}" if all(u.task == "lm" for u in users) else \
        f"partition {cfg.data.partition}" + (f", alpha {cfg.data.alpha}" if cfg.data.partition == "dirichlet" else "")
    setup += ", each seed its own data split" if cfg.data.seed == "run" else \
        f", each seed its own data split (data seeds {cfg.data.seed})" if per_seed_split(cfg.data) else \
        f", one data split (data.seed {cfg.data.seed})"
    header = (f"{title} ({cfg.model}, {cfg.corpus}, {setup}, seeds {seeds}): "
              "mean over users (of the last round), then mean (population std) over seeds\n\n")
    overhead = overhead_table(run_dir, cfg.methods, seeds)
    global_tables = global_model_tables(run_dir, results, cfg.methods, seeds)
    private = privacy_table(results)
    if private:
        global_tables = (global_tables + "\n\n" if global_tables else "") + \
            "Utility and privacy (client-level DP-FedAvg; comix/privacy.py)\n\n" + private
    atomic_write(run_dir / "compare.md", lambda p: Path(p).write_text(
        header + md + "\n\nSystem overhead per client and round (FedAMoLE Table IV; mean over rounds, clients "
        "and seeds)\n\n" + overhead + "\n" + (f"\n{global_tables}\n" if global_tables else "")))
    atomic_write(run_dir / "compare.json", lambda p: Path(p).write_text(json.dumps(
        {spec: {str(s): r for s, r in by.items()} for spec, by in results.items()}, indent=2)))
    data = curves(run_dir, cfg.methods, seeds)
    refs = references(results)
    drawn = [f for f, per_user in (("curves.png", False), ("curves_per_user.png", True))
             if plot_curves(data, run_dir / f, per_user=per_user, refs=refs, ylabel=title)]
    drawn += ["global-model.png"] if plot_global_model(run_dir, results, seeds, run_dir / "global-model.png") else []
    drawn += ["privacy.png"] if plot_privacy(results, run_dir / "privacy.png") else []
    drawn += [f"assignment-{spec_dirname(spec)}.png" for spec in cfg.methods
              if plot_assignment(run_dir, spec, seeds[0], run_dir / f"assignment-{spec_dirname(spec)}.png")]
    shown = md if len(names) <= MANY_USERS else md.split("\n\n")[0] + f"\n\n(per user: {run_dir}/compare.md)"
    if not quiet:
        print(shown + "\n\n" + overhead + (f"\n\n{global_tables}" if global_tables else ""))
    console.print(f"wrote {run_dir}/compare.md, compare.json" + "".join(f", {f}" for f in drawn))
    _report(run_dir, console)
    return CompareResults(results, run_dir)


def export(run_dir, user: str | None, out, method: str | None = None, merged: bool = False,
           static: bool = False, with_base: bool | None = None, format: str = "comix",
           precision: str | None = None, max_len: int | None = None) -> Path:
    """``user``'s model of a finished run (PEFT folders where the method has them) or the run's
    global model (DeepFusion, FedJETS; ``user`` None), with a manifest (comix/personal/); returns ``out``.
    ``format="executorch"`` (precision fp32 | int8) or ``"gguf"`` (f16 | q8_0): the file a device runs."""
    from .personal import export_personal
    return export_personal(Path(run_dir), user, Path(out), method=method, merged=merged, static=static,
                           with_base=with_base, format=format, precision=precision, max_len=max_len)


def load_personal(folder, base=None):
    """(model, tokenizer) of an exported user model, exactly as the run left it (comix/personal/)."""
    from .personal import load_personal as load
    return load(folder, base)


def report(run_dir, routing: bool = True) -> tuple[Path, Path]:
    """report.html and report.md of a run, compare or method folder (comix/reporting/), with the
    token routing maps unless ``routing=False``; returns their paths."""
    from .reporting import write_report
    return write_report(Path(run_dir), routing=routing)
