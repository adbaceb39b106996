"""comix's client round against a FlowerTune-style one: a ``transformers.Trainer`` built afresh
every client round over the same model, LoRA and batches (the main job's FedAvg on SmolLM2-135M,
4 x 128 tokens a step). FlowerTune's client apps (flwr's LLM templates) build an SFTTrainer per
``fit``; the peer here is its core, a Trainer with comix's own loss (``lm_loss``: the products
are the same code), its default fused AdamW (``adamw_torch_fused``), linear decay to 0 within the
round and ``max_grad_norm``. comix runs the same update (``schedule=round_linear``,
``optimizer_state=round``, ``grad_clip`` = the Trainer's), so the two rounds' adapters must agree
(checked each round, relative norm), and the time and memory beside the products are what differ.

Time (one process, the two rounds interleaved after a warm-up round each, the background quiet):
each round's wall time, split into the loss's forward (``lm_loss``), its backward
(``torch.autograd.grad`` / ``backward``), the optimiser step (``AdamW.step``) and the rest
(clipping, schedules, bookkeeping; the Trainer's set-up), per optimiser step. Memory (one
process per side, ``--only``): peak RSS and its rise over the loaded model during the rounds.

    python bench/trainer_peer.py [--rounds 6] [--steps 4] [--out bench/results/trainer-peer.json]
"""
from __future__ import annotations

import footprint  # noqa: F401  (prints wall time and peak RSS at exit)

import argparse
import contextlib
import json
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import date
from pathlib import Path

import torch

from comix.algorithms import ClientContext, ClientState, TrainConfig, make_algorithm
from comix.algorithms import training
from comix.data import SplitConfig, load_corpus, make_user_data
from comix.data.splits import sample_batch
from comix.engines.device import fresh_adapters
from comix.engines.inprocess import ClientModels
from comix.models import LoRAConfig, load_base_model

ROOT = Path(__file__).resolve().parents[1]


class Clock:
    """Seconds spent in the loss's forward, its backward and the optimiser's step, by wrapping the
    functions both sides call (found by attribute at call time, so both see the wrappers)."""

    def __init__(self):
        self.seconds = {"forward": 0.0, "backward": 0.0, "optimizer": 0.0}
        self.steps = 0

    def _timed(self, key, fn):
        def run(*a, **k):
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                self.seconds[key] += time.perf_counter() - t
                self.steps += key == "optimizer"
        return run

    @contextlib.contextmanager
    def on(self):
        saved = training.lm_loss, torch.autograd.grad, torch.autograd.backward, torch.optim.AdamW.step
        training.lm_loss = self._timed("forward", saved[0])
        torch.autograd.grad = self._timed("backward", saved[1])
        torch.autograd.backward = self._timed("backward", saved[2])
        torch.optim.AdamW.step = self._timed("optimizer", saved[3])
        try:
            yield self
        finally:
            training.lm_loss, torch.autograd.grad, torch.autograd.backward, torch.optim.AdamW.step = saved


def setting(rounds: int, steps: int, model: str = "smollm2-135m", batch: int = 4, seq_len: int = 128):
    """The main job's FedAvg client 0: SmolLM2-135M, its LoRA, the rounds' batches drawn once
    (one round more, the warm-up's)."""
    base, tok = load_base_model(model)
    users = make_user_data(load_corpus("multilingual"), tok, SplitConfig(mode="in", valid_tokens=16384, test_tokens=2048))
    train = TrainConfig(rounds=rounds, local_steps=steps, batch_size=batch, seq_len=seq_len, lr=2e-3,
                        schedule="round_linear", optimizer_state="round", grad_clip=1.0)
    algo = make_algorithm("fedavg", LoRAConfig(), train, len(users))
    client = ClientModels(base, algo).for_client(0)
    start = algo.adapters_of(fresh_adapters(client, 42))
    gen = torch.Generator().manual_seed(0)
    batches = [[sample_batch(users[0].train, batch, seq_len, gen) for _ in range(steps)] for _ in range(rounds + 1)]
    return algo, client, users[0], start, batches


def comix_round(algo, model, data, adapters, batches):
    """comix's client round (``Algorithm.client_round``) from ``adapters`` on ``batches``."""
    feed = iter(batches)
    algo.train_batch = lambda ctx, gen: next(feed)
    state = ClientState(adapters={n: t.clone() for n, t in adapters.items()})
    state, _, _ = algo.client_round(ClientContext(0, model, data, algo.train), state, dict(adapters))
    return state.adapters


