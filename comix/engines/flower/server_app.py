"""The server side of the Flower engine: ``engines.server.serve`` with Flower messages.

Run config (``[tool.flwr.app.config]`` of the app, overridable with ``flwr run -c``):
``config`` (a comix YAML recipe on the server machine), ``method`` (a method spec),
``run-dir``, ``clients`` (how many devices to wait for), ``seed`` (-1: the recipe's),
``timeout`` (seconds to wait for one round's replies), ``wait`` (seconds to wait for the devices
to connect). Each device reports its client id (from its node config) when first seen, so the
server knows which node holds which user; a device that reconnects under a new node id is
found again the same way. Replies that are errors, late, or fail the algorithm's checks are
left out of that round's aggregate (``serve``)."""
from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path

from flwr.app import ConfigRecord, Context, Message, RecordDict
from flwr.serverapp import Grid, ServerApp

from ...specs import build_algorithm, server_context, spec_dirname
from ...config import load_config
from ..server import serve
from .wire import from_arrays, from_json, to_arrays, to_json

log = logging.getLogger("comix.flower")
app = ServerApp()


class FlowerTransport:
    def __init__(self, grid: Grid, run: dict, n_clients: int, timeout: float):
        self.grid, self.run, self.n, self.timeout = grid, run, n_clients, timeout
        self.node_of: dict[int, int] = {}       # client id -> node id
        self.initial: dict[int, dict] = {}
        self.users: dict[int, str] = {}
        self.round = 0

    def _message(self, node: int, kind: str, **records) -> Message:
        content = RecordDict({"run": to_json(self.run), "round": ConfigRecord({"round": self.round}), **records})
        return Message(content=content, dst_node_id=node, message_type=kind)

    def _send(self, messages: list[Message]) -> dict[int, Message]:
        by_node = {}
        for reply in self.grid.send_and_receive(messages, timeout=self.timeout):
            by_node[reply.metadata.src_node_id] = reply
        return by_node

    def discover(self, wait: float) -> list[str]:
        """Ask every unknown node which client it is, until all ``n`` clients are known."""
        deadline = time.time() + wait
        while len(self.node_of) < self.n:
            known = set(self.node_of.values())
            fresh = [n for n in self.grid.get_node_ids() if n not in known]
            if fresh:
                for node, reply in self._send([self._message(n, "query.init") for n in fresh]).items():
                    if reply.has_error():
                        log.warning("node %d failed to initialise: %s", node, reply.error.reason)
                        continue
                    info = from_json(reply.content["info"])
                    c = int(info["client"])
                    self.node_of[c], self.users[c] = node, info["user"]
                    self.initial.setdefault(c, from_arrays(reply.content["shared"]))
            if len(self.node_of) < self.n:
                if time.time() > deadline:
                    raise TimeoutError(f"{len(self.node_of)} of {self.n} devices connected within {wait:.0f} s")
                time.sleep(1.0)
        return [self.users[c] for c in range(self.n)]

    def _request(self, kind: str, payloads: dict, **extra) -> dict[int, Message | str]:
        alive = set(self.grid.get_node_ids())
        lost = [c for c in payloads if self.node_of.get(c) not in alive]
        if lost:  # a device may have come back under a new node id
            self.node_of = {c: n for c, n in self.node_of.items() if n in alive}
            try:
                self.discover(wait=0)
            except TimeoutError:
                pass
        msgs = [self._message(self.node_of[c], kind, payload=to_arrays(p)) for c, p in payloads.items()
                if c in self.node_of]
        replies = self._send(msgs)
        out: dict[int, Message | str] = {}
        for c in payloads:
            reply = replies.get(self.node_of.get(c, -1))
            if reply is None:
                out[c] = "no reply (device unreachable or late)"
            elif reply.has_error():
                out[c] = f"device error: {reply.error.reason}"
            else:
                out[c] = reply
        return out

    # -- the Transport of engines.server ---------------------------------------------------------
    def init(self):
        return dict(self.initial)

    def train(self, payloads):
        self.round += 1
        return {c: r if isinstance(r, str) else (from_arrays(r.content["upload"]), from_json(r.content["metrics"]))
                for c, r in self._request("train", payloads).items()}

    def finish(self, payloads) -> None:
        for c, r in self._request("train.finish", payloads).items():
            if isinstance(r, str):
                log.warning("client %d could not finish: %s", c, r)

    def evaluate(self, payloads) -> dict[str, dict]:
        out = {}
        for c, r in self._request("evaluate", payloads).items():
            if isinstance(r, str):
                log.warning("client %d could not evaluate: %s", c, r)
                continue
            m = from_json(r.content["metrics"])
            out[m.pop("user")] = m
        return out

    def snapshot(self):
        return {"round": self.round}  # devices persist their own states

    def restore(self, snapshot) -> None:
        self.round = snapshot["round"]


RUN_ENV = "COMIX_FLOWER_RUN"  # the run config of a simulation (run_simulation takes none); see simulation.py


@app.main()
def main(grid: Grid, context: Context) -> None:
    rc = dict(context.run_config)
    if os.environ.get(RUN_ENV):
        rc.update(json.loads(os.environ[RUN_ENV]))
    cfg = load_config(str(rc["config"]))
    spec = str(rc["method"])
    seed = int(rc.get("seed", -1))
    seed = cfg.seed if seed < 0 else seed
    n = int(rc["clients"])
    run = {"config": Path(str(rc["config"])).read_text(), "method": spec, "seed": seed, "n_clients": n,
           "state_dir": rc.get("state-dir")}
    transport = FlowerTransport(grid, run, n, float(rc.get("timeout", 600)))
    users = transport.discover(float(rc.get("wait", 120)))
    algo = build_algorithm(cfg, spec, n)
    out = Path(str(rc["run-dir"])) / spec_dirname(spec)
    algo.server = server_context(cfg, out, seed)

    def progress(p):
        log.info("round %d/%d train loss %.4f %s %s (%.1f s)", p["round"], p["rounds"], p["train_loss"],
                 p["metric"], p["scores"], p["seconds"])
    result = serve(algo, transport, users, out, seed=seed, resume=True, progress=progress)
    log.info("done: mean %s %.4f -> %s", result["metric"], result["mean"], out / "results.json")
