"""``comix`` command line.

  comix run [CONFIG] [key=value ...]     run every method of the config (default: the main job)
  comix run --resume RUN_DIR             continue a killed run where it stopped
  comix ppl [--model M] [--corpus C ...] pretrained perplexity on the built-in test splits
  comix data [CORPUS] [key=value ...]    token counts per user and split (CoMiGS Table 4)
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import yaml


def _console():
    from rich.console import Console
    return Console(stderr=True)


def _setup(cfg):
    import torch

    from .data import check_seq_len, load_corpus, make_user_data, token_table
    from .models import load_base_model

    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    model, tok = load_base_model(cfg.model)
    users = make_user_data(load_corpus(cfg.corpus), tok, cfg.data)
    check_seq_len(users, cfg.train.seq_len)
    return model, tok, users, token_table(users)


def results_table(results: list[dict], users: list[str]) -> str:
    head = "| method | " + " | ".join(users) + " | mean |"
    rows = [head, "|" + "---|" * (len(users) + 2)]
    for r in results:
        cells = [f"{r['per_user'][u]['test_ppl']:.2f}" for u in users]
        rows.append(f"| {r['method']} | " + " | ".join(cells) + f" | {r['mean_test_ppl']:.2f} |")
    return "\n".join(rows)


def cmd_run(args) -> int:
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

    from .algorithms import make_algorithm
    from .config import load_config, to_dict
    from .engines import run_method
    from .engines.inprocess import atomic_write

    console = _console()
    if args.resume:
        run_dir = Path(args.resume)
        if not (run_dir / "config.yaml").exists():
            raise ValueError(f"--resume: {run_dir} holds no config.yaml (not a comix run directory)")
        cfg = load_config(str(run_dir / "config.yaml"), args.overrides)
    else:
        cfg = load_config(args.config, args.overrides)
        run_dir = Path(cfg.run_dir or f"runs/{cfg.corpus.strip('/').split('/')[-1]}-{time.strftime('%Y%m%d-%H%M%S')}")
        cfg.run_dir = str(run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        text = yaml.safe_dump(to_dict(cfg), sort_keys=False)
        atomic_write(run_dir / "config.yaml", lambda p: Path(p).write_text(text))
    model, _, users, table = _setup(cfg)
    console.print(f"[bold]comix run[/] {run_dir}  model={cfg.model} corpus={cfg.corpus}\n{table}")
    results = []
    for method in cfg.methods:
        out = run_dir / method
        if (out / "results.json").exists():  # finished earlier: keep it
            results.append(json.loads((out / "results.json").read_text()))
            console.print(f"{method}: done earlier, mean test ppl {results[-1]['mean_test_ppl']:.2f}")
            continue
        n_clients = 1 if method == "centralized" else len(users)
        algo = make_algorithm(method, cfg.lora, cfg.train, n_clients, cfg.comigs.experts, cfg.comigs.top_k)
        with Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.fields[info]}"),
                      TimeElapsedColumn(), TimeRemainingColumn(), console=console) as bar:
            task = bar.add_task(method, total=cfg.train.rounds if algo.trains else 1, info="")

            def progress(p):
                ppl = [f"{x:.1f}" for x in p["test_ppl"] if x is not None]
                info = f"round {p['round']}/{p['rounds']} loss {p['train_loss']:.3f}" + (
                    f" test ppl {' '.join(ppl)}" if ppl else "")
                bar.update(task, completed=p["round"], info=info)
                bar.console.log(f"{method} {info} ({p['seconds']:.0f}s)")

            res = run_method(algo, model, users, out, seed=cfg.seed, resume=True, offload=cfg.offload,
                             progress=progress)
            bar.update(task, completed=bar.tasks[0].total)
        results.append(res)
    names = [u.name for u in users]
    md = results_table(results, names)
    atomic_write(run_dir / "results.md", lambda p: Path(p).write_text(
        f"Test perplexity per user ({cfg.model}, {cfg.corpus}, seed {cfg.seed})\n\n{md}\n"))
    atomic_write(run_dir / "results.json", lambda p: Path(p).write_text(json.dumps(results, indent=2)))
    print(md)
    return 0


def cmd_ppl(args) -> int:
    from .data import SplitConfig, builtin, make_user_data
    from .eval import perplexity
    from .models import load_base_model

    model, tok = load_base_model(args.model)
    print(f"| corpus | user | test tokens | perplexity ({args.model}) |\n|---|---|---|---|")
    for corpus in args.corpus:
        users = make_user_data(builtin(corpus), tok, SplitConfig(test_tokens=args.test_tokens or None))
        for u in users:
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


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="comix", description="Collaborative fine-tuning with mixtures of LoRA experts")
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="run a config's methods (no config: the main job)")
    r.add_argument("config", nargs="?", help="YAML recipe (see configs/)")
    r.add_argument("overrides", nargs="*", help="key=value, e.g. train.rounds=2 methods=[local]")
    r.add_argument("--resume", metavar="RUN_DIR", help="continue a killed run")
    p = sub.add_parser("ppl", help="pretrained perplexity on the built-in test splits")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--corpus", nargs="+", default=["topics", "multilingual"])
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--test-tokens", type=int, default=0, help="cap per user (0 = the whole test split)")
    d = sub.add_parser("data", help="token counts per user and split")
    d.add_argument("corpus", nargs="?", default="multilingual")
    d.add_argument("overrides", nargs="*")
    args = ap.parse_args(argv)
    if args.cmd == "run" and args.config and "=" in args.config:  # `comix run key=value` (no file)
        args.overrides, args.config = [args.config, *args.overrides], None
    try:
        return {"run": cmd_run, "ppl": cmd_ppl, "data": cmd_data}[args.cmd](args)
    except (ValueError, FileNotFoundError) as err:
        print(f"comix: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
