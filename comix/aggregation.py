"""The server's half of a round beyond the plain mean: how the uploads are combined and what
optimiser turns the combined update into the next global tensors (``server:`` in a recipe).

* ``server.aggregate``: ``mean`` (FedAvg, CoMiGS eq. 4), or a rule robust to a few poisoned
  uploads, each as Flower 1.41's strategy of the same name computes it
  (flwr/serverapp/strategy/): ``median`` (FedMedian: the coordinate-wise median, unweighted),
  ``trimmed_mean`` (FedTrimmedAvg: per coordinate the mean after cutting ``int(trim x n)`` values
  at each end), ``krum`` (Krum / MultiKrum, Blanchard et al., NeurIPS 2017: each upload scored by
  the sum of its squared distances to its n - f - 2 nearest others, the ``krum_select`` lowest
  averaged).
* ``server.optimizer``: ``fedavg`` (the combined uploads are the next global tensors), or a step
  on the round's pseudo-gradient Delta = combined - x (x: the tensors the round's clients started
  from), Reddi et al., "Adaptive Federated Optimization" (ICLR 2021), Alg. 2, term for term as
  Flower 1.41 computes it: ``fedavgm`` (Hsu et al. 2019: m = momentum m + Delta, x += lr m),
  ``fedadagrad`` (v += Delta^2), ``fedadam`` (v = b2 v + (1 - b2) Delta^2, with Adam's bias
  correction of the rate as Flower adds it: lr sqrt(1 - b2^(t+1)) / (1 - b1^(t+1)), t the tensor's
  server step from 1, flwr's ``server_round + 1``), ``fedyogi`` (v -= (1 - b2) Delta^2
  sign(v - Delta^2)); m = b1 m + (1 - b1) Delta; x += lr m / (sqrt(v) + tau); moments start at 0.
  Each tensor keeps its own moments and step count (FedAMoLE's experts, aggregated only in the
  rounds someone holds them), checkpointed with the run (``state_dict``).
Defaults are Flower's (its strategies' signatures), which take Reddi et al.'s: b1 0.9 (0 for
FedAdagrad), b2 0.99, tau 1e-3; the server rate 1.0 (FedAvgM), 0.1 (FedAdam, FedAdagrad), 0.01
(FedYogi); FedAvgM's momentum 0.9 (Hsu et al. 2019's server momentum; Flower's 0 would make it
FedAvg). With DP-FedAvg the noise is on the mean's sums before the server step (post-processing:
the guarantee stands); under SecAgg+ the step reads the mean of the revealed sum only.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

OPTIMIZERS = ("fedavg", "fedavgm", "fedadam", "fedyogi", "fedadagrad")
AGGREGATES = ("mean", "median", "trimmed_mean", "krum")
DEFAULT_LR = {"fedavgm": 1.0, "fedadam": 0.1, "fedyogi": 0.01, "fedadagrad": 0.1}  # Flower 1.41's


@dataclass
class ServerConfig:
    """``server:`` in a recipe: off by default (the plain mean, no server optimiser)."""
    optimizer: str = "fedavg"         # fedavg | fedavgm | fedadam | fedyogi | fedadagrad
    lr: float | None = None           # the server's rate; None: the optimiser's default (DEFAULT_LR)
    momentum: float = 0.9             # FedAvgM's server momentum
    beta1: float | None = None        # None: 0.9, or 0 for FedAdagrad (Flower's defaults)
    beta2: float = 0.99               # FedAdam and FedYogi: the second moment's decay
    tau: float = 1e-3                 # the adaptivity floor of sqrt(v)
    aggregate: str = "mean"           # mean | median | trimmed_mean | krum
    trim: float = 0.2                 # trimmed_mean: the fraction cut at each end (Flower's beta)
    krum_f: int = 0                   # krum: how many poisoned clients it assumes (Flower's num_malicious_nodes)
    krum_select: int = 1              # krum: how many lowest-scored uploads are averaged (> 1: MultiKrum)

    @property
    def steps(self) -> bool:
        return self.optimizer != "fedavg"

    @property
    def robust(self) -> bool:
        return self.aggregate != "mean"

    def problem(self) -> str | None:
        """What is wrong with these settings (one line naming the key), or None."""
        if self.optimizer not in OPTIMIZERS:
            return f"server.optimizer must be one of {', '.join(OPTIMIZERS)}, got {self.optimizer!r}"
        if self.aggregate not in AGGREGATES:
            return f"server.aggregate must be one of {', '.join(AGGREGATES)}, got {self.aggregate!r}"
        numbers = ("lr", "momentum", "beta1", "beta2", "tau", "trim")
        bad = next((k for k in numbers if getattr(self, k) is not None and (
            isinstance(getattr(self, k), bool) or not isinstance(getattr(self, k), (int, float)))), None)
        if bad:
            return f"server.{bad} must be a number, got {getattr(self, bad)!r}"
        if self.lr is not None and not self.lr > 0:
            return f"server.lr must be > 0 (or null: the optimiser's default), got {self.lr}"
        for key in ("momentum", "beta2") + (("beta1",) if self.beta1 is not None else ()):
            if not 0 <= getattr(self, key) < 1:
                return f"server.{key} must be in [0, 1), got {getattr(self, key)}"
        if not self.tau > 0:
            return f"server.tau must be > 0, got {self.tau}"
        if not 0 <= self.trim < 0.5:
            return f"server.trim must be in [0, 0.5), got {self.trim}"
        if self.krum_f < 0 or self.krum_select < 1:
            return f"server.krum_f must be >= 0 and server.krum_select >= 1, got {self.krum_f} and {self.krum_select}"
        return None


def combine(uploads: dict[int, dict[str, torch.Tensor]], cfg: ServerConfig) -> dict[str, torch.Tensor]:
    """The uploads combined by ``cfg.aggregate`` (not ``mean``: that is ``average``, with DP's noise),
    each tensor over the clients that uploaded it, in fp32, returned in the uploads' dtype."""
    names = sorted({n for u in uploads.values() for n in u})
    if cfg.aggregate == "krum":
        return _krum(uploads, names, cfg.krum_f, cfg.krum_select)
    out = {}
    for n in names:
        ts = [u[n] for u in uploads.values() if n in u]
        stack = torch.stack(ts).to(torch.promote_types(ts[0].dtype, torch.float32))  # fp32, or an fp64 model's fp64
        if cfg.aggregate == "median":
            # numpy's median (Flower's): the mean of the two middle values for an even count,
            # where torch.median would return the lower one
            value = torch.quantile(stack.reshape(len(ts), -1), 0.5, dim=0).reshape(stack.shape[1:])
        else:
            cut = int(cfg.trim * len(ts))
            value = stack.sort(0).values[cut:len(ts) - cut].mean(0)
        out[n] = value.to(ts[0].dtype)
    return out


def _krum(uploads, names, f: int, select: int) -> dict[str, torch.Tensor]:
    clients = sorted(uploads)
    if any(set(uploads[c]) != set(names) for c in clients):
        raise ValueError("server.aggregate=krum compares whole uploads: every client must upload the same tensors")
    flat = torch.stack([torch.cat([uploads[c][n].double().reshape(-1) for n in names]) for c in clients])
    sq = (flat * flat).sum(1)
    dist = sq[:, None] + sq[None, :] - 2 * flat @ flat.t()  # Flower's compute_distances
    closest = max(1, len(clients) - f - 2)
    # argsort's first index is the upload itself (distance 0), skipped as Flower's select_multikrum does
    scores = torch.stack([dist[i, dist[i].argsort(stable=True)[1:closest + 1]].sum() for i in range(len(clients))])
    chosen = [clients[i] for i in scores.argsort(stable=True)[:select].tolist()]
    return {n: torch.stack([uploads[c][n].float() for c in chosen]).mean(0).to(uploads[chosen[0]][n].dtype)
            for n in names}


class ServerOptimizer:
    """``server.optimizer``'s state and step: per tensor name its moments and step count."""

    def __init__(self, cfg: ServerConfig):
        self.cfg = cfg
        self.lr = cfg.lr if cfg.lr is not None else DEFAULT_LR[cfg.optimizer]
        self.beta1 = cfg.beta1 if cfg.beta1 is not None else (0.0 if cfg.optimizer == "fedadagrad" else 0.9)
        self.m: dict[str, torch.Tensor] = {}
        self.v: dict[str, torch.Tensor] = {}
        self.t: dict[str, int] = {}

    def step(self, start: dict[str, torch.Tensor], combined: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The next global tensors from ``start`` (what the round's clients started from) and the
        round's ``combined`` uploads; a combined tensor without a start is an error, not a mean."""
        missing = sorted(set(combined) - set(start))
        if missing:
            raise ValueError(f"server.optimizer={self.cfg.optimizer}: no round-start value for {missing[0]!r} "
                             "(the server steps from the tensors it sent)")
        out = {}
        for n, new in combined.items():
            x = start[n].float()
            delta = new.float() - x
            self.t[n] = t = self.t.get(n, 0) + 1
            if self.cfg.optimizer == "fedavgm":
                m = self.m[n] = self.cfg.momentum * self.m[n] + delta if n in self.m else delta
                out[n] = (x + self.lr * m).to(new.dtype)
                continue
            m = self.m[n] = self.beta1 * self.m.get(n, torch.zeros_like(x)) + (1 - self.beta1) * delta
            v = self.v.get(n, torch.zeros_like(x))
            d2 = delta * delta
            if self.cfg.optimizer == "fedadagrad":
                v = v + d2
            elif self.cfg.optimizer == "fedadam":
                v = self.cfg.beta2 * v + (1 - self.cfg.beta2) * d2
            else:  # fedyogi
                v = v - (1 - self.cfg.beta2) * d2 * torch.sign(v - d2)
            self.v[n] = v
            lr = self.lr
            if self.cfg.optimizer == "fedadam":  # as flwr's FedAdam: eta_norm with server_round + 1
                lr = self.lr * (1 - self.cfg.beta2 ** (t + 1)) ** 0.5 / (1 - self.beta1 ** (t + 1))
            out[n] = (x + lr * m / (v.sqrt() + self.cfg.tau)).to(new.dtype)
        return out

    def state_dict(self) -> dict:
        return {"m": dict(self.m), "v": dict(self.v), "t": dict(self.t)}

    def load_state_dict(self, state: dict) -> None:
        self.m, self.v, self.t = dict(state["m"]), dict(state["v"]), dict(state["t"])
