"""Poisoned uploads against each server rule: what a few malicious devices do to FedAvg's global
model under ``server.aggregate=mean|median|trimmed_mean|krum`` and under the mean with
``privacy.server_clip``.

    python bench/poisoned.py                      # 3 seeds, both attacks, every rule (about 2 h a seed on one core of a 2-core Xeon)
    python bench/poisoned.py --seeds 42           # one seed

The soak (bench/soak.py) sends malformed uploads, which ``check_upload`` rejects before any rule
sees them; these are well-formed (right names, shapes, dtypes, finite) and so reach the rule:
  * ``sign-flip``: the attacker trains honestly, then sends payload - 10 x its update (the
    boosted sign-flipping attack of the Byzantine-robustness literature, e.g. Karimireddy, He &
    Jaggi, ICLR 2022, Sec. 6);
  * ``gaussian``: payload + noise whose norm is 10 x its honest update's (Blanchard et al.,
    NeurIPS 2017, Sec. 5, "Gaussian" Byzantine workers).
The same two of ten clients attack in every round (20 %); trimmed_mean trims 20 % at each end
(Flower's default beta 0.2) and Krum assumes f = 2. ``server_clip`` bounds each upload's update
to the median honest update norm of the clean mean run of the same seed (its metrics'
``update_norm``). What is scored is the global model after the last round on each *honest*
client's test split (FedAvg's personal model is the global one), the mean over the eight.

The model is SmolLM2-135M: the tests' tiny random Llama (vocabulary 257, width 32) does not learn
under LoRA at all (its clean run ends where it started, 228 perplexity), so no rule's effect
could show on it. The untrained model's score is in the result beside the clean run's: a rule is
read only where the clean run's gain over it is resolved over the seeds.
Writes ``bench/results/poisoned.json``; the runs go to ``runs/poisoned`` (``--work``), and a bench
stopped and started again skips the runs it finished there.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import shutil
import time
from pathlib import Path

import footprint  # prints wall time and peak RSS at exit

ROOT = Path(__file__).resolve().parents[1]
RULES = {"mean": [], "median": ["server.aggregate=median"], "trimmed_mean": ["server.aggregate=trimmed_mean"],
         "krum": ["server.aggregate=krum", "server.krum_f=2"], "server_clip": None}  # None: set from the clean run
ATTACKS = ("none", "sign-flip", "gaussian")
ATTACKERS = (0, 1)
SETTING = ["model=smollm2-135m", "corpus=topics", "methods=[fedavg]", "data.clients=10", "data.alpha=1.0",
           "data.valid_tokens=256", "data.test_tokens=1024", "train.rounds=4", "train.local_steps=3",
           "train.batch_size=2", "train.seq_len=128", "train.eval_every=4", "train.eval_splits=[test]"]


def poison(attack: str, upload: dict, payload: dict, seed: int, rnd: int, client: int) -> dict:
    """The attacker's well-formed upload from its honest one."""
    import torch
    update = {n: upload[n].float() - payload[n].float() for n in upload}
    if attack == "sign-flip":
        return {n: (payload[n].float() - 10 * update[n]).to(upload[n].dtype) for n in upload}
    gen = torch.Generator().manual_seed(seed * 1000 + rnd * 10 + client)
    noise = {n: torch.randn(t.shape, generator=gen) for n, t in update.items()}
    scale = 10 * sum(float(d.pow(2).sum()) for d in update.values()) ** 0.5 / \
        sum(float(z.pow(2).sum()) for z in noise.values()) ** 0.5
    return {n: (payload[n].float() + scale * noise[n]).to(upload[n].dtype) for n in upload}


