"""Client-level differential privacy for what leaves a device: DP-FedAvg (McMahan et al., "Learning
Differentially Private Recurrent Language Models", ICLR 2018, Alg. 1 with the Gaussian mechanism).

  * On the client (``clip_upload``, called by ``engines.device.Device.train``, so on Flower it runs
    on the device and the server never sees an unclipped update): the update of the shared
    tensors, upload minus the payload the client started from, is scaled so that its L2 norm over
    *all* shared tensors together is at most ``clip`` (McMahan et al.'s flat clipping).
  * On the server (``GaussianSumNoise``, used by ``Algorithm.aggregate``): Gaussian noise of std
    ``noise_multiplier x clip`` is added to each aggregate's *sum* before it is divided by the
    number of clients summed. FedAMoLE averages each expert over its holders only: every such sum
    gets the same noise, so the concatenation of all sums still has L2 sensitivity ``clip`` to one
    client (its whole upload is clipped at once).
  * The accountant is Google's ``dp-accounting`` (RDP; the library behind Flower's DP strategies),
    fed the sampling the run uses (``engines.server.sample_clients``): full participation =
    T-fold Gaussian mechanism, no amplification; ``train.client_sampling: poisson`` = Poisson
    subsampled Gaussian (McMahan et al.'s setting, add-or-remove-one-client neighbours); a fixed
    number of clients per round = sampling without replacement, which dp-accounting accounts under
    replace-one neighbours, where the sum's sensitivity is 2 x clip (one bounded update swapped for
    another), so its noise multiplier there is sigma / 2 (Wang, Balle, Kasiviswanathan, AISTATS 2019,
    Thm. 27, as dp-accounting implements it).
What is *not* covered is written down (``privacy.md``): tensors an algorithm exempts from the
clip (FedAMoLE's RSEA embeddings: the authors' ``--dp_eta`` noise, ``fedamole.embed_noise``, is
not accounted) and everything of a method that refuses DP (``Algorithm.dp_refusal``).
"""
from __future__ import annotations

import functools
import hashlib
import math
from dataclasses import dataclass

import torch

Tensors = dict[str, torch.Tensor]


@dataclass
class PrivacyConfig:
    """``privacy:`` in a recipe. Off by default (noise 0, no clipping)."""
    noise_multiplier: float = 0.0    # sigma: noise std / clip; 0 = no noise
    clip: float = math.inf           # L2 bound of a client's whole update (YAML .inf = none)
    delta: float = 1e-5              # the delta at which epsilon is reported
    target_epsilon: float = 0.0      # > 0: calibrate sigma to reach it after train.rounds (or refuse)
    # Secure aggregation (Flower engines only): Flower's SecAgg+ (Bell et al., CCS 2020) through its
    # SecAggPlusWorkflow and secaggplus_mod; the server receives masked integer vectors and unmasks
    # only their sum. The knobs are Flower's, with Flower's defaults except the share count.
    secure_aggregation: bool = False
    secagg_shares: float = 1.0        # Flower's num_shares: a fraction of the sampled clients (1.0: all) or a count
    secagg_threshold: float = 0.5     # reconstruction_threshold: a fraction of the shares (or a count)
    secagg_clip_range: float = 8.0    # clipping_range: an upload's values must lie in [-r, r] to be quantised
    secagg_quantization: int = 2**22  # quantization_range: levels over [-r, r] (step 2r / 2^22 ~ 3.8e-6)
    # Robustness, not privacy: the same flat L2 bound applied by the server to each accepted upload's
    # update before aggregating (engines/server.py), for runs without DP, where a device's update is
    # unbounded and one poisoned client (a norm 1,000x the others) would otherwise move the aggregate
    # by its whole update. The server sees the unclipped update, so it protects nothing of privacy;
    # it bounds what one client can do to the mean (by server_clip x its weight). Off by default.
    server_clip: float = math.inf

    @property
    def active(self) -> bool:
        return self.noise_multiplier > 0 or self.target_epsilon > 0 or math.isfinite(self.clip)

    def problem(self) -> str | None:
        """Why this section is invalid (one line), or None."""
        if not self.clip > 0:
            return f"privacy.clip must be > 0 (.inf = no clipping), got {self.clip}"
        if not self.server_clip > 0:
            return f"privacy.server_clip must be > 0 (.inf = no bound), got {self.server_clip}"
        if not self.noise_multiplier >= 0:
            return f"privacy.noise_multiplier must be >= 0, got {self.noise_multiplier}"
        if not 0 < self.delta < 1:
            return f"privacy.delta must be in (0, 1), got {self.delta}"
        if not self.target_epsilon >= 0:
            return f"privacy.target_epsilon must be >= 0 (0 = none), got {self.target_epsilon}"
        if (self.noise_multiplier > 0 or self.target_epsilon > 0) and not math.isfinite(self.clip):
            return "privacy.noise_multiplier / target_epsilon need a finite privacy.clip (noise on an unbounded " \
                   "update protects nothing)"
        if not (0 < self.secagg_shares <= 1 or self.secagg_shares == int(self.secagg_shares) > 2):
            return f"privacy.secagg_shares must be a fraction in (0, 1] or a count > 2, got {self.secagg_shares}"
        if not (0 < self.secagg_threshold <= 1 or self.secagg_threshold == int(self.secagg_threshold) >= 2):
            return f"privacy.secagg_threshold must be a fraction in (0, 1] or a count >= 2, got {self.secagg_threshold}"
        if self.secure_aggregation and math.isfinite(self.server_clip):
            return "privacy.server_clip bounds uploads the server reads; under secure_aggregation it sees only their " \
                   "masked sum: bound the update on the devices with privacy.clip instead"
        if not self.secagg_clip_range > 0 or not 0 < self.secagg_quantization < 2**32:
            return f"privacy.secagg_clip_range must be > 0 and privacy.secagg_quantization in (0, 2^32), got " \
                   f"{self.secagg_clip_range} and {self.secagg_quantization}"
        return None


