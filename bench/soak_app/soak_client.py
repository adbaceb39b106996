"""comix's ClientApp with a fault injector, for the soak (bench/soak.py) and the Flower tests.

The node config's ``fault-plan`` names a JSON file {round: {client: kind}}; on a train message
of that round this device misbehaves as ``kind`` says, the same way each time the round is sent
(a restarted server re-sends it), so what a fault does is known from the plan:

* a corrupt upload, trained and then spoiled before it leaves (``CORRUPT``): ``nan`` and ``inf``
  values, a wrong ``shape`` or ``dtype``, an ``extra`` tensor (the frozen base's embedding, as if
  the base leaked), a ``missing`` tensor, a ``specialist`` (a tensor named like the device's
  private expert, which must never leave it);
* ``delay``: trained, then the reply held back ``delay`` seconds (node config), past the round;
* ``crash``: the device (its SuperNode and this process) dies on receiving the message, before
  training: its state stays at the previous round;
* ``crash-after``: it dies after training (its state for the round is written), before replying.

Every train that completes is appended to ``<state-dir>/journal-client<c>.jsonl`` before any
delay or crash-after: which devices trained in which round, for the soak's in-process replay.
"""
from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import torch
from flwr.app import Context, Message
from flwr.clientapp import ClientApp

from comix.engines.flower import client_app as honest
from comix.engines.flower.wire import from_arrays, to_arrays

CORRUPT = ("nan", "inf", "shape", "dtype", "extra", "missing", "specialist")
FAULTS = (*CORRUPT, "delay", "crash", "crash-after")
# what the server must log for each kind (engines/server.py, Algorithm.check_upload, server_app.py)
REASON = {"nan": "NaN or inf", "inf": "NaN or inf", "shape": "has shape", "dtype": "has dtype",
          "extra": "undeclared", "missing": "missing tensors", "specialist": "undeclared",
          "delay": "no reply", "crash": "no reply", "crash-after": "no reply"}

app = ClientApp()
app.query("init")(honest.init)
app.train("finish")(honest.finish)
app.evaluate()(honest.evaluate)


def corrupt(upload: dict[str, torch.Tensor], kind: str) -> dict[str, torch.Tensor]:
    """``upload`` spoiled as ``kind`` says (one of ``CORRUPT``)."""
    out = dict(upload)
    name = sorted(out)[0]
    t = out[name]
    if kind == "nan":
        out[name] = torch.full_like(t, float("nan"))
    elif kind == "inf":
        out[name] = t.clone().reshape(-1).index_fill(0, torch.tensor([0]), float("inf")).reshape(t.shape)
    elif kind == "shape":
        out[name] = torch.zeros(t.shape[0] + 1, *t.shape[1:], dtype=t.dtype)
    elif kind == "dtype":
        out[name] = t.double()
    elif kind == "extra":
        out["model.embed_tokens.weight"] = torch.zeros(16, 8)
    elif kind == "missing":
        del out[name]
    elif kind == "specialist":  # CoMiGS: expert 0 is the generalist, expert 1 the private specialist
        shared = next((n for n in sorted(out) if ".experts.0." in n), None)
        private = shared.replace(".experts.0.", ".experts.1.") if shared else "model.layers.0.mlp.experts.1.lora_A"
        out[private] = out[shared].clone() if shared else torch.zeros(4, 8)
    else:
        raise ValueError(f"unknown corruption {kind!r}; one of {CORRUPT}")
    return out


def planned(context: Context, rnd: int) -> str | None:
    path = context.node_config.get("fault-plan")
    if not path:
        return None
    plan = json.loads(Path(str(path)).read_text())
    return plan.get(str(rnd), {}).get(str(context.node_config["client-id"]))


def _die() -> None:
    """This device dies at once: its SuperNode (which began a process group of its own) and this
    process with it, as a power cut would; no reply, no clean-up."""
    pid = os.getpid()
    while pid > 1:  # up to the SuperNode that started this ClientApp process
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        if any(Path(a.decode(errors="replace")).name == "flower-supernode" for a in argv[:2]):
            os.killpg(os.getpgid(pid), signal.SIGKILL)
        pid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    os.kill(os.getpid(), signal.SIGKILL)


@app.train()
def train(msg: Message, context: Context) -> Message:
    rnd = int(msg.content["round"]["round"])
    kind = planned(context, rnd)
    if kind == "crash":
        _die()
    reply = honest.train(msg, context)
    client = int(context.node_config["client-id"])
    state_dir = Path(str(context.node_config["state-dir"]))
    with open(state_dir / f"journal-client{client}.jsonl", "a") as fh:
        fh.write(json.dumps({"round": rnd, "client": client, "fault": kind, "time": time.time()}) + "\n")
    if kind == "crash-after":
        _die()
    if kind == "delay":
        time.sleep(float(context.node_config["delay"]))
    if kind in CORRUPT:
        reply.content["upload"] = to_arrays(corrupt(from_arrays(reply.content["upload"]), kind))
    return reply
