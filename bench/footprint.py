"""Every bench ends by printing its own footprint: wall time and peak resident memory (
a benchmark must say what it cost the machine it ran on). ``import footprint`` at the top of a
bench script registers the report; ``python bench/<name>.py`` puts bench/ on the path."""
from __future__ import annotations

import atexit
import json
import platform
import re
import resource
import sys
import time
from pathlib import Path

START = time.perf_counter()


def _own_peak_kib() -> int:
    """This process's own high-water mark. Linux's VmHWM belongs to the process's memory map, so it
    starts afresh at exec; getrusage's ru_maxrss keeps the parent's RSS at fork across exec (a bench
    launched from a 1 GB pytest would report 1 GB it never used), so it is only the fallback."""
    try:
        with open("/proc/self/status") as status:
            return int(re.search(r"VmHWM:\s+(\d+) kB", status.read()).group(1))
    except (OSError, AttributeError):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def peak_rss_mb() -> float:
    """Peak resident set size of this process and its finished children, in MB (Linux: KiB units)."""
    own = _own_peak_kib()
    children = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    return max(own, children) / 1024


def cpu_name() -> str:
    """The CPU's model name (what a result file says it was measured on)."""
    try:
        return next(ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def write_result(path: Path, result: dict) -> None:
    """A bench's result file as JSON, whole or not at all (a temp file, then a rename)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(result, indent=1) + "\n")
    tmp.replace(path)


def line() -> str:
    return f"[footprint] wall {time.perf_counter() - START:.1f} s, peak RSS {peak_rss_mb():,.0f} MB"


atexit.register(lambda: print(line(), file=sys.stderr, flush=True))


def timed_comix(args: list[str], root, what: str, refusal_ok: bool = False) -> dict:
    """``python -m comix.cli <args>`` in ``root`` under /usr/bin/time -v: {"wall_s", "peak_rss_mb"}
    of that process alone; exits naming ``what`` with the end of its stderr if it fails, unless
    ``refusal_ok`` and comix refused the run in its one line (exit 2): then {"refused": that line}."""
    import os
    import subprocess
    cmd = [sys.executable, "-m", "comix.cli", *args]
    t0 = time.perf_counter()
    proc = subprocess.run(["/usr/bin/time", "-v", *cmd], cwd=root, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(root)})
    refused = [line for line in proc.stderr.splitlines() if line.startswith("comix: error: ")]
    if proc.returncode == 2 and refusal_ok and refused:
        return {"refused": refused[-1].removeprefix("comix: error: ")}
    if proc.returncode:
        sys.exit(f"{what} failed:\n{proc.stderr[-2000:]}")
    peak = int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", proc.stderr).group(1)) / 1024
    return {"wall_s": round(time.perf_counter() - t0, 1), "peak_rss_mb": round(peak, 1)}
