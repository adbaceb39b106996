"""A device upload over 2 GB through comix's Flower path, for bench/large_upload.py.

The ClientApp answers the server's ``query.init`` as comix's does (its client id and an empty
listing) and a ``train`` message with one fp32 tensor of ``floats`` values (node config) drawn
from a seeded generator, its SHA-256 in the metrics, built with comix's ``wire.to_arrays`` /
``to_json`` as ``client_app.train`` builds its reply. The ServerApp is comix's
``FlowerTransport`` (engines/flower/server_app.py): it finds the device, asks it to train and
receives the upload through ``FlowerTransport.train``; it writes whether the bytes it received
hash to the device's digest, with its own peak RSS, to the run config's ``result`` file.
"""
from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path

import torch
from flwr.app import Context, Message, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp

from comix.engines.flower.deploy import memory_mb
from comix.engines.flower.server_app import FlowerTransport
from comix.engines.flower.wire import to_arrays, to_json

client = ClientApp()
server = ServerApp()


def digest(t: torch.Tensor) -> str:
    return hashlib.sha256(memoryview(t.contiguous().numpy()).cast("B")).hexdigest()  # no copy of the bytes


def _peak_mb() -> float:
    """This process's own peak (VmHWM: getrusage would keep the RSS of the process that forked it)."""
    return memory_mb(os.getpid(), "VmHWM")


@client.query("init")
def init(msg: Message, context: Context) -> Message:
    info = {"client": int(context.node_config["client-id"]), "user": "synthetic"}
    return Message(RecordDict({"shared": to_arrays({}), "info": to_json(info)}), reply_to=msg)


@client.train()
def train(msg: Message, context: Context) -> Message:
    t0 = time.time()
    weights = torch.randn(int(context.node_config["floats"]), generator=torch.Generator().manual_seed(0))
    metrics = {"sha256": digest(weights), "bytes": weights.numel() * 4, "made_s": round(time.time() - t0, 1),
               "client_peak_rss_mb_before_send": round(_peak_mb(), 1)}
    return Message(RecordDict({"upload": to_arrays({"device.weights": weights}), "metrics": to_json(metrics)}),
                   reply_to=msg)


@server.main()
def main(grid: Grid, context: Context) -> None:
    rc = dict(context.run_config)
    transport = FlowerTransport(grid, {"config": "", "method": "synthetic"}, 1, float(rc["timeout"]))
    transport.discover(wait=120)
    t0 = time.time()
    reply = transport.train({0: {}})[0]
    seconds = time.time() - t0
    if isinstance(reply, str):
        out = {"received": False, "reason": reply}
    else:
        upload, metrics = reply
        w = upload["device.weights"]
        out = {"received": True, "bytes": w.numel() * w.element_size(), "dtype": str(w.dtype),
               "bit_exact": digest(w) == metrics["sha256"], "round_trip_s": round(seconds, 1), **metrics}
    out["serverapp_peak_rss_mb"] = round(_peak_mb(), 1)
    Path(str(rc["result"])).write_text(json.dumps(out))
