"""Flower's simulation engine (Ray): many virtual devices on one machine, the same ServerApp
and ClientApp as a deployment (``comix run ... engine=flower-sim``; ``pip install comix[flower-sim]``).

Every virtual SuperNode is device ``partition-id`` and reads its user from the recipe's corpus.
Ray is started with node address 127.0.0.1 and no dashboard. CAUTION, measured with the Ray
2.55.1 that flwr 1.41 pins: its gcs_server, raylet and worker gRPC servers still listen on all
interfaces and its runtime-env agent on the machine's address (Ray fixed this upstream later,
ray-project/ray#59852); run simulations behind a firewall, or use the deployment engine on
loopback (TLS + SuperNode auth), which listens on 127.0.0.1 only."""
from __future__ import annotations

import json
import os
from pathlib import Path


def simulate(config: str | Path, method: str, run_dir: str | Path, clients: int, seed: int = -1,
             cpus: int | None = None, state_dir: str | Path | None = None) -> dict:
    """Run one method spec of a recipe on ``clients`` virtual devices; returns results.json."""
    from flwr.simulation import run_simulation

    from ...compare import spec_dirname
    from . import client_app, server_app

    run = {"config": str(config), "method": method, "run-dir": str(run_dir), "clients": clients, "seed": seed,
           "state-dir": str(state_dir or Path(run_dir) / "device-state")}
    os.environ[server_app.RUN_ENV] = json.dumps(run)  # run_simulation takes no run config
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    try:
        run_simulation(server_app=server_app.app, client_app=client_app.app, num_supernodes=clients,
                       backend_config={"client_resources": {"num_cpus": 1},
                                       "init_args": {"_node_ip_address": "127.0.0.1", "include_dashboard": False,
                                                     "num_cpus": cpus or os.cpu_count() or 1}})
    finally:
        os.environ.pop(server_app.RUN_ENV, None)
    out = Path(run_dir) / spec_dirname(method) / "results.json"
    if not out.exists():
        raise RuntimeError(f"the Flower simulation of {method} ended without {out}")
    return json.loads(out.read_text())
