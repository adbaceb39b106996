"""The server's side of a run, whatever carries the messages: Alg. 1's outer loop.

Each round: the clients sampled for it (all by default; ``train.clients_per_round`` or
``train.client_fraction`` otherwise, drawn from the run's seed and the round so that both
engines pick the same) train on their payloads and reply (upload + metrics); replies that fail
the algorithm's checks (undeclared or missing tensors, wrong shapes, NaN/inf) or never arrive
are logged and left out, so ``server_round`` aggregates the others (weights renormalised over
who replied); then the next payloads. After the last round the clients take their final
payload (``client_finish``); on evaluation rounds each client reports its perplexities.

A ``Transport`` carries the requests: ``init() -> {client: shared tensors}``,
``train({client: payload}) -> {client: (upload, metrics) | error string}``,
``finish({client: payload})``, ``evaluate({client: payload}) -> {user: metrics}`` and
``snapshot()/restore()`` of what the server must checkpoint for the clients (in-process: their
states; Flower devices persist their own). Under secure aggregation (Flower only) the round goes
through ``train_secure``, which returns the sum of the uploads and never an upload (``secure_round``). A checkpoint is written atomically every round;
``resume=True`` continues from it with the same numbers as an uninterrupted run.
"""
from __future__ import annotations

import hashlib
import json
import logging
import math
import random
import time
from dataclasses import asdict
from pathlib import Path
from typing import Callable, Protocol

import torch

from ..algorithms import Algorithm, tensor_bytes
from ..algorithms.base import Tensors
from ..files import atomic_write
from ..fleet import DEADLINE_MISSED
from ..privacy import GaussianSumNoise, clip_upload, epsilon_after, privacy_record, sampling_of
from ..tracking import RunTrackers, TensorBoardLog

log = logging.getLogger("comix.server")


class Transport(Protocol):
    def init(self) -> dict[int, Tensors]: ...
    def train(self, payloads: dict[int, Tensors]) -> dict[int, tuple[Tensors, dict] | str]: ...
    # secure aggregation only (Flower): (sum of the uploads, how many were summed, {client: metrics | error})
    def train_secure(self, payloads: dict[int, Tensors], expected: dict[int, Tensors]
                     ) -> tuple[Tensors, int, dict[int, dict | str]]: ...
    def finish(self, payloads: dict[int, Tensors]) -> None: ...
    def evaluate(self, payloads: dict[int, Tensors]) -> dict[str, dict]: ...
    def snapshot(self): ...
    def restore(self, snapshot) -> None: ...


def sample_clients(n_clients: int, train, seed: int, rnd: int) -> list[int]:
    """The clients that train in round ``rnd`` (from 1): all of them by default (the papers' full
    participation), else ``clients_per_round`` (or ``client_fraction`` of them) drawn uniformly
    without replacement from a generator seeded by (seed, round); with ``client_sampling:
    poisson`` each client independently with probability ``client_fraction`` (possibly none).
    The DP accountant (privacy.sampling_of) follows the same rule."""
    if train.client_sampling == "poisson":
        rng = random.Random(f"{seed}:{rnd}")
        return [c for c in range(n_clients) if rng.random() < train.client_fraction]
    k = train.clients_per_round or max(1, round(train.client_fraction * n_clients))
    if k >= n_clients:
        return list(range(n_clients))
    return sorted(random.Random(f"{seed}:{rnd}").sample(range(n_clients), k))


def eval_sample(n_clients: int, train, seed: int, rnd: int) -> list[int]:
    """The clients that score the model they hold in round ``rnd``: all of them in the last round
    (MTAL and the results are every client's), else a sample of ``train.eval_clients`` drawn from
    (seed, round) when it is set; the same on every engine."""
    if not train.eval_clients or train.eval_clients >= n_clients or rnd == train.rounds:
        return list(range(n_clients))
    return sorted(random.Random(f"{seed}:{rnd}:eval").sample(range(n_clients), train.eval_clients))


