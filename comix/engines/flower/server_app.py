"""The server side of the Flower engine: ``engines.server.serve`` with Flower messages.

Run config (``[tool.flwr.app.config]`` of the app, overridable with ``flwr run -c``):
``config`` (a comix YAML recipe on the server machine), ``method`` (a method spec),
``run-dir``, ``clients`` (how many devices to wait for), ``seed`` (-1: the recipe's),
``timeout`` (seconds to wait for one round's replies), ``wait`` (seconds to wait for the devices
to connect). Each device reports its client id (from its node config) when first seen, so the
server knows which node holds which user; a device that reconnects (under the node id of its
key with authentication, else a new one) is found again the same way. Replies that are errors,
late, or fail the algorithm's checks are left out of that round's aggregate (``serve``)."""
from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path

from flwr.app import ArrayRecord, ConfigRecord, Context, Message, RecordDict
from flwr.server.compat.grid_client_proxy import GridClientProxy
from flwr.server.strategy import Strategy
from flwr.serverapp import Grid, ServerApp

from ...fleet import DEADLINE_MISSED
from ...specs import build_algorithm, server_context, spec_dirname
from ...config import load_config
from ..server import serve
from .wire import from_arrays, from_json, from_parameters, secure_fitins, to_arrays, to_json

log = logging.getLogger("comix.flower")
app = ServerApp()


class FlowerTransport:
    def __init__(self, grid: Grid, run: dict, n_clients: int, timeout: float, privacy=None):
        self.grid, self.run, self.n, self.timeout, self.privacy = grid, run, n_clients, timeout, privacy
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

    def _refresh(self, clients) -> None:
        """Find again the devices of ``clients`` whose node is gone (back under a new node id)."""
        alive = set(self.grid.get_node_ids())
        if any(self.node_of.get(c) not in alive for c in clients):
            self.node_of = {c: n for c, n in self.node_of.items() if n in alive}
            try:
                self.discover(wait=0)
            except TimeoutError:
                pass

    def _request(self, kind: str, payloads: dict, **extra) -> dict[int, Message | str]:
        self._refresh(payloads)
        msgs = [self._message(self.node_of[c], kind, payload=to_arrays(p)) for c, p in payloads.items()
                if c in self.node_of]
        replies = self._send(msgs)
        out: dict[int, Message | str] = {}
        for c in payloads:
            reply = replies.get(self.node_of.get(c, -1))
            if c not in self.node_of:  # nothing was sent: the device is not connected
                out[c] = "device unreachable (not connected: no message sent)"
            elif reply is None:  # sent: it died with the message, or answered after the timeout
                out[c] = f"no reply within the round's timeout ({self.timeout:g} s)"
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

    def train_secure(self, payloads, expected):
        """One round through Flower's SecAgg+ (its SecAggPlusWorkflow, run with a legacy context
        whose strategy hands out each client's payload and keeps the unmasked mean): returns the
        sum of the uploads of the clients that finished the protocol, their count, and per client
        its metrics or why it is missing. A client whose declared listing is not the expected one
        is reported, and the round fails: its masked vector is already inside the sum."""
        from flwr.server.compat.legacy_context import LegacyContext
        from flwr.server.workflow import SecAggPlusWorkflow

        self.round += 1
        self._refresh(payloads)
        strategy = _SecureSum({self.node_of[c]: (c, secure_fitins(self.run, self.round, p))
                               for c, p in payloads.items() if c in self.node_of}, self.grid)
        context = LegacyContext(Context(run_id=0, node_id=0, node_config={}, state=RecordDict(), run_config={}),
                                strategy=strategy)
        context.state["config"] = ConfigRecord({"current_round": self.round})
        context.state["parameters"] = ArrayRecord()
        p = self.privacy
        # max_weight 1: every client weighs 1, so the weight's quantisation costs no precision
        SecAggPlusWorkflow(_share_param(p.secagg_shares), _share_param(p.secagg_threshold), max_weight=1.0,
                           clipping_range=p.secagg_clip_range, quantization_range=int(p.secagg_quantization),
                           timeout=self.timeout)(self.grid, context)
        replies: dict[int, dict | str] = {c: "no masked vector in the sum (dropped out, late or refused)"
                                          for c in payloads}
        for c in payloads:  # a device that said why it left (its deadline, a refused upload)
            said = [f for f in strategy.failures if f"client {c} " in f]
            if said and c not in strategy.replies:
                replies[c] = DEADLINE_MISSED if DEADLINE_MISSED in said[0] else said[0][:200]
        for c, info in strategy.replies.items():
            listing = [[n, list(t.shape)] for n, t in sorted(expected[c].items())]
            if info["listing"] != listing:
                raise RuntimeError(f"round {self.round}: client {c} masked tensors {info['listing'][:2]}..., expected "
                                   f"{listing[:2]}...: a secure sum of different listings is meaningless")
            replies[c] = info["metrics"]
        count = len(strategy.replies)
        listing = next(iter(expected.values()))
        total = {n: t * count for n, t in from_parameters(strategy.mean, sorted(listing)).items()} if count else {}
        return total, count, replies

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


