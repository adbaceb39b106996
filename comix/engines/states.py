"""Where a client's private state lives between its turns (``StateStore``: memory, or one file
per client; ``RoundStore``: one file per client and round) and how a state is written: packed,
its tensors in one buffer (``pack`` / ``unpack``)."""
from __future__ import annotations

import dataclasses
import os
import re
from pathlib import Path

import torch

from ..algorithms import ClientState
from ..files import atomic_write


class _Slot(int):
    """Where a packed tensor sits in ``pack``'s list."""


def _map_leaves(o, leaf: type, fn):
    """``o`` (a nest of dataclasses, dicts, lists and tuples) with every ``leaf`` replaced by ``fn(leaf)``."""
    if isinstance(o, leaf):
        return fn(o)
    if dataclasses.is_dataclass(o) and not isinstance(o, type):
        return dataclasses.replace(o, **{f.name: _map_leaves(getattr(o, f.name), leaf, fn) for f in dataclasses.fields(o)})
    if isinstance(o, dict):
        return {k: _map_leaves(v, leaf, fn) for k, v in o.items()}
    if isinstance(o, (list, tuple)):
        return type(o)(_map_leaves(v, leaf, fn) for v in o)
    return o


def pack(obj):
    """``obj`` (a ``ClientState`` or any nest of dataclasses, dicts, lists and tuples) with all its
    tensors moved into one flat byte buffer: torch.save writes each tensor as its own record (a
    client's state is ~150 small tensors with its AdamW moments, ~5 ms a save or load, which made a
    1,000-client run spend its time pickling), and one buffer is one record. ``unpack`` inverts it."""
    tensors = []

    def slot(t: torch.Tensor) -> _Slot:
        tensors.append(t.detach())
        return _Slot(len(tensors) - 1)
    tree = _map_leaves(obj, torch.Tensor, slot)
    flat = [t.to("cpu").contiguous().reshape(-1).view(torch.uint8) for t in tensors]
    meta = [(t.dtype, tuple(t.shape), str(t.device)) for t in tensors]  # each comes back where it was
    # each tensor starts at an 8-byte boundary: viewing bytes as float64 / int64 needs an aligned offset
    padded = [torch.cat([f, f.new_zeros(-f.numel() % 8)]) for f in flat]
    return {"comix_packed": 1, "tree": tree, "meta": meta, "sizes": [f.numel() for f in flat],
            "bytes": torch.cat(padded) if padded else torch.zeros(0, dtype=torch.uint8)}


def unpack(packed):
    """The object ``pack`` packed, each tensor its own copy; anything else is returned as it is
    (a state saved before states were packed)."""
    if not (isinstance(packed, dict) and packed.get("comix_packed")):
        return packed
    starts, at = [], 0
    for n in packed["sizes"]:
        starts.append(at)
        at += n + (-n % 8)
    parts = [packed["bytes"][s:s + n] for s, n in zip(starts, packed["sizes"])]
    tensors = [p.view(dtype).reshape(shape).to(device, copy=True) for p, (dtype, shape, device) in zip(parts, packed["meta"])]
    return _map_leaves(packed["tree"], _Slot, lambda s: tensors[s])


class StateStore:
    """Client states in memory, or on disk (one file per client) when ``directory`` is set."""

    def __init__(self, directory: Path | None = None):
        self.dir, self.mem = directory, {}

    def _path(self, c: int) -> Path:
        return self.dir / f"client{c}.pt"

    def __contains__(self, c: int) -> bool:
        return c in self.mem if self.dir is None else self._path(c).exists()

    def __setitem__(self, c: int, state: ClientState):
        if self.dir is None:
            self.mem[c] = state
        else:
            atomic_write(self._path(c), lambda p: torch.save(pack(state), p))

    def __getitem__(self, c: int) -> ClientState:
        if self.dir is None:
            return self.mem[c]
        return unpack(torch.load(self._path(c), weights_only=False))


class RoundStore(StateStore):
    """Reads the state after round ``read`` (or the newest before it), writes the state after
    round ``write``; keeps the newest file before ``write`` so a re-sent round starts from the right
    state. Which rounds each client has on disk is read from the directory once and then kept
    up to date by this store's own writes (one directory listing per read made a 1,000-client run
    quadratic: a glob over every client's files for each client)."""

    _NAME = re.compile(r"client(\d+)\.round(\d+)\.pt")

    def __init__(self, directory: Path, read: int, write: int):
        super().__init__(directory)
        self.read, self.write = read, write
        self._rounds: dict[int, set[int]] | None = None

    def _file(self, c: int, r: int) -> Path:
        return self.dir / f"client{c}.round{r}.pt"

    def _index(self) -> dict[int, set[int]]:
        if self._rounds is None:
            self._rounds = {}
            for name in (os.listdir(self.dir) if self.dir.exists() else ()):
                m = self._NAME.fullmatch(name)
                if m:
                    self._rounds.setdefault(int(m.group(1)), set()).add(int(m.group(2)))
        return self._rounds

    def _latest(self, c: int) -> Path | None:
        """The newest state at or before round ``read`` (a device that missed rounds while it
        was down continues from the last one it finished)."""
        done = [r for r in self._index().get(c, ()) if r <= self.read]
        return self._file(c, max(done)) if done else None

    def __contains__(self, c: int) -> bool:
        return self._latest(c) is not None

    def __getitem__(self, c: int) -> ClientState:
        return unpack(torch.load(self._latest(c), weights_only=False))

    def __setitem__(self, c: int, state: ClientState):
        atomic_write(self._file(c, self.write), lambda p: torch.save(pack(state), p))
        rounds = self._index().setdefault(c, set())
        rounds.add(self.write)
        # keep the newest state before this round, whichever round that was: a re-sent round starts
        # from it (a device that missed round write - 1 has none; deleting "write - 2" made its replay
        # of a re-sent round start from a fresh state, found by bench/soak.py)
        for r in sorted(r for r in rounds if r < self.write)[:-1]:
            self._file(c, r).unlink(missing_ok=True)
            rounds.discard(r)