def upload_record(uploads: dict[int, Tensors], seen: set) -> dict:
    """What left each client this round for privacy.md: ``uploads`` {client: {"sig", "bytes"}},
    where a signature names the exact list of (tensor, shape, dtype), and ``signatures`` with the
    lists not recorded in an earlier round (``seen`` is updated)."""
    out, new = {}, {}
    for c, up in sorted(uploads.items()):
        listing = [[n, list(t.shape), str(t.dtype).removeprefix("torch.")] for n, t in sorted(up.items())]
        sig = hashlib.sha1(json.dumps(listing).encode()).hexdigest()[:10]
        if sig not in seen:
            seen.add(sig)
            new[sig] = listing
        out[str(c)] = {"sig": sig, "bytes": tensor_bytes(up)}
    return {"uploads": out, **({"signatures": new} if new else {})}


def payload_fingerprint(payloads: dict[int, Tensors]) -> list[float]:
    """Two float64 numbers that pin down what the server sends after a round: the sum of squares
    and a position-weighted sum (weights cos(i)) over every client's payload, tensors in name
    order. Two engines' rounds agree when their fingerprints do (to float noise: devices in their
    own processes sum in another order); bench/soak.py checks a disturbed Flower run this way."""
    squares = weighted = 0.0
    done: dict[int, tuple[float, float]] = {}  # a tensor several clients hold (an average) is read once
    for c in sorted(payloads):
        for n in sorted(payloads[c]):
            t = payloads[c][n]
            if id(t) not in done:
                x = t.detach().to("cpu", torch.float64).reshape(-1)
                done[id(t)] = (float(x.square().sum()), float((x * torch.arange(x.numel(), dtype=torch.float64).cos()).sum()))
            squares, weighted = squares + done[id(t)][0], weighted + done[id(t)][1]
    return [squares, weighted]


def shapes_only(tensors: Tensors) -> Tensors:
    """Names and shapes of ``tensors`` without their memory (meta tensors): what the server keeps
    of each client's initial upload to check later uploads against."""
    return {n: torch.empty(t.shape, dtype=t.dtype, device="meta") for n, t in tensors.items()}


def dp_noise(algorithm: Algorithm, seed: int, rnd: int) -> GaussianSumNoise | None:
    """DP-FedAvg's noise for round ``rnd`` (from 0): std sigma x clip on each aggregate's sum,
    seeded by (seed, round) so that every engine, secure aggregation included, draws the same."""
    sigma = algorithm.privacy.noise_multiplier
    return GaussianSumNoise(sigma * algorithm.privacy.clip, seed, rnd + 1) if sigma > 0 else None


def secure_round(algorithm: Algorithm, transport: Transport, server_state, payloads, sampled: list[int],
                 reference: dict, client_metrics: dict, rnd: int, seed: int, seen: set):
    """One round under secure aggregation (Flower's SecAgg+): the transport returns the *sum* of
    the uploads of the clients that finished the protocol and each client's metrics, never an
    upload. What the server can still check: each client's declared listing (names and shapes)
    against what it expects, and the sum's finiteness; the clients refuse to mask a non-finite or
    out-of-range upload (a dropout, which SecAgg+ recovers from). Returns (server state, payloads,
    the server.jsonl row)."""
    t0 = time.time()
    expected = {c: algorithm.expected_upload(server_state, c, reference[c]) for c in sampled}
    total, count, replies = transport.train_secure({c: payloads[c] for c in sampled}, expected)
    t_train = time.time()
    for c in sampled:
        reply = replies.get(c, "no reply")
        down = tensor_bytes(payloads[c])
        if reply == DEADLINE_MISSED:  # the device left the protocol, as the plain path drops its update
            client_metrics[c] = {"sampled": True, "dropped": "deadline", "bytes_up": 0, "bytes_down": down}
        elif isinstance(reply, str):
            log.warning("round %d: client %d left out of the secure sum: %s", rnd + 1, c, reply)
            client_metrics[c] = {"sampled": True, "failed": reply, "bytes_up": 0, "bytes_down": down}
        else:
            client_metrics[c] = {"sampled": True, **reply, "bytes_down": down}
        fleet = algorithm.fleet
        if fleet and not isinstance(reply, str):
            client_metrics[c].update(profile=fleet.profile_of(c, len(reference)).name,
                                     device_s=round(fleet.seconds(c, len(reference), reply.get("tokens", 0)), 3))
    row = {"round": rnd + 1, "train_s": round(t_train - t0, 4), "secure_sum_of": count}
    if count == 0 and all("dropped" in client_metrics[c] for c in sampled):  # every device late: as the plain path
        return server_state, payloads, {**row, "aggregate_s": 0.0, **upload_record({}, seen)}
    if count == 0 or not all(torch.isfinite(t).all() for t in total.values()):
        raise RuntimeError(f"round {rnd + 1}: secure aggregation returned no valid sum ({count} clients)")
    algorithm.aggregation_noise = dp_noise(algorithm, seed, rnd)
    server_state, payloads = algorithm.server_round_of_sum(server_state, total, count)
    algorithm.aggregation_noise = None
    declared = {c: expected[c] for c in sampled if not isinstance(replies.get(c, ""), str)}
    return server_state, payloads, {**row, "aggregate_s": round(time.time() - t_train, 4),
                                    **upload_record(declared, seen)}