# -- the client's step ----------------------------------------------------------------------------
def clip_upload(upload: Tensors, start: Tensors, clip: float, exempt=lambda name: False) -> tuple[Tensors, float]:
    """(``upload`` with its update clipped, the update's L2 norm before clipping). The update of a
    tensor is ``upload - start`` (``start``: the payload the client began the round from; a tensor
    the payload did not hold starts from zero); all non-exempt tensors are scaled by one factor
    min(1, clip / ||update||) (McMahan et al. 2018, flat clipping)."""
    names = [n for n in upload if not exempt(n)]
    delta = {n: upload[n].float() - (start[n].float() if n in start else 0.0) for n in names}
    norm = math.sqrt(sum(float(d.pow(2).sum()) for d in delta.values()))
    if not math.isfinite(clip) or norm <= clip:
        return upload, norm
    scale = clip / norm
    out = dict(upload)
    for n in names:
        base = start[n].float() if n in start else 0.0
        out[n] = (base + delta[n] * scale).to(upload[n].dtype)
    return out, norm


# -- the server's step ----------------------------------------------------------------------------
class GaussianSumNoise:
    """N(0, std^2) per coordinate of each aggregate's sum, from a generator seeded by the run's seed
    and the round, so both engines draw the same noise in the same order."""

    def __init__(self, std: float, seed: int, rnd: int):
        self.std = std
        digest = hashlib.sha256(f"comix-dp:{seed}:{rnd}".encode()).digest()
        self.gen = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & (2**63 - 1))

    def __call__(self, total: torch.Tensor) -> torch.Tensor:
        return total + self.std * torch.randn(total.shape, generator=self.gen, dtype=torch.float64).to(total.dtype)


# -- the accountant -----------------------------------------------------------------------------
def sampling_of(n_clients: int, train) -> tuple[str, float, int]:
    """(kind, rate, clients per round) of the run's client sampling (engines.server.sample_clients)."""
    if getattr(train, "client_sampling", "fixed") == "poisson":
        return "poisson", train.client_fraction, n_clients
    k = train.clients_per_round or max(1, round(train.client_fraction * n_clients))
    if k >= n_clients:
        return "full", 1.0, n_clients
    return "fixed", k / n_clients, k


def _dp_event(noise_multiplier: float, rounds: int, kind: str, n_clients: int, k: int, rate: float):
    import dp_accounting as dpa
    if kind == "full":
        one = dpa.GaussianDpEvent(noise_multiplier)
    elif kind == "poisson":
        one = dpa.PoissonSampledDpEvent(rate, dpa.GaussianDpEvent(noise_multiplier))
    else:  # replace-one neighbours: the sum's sensitivity is 2 x clip
        one = dpa.SampledWithoutReplacementDpEvent(n_clients, k, dpa.GaussianDpEvent(noise_multiplier / 2))
    return dpa.SelfComposedDpEvent(one, rounds)