def run(overrides: list[str], attack: str, seed: int, out: Path, method: str = "fedavg") -> dict:
    """One run of ``method`` in process with ``attack`` by ``ATTACKERS``: the honest clients' mean
    test perplexity and update norms."""
    from comix.config import load_config
    from comix.engines.inprocess import InProcess
    from comix.engines.server import serve
    from comix.engines.states import StateStore
    from comix.runner import load_inputs
    from comix.runtime import resolve
    from comix.specs import build_algorithm, server_context

    class Poisoned(InProcess):
        def train(self, payloads):
            replies = super().train(payloads)
            if attack == "none":
                return replies
            return {c: (poison(attack, r[0], payloads[c], seed, self.round, c), r[1])
                    if c in ATTACKERS and not isinstance(r, str) else r for c, r in replies.items()}

    done = out / "bench.json"  # (a run finished before the bench was stopped: read, not run again)
    if done.exists():
        return json.loads(done.read_text())
    shutil.rmtree(out, ignore_errors=True)  # what a stopped run left half-written
    cfg = load_config(None, [*SETTING, *overrides, f"seed={seed}"])
    model, _, users, _, _ = load_inputs(cfg)
    algo = build_algorithm(cfg, method, len(users))
    method_dir = out / method
    algo.server = server_context(cfg, method_dir, cfg.seed)
    transport = Poisoned(algo, model, users, cfg.seed, StateStore(), resolve(cfg.device, cfg.precision))
    serve(algo, transport, [u.name for u in users], method_dir, seed=cfg.seed)
    rows = [json.loads(ln) for ln in (method_dir / "metrics.jsonl").read_text().splitlines()]
    result = json.loads((method_dir / "results.json").read_text())
    honest = [u.name for c, u in enumerate(users) if c not in ATTACKERS]
    figures = {"honest_test_ppl": statistics.fmean(result["per_user"][u]["test_ppl"] for u in honest),
               "honest_update_norms": [r["update_norm"] for r in rows if "update_norm" in r and r["user"] in honest]}
    footprint.write_result(done, figures)
    return figures


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[42, 45, 47])
    ap.add_argument("--result", type=Path, default=ROOT / "bench" / "results" / "poisoned.json")
    ap.add_argument("--work", type=Path, default=ROOT / "runs" / "poisoned",
                    help="the runs' folder; a bench stopped and started again skips the runs it finished there")
    args = ap.parse_args()
    import torch
    torch.set_num_threads(1)
    table: dict[str, dict[str, list[float]]] = {a: {r: [] for r in RULES} for a in ATTACKS}
    untrained, clips = [], []
    for seed in args.seeds:
        base = args.work / str(seed)
        untrained.append(run([], "none", seed, base / "pretrained", "pretrained")["honest_test_ppl"])
        clean = run([], "none", seed, base / "clean")
        clip = statistics.median(clean["honest_update_norms"])
        clips.append(clip)
        for attack in ATTACKS:
            for rule, extra in RULES.items():
                if attack == "none" and rule == "mean":
                    ppl = clean["honest_test_ppl"]
                else:
                    extra = [f"privacy.server_clip={clip}"] if extra is None else extra
                    ppl = run(extra, attack, seed, base / f"{attack}-{rule}")["honest_test_ppl"]
                table[attack][rule].append(ppl)
                print(f"seed {seed} {attack:>9} {rule:>12}: honest test ppl {ppl:.3f}", flush=True)
    fig = {"setting": SETTING, "attackers": list(ATTACKERS), "clients": 10, "seeds": args.seeds,
           "honest_test_ppl": table, "pretrained_honest_test_ppl": untrained, "server_clip": clips,
           "command": "python bench/poisoned.py " + " ".join(sys.argv[1:]), "date": time.strftime("%Y-%m-%d"),
           "torch": torch.__version__,
           "machine": f"{os.cpu_count()} cores of an {footprint.cpu_name()}, torch threads 1",
           "bench_peak_rss_mb": round(footprint.peak_rss_mb(), 1)}
    footprint.write_result(args.result, fig)
    print(f"wrote {args.result}")


if __name__ == "__main__":
    main()
