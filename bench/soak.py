"""Flower under load and faults: a soak of a TLS + authenticated loopback deployment.

    python bench/soak.py                          # 16 SuperNodes, 20 rounds, seed 0 (44 min on 2 cores, and as long again undisturbed)
    python bench/soak.py --nodes 4 --rounds 6     # a short one
    python bench/soak.py --no-baseline            # skip the undisturbed run (its wall time only)
    python bench/soak.py --baseline-only          # only the undisturbed run, added to the result file

A SuperLink and ``--nodes`` SuperNodes on 127.0.0.1 (TLS with a CA made here, every node's key
registered) run a tiny CoMiGS job while a seeded fault injector (bench/soak_app/soak_client.py)
makes devices send corrupt uploads (NaN / inf, a wrong shape or dtype, an extra or a missing
tensor, a specialist's tensor), hold their reply past the round's timeout, and die on receiving a
round's message or after training it; a supervisor restarts dead SuperNodes with the same key, and
the ServerApp is killed once mid-run (a device has trained the round, the server has not
aggregated it) and started again with the same ``flwr run`` command.
Everything is bounded: the plan is fixed before the run, the run has a deadline, every process is
stopped by PID at the end.

Then the run is checked: every round logged for every device, results and checkpoint written;
every planned fault left out of its round's aggregate with the reason the server gives for it;
and the whole run replayed in process (``replay``): the same recipe and seed, the same devices
training in each round (the devices' journals) and the same uploads accepted (metrics.jsonl),
whose aggregate after every round (server.jsonl's ``payload_fingerprint``) and final scores must
equal the deployment's. A rejected upload that entered a sum, a round applied twice after the
restart or a device that resumed from the wrong state would each break that equality.

Writes ``bench/results/soak.json`` (``--result``); docs/flower.md quotes it (bench/tables.py).
"""
from __future__ import annotations

import argparse
import os
import json
import math
import random
import shutil
import sys
import threading
import time
from pathlib import Path

import footprint  # prints wall time and peak RSS at exit

ROOT = Path(__file__).resolve().parents[1]
APP = Path(__file__).parent / "soak_app"
sys.path.insert(0, str(APP))
from soak_client import FAULTS, REASON  # noqa: E402

METHOD = "comigs-1g1s"
WORDS = ["the cat sat on a mat", "der hund lief im park", "def return import class", "le chat dort sur le lit",
         "el perro come en casa", "il gatto beve il latte", "de kat zit op de mat", "o gato subiu no telhado"]


