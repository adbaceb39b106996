"""``comix`` command line.

  comix run [CONFIG] [key=value ...]     run every method of the config (default: the main job)
  comix run --resume RUN_DIR             continue a killed run where it stopped
  comix recipes                          the built-in recipes (comix run small/table1-multilingual)
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



def _console():
    from rich.console import Console
    return Console(stderr=True)


RUN_DIR: Path | None = None  # the run directory being written (named in the Ctrl-C message)


def _set_run_dir(path: Path) -> None:
    global RUN_DIR
    RUN_DIR = path


def cmd_run(args) -> int:
    from .api import run
    run(args.config, *args.overrides, resume=args.resume, on_run_dir=_set_run_dir)
    return 0


def cmd_compare(args) -> int:
    from .api import compare
    compare(args.config, *args.overrides, methods=args.methods, seeds=args.seeds, resume=args.resume,
            on_run_dir=_set_run_dir)
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
    runtimes = args.client_runtime * len(users) if len(args.client_runtime) == 1 else args.client_runtime
    if len(runtimes) != len(users):
        print(f"comix: error: --client-runtime gives {len(runtimes)} runtimes for {len(users)} SuperNodes: one, or "
              "one per SuperNode", file=sys.stderr)
        return 2
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
            fed.start_supernode(c, {"data": "multilingual", "user": user, "state-dir": str(work / "device-state"),
                                    "client-runtime": runtimes[c]})  # where this device trains
        console.print(f"{len(users)} SuperNodes started ({', '.join(runtimes)}); running {args.method} for "
                      f"{args.rounds} rounds ...")
        res = fed.run({"config": str(config), "method": args.method, "run-dir": str(work / "run"),
                       "clients": len(users)}, timeout=args.timeout)
    out = work / "run" / args.method / "results.json"
    if res.returncode != 0 or not out.exists():
        print(f"comix: error: the Flower run failed (see {work}/*.log)\n{res.stdout[-2000:]}{res.stderr[-2000:]}",
              file=sys.stderr)
        return 1
    from .api import results_table
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
    from .config import with_data_seed
    cfg = load_config(None, [f"corpus={args.corpus}", *args.overrides])
    cfg = with_data_seed(cfg, cfg.seed)  # data.seed run or a mapping: the split of the run's seed
    from .data import load_corpus, make_user_data, token_table
    from .models.base import load_tokenizer
    corpus = load_corpus(cfg.corpus)  # an unknown corpus fails before anything loads
    print(token_table(make_user_data(corpus, load_tokenizer(cfg.model), cfg.data)))
    return 0


def cmd_export(args) -> int:
    from .personal import export_personal
    out = export_personal(Path(args.dir), args.user, Path(args.out), method=args.method, merged=args.merged,
                          static=args.static, with_base=args.with_base or None, format=args.format,
                          precision=args.precision, max_len=args.max_len)
    man = json.loads((out / "manifest.json").read_text())
    if man["kind"] in ("executorch", "gguf"):
        f = man["file"]
        name = f.get("pte") or f.get("gguf")
        print(f"exported {man['method']} / {man['user']} as {man['kind']} {man['precision']} to {out}/{name} "
              f"({f['bytes'] / 1e6:.2f} MB, tokenizer beside it)")
        print(f"  run it: {man['run'].format(out=out)}")
        if man.get("caveat"):
            print(f"  note: {man['caveat']}")
        return 0
    print(f"exported {man['method']} / {man.get('user', 'every user')} ({man['kind']}) to {out}")
    if man["kind"] == "lora":
        print(f"  PEFT: PeftModel.from_pretrained(base, '{out}')" + (f"; merged model: {out}/merged" if args.merged else ""))
    elif man["kind"] == "mixture":
        print(f"  {len(man['experts'])} experts as PEFT folders under {out}/experts, routers in {out}/routers.safetensors"
              + (f"; static approximation: {out}/static" if args.static else ""))
    elif man["kind"] == "global-moe":
        print(f"  the server's global model: AutoModelForCausalLM.from_pretrained('{out}/model')")
    else:
        print(f"  {man['note']}" + (f"; {len(man['experts'])} experts as PEFT folders under {out}/experts "
                                    "(approximations)" if man.get("experts") else ""))
    print(f"  exact model: comix.load_personal('{out}'); try: comix generate {out} \"Hello\"")
    if man.get("caveat"):
        print(f"  note: {man['caveat']}")
    return 0


def cmd_report(args) -> int:
    from .api import report
    page, md = report(Path(args.dir), routing=not args.no_routing)
    print(f"report: {page} (and {md})")
    return 0


def cmd_generate(args) -> int:
    import torch

    from .models.base import TINY
    from .personal import load_any
    model, tok = load_any(args.dir)
    manifest = Path(args.dir) / "manifest.json"
    if manifest.exists():  # what generates: the export's method, user and base (stderr: stdout is the text)
        m = json.loads(manifest.read_text())
        base = (m.get("base") or {}).get("spec", "?")
        print(f"model: {m.get('method')} for user {m.get('user')} on {base}" +
              (f" (a tiny model with random weights: its text says that the code runs, not what a method learnt)"
               if base in TINY else ""), file=sys.stderr)
    ids = tok(args.prompt, return_tensors="pt")["input_ids"]
    from .personal.device import PteModel
    if isinstance(model, PteModel):  # an ExecuTorch program: greedy, run by ExecuTorch's runtime
        print(args.prompt + tok.decode(model.generate(ids[0], args.max_new_tokens, tok.eos_token_id),
                                       skip_special_tokens=True))
        return 0
    with torch.inference_mode():
        out = model.generate(input_ids=ids, max_new_tokens=args.max_new_tokens, do_sample=False,
                             pad_token_id=tok.pad_token_id or tok.eos_token_id)
    print(args.prompt + tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True))
    return 0


def cmd_recipes(args) -> int:
    from .recipes import builtin_recipes
    recipes = builtin_recipes()
    width = max(len(name) for name, _ in recipes)
    for name, first in recipes:
        print(f"{name.ljust(width)}  {first[:110 - width]}")
    print(f"\n{len(recipes)} recipes; run one from any directory: comix run <name> [key=value ...]")
    return 0


def unknown_key(overrides: list[str]) -> str | None:
    """The first ``key=value`` whose key no config has, in load_config's words (cli_help.json:
    answered before torch is imported)."""
    import difflib

    from .cli_help import config_keys
    keys = config_keys()
    for item in overrides:
        key = item.split("=", 1)[0].strip()
        if "=" in item and key not in keys:
            close = difflib.get_close_matches(key, sorted(keys), n=1)
            return f"unknown config key {key!r}" + (f" (did you mean {close[0]}?)" if close else
                                                     " (comix run --help lists every key)")
    return None


def _resume_hint(args) -> str:
    """After a run has started (its directory exists), how to continue it."""
    if RUN_DIR is not None and args.cmd in ("run", "compare") and (RUN_DIR / "config.yaml").exists():
        return f"; continue with: comix {args.cmd} --resume {RUN_DIR}"
    return ""


def main(argv=None) -> int:
    global RUN_DIR
    from . import __version__

    RUN_DIR = None
    # transformers' / the hub's own loading bars would interleave with comix's progress
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    import warnings  # ... and the hub then warns each time a library asks for its bars back
    warnings.filterwarnings("ignore", message="Cannot enable progress bars", category=UserWarning)

    ap = argparse.ArgumentParser(prog="comix", description="Collaborative fine-tuning with mixtures of LoRA experts")
    ap.add_argument("--version", action="version", version=f"comix {__version__}")
    sub = ap.add_subparsers(dest="cmd", required=True)
    from .cli_help import render
    r = sub.add_parser("run", help="run a config's methods (no config: the main job)", epilog=render(),
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    r.add_argument("config", nargs="?", help="YAML recipe (see configs/)")
    r.add_argument("overrides", nargs="*", help="key=value, e.g. train.rounds=2 methods=[local]")
    r.add_argument("--resume", metavar="RUN_DIR", help="continue a killed run")
    defaults = argparse.ArgumentDefaultsHelpFormatter
    p = sub.add_parser("ppl", help="pretrained perplexity on the built-in test splits", formatter_class=defaults,
                       description="Perplexity of the frozen base model on each user's test split of built-in corpora.")
    p.add_argument("--model", default="smollm2-135m", help="smollm2-135m, tiny-llama, tiny-gpt2, tiny-qwen2, a hub id "
                   "or a local folder")
    p.add_argument("--corpus", nargs="+", default=["topics", "multilingual"], help="built-in corpora")
    p.add_argument("--seq-len", type=int, default=128, help="tokens per evaluation window")
    p.add_argument("--batch-size", type=int, default=8, help="windows per forward pass")
    p.add_argument("--test-tokens", type=int, default=0, help="cap per user (0 = the whole test split)")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    p.add_argument("--precision", default="fp32", choices=("fp32", "bf16", "fp16"))
    c = sub.add_parser("compare", help="methods x seeds grid: Table 1/5-style tables and learning curves")
    c.add_argument("config", nargs="?", help="YAML recipe (see configs/)")
    c.add_argument("overrides", nargs="*", help="key=value overrides for every run")
    c.add_argument("--methods", nargs="+", metavar="SPEC", help="method specs, e.g. local comigs-1g1s hetlora:reg=0.05")
    c.add_argument("--seeds", nargs="+", metavar="SEED", help="e.g. 42 45 47")
    c.add_argument("--resume", metavar="RUN_DIR", help="finish an interrupted grid (finished runs are skipped)")
    f = sub.add_parser("flower-demo", help="loopback Flower federation (TLS + auth), a tiny CoMiGS run, all stopped")
    f.add_argument("--clients", type=int, default=3, choices=(1, 2, 3, 4))
    f.add_argument("--method", default="comigs-1g1s")
    f.add_argument("--model", default="tiny-llama")
    f.add_argument("--rounds", type=int, default=2)
    f.add_argument("--workdir", help="where certificates, keys, logs and results go (default: a temp dir)")
    f.add_argument("--insecure", action="store_true", help="no TLS, no SuperNode auth (prints a warning)")
    f.add_argument("--timeout", type=float, default=1200)
    f.add_argument("--client-runtime", nargs="+", default=["pytorch"], choices=("pytorch", "executorch"),
                   help="where the SuperNodes' devices train: one for all, or one per SuperNode (executorch: each "
                        "local step in ExecuTorch's training runtime, docs/export.md)")
    fc = sub.add_parser("flower-certs", help="a CA and a SuperLink TLS certificate")
    fc.add_argument("directory")
    fc.add_argument("--host", nargs="+", default=["127.0.0.1", "localhost"], help="the SuperLink's addresses")
    fk = sub.add_parser("flower-key", help="an ECDSA key pair for one SuperNode")
    fk.add_argument("directory")
    fk.add_argument("name")
    d = sub.add_parser("data", help="token counts per user and split", formatter_class=defaults,
                       description="Token counts per user and split (CoMiGS Table 4) as a run would split the "
                                   "corpus; loads the model's tokenizer only.")
    d.add_argument("corpus", nargs="?", default="multilingual", help="a corpus name or folder (see comix run --help)")
    d.add_argument("overrides", nargs="*", help="key=value config keys, e.g. model=tiny-llama data.mode=ood")
    e = sub.add_parser("export", help="a user's personalised model (PEFT folders where they exist) or a run's global "
                       "model, with a manifest (comix.load_personal)")
    e.add_argument("dir", help="a run folder (with --method when it holds several) or a method folder")
    e.add_argument("--user", help="the user (every method with a model per user; not DeepFusion / FedJETS, whose "
                                   "global model serves everyone)")
    e.add_argument("--out", required=True, help="a new folder")
    e.add_argument("--method", help="the method spec, when the run holds several")
    e.add_argument("--merged", action="store_true", help="plain LoRA: also the base with the LoRA merged (merged/)")
    e.add_argument("--with-base", action="store_true",
                   help="also base/, the base model as a transformers folder that every PEFT folder names (default "
                        "for the tiny models comix builds): AutoPeftModelForCausalLM then loads the export offline")
    e.add_argument("--format", default="comix", choices=["comix", "executorch", "gguf"],
                   help="comix: adapters, PEFT folders and a manifest; executorch: the whole personalised model, routers "
                        "included, as an ExecuTorch .pte (XNNPACK); gguf: a plain-LoRA model merged, for llama.cpp / Ollama")
    e.add_argument("--precision", help="executorch: fp32 (default) | int8 (XNNPACK's quantiser); gguf: f16 (default) | q8_0")
    e.add_argument("--max-len", type=int, help="executorch: positions of the program's KV cache (default: the "
                                                "model's context, at most 512)")
    e.add_argument("--static", action="store_true",
                   help="mixtures: also one PEFT adapter of the experts at the user's mean gate (static/, approximate)")
    rp = sub.add_parser("report", help="report.html and report.md of a run or compare folder (tables, curves, "
                        "expert scores, token routing, traffic, privacy)")
    rp.add_argument("dir", help="a run, compare or method folder")
    rp.add_argument("--no-routing", action="store_true", help="skip the token routing maps (they rebuild each user model)")
    sub.add_parser("recipes", help="the built-in recipes (comix run <name> runs one from any directory)")
    g = sub.add_parser("generate", help="a greedy completion from an exported model")
    g.add_argument("dir", help="a `comix export` folder (an ExecuTorch or GGUF export too), a .pte of one, a PEFT "
                              "LoRA folder or a (merged) model folder")
    g.add_argument("prompt")
    g.add_argument("--max-new-tokens", type=int, default=40)
    args = ap.parse_args(argv)
    if args.cmd in ("run", "compare") and args.config and "=" in args.config:  # `comix run key=value` (no file)
        args.overrides, args.config = [args.config, *args.overrides], None
    if args.cmd == "compare":  # `--methods a b run_dir=x`, `--seeds 1 2 run_dir=x`: a trailing key=value is an override
        for name in ("methods", "seeds"):
            values = getattr(args, name) or []
            keep = [v for v in values if "=" not in v.split(":")[0]]
            args.overrides += [v for v in values if v not in keep]
            setattr(args, name, keep or None)
        bad = [s for s in args.seeds or [] if not s.lstrip("-").isdigit()]
        if bad:
            ap.error(f"argument --seeds: invalid int value: {bad[0]!r}")
        args.seeds = [int(s) for s in args.seeds] if args.seeds else None
    if args.cmd in ("run", "compare", "data") and unknown_key(args.overrides):
        print(f"comix: error: {unknown_key(args.overrides)}", file=sys.stderr)
        return 2
    try:
        return {"run": cmd_run, "compare": cmd_compare, "ppl": cmd_ppl, "data": cmd_data,
                "flower-demo": cmd_flower_demo, "flower-certs": cmd_flower_certs,
                "flower-key": cmd_flower_key, "export": cmd_export, "generate": cmd_generate,
                "report": cmd_report, "recipes": cmd_recipes}[args.cmd](args)
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