@functools.lru_cache(maxsize=4096)
def epsilon(noise_multiplier: float, rounds: int, delta: float, kind: str = "full", n_clients: int = 1,
            k: int = 1, rate: float = 1.0) -> float:
    """Epsilon at ``delta`` after ``rounds`` rounds (dp-accounting's RdpAccountant); inf with no noise."""
    if noise_multiplier <= 0:
        return math.inf
    if rounds == 0:
        return 0.0
    import logging

    from dp_accounting import rdp
    from dp_accounting.rdp.rdp_privacy_accountant import NeighborRel
    logging.getLogger("absl").setLevel(logging.ERROR)  # its per-order convergence notes are not ours
    rel = NeighborRel.REPLACE_ONE if kind == "fixed" else NeighborRel.ADD_OR_REMOVE_ONE
    acc = rdp.RdpAccountant(neighboring_relation=rel)
    acc.compose(_dp_event(noise_multiplier, rounds, kind, n_clients, k, rate))
    return float(acc.get_epsilon(delta))


def calibrate(target_epsilon: float, rounds: int, delta: float, kind: str, n_clients: int, k: int,
              rate: float) -> float:
    """The smallest noise multiplier (to 1e-3 relative) whose epsilon after ``rounds`` is at most
    ``target_epsilon``: a bisection over the accountant above."""
    lo, hi = 1e-3, 1.0
    while epsilon(hi, rounds, delta, kind, n_clients, k, rate) > target_epsilon:
        lo, hi = hi, hi * 2
        if hi > 1e6:
            raise ValueError(f"privacy.target_epsilon = {target_epsilon} cannot be reached in {rounds} rounds")
    while hi - lo > 1e-3 * hi:
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if epsilon(mid, rounds, delta, kind, n_clients, k, rate) > target_epsilon else (lo, mid)
    return hi


def resolve_privacy(privacy: PrivacyConfig, n_clients: int, train) -> PrivacyConfig:
    """``privacy`` with the noise multiplier the run will use: calibrated to ``target_epsilon``
    when only the target is given; with both, refused (one line) when the given noise would spend
    more than the target over ``train.rounds``."""
    from dataclasses import replace
    kind, rate, k = sampling_of(n_clients, train)
    if privacy.target_epsilon > 0 and privacy.noise_multiplier == 0:
        sigma = calibrate(privacy.target_epsilon, train.rounds, privacy.delta, kind, n_clients, k, rate)
        privacy = replace(privacy, noise_multiplier=round(sigma, 6))
        check_not_drowned(privacy, kind, rate * n_clients if kind == "poisson" else k,
                          f"privacy.target_epsilon = {privacy.target_epsilon} over {train.rounds} rounds calibrates")
        return privacy
    check_not_drowned(privacy, kind, rate * n_clients if kind == "poisson" else k, "privacy.noise_multiplier is")
    if privacy.target_epsilon <= 0:
        return privacy
    spent = epsilon(privacy.noise_multiplier, train.rounds, privacy.delta, kind, n_clients, k, rate)
    if spent > privacy.target_epsilon:
        raise ValueError(f"privacy.target_epsilon = {privacy.target_epsilon} cannot be met: noise_multiplier "
                         f"{privacy.noise_multiplier} over {train.rounds} rounds spends epsilon {spent:.3g}; raise "
                         "the noise, lower the rounds or leave noise_multiplier at 0 to calibrate it")
    return privacy


def check_not_drowned(privacy: PrivacyConfig, kind: str, per_round: float, what: str) -> None:
    """Refuse (one line, before any work) a noise that drowns every update: the noise on the
    *average* of the ``per_round`` clients summed has std sigma x clip / per_round per coordinate,
    so with sigma > per_round each coordinate's noise exceeds the norm bound of a whole update
    (clip): the model trains on noise alone, and at large sigma its weights overflow to NaN."""
    sigma = privacy.noise_multiplier
    if sigma > max(1.0, per_round):
        raise ValueError(
            f"{what} noise multiplier sigma = {sigma:.6g}, more than the {per_round:g} clients averaged per round "
            f"({kind} sampling): the noise on each coordinate of the average (std {sigma * privacy.clip / per_round:.3g})"
            f" exceeds the bound on a whole update (privacy.clip = {privacy.clip:g}), so every update would be drowned; "
            "allow a larger epsilon, more clients per round or fewer rounds")


def epsilon_after(privacy: PrivacyConfig, rounds: int, n_clients: int, train) -> float | None:
    """The run's epsilon after ``rounds`` rounds (None when no noise is added)."""
    if privacy.noise_multiplier <= 0:
        return None
    kind, rate, k = sampling_of(n_clients, train)
    return epsilon(privacy.noise_multiplier, rounds, privacy.delta, kind, n_clients, k, rate)


FIXED_K_NOTE = ("Sampling a fixed number of clients per round is accounted under replace-one neighbours (the sum's "
                "sensitivity is 2 x clip), so its epsilon is larger than full participation's at the same sigma; "
                "train.client_sampling=poisson is accounted under add-or-remove-one with amplification by sampling.")


