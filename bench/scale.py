"""Many clients on one machine: peak RAM and time per round against the number of clients.

    python bench/scale.py [--quick]

Each configuration runs in its own process (peak RSS = that process's VmHWM): CoMiGS-1G1S,
in-process engine, client states offloaded to disk (one file per client and round), clients
from a Dirichlet(0.5) split of the built-in ``topics`` corpus, 10 clients sampled per round.
  * tiny random Llama: 10 / 100 / 1000 clients (10 sampled per round), then 1000 clients with
    10 / 20 / 40 sampled per round (time per round should grow with the sampled, not the total);
  * SmolLM2-135M: 100 clients, 10 sampled per round, 2 rounds of 2 steps (batch 4 x 64).
Evaluation (every client's valid/test perplexity) runs once, after the last round, and is
timed apart from the training rounds. Prints a table and writes bench/results/scale.md.
"""
from __future__ import annotations

import footprint  # noqa: F401  (prints wall time and peak RSS at exit)

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def child(spec: dict) -> dict:
    """One configuration, in this process."""
    import torch

    from comix.algorithms import TrainConfig, make_algorithm
    from comix.data import SplitConfig, builtin, make_user_data
    from comix.engines import run_method
    from comix.models import LoRAConfig, load_base_model

    torch.set_num_threads(spec.get("threads", 2))
    t0 = time.time()
    model, tok = load_base_model(spec["model"])
    users = make_user_data(builtin("topics"), tok, SplitConfig(clients=spec["clients"], alpha=0.5,
                                                               valid_tokens=spec["eval_tokens"],
                                                               test_tokens=spec["eval_tokens"]))
    setup_s = time.time() - t0
    train = TrainConfig(rounds=spec["rounds"], local_steps=spec["steps"], batch_size=spec["batch"],
                        seq_len=spec["seq_len"], tau=spec["steps"], router_steps=1, clients_per_round=spec["sampled"],
                        eval_every=spec["rounds"], eval_batch_size=8, eval_splits=["valid", "test"])
    algo = make_algorithm("comigs-1g1s", LoRAConfig(), train, len(users))
    rounds = []
    with tempfile.TemporaryDirectory() as out:
        t1 = time.time()
        res = run_method(algo, model, users, Path(out), seed=0, offload=True, progress=lambda p: rounds.append(p["seconds"]))
        total = time.time() - t1
    hwm = next(int(line.split()[1]) for line in Path("/proc/self/status").read_text().splitlines()
               if line.startswith("VmHWM"))
    return {**spec, "setup_s": setup_s, "round_s": statistics.median(rounds[:-1]) if len(rounds) > 1 else rounds[0],
            "last_round_with_eval_s": rounds[-1], "total_s": total, "peak_rss_mb": hwm / 1024,
            "mean_test_ppl": res["mean_test_ppl"]}


def run(spec: dict) -> dict:
    proc = subprocess.run([sys.executable, __file__, "--child", json.dumps(spec)], capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(proc.stderr[-3000:])
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="tiny model only, 10 and 100 clients")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(child(json.loads(args.child))))
        return 0
    tiny = dict(model="tiny-llama", rounds=4, steps=2, batch=4, seq_len=64, eval_tokens=256)
    specs = [dict(tiny, clients=n, sampled=10) for n in ((10, 100) if args.quick else (10, 100, 1000))]
    if not args.quick:
        specs += [dict(tiny, clients=1000, sampled=k) for k in (20, 40)]
        specs += [dict(model="smollm2-135m", rounds=2, steps=2, batch=4, seq_len=64, eval_tokens=256,
                       clients=100, sampled=10)]
    rows = ["| model | clients | sampled / round | time / round (s) | last round + eval of all (s) | "
            "peak RAM (MB) | setup (s) |", "|---|---|---|---|---|---|---|"]
    for spec in specs:
        r = run(spec)
        rows.append(f"| {r['model']} | {r['clients']} | {r['sampled']} | {r['round_s']:.2f} | "
                    f"{r['last_round_with_eval_s']:.1f} | {r['peak_rss_mb']:.0f} | {r['setup_s']:.1f} |")
        print(rows[-1], flush=True)
    text = "\n".join(rows) + "\n"
    out = ROOT / "bench" / "results" / "scale.md"
    out.write_text(f"`python bench/scale.py` on {platform.machine()} with {os.cpu_count()} CPU cores (CoMiGS-1G1S, "
                   "in-process, offloaded states, Dirichlet(0.5) clients of `topics`, 2 torch threads)\n\n" + text)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