def trainer_round(algo, model, adapters, batches, out_dir):
    """A Trainer built for this round (FlowerTune's ``fit``), the same loss, order and update."""
    from torch.utils.data import SequentialSampler
    from transformers import Trainer, TrainingArguments
    t = algo.train

    class PeerTrainer(Trainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            return training.lm_loss(model, inputs["x"][0], inputs["y"][0])

        def _get_train_sampler(self, *args, **kwargs):  # the batches in the round's order
            return SequentialSampler(self.train_dataset)
    algo.load_state(model, adapters)
    args = TrainingArguments(output_dir=str(out_dir), per_device_train_batch_size=1, max_steps=len(batches),
                             learning_rate=t.lr, weight_decay=t.weight_decay, adam_beta1=t.betas[0],
                             adam_beta2=t.betas[1], adam_epsilon=1e-8, max_grad_norm=t.grad_clip,
                             lr_scheduler_type="linear", warmup_steps=0, save_strategy="no", report_to=[],
                             logging_strategy="no", disable_tqdm=True, use_cpu=True, remove_unused_columns=False,
                             dataloader_num_workers=0, seed=0)
    rows = [{"x": x, "y": y} for x, y in batches]
    PeerTrainer(model=model, args=args, train_dataset=rows, data_collator=lambda items: {
        k: torch.stack([it[k] for it in items]) for k in items[0]}).train()
    return {n: p.detach().clone() for n, p in model.named_parameters() if n in adapters}


def rel_diff(a: dict, b: dict) -> float:
    return max(float(torch.linalg.vector_norm(a[n] - b[n]) / max(float(torch.linalg.vector_norm(a[n])), 1e-12)) for n in a)


def moved(start: dict, after: dict) -> float:
    """||after - start|| / ||start|| over every adapter tensor together."""
    names = sorted(after)
    delta = torch.cat([(after[n] - start[n]).flatten() for n in names])
    return float(torch.linalg.vector_norm(delta) / torch.linalg.vector_norm(torch.cat([start[n].flatten() for n in names])))


def status_mb(key: str) -> float:
    """VmRSS (now) or VmHWM (the peak since the last reset) of this process, MB."""
    line = next(ln for ln in Path("/proc/self/status").read_text().splitlines() if ln.startswith(key + ":"))
    return int(line.split()[1]) / 1024


def memory(side: str, rounds: int, steps: int) -> dict:
    """One side alone in this process: RSS once the model and data are loaded, and the peak during
    its rounds (the kernel's high-water mark reset after loading: /proc/self/clear_refs, 5)."""
    algo, model, data, start, batches = setting(rounds, steps)
    loaded = status_mb("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(rounds):
            if side == "comix":
                comix_round(algo, model, data, start, batches[r])
            else:
                trainer_round(algo, model, start, batches[r], Path(tmp))
    peak = status_mb("VmHWM")
    return {"side": side, "loaded_rss_mb": round(loaded, 1), "peak_rss_mb": round(peak, 1),
            "rise_mb": round(peak - loaded, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--only", choices=["comix", "trainer"], help="memory of one side alone (a JSON line)")
    ap.add_argument("--out", default="bench/results/trainer-peer.json")
    args = ap.parse_args()
    if args.only:
        print(json.dumps(memory(args.only, args.rounds, args.steps)))
        return
    algo, model, data, start, batches = setting(args.rounds, args.steps)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        comix_round(algo, model, data, start, batches[-1])  # warm-ups (lazy initialisation, caches)
        trainer_round(algo, model, start, batches[-1], Path(tmp))
        for r in range(args.rounds):
            got = {}
            for side in (("comix", "trainer") if r % 2 == 0 else ("trainer", "comix")):  # interleaved
                with Clock().on() as clock:
                    t = time.perf_counter()
                    got[side] = comix_round(algo, model, data, start, batches[r]) if side == "comix" else \
                        trainer_round(algo, model, start, batches[r], Path(tmp))
                    wall = time.perf_counter() - t
                s = clock.seconds
                rows.append({"round": r, "side": side, "wall_s": round(wall, 4), "steps": clock.steps,
                             **{f"{k}_s": round(v, 4) for k, v in s.items()},
                             "rest_s": round(wall - s["forward"] - s["backward"] - s["optimizer"], 4)})
            rows[-1]["adapters_rel_diff"] = rows[-2]["adapters_rel_diff"] = rel_diff(got["comix"], got["trainer"])
            # and the round moved the adapters (a side that trained nothing would agree with itself only)
            rows[-1]["moved_rel"] = rows[-2]["moved_rel"] = min(moved(start, got[side]) for side in got)
    mems = [json.loads(subprocess.run([sys.executable, __file__, "--only", side, "--rounds", str(args.rounds),
                                       "--steps", str(args.steps)], capture_output=True, text=True, check=True,
                                      cwd=ROOT).stdout.strip().splitlines()[-1]) for side in ("comix", "trainer")]

    def per_step(side, key):
        return statistics.median(r[key] / r["steps"] * 1000 for r in rows if r["side"] == side)
    summary = {side: {f"{k}_ms_per_step": round(per_step(side, f"{k}_s"), 2)
                      for k in ("wall", "forward", "backward", "optimizer", "rest")} for side in ("comix", "trainer")}
    walls = [{a["side"]: a["wall_s"], b["side"]: b["wall_s"]} for a, b in zip(rows[::2], rows[1::2])]
    ratio = statistics.median(w["comix"] / w["trainer"] for w in walls)  # paired by round
    out = {"what": "comix's client round against a Trainer built each round (bench/trainer_peer.py)",
           "setting": f"smollm2-135m, FedAvg's LoRA, {args.rounds} rounds x {args.steps} steps of 4 x 128, fp32",
           "machine": f"{torch.get_num_threads()}-thread CPU", "date": str(date.today()),
           "comix_over_trainer_wall": round(ratio, 4), "max_adapters_rel_diff": max(r["adapters_rel_diff"] for r in rows),
           "min_moved_rel": min(r["moved_rel"] for r in rows),
           "per_step": summary, "memory": {m["side"]: m for m in mems}, "rounds": rows}
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps({k: v for k, v in out.items() if k != "rounds"}, indent=1))


if __name__ == "__main__":
    main()