# -- the plan -------------------------------------------------------------------------------------
def make_plan(seed: int, nodes: int, rounds: int, rate: float = 0.1) -> dict[int, dict[int, str]]:
    """{round: {client: fault}} drawn from ``seed``: each device faulty in a round with probability
    ``rate``, every kind of ``FAULTS`` at least once where there are slots (kinds dealt in a
    shuffled cycle), at most half of a round's devices faulty (the round keeps honest uploads),
    and the last two rounds clean (a device that died in the round before the last is back to be
    scored at the end)."""
    rng = random.Random(seed)
    slots = []
    for r in range(1, max(1, rounds - 1)):
        faulty = [c for c in range(nodes) if rng.random() < rate][: nodes // 2]
        slots += [(r, c) for c in faulty]
    kinds = list(FAULTS)
    rng.shuffle(kinds)
    plan: dict[int, dict[int, str]] = {}
    for i, (r, c) in enumerate(slots):
        plan.setdefault(r, {})[c] = kinds[i % len(kinds)]
    return plan


# -- the deployment -------------------------------------------------------------------------------
def write_inputs(workdir: Path, nodes: int, rounds: int, seed: int) -> tuple[Path, Path, list[str]]:
    """(recipe, corpus folder, users in client order): ``nodes`` users of synthetic text, a tiny
    CoMiGS recipe scored once, after the last round."""
    corpus = workdir / "data"
    rng = random.Random(seed)
    users = [f"user{c:02d}" for c in range(nodes)]
    for c, u in enumerate(users):
        (corpus / u).mkdir(parents=True, exist_ok=True)
        vocab = WORDS[c % len(WORDS)].split()
        for i in range(12):
            (corpus / u / f"{i}.txt").write_text(" ".join(rng.choice(vocab) for _ in range(60)))
    recipe = workdir / "soak.yaml"
    recipe.write_text(f"""model: tiny-llama
corpus: {corpus}
methods: [{METHOD}]
seed: {seed}
data: {{valid_tokens: 512, test_tokens: 256}}
train: {{rounds: {rounds}, local_steps: 2, batch_size: 2, seq_len: 32, tau: 2, router_steps: 1, eval_every: {rounds},
        eval_splits: [valid, test]}}
""")
    return recipe, corpus, users


def deploy(workdir: Path, recipe: Path, corpus: Path, users: list[str], plan: dict, timeout: float,
           kill_server_after: int | None, deadline_s: float = 7200, restart_after: float = 3.0) -> dict:
    """Run the soak: the deployment, the supervisor (dead SuperNodes restarted with their key after
    ``restart_after`` s) and the ServerApp killed once within the round after ``kill_server_after``
    and resubmitted at once: once that round is logged and a device has trained the next (its
    journal entry: its state for that round is written), so the restarted server re-sends a round
    some devices already trained and they replay it from the state before. Returns what happened,
    and how many of the processes it started are still running once it is closed."""
    from comix.engines.flower.deploy import Federation, memory_mb

    state = workdir / "state"
    state.mkdir(parents=True, exist_ok=True)
    (workdir / "plan.json").write_text(json.dumps({str(r): {str(c): k for c, k in p.items()} for r, p in plan.items()}))
    out = workdir / "flower" / METHOD
    rc = {"config": str(recipe), "method": METHOD, "run-dir": str(workdir / "flower"), "clients": len(users),
          "timeout": float(timeout), "wait": 300.0}
    node = {c: {"data": str(corpus), "user": u, "state-dir": str(state), "fault-plan": str(workdir / "plan.json"),
                "delay": float(timeout) + 10.0} for c, u in enumerate(users)}
    events = {"device_restarts": 0, "activation_retries": 0, "server_kills": 0, "submissions": 0}
    peak = {"serverapp": 0.0, "superlink": 0.0}
    t0 = time.time()
    with Federation(workdir / "fed") as fed:
        fed.start_superlink()
        for c in node:
            fed.start_supernode(c, node[c])
        runs = []

        def submit():  # the same command every time
            events["submissions"] += 1
            runs.append(threading.Thread(target=fed.run, args=(rc,), kwargs={"app": APP, "timeout": deadline_s},
                                         daemon=True))
            runs[-1].start()
        submit()
        dead_since: dict[int, float] = {}
        while not (out / "results.json").exists():
            if time.time() - t0 > deadline_s:
                raise TimeoutError(f"the soak passed its deadline ({deadline_s:.0f} s); logs in {workdir / 'fed'}")
            for c in node:  # the supervisor: a device that died comes back with the same key
                code = fed.procs[f"supernode{c}"].poll()
                if code is not None:
                    # killed (a signal: the injector's SIGKILL) is a death; a SuperNode that exits by itself
                    # (status 1; its log says Flower's code 305) was refused activation because the SuperLink
                    # still holds the dead node of its key (same key, same node id) online: a retry
                    if c not in dead_since:
                        events["device_restarts" if code < 0 else "activation_retries"] += 1
                    dead_since.setdefault(c, time.time())
                    if time.time() - dead_since[c] >= restart_after:
                        fed.start_supernode(c, node[c], key=fed.workdir / "keys" / f"node{c}")
                        del dead_since[c]
            logged = _logged_rounds(out / "metrics.jsonl", len(users))
            if kill_server_after is not None and not events["server_kills"] and logged >= kill_server_after:
                if logged > kill_server_after:  # the moment passed unseen (a round shorter than a poll)
                    events["missed_kill"], kill_server_after = True, None
                elif kill_server_after + 1 in trained_rounds(state) and fed.kill_serverapp():
                    events["server_kills"] += 1
                    events["killed_in_round"] = kill_server_after + 1
                    submit()
            peak["serverapp"] = max(peak["serverapp"], sum(memory_mb(p) for p in fed.serverapps()))
            peak["superlink"] = max(peak["superlink"], memory_mb(fed.procs["superlink"].pid))
            time.sleep(0.5)
        wall = time.time() - t0
        for t in runs:
            t.join(timeout=180)
        pids = [p.pid for p in fed.procs.values()]
        events["tls"] = "--insecure" not in " ".join(map(str, fed.procs["superlink"].args))
    # every process it started is gone once the federation is closed (stopped by PID)
    events["processes_left"] = sum(_alive(pid) for pid in pids)
    return {**events, "wall_s": round(wall, 1), "serverapp_peak_rss_mb": round(peak["serverapp"], 1),
            "superlink_peak_rss_mb": round(peak["superlink"], 1)}


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _rows(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def _logged_rounds(metrics: Path, n: int) -> int:
    rows = _rows(metrics)
    return max([r for r in {x["round"] for x in rows} if sum(x["round"] == r for x in rows) == n], default=0)


# -- the checks -----------------------------------------------------------------------------------
def trained_rounds(state: Path) -> dict[int, set[int]]:
    """{round: the clients that trained it} from the devices' journals (soak_client.py)."""
    out: dict[int, set[int]] = {}
    for journal in state.glob("journal-client*.jsonl"):
        for row in _rows(journal):
            out.setdefault(row["round"], set()).add(row["client"])
    return out


def replay(recipe: Path, trained: dict[int, set[int]], accepted: dict[int, set[int]], out: Path) -> Path:
    """The run again in this process: the same recipe and seed, in each round the clients of
    ``trained`` training and those of ``accepted`` aggregated; returns its method folder."""
    import torch

    from comix.config import load_config
    from comix.engines.inprocess import InProcess
    from comix.engines.server import serve
    from comix.engines.states import StateStore
    from comix.runner import load_inputs
    from comix.runtime import resolve
    from comix.specs import build_algorithm, server_context

    class Replay(InProcess):
        def train(self, payloads):
            rnd = self.round + 1
            replies = super().train({c: p for c, p in payloads.items() if c in trained.get(rnd, ())})
            return {c: replies[c] if c in accepted.get(rnd, ()) else "left out, as in the deployment" for c in payloads}

    torch.set_num_threads(1)  # as each device (its node config's threads, default 1)
    cfg = load_config(str(recipe))
    model, _, users, _, _ = load_inputs(cfg)
    algo = build_algorithm(cfg, METHOD, len(users))
    method_dir = out / METHOD
    algo.server = server_context(cfg, method_dir, cfg.seed)
    transport = Replay(algo, model, users, cfg.seed, StateStore(), resolve(cfg.device, cfg.precision))
    serve(algo, transport, [u.name for u in users], method_dir, seed=cfg.seed)
    return method_dir


def check(workdir: Path, users: list[str], plan: dict, rounds: int) -> dict:
    """The soak's figures and the problems found (``problems``: empty when it survived)."""
    out = workdir / "flower" / METHOD
    rows = _rows(out / "metrics.jsonl")
    problems = []
    by = {(r["round"], r["user"]): r for r in rows}
    if len(rows) != len(by) or set(by) != {(r, u) for r in range(1, rounds + 1) for u in users}:
        problems.append(f"metrics.jsonl has {len(rows)} rows, {len(by)} distinct, for {rounds} x {len(users)}")
    result = json.loads((out / "results.json").read_text()) if (out / "results.json").exists() else {}
    if set(result.get("per_user", {})) != set(users):
        problems.append(f"results.json scores {sorted(result.get('per_user', {}))}")
    if not (out / "checkpoint.pt").exists():
        problems.append("no checkpoint.pt")
    faults = {k: {"injected": 0, "left_out": 0} for k in FAULTS}
    for r, p in plan.items():
        for c, kind in p.items():
            if r > rounds:
                continue
            faults[kind]["injected"] += 1
            failed = by.get((r, users[c]), {}).get("failed", "")
            if REASON[kind] in failed:
                faults[kind]["left_out"] += 1
            else:
                problems.append(f"round {r} client {c}: {kind} not left out with '{REASON[kind]}' (got {failed!r})")
    planned = {(r, users[c]) for r, p in plan.items() for c in p}
    collateral = sorted({r["failed"].split(" (")[0] for k, r in by.items() if "failed" in r and k not in planned})
    missed = sum("failed" in r and k not in planned for k, r in by.items())
    accepted = {r: {c for c, u in enumerate(users) if "failed" not in by.get((r, u), {"failed": "?"})}
                for r in range(1, rounds + 1)}
    trained = trained_rounds(workdir / "state")
    for r, a in accepted.items():  # an accepted upload was trained: the journals are complete
        if not a <= trained.get(r, set()):
            problems.append(f"round {r}: accepted {sorted(a - trained.get(r, set()))} without a journal entry")
    ref = replay(workdir / "soak.yaml", trained, accepted, workdir / "replay")
    mine, theirs = _rows(out / "server.jsonl"), _rows(ref / "server.jsonl")
    worst = 0.0
    for a, b in zip(mine, theirs):
        for x, y in zip(a["payload_fingerprint"], b["payload_fingerprint"]):
            worst = max(worst, abs(x - y) / max(abs(y), 1e-12))
    equal_rounds = sum(all(math.isclose(x, y, rel_tol=1e-6, abs_tol=1e-9) for x, y in
                           zip(a["payload_fingerprint"], b["payload_fingerprint"])) for a, b in zip(mine, theirs))
    if len(mine) != rounds or equal_rounds != rounds:
        problems.append(f"{equal_rounds} of {rounds} rounds' aggregates equal the replay's (worst relative "
                        f"difference {worst:.2g}; {len(mine)} rounds in server.jsonl)")
    final = json.loads((ref / "results.json").read_text())["per_user"]
    score = max((abs(result["per_user"][u]["test_ppl"] / final[u]["test_ppl"] - 1) for u in users
                 if u in result.get("per_user", {})), default=math.inf)
    if not score < 1e-4:
        problems.append(f"final test perplexity differs from the replay's by {score:.2g} (relative)")
    return {"rounds_completed": len({r["round"] for r in rows}), "faults": faults, "collateral_misses": missed,
            "collateral_reasons": collateral, "aggregates_equal_to_replay": equal_rounds,
            "worst_fingerprint_rel_diff": worst, "final_test_ppl_rel_diff": score, "problems": problems}


def soak(workdir: Path, nodes: int, rounds: int, seed: int, timeout: float, plan: dict | None = None,
         kill_server_after: int | None = -1, rate: float = 0.1) -> dict:
    """One soak in ``workdir`` (made afresh): the deployment, then the checks. ``plan`` None: drawn
    from ``seed`` (``make_plan``); ``kill_server_after`` -1: a seeded round in the middle third,
    None: the server is left alone."""
    shutil.rmtree(workdir, ignore_errors=True)
    workdir.mkdir(parents=True)
    plan = make_plan(seed, nodes, rounds, rate) if plan is None else plan
    if kill_server_after == -1:
        kill_server_after = random.Random(seed + 2).randint(max(1, rounds // 3), max(1, 2 * rounds // 3))
    recipe, corpus, users = write_inputs(workdir, nodes, rounds, seed)
    events = deploy(workdir, recipe, corpus, users, plan, timeout, kill_server_after)
    checked = check(workdir, users, plan, rounds)
    checked["problems"] += ["the ServerApp was not killed: its moment passed"] * events.pop("missed_kill", False)
    checked["problems"] += [f"{n} started processes still running" for n in [events["processes_left"]] if n]
    return {"nodes": nodes, "rounds": rounds, "seed": seed, "timeout_s": timeout, **events, **checked}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nodes", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--rate", type=float, default=0.1, help="probability a device is faulty in a round")
    ap.add_argument("--timeout", type=float, default=120.0, help="seconds the server waits for a round's replies")
    ap.add_argument("--workdir", type=Path, default=ROOT / "runs" / "soak")
    ap.add_argument("--no-baseline", action="store_true", help="skip the undisturbed run")
    ap.add_argument("--baseline-only", action="store_true",
                    help="only the undisturbed run, its wall time added to an existing --result of the same size")
    ap.add_argument("--result", type=Path, default=ROOT / "bench" / "results" / "soak.json")
    args = ap.parse_args()
    import flwr
    import torch
    if args.baseline_only:
        fig = json.loads(args.result.read_text())
        if (fig["nodes"], fig["rounds"], fig["seed"], fig["timeout_s"]) != (args.nodes, args.rounds, args.seed,
                                                                            args.timeout):
            sys.exit(f"{args.result} is a soak of {fig['nodes']} nodes x {fig['rounds']} rounds (seed {fig['seed']}, "
                     f"timeout {fig['timeout_s']:g} s): give the same --nodes --rounds --seed --timeout")
    else:
        fig = soak(args.workdir / "soak", args.nodes, args.rounds, args.seed, args.timeout, rate=args.rate)
        print(json.dumps(fig, indent=1))
        fig.update(command="python bench/soak.py " + " ".join(a for a in sys.argv[1:] if a != "--no-baseline"),
                   date=time.strftime("%Y-%m-%d"), torch=torch.__version__, flwr=flwr.__version__,
                   machine=f"{os.cpu_count()} cores of an {footprint.cpu_name()}, alone",
                   bench_peak_rss_mb=round(footprint.peak_rss_mb(), 1))
    if not args.no_baseline:  # the same deployment and job, nothing injected, the server left alone
        calm = soak(args.workdir / "undisturbed", args.nodes, args.rounds, args.seed, args.timeout, plan={},
                    kill_server_after=None)
        fig.update(undisturbed_wall_s=calm["wall_s"], undisturbed_problems=calm["problems"],
                   undisturbed_date=time.strftime("%Y-%m-%d"))
    footprint.write_result(args.result, fig)
    print(f"wrote {args.result}; problems: {fig['problems'] or 'none'}")


if __name__ == "__main__":
    main()
