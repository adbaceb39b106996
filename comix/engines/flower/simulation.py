"""Flower's simulation engine (Ray): many virtual devices on one machine, the same ServerApp
and ClientApp as a deployment (``comix run ... engine=flower-sim``; ``pip install comix[flower-sim]``).

Every virtual SuperNode is device ``partition-id`` and reads its user from the recipe's corpus.

Loopback only: the Ray 2.55.1 that flwr 1.41 pins opens gRPC ports on all interfaces even when
told ``_node_ip_address="127.0.0.1"`` (measured with ``ss -ltnp``; fixed upstream later in
ray-project/ray#59852). So the simulation runs in a fresh network namespace whose only
interface is loopback (``unshare -rn``, unprivileged): whatever Ray opens is reachable from
this machine's loopback inside that namespace and from nowhere else. The namespace has no
network, so the model and data must be local (the offline default, or an HF cache).
"""
from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

def simulate(config: str | Path, method: str, run_dir: str | Path, clients: int, seed: int = -1,
             cpus: int | None = None, state_dir: str | Path | None = None, gpus: float = 0.0) -> dict:
    """Run one method spec of a recipe on ``clients`` virtual devices; returns results.json.
    ``gpus``: each virtual device's share of a GPU (Flower's ``client_resources.num_gpus``; 0.25
    lets four devices train at once on one GPU; 0 = CPU only)."""
    from ...specs import spec_dirname

    run = {"config": str(config), "method": method, "run-dir": str(run_dir), "clients": clients, "seed": seed,
           "state-dir": str(state_dir or Path(run_dir) / "device-state"), "cpus": cpus or os.cpu_count() or 1, "gpus": gpus}
    if not (shutil.which("unshare") and shutil.which("ip")):
        raise RuntimeError("engine=flower-sim needs `unshare` and `ip` (util-linux, iproute2) to keep Ray on loopback")
    inner = 'ip link set lo up && exec "$0" -m comix.engines.flower.simulation "$1"'
    proc = subprocess.run(["unshare", "-rn", "sh", "-c", inner, sys.executable, json.dumps(run)])
    out = Path(run_dir) / spec_dirname(method) / "results.json"
    if proc.returncode != 0 or not out.exists():
        raise RuntimeError(f"the Flower simulation of {method} failed (exit {proc.returncode}); no {out}")
    return json.loads(out.read_text())


def _simulate_here(run: dict) -> None:
    """Inside the namespace: Ray + Flower's run_simulation with comix's apps."""
    from flwr.simulation import run_simulation

    from . import client_app, server_app
    from .server_app import RUN_ENV

    Path(run["run-dir"]).mkdir(parents=True, exist_ok=True)
    (Path(run["run-dir"]) / "network.json").write_text(json.dumps(   # what this simulation could reach
        {"netns": os.readlink("/proc/self/ns/net"), "interfaces": sorted(name for _, name in socket.if_nameindex())}))
    os.environ[RUN_ENV] = json.dumps(run)
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    run_simulation(server_app=server_app.app, client_app=client_app.app, num_supernodes=int(run["clients"]),
                   backend_config={"client_resources": {"num_cpus": 1, "num_gpus": float(run.get("gpus", 0.0))},
                                   "init_args": {"_node_ip_address": "127.0.0.1", "include_dashboard": False,
                                                 "num_cpus": int(run["cpus"])}})


if __name__ == "__main__":
    _simulate_here(json.loads(sys.argv[1]))