def serve(algorithm: Algorithm, transport: Transport, users: list[str], out_dir: Path, seed: int = 42,
          resume: bool = False, progress: Callable[[dict], None] | None = None) -> dict:
    """Run ``algorithm`` to the end; writes metrics.jsonl (per client and round), server.jsonl (per
    round: the server's timings and the algorithm's ``server_report``), checkpoint.pt and results.json."""
    train = algorithm.train
    out_dir.mkdir(parents=True, exist_ok=True)
    metrics_path, ckpt_path, server_path = out_dir / "metrics.jsonl", out_dir / "checkpoint.pt", out_dir / "server.jsonl"
    n_clients = 1 if algorithm.pooled else len(users)
    client_of = (lambda u: 0) if algorithm.pooled else (lambda u: u)

    start = 0
    if resume and ckpt_path.exists():
        try:
            ck = torch.load(ckpt_path, weights_only=False)
        except Exception as err:  # truncated or damaged: torch raises RuntimeError, EOFError, pickle errors
            raise ValueError(f"checkpoint {ckpt_path} is corrupt ({str(err).splitlines()[0][:80]}); delete it to "
                             f"run {algorithm.name} again from round 1, or restore it") from None
        start, server_state, payloads, reference = ck["round"], ck["server_state"], ck["payloads"], ck["reference"]
        if algorithm.server_optimizer is not None:  # its moments and step counts, as the round left them
            algorithm.server_optimizer.load_state_dict(ck["server_optimizer"])
        transport.restore(ck["clients"])
        torch.set_rng_state(ck["torch_rng"])
        for path in (metrics_path, server_path):  # drop what a killed round had written
            kept = [ln for ln in path.read_text().splitlines() if json.loads(ln)["round"] <= start] \
                if path.exists() else []
            atomic_write(path, lambda p, kept=kept: Path(p).write_text("".join(ln + "\n" for ln in kept)))
    else:
        torch.manual_seed(seed)
        initial = transport.init()  # each client's initial shared tensors: names and shapes to expect
        server_state, payloads = algorithm.server_init(initial)
        reference = {c: shapes_only(t) for c, t in initial.items()}
        del initial
        metrics_path.write_text("")
        server_path.write_text("")

    board = TensorBoardLog(out_dir, purge_from=start + 1 if start else None) if train.tensorboard else None
    trackers = None
    if train.mlflow or train.wandb:  # comix/tracking.py: the method's settings as the tracked run's parameters
        trackers = RunTrackers(out_dir, train, algorithm.name, {
            "method": algorithm.name, "seed": seed, "train": asdict(train), "lora": asdict(algorithm.lora),
            "privacy": asdict(algorithm.privacy), "server": asdict(algorithm.server_config)})
        trackers.catch_up(start, metrics_path)
    total_up = sum(json.loads(ln).get("bytes_up", 0) for ln in metrics_path.read_text().splitlines())
    seen = {s for ln in server_path.read_text().splitlines() for s in json.loads(ln).get("signatures", {})}
    try:
        for rnd in range(start, train.rounds):
            t0 = time.time()
            sampled = sample_clients(n_clients, train, seed, rnd + 1)
            client_metrics = {c: {"sampled": False, "bytes_up": 0, "bytes_down": 0} for c in range(n_clients)}
            # what this round's clients start from: the server optimiser steps from it (comix/aggregation.py)
            algorithm.round_start = {n: t for p in payloads.values() for n, t in p.items()}
            fleet = algorithm.fleet
            if fleet:  # a device that is not there this round is not asked (comix/fleet.py)
                away = [c for c in sampled if not fleet.available(c, n_clients, rnd + 1, seed)]
                for c in away:
                    client_metrics[c]["dropped"] = "unavailable"
                sampled = [c for c in sampled if c not in away]
            if algorithm.privacy.secure_aggregation and any(reference[c] for c in sampled):
                server_state, payloads, server_row = secure_round(algorithm, transport, server_state, payloads, sampled,
                                                                  reference, client_metrics, rnd, seed, seen)
                replies = None
            else:
                replies = transport.train({c: payloads[c] for c in sampled})
            t_train = time.time()
            uploads = {}
            for c in sampled if replies is not None else ():
                reply = replies.get(c, "no reply")
                expected = algorithm.expected_upload(server_state, c, reference[c])
                reason = reply if isinstance(reply, str) else algorithm.check_upload(reply[0], expected)
                down = tensor_bytes(payloads[c])
                if reason:
                    log.warning("round %d: client %d left out of the aggregate: %s", rnd + 1, c, reason)
                    client_metrics[c] = {"sampled": True, "failed": reason, "bytes_up": 0, "bytes_down": down}
                    continue
                client_metrics[c] = {"sampled": True, **reply[1], "bytes_up": tensor_bytes(reply[0]), "bytes_down": down}
                if fleet:
                    client_metrics[c].update(profile=fleet.profile_of(c, n_clients).name,
                                             device_s=round(fleet.seconds(c, n_clients, reply[1].get("tokens", 0)), 3))
                    if fleet.late(c, n_clients, reply[1].get("tokens", 0)):  # trained, but the server did not wait
                        client_metrics[c].update(dropped="deadline", bytes_up=0)
                        continue
                uploads[c] = reply[0]
                if math.isfinite(algorithm.privacy.server_clip):  # the server's own bound (privacy.py server_clip)
                    uploads[c], norm = clip_upload(reply[0], payloads[c], algorithm.privacy.server_clip, algorithm.dp_exempt)
                    client_metrics[c]["server_norm"] = round(norm, 6)
            if replies is not None:
                if not uploads and sampled and not any("dropped" in m for m in client_metrics.values()):
                    raise RuntimeError(f"round {rnd + 1}: no client replied with a valid upload")
                t_agg = time.time()
                if uploads:  # (Poisson sampling may draw nobody: the round leaves every payload as it was)
                    algorithm.aggregation_noise = dp_noise(algorithm, seed, rnd)
                    server_state, payloads = algorithm.server_round(server_state, uploads)
                    algorithm.aggregation_noise = None
                # what the server did this round (Table IV's aggregation latency; FedAMoLE adds its expert
                # assignment and RSEA time, which the paper counts inside aggregation)
                server_row = {"round": rnd + 1, "train_s": round(t_train - t0, 4),
                              "aggregate_s": round(time.time() - t_agg, 4), **upload_record(uploads, seen)}
            dropped = {str(c): m["dropped"] for c, m in client_metrics.items() if "dropped" in m}
            if dropped:  # the fleet's absent and late devices (comix/fleet.py)
                server_row["dropped"] = dropped
            retried = {str(c): m["cohort_retry"] for c, m in client_metrics.items() if "cohort_retry" in m}
            if retried:  # clients whose cohort ran out of device memory and trained again in smaller ones
                server_row["cohort_retry"] = retried
            if math.isfinite(algorithm.privacy.clip):  # the updates the clip shortened (privacy.md)
                server_row["clipped"] = sum(m.get("update_norm", 0) > algorithm.privacy.clip for m in client_metrics.values())
            if math.isfinite(algorithm.privacy.server_clip):  # the uploads the server's bound shortened
                server_row["server_clipped"] = sum(m.get("server_norm", 0) > algorithm.privacy.server_clip
                                                   for m in client_metrics.values())
            server_row.update(algorithm.server_report(server_state))
            server_row["payload_fingerprint"] = payload_fingerprint(payloads)
            eps = epsilon_after(algorithm.privacy, rnd + 1, n_clients, train)
            if eps is not None:
                server_row["epsilon"] = eps
            if rnd + 1 == train.rounds:  # the clients take the final payload (FDLoRA fuses here)
                transport.finish({c: payloads[c] for c in range(n_clients)})
                payloads = {c: {} for c in range(n_clients)}
            evaluation = {}
            if (rnd + 1) % train.eval_every == 0 or rnd + 1 == train.rounds:
                t_eval = time.time()
                # a global model the server holds is scored on the server's test data (by domain);
                # otherwise every client evaluates the model it holds
                evaluation = algorithm.server_evaluate(server_state)
                if evaluation is None:
                    chosen = eval_sample(n_clients, train, seed, rnd + 1)
                    evaluation = transport.evaluate({c: payloads[c] for c in chosen})
                server_row["eval_s"] = round(time.time() - t_eval, 4)
            with open(server_path, "a") as fh:
                fh.write(json.dumps(server_row) + "\n")
            lines = []
            for u, name in enumerate(users):
                row = {"round": rnd + 1, "iteration": (rnd + 1) * train.local_steps, "user": name,
                       **client_metrics[client_of(u)], **({"epsilon": eps} if eps is not None else {})}
                if algorithm.pooled:
                    row["bytes_up"] = row["bytes_down"] = 0
                row.update(evaluation.get(name, {}))
                lines.append(row)
            lines += [{"round": rnd + 1, "iteration": (rnd + 1) * train.local_steps, "user": name,
                       "evaluated_by": "server", **m} for name, m in evaluation.items() if name not in users]
            total_up += sum(r.get("bytes_up", 0) for r in lines)
            with open(metrics_path, "a") as fh:
                fh.writelines(json.dumps(r) + "\n" for r in lines)
            if board:
                board.log_rows(lines)
            ck = {"round": rnd + 1, "server_state": server_state, "payloads": payloads, "reference": reference,
                  "clients": transport.snapshot(), "torch_rng": torch.get_rng_state()}
            if algorithm.server_optimizer is not None:
                ck["server_optimizer"] = algorithm.server_optimizer.state_dict()
            atomic_write(ckpt_path, lambda p: torch.save(ck, p))
            if trackers:  # after the checkpoint: a round reaches MLflow and W&B once (RunTrackers.catch_up)
                trackers.log_round(rnd + 1, lines)
            if progress:
                losses = [r["train_loss"] for r in lines if "train_loss" in r]
                scores = [task_score(r) for r in lines]
                progress({"round": rnd + 1, "rounds": train.rounds, "seconds": time.time() - t0, "epsilon": eps,
                          "train_loss": sum(losses) / max(1, len(losses)),
                          "metric": next((k for k, _ in filter(None, scores)), None),
                          "scores": [sc[1] if sc else None for sc in scores]})
    except BaseException:  # a failed or interrupted run: its tracked runs end as failed, resumable
        if trackers:
            trackers.close(failed=True)
        raise
    if board:
        board.close()
    if trackers:
        trackers.close()
    rows = [json.loads(ln) for ln in server_path.read_text().splitlines()]
    record = privacy_record(rows, algorithm.name, algorithm.privacy, sampling_of(n_clients, train),
                            algorithm.dp_refusal(), algorithm.dp_exempt)
    atomic_write(out_dir / "privacy.md", lambda p: Path(p).write_text(record))
    last = [r for r in map(json.loads, metrics_path.read_text().splitlines()) if r["round"] == train.rounds]
    per_user = {r["user"]: {k: v for k, v in r.items()
                            if k.startswith(("valid_", "test_")) or k in ("gates", "gate_entropy")}
                for r in last if task_score(r)}
    server_scored = [r["user"] for r in last if r.get("evaluated_by") == "server"]
    eps = epsilon_after(algorithm.privacy, train.rounds, n_clients, train)
    private = {"privacy": asdict(algorithm.privacy), "epsilon": eps} if algorithm.privacy.active else {}
    spent = device_totals([json.loads(ln) for ln in metrics_path.read_text().splitlines()])
    return finish_run(out_dir, algorithm, server_scored or users, per_user, total_up, train.rounds,
                      {**private, "devices": spent})