def _share_param(x: float) -> int | float:
    """Flower reads an int as a count and a float as a fraction."""
    return int(x) if x > 1 else float(x)


class _SecureSum(Strategy):
    """The two hooks SecAggPlusWorkflow calls: ``configure_fit`` (each sampled device's payload)
    and ``aggregate_fit`` (the unmasked mean, identical in every result, and each device's
    metrics). Nothing else of a Flower strategy is used."""

    def __init__(self, fitins: dict, grid: Grid):
        self.fitins, self.grid = fitins, grid   # node id -> (client, FitIns)
        self.mean, self.replies, self.failures = None, {}, []

    def configure_fit(self, server_round, parameters, client_manager):
        return [(GridClientProxy(node, self.grid, 0), ins) for node, (_, ins) in self.fitins.items()]

    def aggregate_fit(self, server_round, results, failures):
        for proxy, res in results:
            self.mean = res.parameters
            self.replies[self.fitins[proxy.node_id][0]] = json.loads(res.metrics["json"])
        self.failures = [str(f) for f in failures]  # the devices' own reasons, each naming its client
        return None, {}

    def initialize_parameters(self, client_manager):
        return None

    def configure_evaluate(self, server_round, parameters, client_manager):
        return []

    def aggregate_evaluate(self, server_round, results, failures):
        return None, {}

    def evaluate(self, server_round, parameters):
        return None


RUN_ENV = "COMIX_FLOWER_RUN"  # the run config of a simulation (run_simulation takes none); see simulation.py


@app.main()
def main(grid: Grid, context: Context) -> None:
    rc = dict(context.run_config)
    if os.environ.get(RUN_ENV):
        rc.update(json.loads(os.environ[RUN_ENV]))
    serve_on(grid, rc)


def serve_on(grid: Grid, rc: dict) -> dict:
    """The run of ``rc`` (the run config above) over ``grid``; returns results.json."""
    cfg = load_config(str(rc["config"]))
    spec = str(rc["method"])
    seed = int(rc.get("seed", -1))
    seed = cfg.seed if seed < 0 else seed
    n = int(rc["clients"])
    run = {"config": Path(str(rc["config"])).read_text(), "method": spec, "seed": seed, "n_clients": n,
           "state_dir": rc.get("state-dir")}
    algo = build_algorithm(cfg, spec, n)
    transport = FlowerTransport(grid, run, n, float(rc.get("timeout", 600)), algo.privacy)
    users = transport.discover(float(rc.get("wait", 120)))
    out = Path(str(rc["run-dir"])) / spec_dirname(spec)
    algo.server = server_context(cfg, out, seed)

    def progress(p):
        log.info("round %d/%d train loss %.4f %s %s (%.1f s)", p["round"], p["rounds"], p["train_loss"],
                 p["metric"], p["scores"], p["seconds"])
    result = serve(algo, transport, users, out, seed=seed, resume=True, progress=progress)
    log.info("done: mean %s %.4f -> %s", result["metric"], result["mean"], out / "results.json")
    return result
