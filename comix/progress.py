"""Progress inside a round, for phases that take minutes: a device i of N training, a
server's distillation step j of M. Any layer may call ``step(phase, done, total)``; the runner
installs a listener that shows it on the run's progress bar (nothing happens without one), so
no module imports a higher layer to report progress."""
from __future__ import annotations

from typing import Callable

_listener: Callable[[str, int, int], None] | None = None


def listen(fn: Callable[[str, int, int], None] | None) -> None:
    """Install (or, with None, remove) the listener of ``step``."""
    global _listener
    _listener = fn


def step(phase: str, done: int, total: int) -> None:
    """``done`` of ``total`` units of ``phase`` are finished (e.g. "KD domain 2/4", 10, 30)."""
    if _listener is not None:
        _listener(phase, done, total)