def device_totals(rows: list[dict]) -> dict:
    """What the devices spent over the run (metrics.jsonl's rows of sampled devices): bytes up and
    down, tokens and training seconds summed over devices and rounds, and the largest training
    memory any device needed in a round (engines/footprint.py Footprint)."""
    trained = [r for r in rows if r.get("sampled")]
    out = {k: sum(r.get(k, 0) for r in trained) for k in ("bytes_up", "bytes_down", "tokens", "train_s")}
    out["train_s"] = round(out["train_s"], 3)
    out["memory_mb_max"] = max((r["memory_mb"] for r in trained if "memory_mb" in r), default=None)
    out["device_rounds"] = len(trained)
    return out


# wall-clock and memory measurements in metrics.jsonl / server.jsonl: they differ between two runs
# that are otherwise equal number for number
TIMINGS = ("train_s", "eval_s", "aggregate_s", "peak_mem_mb")
# classification, generation, question answering scored on the answers (DeepFusion's QA: the
# answer-only perplexity, the paper's), language modelling
TASK_METRICS = ("test_acc", "test_rouge_l", "test_answer_ppl", "test_ppl")


def task_score(metrics: dict) -> tuple[str, float] | None:
    """(key, value) of a client's task metric among its reported ``metrics``: accuracy (%) for
    classification, Rouge-L (%) for generation, else test perplexity; None if it reported none."""
    return next(((k, metrics[k]) for k in TASK_METRICS if k in metrics), None)


