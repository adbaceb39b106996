"""A SmolLM2-135M user of the main job on a device's runtimes: for FedAvg (merged) and CoMiGS-1G1S
(the mixture, routers included), each format and precision ``comix export`` writes, the file's
size, its perplexity on the user's test split against comix's own model, and greedy generation's
tokens per second on this CPU.

    python bench/device_export.py [--run runs/quant-none] [--user de] [--new-tokens 64] [--precisions int8]

``--run``: a finished main job holding fedavg and comigs-1g1s (made with ``comix run
methods=[fedavg,comigs-1g1s] run_dir=RUN`` when the folder does not exist). The rows:
  * comix: the rebuilt user model in PyTorch (eager, fp32): the reference;
  * executorch fp32 / int8: the .pte run by ExecuTorch's Python runtime (XNNPACK, 2 threads);
  * gguf f16 / q8_0: the file read back by transformers' GGUF reader (perplexity), and by
    llama.cpp (llama-cpp-python, ``pip install -e ".[llamacpp]"``, built from source here: its
    perplexity over the same windows and its tokens/s) where it is installed.
Perplexity is over the same windows as comix's evaluation (the run's ``train.seq_len``, every
window of the split); generation starts from the split's first 32 tokens and makes ``--new-tokens``
greedily, after one untimed warm-up, median of 3. Writes bench/results/device-export.json;
``python bench/tables.py`` puts its table in docs/export.md. Run it alone on the machine.
"""
from __future__ import annotations

import footprint  # prints wall time and peak RSS at exit

import argparse
import datetime
import json
import math
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "bench" / "results" / "device-export.json"
# int8 last: its lowering is the slow one (a file is written after every row)
ROWS = [("fedavg", "comix", "fp32"), ("fedavg", "executorch", "fp32"), ("fedavg", "gguf", "f16"),
        ("fedavg", "gguf", "q8_0"), ("comigs-1g1s", "comix", "fp32"), ("comigs-1g1s", "executorch", "fp32"),
        ("fedavg", "executorch", "int8"), ("comigs-1g1s", "executorch", "int8")]


def windows(tokens: torch.Tensor, seq_len: int) -> list[torch.Tensor]:
    """The evaluation's windows: seq_len + 1 tokens each (inputs and their next tokens), the last shorter."""
    return [tokens[s:s + seq_len + 1].long() for s in range(0, len(tokens) - 1, seq_len)]


def timed(fn, reps: int = 3) -> float:
    fn()  # warm-up, untimed
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def torch_model(model, eos):
    """logits and greedy generation of a transformers model (comix's own, or a GGUF read back)."""
    def logits(ids):
        with torch.inference_mode():
            return model(input_ids=ids.reshape(1, -1)).logits[0]

    def generate(ids, n):
        with torch.inference_mode():
            out = model.generate(input_ids=ids.reshape(1, -1), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                                 pad_token_id=eos)
        return out[0, len(ids):].tolist()
    return logits, generate


def pte_model(pte):
    return (lambda ids: pte.logits(ids)[0]), (lambda ids, n: pte.generate(ids, n, eos=None))


def llama_cpp_model(path: Path, n_ctx: int):
    """llama.cpp through llama-cpp-python: every position's logits, greedy tokens, and the model
    (closed by the caller: llama-cpp-python's own finaliser fails at interpreter exit)."""
    from llama_cpp import Llama
    llm = Llama(model_path=str(path), n_ctx=n_ctx, n_threads=os.cpu_count(), logits_all=True, verbose=False)

    def logits(ids):
        llm.reset()
        llm.eval(ids.tolist())
        return torch.from_numpy(llm.scores[:len(ids)].copy())

    def generate(ids, n):
        llm.reset()
        out = []
        for token in llm.generate(ids.tolist(), top_k=1, temp=0.0, reset=True):
            out.append(token)
            if len(out) == n:
                break
        return out
    return logits, generate, llm


def perplexity(logits, wins) -> float:
    nll, n = 0.0, 0
    for w in wins:
        nll += torch.nn.functional.cross_entropy(logits(w[:-1]).float(), w[1:], reduction="sum").item()
        n += len(w) - 1
    return math.exp(nll / n)


