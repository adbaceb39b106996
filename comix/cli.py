"""``comix`` command line.

  comix run [CONFIG] [key=value ...]     run every method of the config (default: the main job)
  comix run --resume RUN_DIR             continue a killed run where it stopped
  comix compare [CONFIG] --methods M.. --seeds S..   a resumable grid with tables and curves
  comix ppl [--model M] [--corpus C ...] pretrained perplexity on the built-in test splits
  comix data [CORPUS] [key=value ...]    token counts per user and split (CoMiGS Table 4)
  comix flower-demo | flower-certs | flower-key   the Flower engine (see docs/flower.md)
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import yaml


def _console():
    from rich.console import Console
    return Console(stderr=True)


def results_table(results: list[dict], users: list[str]) -> str:
    """Each method's test metric per user and its mean over users (``compare.user_table``'s layout)."""
    from .compare import metric_of, user_table
    cells = {}
    for r in results:
        key, mean = metric_of(r)
        cells[r["method"]] = [f"{r['per_user'][u][key]:.2f}" if key in r["per_user"].get(u, {}) else "-"
                              for u in users] + [f"{mean:.2f}"]
    return user_table(cells, [*users, "mean"])


def results_summary(results: list[dict]) -> str:
    """What the console shows for many users: per method the mean, min and max over users."""
    from .compare import metric_of
    rows = ["| method | users | mean | min | max |", "|---|---|---|---|---|"]
    for r in results:
        key, mean = metric_of(r)
        xs = [v[key] for v in r["per_user"].values() if key in v]
        spread = f"{min(xs):.2f} | {max(xs):.2f}" if xs else "- | -"
        rows.append(f"| {r['method']} | {len(xs)} | {mean:.2f} | {spread} |")
    return "\n".join(rows)


RUN_DIR: Path | None = None  # the run directory being written (named in the Ctrl-C message)


CONFIG_LOCK = "config.lock.json"  # the settings a run started with: --resume must match them
RESUME_MAY_CHANGE = {"threads", "keep_checkpoints", "run_dir"}  # change no number of the run


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
    diff = sorted(k for k in started.keys() | now.keys() if k not in RESUME_MAY_CHANGE and started.get(k) != now.get(k))
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


def _prepare(args, default_name: str):
    """Load (or, with --resume, reload) the config and load data and model; only then create the
    run directory with config.yaml, so a bad input leaves nothing behind."""
    global RUN_DIR
    from .config import load_config, to_dict
    from .files import atomic_write
    from .runner import load_inputs

    if args.resume:
        run_dir = Path(args.resume)
        if not (run_dir / "config.yaml").exists():
            raise ValueError(f"--resume: {run_dir} holds no config.yaml (not a comix run directory)")
        cfg = load_config(str(run_dir / "config.yaml"), args.overrides)
        check_resume_config(run_dir, cfg)
        RUN_DIR = run_dir
        return (cfg, run_dir, *load_inputs(cfg))
    cfg = load_config(args.config, args.overrides)
    if getattr(args, "methods", None):
        cfg.methods = list(args.methods)
    if getattr(args, "seeds", None):
        cfg.seeds = list(args.seeds)
    cfg.validate()
    stamp = time.strftime("%Y%m%d-%H%M%S")
    run_dir = Path(cfg.run_dir or f"runs/{default_name}{cfg.corpus.strip('/').split('/')[-1]}-{stamp}")
    cfg.run_dir = str(run_dir)
    check_writable(run_dir)
    loaded = load_inputs(cfg)
    run_dir.mkdir(parents=True, exist_ok=True)
    RUN_DIR = run_dir
    text = yaml.safe_dump(to_dict(cfg), sort_keys=False)
    lock = json.dumps(flat_config(cfg), indent=1)
    atomic_write(run_dir / CONFIG_LOCK, lambda p: Path(p).write_text(lock))
    atomic_write(run_dir / "config.yaml", lambda p: Path(p).write_text(text))
    from .data import describe_partition
    part = json.dumps(describe_partition(loaded[2]), indent=1)  # the same for every method of the run
    atomic_write(run_dir / "partition.json", lambda p: Path(p).write_text(part))
    return (cfg, run_dir, *loaded)


def cmd_run(args) -> int:
    from .compare import metric_title
    from .files import atomic_write
    from .runner import run_spec
    from .specs import spec_dirname

    console = _console()
    cfg, run_dir, model, _, users, table, server_data = _prepare(args, "")
    console.print(f"[bold]comix run[/] {run_dir}  model={cfg.model} corpus={cfg.corpus} "
                  f"device={model.device} precision={cfg.precision}\n{table}")
    results = [run_spec(cfg, spec, cfg.seed, run_dir / spec_dirname(spec), model, users, console, server_data)
               for spec in cfg.methods]
    md = results_table(results, [u.name for u in users])
    atomic_write(run_dir / "results.md", lambda p: Path(p).write_text(
        f"{metric_title(results)} per user ({cfg.model}, {cfg.corpus}, seed {cfg.seed})\n\n{md}\n"))
    atomic_write(run_dir / "results.json", lambda p: Path(p).write_text(json.dumps(results, indent=2)))
    from .compare import MANY_USERS
    print(md if len(users) <= MANY_USERS else results_summary(results) + f"\n(per user: {run_dir}/results.md)")
    console.print(f"results: {run_dir}/results.md (per method: metrics.jsonl, results.json"
                  f"{', adapters/' if not cfg.keep_checkpoints else ', checkpoint.pt'})")
    return 0


def cmd_compare(args) -> int:
    from .compare import (MANY_USERS, collect, curves, global_model_tables, metric_title, overhead_table,
                          plot_assignment, plot_curves, plot_global_model, plot_privacy, privacy_table, references,
                          summary_tables)
    from .files import atomic_write
    from .runner import run_spec
    from .specs import spec_dirname

    console = _console()
    cfg, run_dir, model, _, users, table, server_data = _prepare(args, "compare-")
    seeds = cfg.seeds or [cfg.seed]
    console.print(f"[bold]comix compare[/] {run_dir}  methods={' '.join(cfg.methods)} seeds={seeds}\n{table}")
    for seed in seeds:
        for spec in cfg.methods:
            run_spec(cfg, spec, seed, run_dir / f"seed{seed}" / spec_dirname(spec), model, users, console,
                     server_data)
    results = collect(run_dir, cfg.methods, seeds)
    # the users the results score: the devices, or the server's test domains (DeepFusion)
    scored = {k for by in results.values() for r in by.values() for k in r["per_user"]}
    names = [u.name for u in users if u.name in scored] + sorted(scored - {u.name for u in users})
    md = summary_tables(results, names)
    title = metric_title([r for by in results.values() for r in by.values()])
    setup = f"mode {cfg.data.mode}" if all(u.task == "lm" for u in users) else \
        f"partition {cfg.data.partition}" + (f", alpha {cfg.data.alpha}" if cfg.data.partition == "dirichlet" else "")
    header = (f"{title} ({cfg.model}, {cfg.corpus}, {setup}, seeds {seeds}): "
              "mean over users (of the last round), then mean (std) over seeds\n\n")
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
    print(shown + "\n\n" + overhead + (f"\n\n{global_tables}" if global_tables else ""))
    console.print(f"wrote {run_dir}/compare.md, compare.json" + "".join(f", {f}" for f in drawn))
    return 0


DEMO_CONFIG = """# written by `comix flower-demo`: a tiny CoMiGS job on the built-in multilingual corpus
model: {model}
corpus: multilingual
methods: [{method}]
seed: 42
data: {{valid_tokens: 2048, test_tokens: 1024}}
train: {{rounds: {rounds}, local_steps: 2, batch_size: 2, seq_len: 64, tau: 2, router_steps: 1, eval_every: 1}}
"""


def cmd_flower_demo(args) -> int:
    """SuperLink + N SuperNodes on 127.0.0.1 (TLS + SuperNode auth unless --insecure), a tiny
    CoMiGS run through `flwr run`, then every process stopped."""
    import tempfile

    from .engines.flower.deploy import Federation

    console = _console()
    users = ["de", "fr", "it", "nl"][:args.clients]
    work = Path(args.workdir or tempfile.mkdtemp(prefix="comix-flower-"))
    work.mkdir(parents=True, exist_ok=True)
    config = work / "demo.yaml"
    config.write_text(DEMO_CONFIG.format(model=args.model, method=args.method, rounds=args.rounds))
    t0 = time.time()
    with Federation(work, insecure=args.insecure) as fed:
        fed.start_superlink()
        console.print(f"SuperLink on {fed.address} ({'INSECURE' if args.insecure else 'TLS + SuperNode auth'}), "
                      f"logs in {work}")
        for c, user in enumerate(users):
            fed.start_supernode(c, {"data": "multilingual", "user": user, "state-dir": str(work / "device-state")})
        console.print(f"{len(users)} SuperNodes started; running {args.method} for {args.rounds} rounds ...")
        res = fed.run({"config": str(config), "method": args.method, "run-dir": str(work / "run"),
                       "clients": len(users)}, timeout=args.timeout)
    out = work / "run" / args.method / "results.json"
    if res.returncode != 0 or not out.exists():
        print(f"comix: error: the Flower run failed (see {work}/*.log)\n{res.stdout[-2000:]}{res.stderr[-2000:]}",
              file=sys.stderr)
        return 1
    result = json.loads(out.read_text())
    print(results_table([result], users))
    console.print(f"done in {time.time() - t0:.0f} s; every process stopped; metrics in {out.parent}")
    return 0


def cmd_flower_certs(args) -> int:
    from .engines.flower.deploy import make_certificates
    c = make_certificates(args.directory, hosts=tuple(args.host))
    print(f"CA certificate (copy to every device): {c.ca}\nSuperLink certificate: {c.cert}\nSuperLink key: {c.key}")
    return 0


def cmd_flower_key(args) -> int:
    from .engines.flower.deploy import make_node_key
    private, public = make_node_key(args.directory, args.name)
    print(f"private key (stays on the device): {private}\npublic key (register on the server): {public}")
    return 0


def cmd_ppl(args) -> int:
    from .data import SplitConfig, builtin, make_user_data
    from .eval import perplexity
    from .models import load_base_model
    from .runtime import resolve

    runtime = resolve(args.device, args.precision)
    model, tok = load_base_model(args.model)
    model = runtime.prepare_base(model)
    print(f"| corpus | user | test tokens | perplexity ({args.model}) |\n|---|---|---|---|")
    for corpus in args.corpus:
        users = make_user_data(builtin(corpus), tok, SplitConfig(test_tokens=args.test_tokens or None))
        for u in users:
            with runtime.autocast():
                ppl = perplexity(model, u.test, args.seq_len, args.batch_size)
            print(f"| {corpus} | {u.name} | {len(u.test)} | {ppl:.2f} |", flush=True)
    return 0


def cmd_data(args) -> int:
    from .config import load_config
    cfg = load_config(None, [f"corpus={args.corpus}", *args.overrides])
    from .data import load_corpus, make_user_data, token_table
    from .models import load_base_model
    _, tok = load_base_model(cfg.model)
    print(token_table(make_user_data(load_corpus(cfg.corpus), tok, cfg.data)))
    return 0


def cmd_export(args) -> int:
    from .export import export_personal
    out = export_personal(Path(args.dir), args.user, Path(args.out), method=args.method, merged=args.merged,
                          static=args.static)
    man = json.loads((out / "manifest.json").read_text())
    print(f"exported {man['method']} / {args.user} ({man['kind']}) to {out}")
    if man["kind"] == "lora":
        print(f"  PEFT: PeftModel.from_pretrained(base, '{out}')" + (f"; merged model: {out}/merged" if args.merged else ""))
    else:
        print(f"  {len(man['experts'])} experts as PEFT folders under {out}/experts, routers in {out}/routers.safetensors"
              + (f"; static approximation: {out}/static" if args.static else ""))
    print(f"  exact model: comix.load_personal('{out}'); try: comix generate {out} \"Hello\"")
    return 0


def cmd_generate(args) -> int:
    import torch

    from .export import load_personal
    model, tok = load_personal(args.dir)
    ids = tok(args.prompt, return_tensors="pt")["input_ids"]
    with torch.inference_mode():
        out = model.generate(input_ids=ids, max_new_tokens=args.max_new_tokens, do_sample=False,
                             pad_token_id=tok.pad_token_id or tok.eos_token_id)
    print(args.prompt + tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True))
    return 0


def config_help() -> str:
    """Methods and every config key with its default (for `comix run --help`)."""
    import dataclasses
    import textwrap

    from .algorithms import METHODS
    from .config import RunConfig

    lines = ["methods (methods=[a,b] or a spec such as hetlora:reg=0.05):",
             textwrap.fill(", ".join(METHODS), 96, initial_indent="  ", subsequent_indent="  "),
             "", "config keys (key=value; sections take section.key=value):"]
    cfg = RunConfig()
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if dataclasses.is_dataclass(value):
            items = ", ".join(f"{g.name}={getattr(value, g.name)!r}" for g in dataclasses.fields(value))
            lines.append(textwrap.fill(f"{f.name}: {items}", 96, initial_indent="  ", subsequent_indent="      "))
        else:
            lines.append(f"  {f.name}={value!r}")
    lines += ["", "the defaults above are the main job; README.md and configs/ have recipes"]
    return "\n".join(lines)


def _resume_hint(args) -> str:
    """After a run has started (its directory exists), how to continue it."""
    if RUN_DIR is not None and args.cmd in ("run", "compare") and (RUN_DIR / "config.yaml").exists():
        return f"; continue with: comix {args.cmd} --resume {RUN_DIR}"
    return ""


def main(argv=None) -> int:
    global RUN_DIR
    from . import __version__

    RUN_DIR = None

    ap = argparse.ArgumentParser(prog="comix", description="Collaborative fine-tuning with mixtures of LoRA experts")
    ap.add_argument("--version", action="version", version=f"comix {__version__}")
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="run a config's methods (no config: the main job)", epilog=config_help(),
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    r.add_argument("config", nargs="?", help="YAML recipe (see configs/)")
    r.add_argument("overrides", nargs="*", help="key=value, e.g. train.rounds=2 methods=[local]")
    r.add_argument("--resume", metavar="RUN_DIR", help="continue a killed run")
    p = sub.add_parser("ppl", help="pretrained perplexity on the built-in test splits")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--corpus", nargs="+", default=["topics", "multilingual"])
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--test-tokens", type=int, default=0, help="cap per user (0 = the whole test split)")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    p.add_argument("--precision", default="fp32", choices=("fp32", "bf16", "fp16"))
    c = sub.add_parser("compare", help="methods x seeds grid: Table 1/5-style tables and learning curves")
    c.add_argument("config", nargs="?", help="YAML recipe (see configs/)")
    c.add_argument("overrides", nargs="*", help="key=value overrides for every run")
    c.add_argument("--methods", nargs="+", metavar="SPEC", help="method specs, e.g. local comigs-1g1s hetlora:reg=0.05")
    c.add_argument("--seeds", nargs="+", type=int, help="e.g. 42 45 47")
    c.add_argument("--resume", metavar="RUN_DIR", help="finish an interrupted grid (finished runs are skipped)")
    f = sub.add_parser("flower-demo", help="loopback Flower federation (TLS + auth), a tiny CoMiGS run, all stopped")
    f.add_argument("--clients", type=int, default=3, choices=(1, 2, 3, 4))
    f.add_argument("--method", default="comigs-1g1s")
    f.add_argument("--model", default="tiny-llama")
    f.add_argument("--rounds", type=int, default=2)
    f.add_argument("--workdir", help="where certificates, keys, logs and results go (default: a temp dir)")
    f.add_argument("--insecure", action="store_true", help="no TLS, no SuperNode auth (prints a warning)")
    f.add_argument("--timeout", type=float, default=1200)
    fc = sub.add_parser("flower-certs", help="a CA and a SuperLink TLS certificate")
    fc.add_argument("directory")
    fc.add_argument("--host", nargs="+", default=["127.0.0.1", "localhost"], help="the SuperLink's addresses")
    fk = sub.add_parser("flower-key", help="an ECDSA key pair for one SuperNode")
    fk.add_argument("directory")
    fk.add_argument("name")
    d = sub.add_parser("data", help="token counts per user and split")
    d.add_argument("corpus", nargs="?", default="multilingual")
    d.add_argument("overrides", nargs="*")
    e = sub.add_parser("export", help="a user's personalised model as PEFT folders and a manifest (comix.load_personal)")
    e.add_argument("dir", help="a run folder (with --method when it holds several) or a method folder")
    e.add_argument("--user", required=True)
    e.add_argument("--out", required=True, help="a new folder")
    e.add_argument("--method", help="the method spec, when the run holds several")
    e.add_argument("--merged", action="store_true", help="plain LoRA: also the base with the LoRA merged (merged/)")
    e.add_argument("--static", action="store_true",
                   help="mixtures: also one PEFT adapter of the experts at the user's mean gate (static/, approximate)")
    g = sub.add_parser("generate", help="a greedy completion from an exported model")
    g.add_argument("dir", help="a `comix export` folder")
    g.add_argument("prompt")
    g.add_argument("--max-new-tokens", type=int, default=40)
    args = ap.parse_args(argv)
    if args.cmd in ("run", "compare") and args.config and "=" in args.config:  # `comix run key=value` (no file)
        args.overrides, args.config = [args.config, *args.overrides], None
    try:
        return {"run": cmd_run, "compare": cmd_compare, "ppl": cmd_ppl, "data": cmd_data,
                "flower-demo": cmd_flower_demo, "flower-certs": cmd_flower_certs,
                "flower-key": cmd_flower_key, "export": cmd_export, "generate": cmd_generate}[args.cmd](args)
    except (ValueError, FileNotFoundError) as err:
        print(f"comix: error: {err}" + _resume_hint(args), file=sys.stderr)
        return 2
    except OSError as err:  # an unwritable or full disk, a path through a file: one line, never a traceback
        what = f"{err.strerror or err}" + (f": {err.filename}" if err.filename else "")
        print(f"comix: error: {what}" + _resume_hint(args), file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        if RUN_DIR is not None and args.cmd in ("run", "compare"):
            print(f"\ncomix: interrupted; continue with: comix {args.cmd} --resume {RUN_DIR}", file=sys.stderr)
        else:
            print("\ncomix: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