def finish_run(out_dir: Path, algorithm: Algorithm, users: list[str], per_user: dict, bytes_up: int,
               rounds: int, extra: dict | None = None) -> dict:
    """results.json with ``metric`` (the users' task metric: ``test_ppl``, ``test_acc``,
    ``test_rouge_l``, or ``test_score`` when users' tasks differ), ``mean`` over users (FedAMoLE's
    MTAL when it is the last round's accuracy or Rouge-L) and, for perplexity, ``mean_test_ppl``.
    A user whose device could not report its final evaluation is listed under ``missing`` and
    left out of the mean (it is never silently counted)."""
    scores = {u: task_score(per_user.get(u, {})) for u in users}
    missing = [u for u in users if scores[u] is None]
    if len(missing) == len(users):
        raise RuntimeError("no user reported a final test metric")
    keys = {scores[u][0] for u in users if u not in missing}
    if keys == {"test_answer_ppl", "test_ppl"}:  # QA and plain-text domains: every one has a stream perplexity
        scores = {u: ("test_ppl", per_user[u]["test_ppl"]) if u not in missing else None for u in users}
        keys = {"test_ppl"}
    metric = keys.pop() if len(keys) == 1 else "test_score"
    values = [scores[u][1] for u in users if u not in missing]
    if metric == "test_score":  # mixed tasks: each user's own metric (all higher-is-better)
        for u in users:
            if u not in missing:
                per_user[u]["test_score"] = scores[u][1]
    mean = sum(values) / len(values)
    result = {"method": algorithm.name, "rounds": rounds, "per_user": per_user, "metric": metric, "mean": mean,
              **({"mean_test_ppl": mean} if metric == "test_ppl" else {}), "bytes_up_total": bytes_up,
              "train": asdict(algorithm.train), **({"missing": missing} if missing else {}), **(extra or {})}
    atomic_write(out_dir / "results.json", lambda p: Path(p).write_text(json.dumps(result, indent=2)))
    return result