# -- the record of what left each device (privacy.md) ---------------------------------------------
def privacy_record(rows: list[dict], method: str, privacy: PrivacyConfig, sampling: tuple, refusal: str | None,
                   exempt) -> str:
    """``privacy.md`` of one run from its server.jsonl ``rows``: the protection in force, per round
    which client uploaded how many bytes (and epsilon), and every distinct upload listing (tensor,
    shape, dtype) once, with the rounds and clients that sent it."""
    kind, rate, k = sampling
    dp = privacy.noise_multiplier > 0
    lines = [f"# What left each device: {method}", ""]
    lines.append("- Differential privacy: " + (
        f"DP-FedAvg, clip {privacy.clip:g} (L2 over a client's whole update, on the device), noise multiplier "
        f"{privacy.noise_multiplier:g} (std {privacy.noise_multiplier * privacy.clip:g} on each aggregate's sum), "
        f"delta {privacy.delta:g}; dp-accounting RDP, sampling {kind}"
        + (f" (rate {rate:g})" if kind != "full" else " (every client every round: no amplification)")
        if dp else ("clipping only (clip %g), no noise: no epsilon" % privacy.clip if math.isfinite(privacy.clip)
                    else "off" + (f" ({method} cannot offer it: {refusal})" if refusal else ""))))
    lines.append("- Secure aggregation: " + (
        f"Flower SecAgg+ (shares {privacy.secagg_shares:g}, threshold {privacy.secagg_threshold:g}, values in "
        f"[-{privacy.secagg_clip_range:g}, {privacy.secagg_clip_range:g}] quantised to {privacy.secagg_quantization} "
        "levels): the server received masked vectors and unmasked only their sum; the listings below are what each "
        "client declared it masked" + ("; DP noise is added by the server to the unmasked sum (central DP: the "
                                       "released aggregate is protected, the server itself sees the exact sum)"
                                       if dp else "")
        if privacy.secure_aggregation else "off (the server sees each client's upload)"))
    if kind == "fixed" and dp:
        lines.append(f"- {FIXED_K_NOTE}")
    names = {n for r in rows for listing in r.get("signatures", {}).values() for n, *_ in listing}
    exempt_names = sorted(n for n in names if exempt(n))
    if (dp or math.isfinite(privacy.clip)) and exempt_names:
        lines.append(f"- Not covered by the clip or the epsilon: {len(exempt_names)} tensors "
                     f"({', '.join(exempt_names[:3])}{', ...' if len(exempt_names) > 3 else ''})")
    if not any(u["bytes"] for r in rows for u in r.get("uploads", {}).values()):
        lines += ["- Uploads: none; nothing left any device in any round."]
        return "\n".join(lines) + "\n"
    clipping = math.isfinite(privacy.clip)  # how many updates the clip shortened (their norm was above it)
    lines += ["", "| round | clients uploading | bytes per client (min / max) | listing(s) |"
              + (" updates clipped |" if clipping else "") + " epsilon |", "|---|---|---|---|" + "---|" * (1 + clipping)]
    for r in rows:
        ups = {c: u for c, u in r.get("uploads", {}).items() if u["bytes"]}
        sizes = [u["bytes"] for u in ups.values()]
        sigs = sorted({u["sig"] for u in ups.values()})
        eps = f"{r['epsilon']:.4g}" if "epsilon" in r else "-"
        size = f"{min(sizes):,} / {max(sizes):,}" if sizes else "-"
        clipped = f" {r['clipped']} of {len(ups)} |" if clipping and "clipped" in r else " - |" if clipping else ""
        lines.append(f"| {r['round']} | {len(ups)} | {size} | {' '.join(sigs) if len(sigs) <= 3 else f'{len(sigs)} listings'}"
                     f" |{clipped} {eps} |")
    lines += ["", "## Upload listings", ""]
    for r in rows:
        for sig, listing in r.get("signatures", {}).items():
            senders = sorted({(q["round"], int(c)) for q in rows for c, u in q.get("uploads", {}).items()
                              if u["sig"] == sig})
            lines.append(f"### {sig}: {len(listing)} tensors, first sent in round {r['round']} "
                         f"({len(senders)} uploads in all)")
            lines += ["", "| tensor | shape | dtype |", "|---|---|---|"]
            lines += [f"| {n} | {'x'.join(map(str, shape)) or 'scalar'} | {dtype} |" for n, shape, dtype in listing]
            lines.append("")
    return "\n".join(lines) + "\n"
