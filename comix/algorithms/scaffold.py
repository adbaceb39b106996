"""SCAFFOLD's control variates (Karimireddy et al., ICML 2020, Alg. 1, option II) over the
contract's round (``train.scaffold``), for both executors.

The server holds one control variate c per shared tensor, each client its own c_i; both start at
zero. A round's payload carries the shared tensors x and c. After every local step the client
corrects each shared parameter, y <- y - eta_k (c - c_i); after the round's K steps

    c_i+ = c_i - c + (x - y) / sum_k eta_k          (option II: (x - y) / (K eta) at a constant eta)

and it uploads y and Delta c_i = c_i+ - c_i, never c_i itself, which stays on the device. The
server takes the mean of the y (or ``server.optimizer``'s step from it) and

    c <- c + (1 / N) sum over the round's clients of Delta c_i      (Alg. 1 line 17: |S|/N x their mean)

with N every client of the run, so a round that samples some clients moves c by their share.

comix trains with AdamW, for which Alg. 1's corrected gradient (g - c_i + c) would be rescaled by
the moments; as OpenFedLLM (Ye et al., KDD 2024; federated_learning/fed_local_sft.py, the
SCAFFOLD callback) does, the correction is applied to the parameters after each optimiser step at
that step's learning rate, so that the drift estimate (x - y) / sum eta of option II measures the
same units it corrects. With plain SGD both forms are Alg. 1's step. Only parameters the method
shares are corrected: specialists, routers and personal LoRA have no server counterpart.

A variate travels under its tensor's name with ``PREFIX`` before it: in the payload (c) and in the
upload (Delta c_i), so both are counted in the bytes and checked as any declared tensor. The
server's c is read back from the payload the round started from (``Algorithm.round_start``), so
it is checkpointed with the payloads; each c_i lives in its client's state (``extra``).
"""
from __future__ import annotations

import torch

from ..runtime import at_least_fp32

Tensors = dict[str, torch.Tensor]

PREFIX = "scaffold_c:"
LOCAL = "scaffold_c_i"           # ClientState.extra: this client's c_i (kept across rounds)
ROUND = "scaffold_round"         # ClientState.extra, during a round only: the server's c and the sum of rates


def is_control(name: str) -> bool:
    return name.startswith(PREFIX)


def split_controls(tensors: Tensors) -> tuple[Tensors, Tensors]:
    """(the tensors that are not variates, the variates keyed by their tensor's own name)."""
    return ({n: t for n, t in tensors.items() if not is_control(n)},
            {n[len(PREFIX):]: t for n, t in tensors.items() if is_control(n)})


def with_controls(tensors: Tensors, controls: Tensors) -> Tensors:
    return {**tensors, **{PREFIX + n: t for n, t in controls.items()}}


def zero_controls(shared: Tensors) -> Tensors:
    """Zero variates for ``shared`` (fp32, or fp64 for an fp64 model: at_least_fp32, as the update
    they estimate): c and c_i at the start."""
    return {n: torch.zeros(t.shape, dtype=torch.promote_types(t.dtype, torch.float32)) for n, t in shared.items()}


# -- the client --------------------------------------------------------------------------------------
def begin_control_round(extra: dict, payload: Tensors) -> Tensors:
    """Take the server's c out of ``payload`` for the round (into ``extra[ROUND]``, beside the sum
    of the rates the round's steps will use); returns the payload without it."""
    rest, c = split_controls(payload)
    if c:
        extra[ROUND] = {"c": {n: at_least_fp32(t) for n, t in c.items()}, "lr_sum": 0.0}
    return rest


def control_correction(extra: dict) -> Tensors | None:
    """c - c_i per shared tensor name for the round, or None when the round carries no variates."""
    rnd = extra.get(ROUND)
    if rnd is None:
        return None
    local = extra.get(LOCAL) or {}
    return {n: c - local[n] if n in local else c for n, c in rnd["c"].items()}


def cohort_correction(extras: list[dict], named) -> list[torch.Tensor] | None:
    """For a cohort (algorithms/cohort.py): each trained parameter's c - c_i, stacked over the
    members (``extras``: their states' ``extra``) as the parameter is, zero where it has no variate."""
    corr = [control_correction(e) for e in extras]
    if corr[0] is None:
        return None
    return [torch.stack([c.get(n, torch.zeros(p.shape[1:])) for c in corr]).to(p.device) for n, p in named]


@torch.no_grad()
def apply_correction(params: list[tuple[torch.Tensor, torch.Tensor]], lr: float, extra: dict) -> None:
    """After a local step at ``lr``: y <- y - lr (c - c_i) for each (parameter, its c - c_i)."""
    for p, corr in params:
        p.sub_(corr.to(p.device, p.dtype), alpha=lr)
    add_control_rate(extra, lr)


def add_control_rate(extra: dict, lr: float) -> None:
    """Count a local step at ``lr`` in the round's sum of rates (option II's K eta)."""
    extra[ROUND]["lr_sum"] += lr


def end_control_round(extra: dict, start: Tensors, trained: Tensors) -> Tensors:
    """Option II's new c_i from the round's start x and trained y of each variate's tensor; the
    client keeps it (``extra[LOCAL]``) and the returned Delta c_i, keyed as uploads are, is all of
    it that leaves the device. Nothing when the round carried no variates."""
    rnd = extra.pop(ROUND, None)
    if rnd is None:
        return {}
    if rnd["lr_sum"] <= 0:
        raise ValueError("SCAFFOLD needs at least one local step at a positive learning rate in the round")
    local = extra.get(LOCAL) or {}
    new, delta = {}, {}
    for n, c in rnd["c"].items():
        c_i = local.get(n, torch.zeros_like(c))
        new[n] = c_i - c + (at_least_fp32(start[n]) - at_least_fp32(trained[n])) / rnd["lr_sum"]
        delta[n] = new[n] - c_i
    extra[LOCAL] = new
    return with_controls({}, delta)


# -- the server --------------------------------------------------------------------------------------
def server_controls(start: Tensors, delta_sum: Tensors, n_clients: int) -> Tensors:
    """c + (1/N) sum_i Delta c_i, from the round's starting c (``start``, payload names) and the sum
    of the round's Delta c_i (upload names)."""
    _, c = split_controls(start)
    _, total = split_controls(delta_sum)
    return with_controls({}, {n: at_least_fp32(c[n]) + at_least_fp32(total[n]) / n_clients if n in total else c[n] for n in c})


def control_delta_sum(uploads: dict[int, Tensors]) -> Tensors:
    """The sum over the round's clients of each uploaded variate delta (upload names)."""
    out: Tensors = {}
    for up in uploads.values():
        for n, t in up.items():
            if is_control(n):
                out[n] = out[n] + at_least_fp32(t) if n in out else at_least_fp32(t).clone()
    return out