def measure(logits, generate, wins, prompt, new_tokens) -> dict:
    made = []
    seconds = timed(lambda: made.append(generate(prompt, new_tokens)))
    return {"ppl": perplexity(logits, wins), "tokens_per_s": len(made[-1]) / seconds, "new_tokens": len(made[-1]),
            "greedy": made[-1]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run", default=str(ROOT / "runs" / "quant-none"))
    ap.add_argument("--user", default="de")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--precisions", nargs="+", choices=sorted({p for _, _, p in ROWS}),
                    help="measure only these exports (and comix's own rows, their reference); keep the "
                         "committed file's other rows")
    args = ap.parse_args(argv)
    kept = []
    if args.precisions and OUT.exists():
        kept = [r for r in json.loads(OUT.read_text())["rows"]
                if r["format"] != "comix" and r["precision"] not in args.precisions]
    torch.set_num_threads(os.cpu_count())
    run = Path(args.run)
    if not run.exists():
        from comix.cli import main as comix
        assert comix(["run", "methods=[fedavg,comigs-1g1s]", f"run_dir={run}"]) == 0
    from comix.config import load_config
    from comix.data import load_corpus, make_user_data
    from comix.personal import export_personal, rebuild, resolve_method_dir
    from comix.personal.formats import load_device
    cfg = load_config(str(run / "config.yaml"))
    out_dir = ROOT / "runs" / "device-export"
    shutil.rmtree(out_dir, ignore_errors=True)
    try:
        import llama_cpp
        llama_version = llama_cpp.__version__
    except ImportError:
        llama_version = None
    rows = []
    for method, fmt, precision in ROWS:
        if any((r["method"], r["format"], r["precision"]) == (method, fmt, precision) for r in kept):
            rows.append(next(r for r in kept if (r["method"], r["format"], r["precision"]) == (method, fmt, precision)))
            continue
        model, tok, _ = rebuild(resolve_method_dir(run, method), args.user)
        user = next(u for u in make_user_data(load_corpus(cfg.corpus), tok, cfg.data) if u.name == args.user)
        wins, prompt = windows(user.test, cfg.train.seq_len), user.test[:32].long()
        row = {"method": method, "format": fmt, "precision": precision}
        if fmt == "comix":
            row.update(measure(*torch_model(model.eval(), tok.eos_token_id), wins, prompt, args.new_tokens))
            row["file_bytes"] = None
        else:
            folder = out_dir / f"{method}-{fmt}-{precision}"
            start = time.perf_counter()
            export_personal(run, args.user, folder, method=method, format=fmt, precision=precision)
            row["export_s"] = time.perf_counter() - start
            man = json.loads((folder / "manifest.json").read_text())
            row["file_bytes"], row["xnnpack"] = man["file"]["bytes"], man["file"].get("xnnpack")
            loaded, _, _ = load_device(folder)
            if fmt == "executorch":
                row.update(measure(*pte_model(loaded), wins, prompt, args.new_tokens))
            else:  # the GGUF read back by transformers: its perplexity (speed is llama.cpp's, below)
                row["ppl"] = perplexity(torch_model(loaded, tok.eos_token_id)[0], wins)
                if llama_version:
                    logits, generate, llm = llama_cpp_model(folder / "model.gguf",
                                                            cfg.train.seq_len + args.new_tokens + 64)
                    got = measure(logits, generate, wins, prompt, args.new_tokens)
                    llm.close()
                    row.update(llama_cpp_ppl=got["ppl"], tokens_per_s=got["tokens_per_s"], greedy=got["greedy"],
                               new_tokens=got["new_tokens"])
        reference = next((r for r in rows if r["method"] == method and r["format"] == "comix"), row)
        row["ppl_vs_comix"] = row["ppl"] / reference["ppl"] - 1
        if "greedy" in row:
            row["greedy_equals_comix"] = row["greedy"] == reference["greedy"]
        print(f"{method} {fmt} {precision}: ppl {row['ppl']:.3f} ({100 * row['ppl_vs_comix']:+.2f} %), "
              f"{row.get('tokens_per_s', float('nan')):.1f} tokens/s, "
              f"{(row['file_bytes'] or 0) / 1e6:.1f} MB", flush=True)
        rows.append(row)
        write(rows, args, cfg, llama_version, argv)
    print(f"wrote {OUT}")
    return 0


def write(rows: list[dict], args, cfg, llama_version, argv) -> None:
    """The result file so far (temp file, then rename): a bench stopped in a slow row keeps the rest."""
    rows = [{k: v for k, v in row.items() if k != "greedy"} for row in rows]
    footprint.write_result(OUT, {
        "command": "python bench/device_export.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "base": cfg.model, "user": args.user, "seq_len": cfg.train.seq_len, "new_tokens": args.new_tokens,
        "machine": f"{os.cpu_count()} cores of an {footprint.cpu_name()}, alone",
        "date": datetime.date.today().isoformat(), "torch": torch.__version__,
        "executorch": __import__("importlib.metadata").metadata.version("executorch"), "llama_cpp": llama_version,
        "seconds": time.perf_counter() - footprint.START, "peak_rss_mb": footprint.peak_rss_mb(), "rows": rows})


if __name__ == "__main__":
    sys.exit(main())
