"""Devices as they are: a fleet file gives each share of the clients a memory budget, a training
throughput and an availability; the simulation drops, each round, the devices that are not
available or would miss the round's deadline, and the server aggregates the replies it has.

    fleet: my-fleet.yaml        # a file, or a built-in fleet: phones, edge-boards, mixed
                                # (comix/data/fleets/, each figure with its source)
    # my-fleet.yaml
    deadline_s: 60          # a round's deadline in seconds of device time (0: none)
    profiles:
      - {name: phone-1gb, share: 0.34, memory_mb: 1024, tokens_per_s: 400, availability: 0.8}
      - {name: phone-2gb, share: 0.33, memory_mb: 2048, tokens_per_s: 400, availability: 0.9}
      - {name: board-4gb, share: 0.33, memory_mb: 4096, tokens_per_s: 1600, availability: 1.0}

Clients take the profiles in order of their index, by share (``profile_of``). A device's round
takes ``tokens / tokens_per_s`` seconds of its time (the tokens its training forwards read,
measured on the device: engines/footprint.py Footprint), so the deadline drops the same devices on
every engine and every machine. Availability is drawn per device and round from a generator
seeded by (run seed, round, client). Memory: ``plan`` reads the training memory each client of
the method needs (the frozen base at each precision, the trainable state, one step's
activations, at each number of micro-batches asked) and checks that every device fits the run's
base precision; with ``quant=auto`` each device gets the least-compressed precision that fits its
budget (its own base: devices differ), with ``micro_batches=auto`` the fewest slices of its batches
that fit, tried before a more compressed base. A device nothing fits stops the run in one line,
before any work.
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field
from pathlib import Path

import yaml


@dataclass
class DeviceProfile:
    name: str
    share: float                 # of the clients, taken in order of their index
    memory_mb: float             # what training may use on the device
    tokens_per_s: float          # its training throughput
    availability: float = 1.0    # probability it can take part in a round
    source: str = ""             # where the figures come from

    def problem(self) -> str | None:
        """What is wrong with the profile, naming the key and its value (None: nothing)."""
        for key, ok, want in (("share", lambda v: 0 < v <= 1, "a number in (0, 1]"),
                              ("memory_mb", lambda v: v > 0, "a number of megabytes > 0 (no unit)"),
                              ("tokens_per_s", lambda v: v > 0, "a number > 0"),
                              ("availability", lambda v: 0 < v <= 1, "a number in (0, 1]")):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not ok(value):
                return f"profile {self.name!r}: {key} must be {want}, got {value!r}"
        return None


@dataclass
class Fleet:
    profiles: list[DeviceProfile] = field(default_factory=list)
    deadline_s: float = 0.0

    def profile_of(self, client: int, n_clients: int) -> DeviceProfile:
        edge, total = (client + 0.5) / n_clients, sum(p.share for p in self.profiles)
        acc = 0.0
        for p in self.profiles:
            acc += p.share / total
            if edge <= acc:
                return p
        return self.profiles[-1]

    def available(self, client: int, n_clients: int, rnd: int, seed: int) -> bool:
        p = self.profile_of(client, n_clients).availability
        return p >= 1 or random.Random(f"{seed}:{rnd}:{client}:available").random() < p

    def seconds(self, client: int, n_clients: int, tokens: int) -> float:
        return tokens / self.profile_of(client, n_clients).tokens_per_s

    def late(self, client: int, n_clients: int, tokens: int) -> bool:
        return self.deadline_s > 0 and self.seconds(client, n_clients, tokens) > self.deadline_s


# why a device's update is missing when it trained past the deadline (said by the device under
# secure aggregation, where the server cannot see an update to drop: engines/flower)
DEADLINE_MISSED = "past the round's deadline"

BUILTIN = Path(__file__).parent / "data" / "fleets"  # phones, edge-boards, mixed: sources in each file


def builtin_fleets() -> list[str]:
    return sorted(f.stem for f in BUILTIN.glob("*.yaml"))


def load_fleet(path: str | None) -> Fleet | None:
    """The fleet of a file or a built-in fleet's name (None: every device alike, always there, no
    deadline). One line naming the file and the bad key on bad input."""
    if not path:
        return None
    file = BUILTIN / f"{path}.yaml" if path in builtin_fleets() else Path(path)
    if not file.is_file():
        raise ValueError(f"fleet {path}: no such file (built-in fleets: {', '.join(builtin_fleets())})")
    keys = "keys: deadline_s, profiles: a list of {name, share, memory_mb, tokens_per_s, availability, source}"
    try:
        raw = yaml.safe_load(file.read_text())
    except yaml.YAMLError as e:
        raise ValueError(f"fleet {path}: not valid YAML: {str(e).splitlines()[0]}") from None
    raw = {} if raw is None else raw
    if not isinstance(raw, dict):
        raise ValueError(f"fleet {path}: the file must hold a mapping ({keys}), not a {type(raw).__name__}")
    unknown = sorted(set(raw) - {"deadline_s", "profiles"})
    if unknown:
        raise ValueError(f"fleet {path}: unknown key {unknown[0]!r} ({keys})")
    deadline = raw.get("deadline_s", 0.0)
    if isinstance(deadline, bool) or not isinstance(deadline, (int, float)) or deadline < 0:
        raise ValueError(f"fleet {path}: deadline_s must be a number of seconds >= 0 (0: none), got {deadline!r}")
    items = raw.get("profiles") or []
    if not isinstance(items, list) or not all(isinstance(p, dict) for p in items):
        raise ValueError(f"fleet {path}: profiles must be a list of mappings ({keys})")
    if not items:
        raise ValueError(f"fleet {path}: profiles is empty")
    profiles = []
    for i, item in enumerate(items):
        try:
            profiles.append(DeviceProfile(**item))
        except TypeError as e:  # a missing or unknown key
            raise ValueError(f"fleet {path}: profile {i + 1}: {str(e).split('.__init__() ')[-1]} ({keys})") from None
        if profiles[-1].problem():
            raise ValueError(f"fleet {path}: {profiles[-1].problem()}")
    return Fleet(profiles, float(deadline))


Setting = tuple[str, int]  # a device's (base precision, micro-batches)


def plan(fleet: Fleet, needs: list[dict[Setting, float]], quant: str | list[str], method: str,
         micro_batches: int | str | list[int] = 1) -> tuple[Setting, ...]:
    """Each client's (base precision, micro-batches) for ``method``. ``needs[c][(q, m)]``: the MB
    client c needs to train with the base at precision q (none / int8 / nf4) and each batch in m
    slices (engines/device.py ``training_memory``). ``auto`` (either or both): the first setting
    that fits the device's budget in order of quality: the least-compressed precision (NF4 costs
    perplexity, the README's quantised-base table), and at it the fewest slices (slicing costs
    time, not quality: the gradients are the batch's); a value, or one per client: that one,
    checked. One line naming the device that nothing (or not the asked setting) fits."""
    n, out = len(needs), []
    for c, need in enumerate(needs):
        p = fleet.profile_of(c, n)
        want_q = quant if isinstance(quant, str) else quant[c]
        want_m = micro_batches if isinstance(micro_batches, (int, str)) else micro_batches[c]
        order = [(q, m) for q in ("none", "int8", "q4", "nf4") for m in sorted({m for _, m in need}) if (q, m) in need]
        fits = [s for s in order if need[s] <= p.memory_mb]
        if not fits:
            raise ValueError(f"fleet: nothing fits device {c} ({p.name}, {p.memory_mb:g} MB) for {method}: it needs "
                             + ", ".join(f"{megabytes(v)} with {_shown(s)}" for s, v in need.items())
                             + ("" if want_m == "auto" else "; micro_batches=auto would also try its batch in slices"))
        asked = [s for s in fits if want_q in ("auto", s[0]) and want_m in ("auto", s[1])]
        if not asked:
            wanted = next(s for s in order if want_q in ("auto", s[0]) and want_m in ("auto", s[1]))
            raise ValueError(f"fleet: device {c} ({p.name}, {p.memory_mb:g} MB) cannot train {method} with "
                             f"{_shown(wanted)} ({megabytes(need[wanted])}); {_shown(fits[0])} fits it "
                             f"({megabytes(need[fits[0]])}), quant=auto / micro_batches=auto pick per device")
        out.append(asked[0])
    return tuple(out)


def megabytes(mb: float) -> str:
    """A memory figure as it reads: one decimal below 10 MB (a tiny model's 0.4 MB is not "0 MB")."""
    return f"{mb:.1f} MB" if mb < 10 else f"{mb:.0f} MB"


def _shown(setting: Setting) -> str:
    return f"quant={setting[0]}" + (f", micro_batches={setting[1]}" if setting[1] > 1 else "")


def plan_capacity(fleet: Fleet, needs: dict[int, list[dict[Setting, float]]], quant: str | list[str],
                  method: str, micro_batches: int | str | list[int] = 1) -> list[int]:
    """Each client's capacity (CoMiGS-1GxS's experts, HetLoRA's or FLoRA's rank): ``needs[v][c]``
    is what client c needs to train at value v with each (precision, micro-batches). The device
    keeps the setting ``plan`` gives it at the smallest value (quantise and slice only as far as
    memory forces), then takes the largest value whose training fits its budget in that setting."""
    values = sorted(needs)
    settings = plan(fleet, needs[values[0]], quant, method, micro_batches)  # one line for a device nothing fits
    n = len(settings)
    return [max(v for v in values if needs[v][c][s] <= fleet.profile_of(c, n).memory_mb)
            for c, s in enumerate(settings)]
