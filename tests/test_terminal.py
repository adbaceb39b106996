"""What a person sees in a terminal: ``comix run`` in a pseudo-terminal, its bytes fed
to a VT100 emulator (pyte), the screen read back. The live bar is there while the run goes (with
its times, not cut to ``0:0…``), it is gone at the end (transient), each round's log line is on
the screen once, and Ctrl-C leaves one line naming the resume command."""
import os
import pty
import re
import select
import signal
import subprocess
import sys
import time

import pytest

pyte = pytest.importorskip("pyte")
from test_cli import TINY, _user_dirs  # noqa: E402

COLS, ROWS = 120, 60


def _run_in_terminal(argv, cwd, interrupt_after: str | None = None, timeout=300):
    """(screen lines at the end, every byte written) of ``comix argv`` in a COLS x ROWS pty;
    ``interrupt_after``: send Ctrl-C (SIGINT to the process group) once that text has appeared."""
    master, slave = pty.openpty()
    import fcntl
    import struct
    import termios
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", ROWS, COLS, 0, 0))
    env = {**os.environ, "COLUMNS": str(COLS), "LINES": str(ROWS), "TERM": "xterm-256color"}
    env.pop("NO_COLOR", None)
    # SIGINT back to its default: a shell without job control starts background jobs (pytest under
    # nohup / CI) with it ignored, and Python then never raises KeyboardInterrupt
    proc = subprocess.Popen([sys.executable, "-m", "comix.cli", *argv], stdin=slave, stdout=slave, stderr=slave,
                            cwd=cwd, env=env, start_new_session=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    os.close(slave)
    raw, sent = b"", False
    deadline = time.time() + timeout
    while time.time() < deadline:
        ready, _, _ = select.select([master], [], [], 0.2)
        if ready:
            try:
                chunk = os.read(master, 65536)
            except OSError:  # the child closed the terminal
                break
            if not chunk:
                break
            raw += chunk
        # rich may colour parts of a line (numbers, paths): look for the text with the escapes removed
        if interrupt_after and not sent and interrupt_after.encode() in re.sub(rb"\x1b\[[0-9;?]*[A-Za-z]", b"", raw):
            os.killpg(proc.pid, signal.SIGINT)
            sent = True
        if proc.poll() is not None and not ready:
            break
    proc.wait(timeout=30)
    os.close(master)
    screen = pyte.Screen(COLS, ROWS)
    stream = pyte.ByteStream(screen)
    stream.feed(raw)
    return [ln.rstrip() for ln in screen.display], raw, proc.returncode


def test_the_progress_bar_in_a_terminal_is_live_then_gone(tmp_path):
    data = _user_dirs(tmp_path / "data")
    run = tmp_path / "run"
    screen, raw, code = _run_in_terminal(["run", f"corpus={data}", f"run_dir={run}", "methods=[fedavg]", *TINY],
                                         tmp_path)
    text = "\n".join(screen)
    assert code == 0, text
    assert "━" in raw.decode(errors="replace")           # a live bar was drawn while the run went ...
    assert "━" not in text                               # ... and is gone at the end (transient)
    assert "0:0…" not in raw.decode(errors="replace")     # its times were never cut
    for rnd in (1, 2):                                    # each round's log line once, not twice
        assert sum(f"fedavg round {rnd}/2" in ln for ln in screen) == 1, text
    assert "report:" in text and "results:" in text


def test_ctrl_c_in_a_terminal_leaves_one_line_and_no_bar(tmp_path):
    data = _user_dirs(tmp_path / "data")
    run = tmp_path / "run"
    screen, _, code = _run_in_terminal(["run", f"corpus={data}", f"run_dir={run}", "methods=[fedavg]",
                                        *TINY, "train.rounds=1000"], tmp_path, interrupt_after="round 1/1000")
    text = "\n".join(screen)
    assert code == 130, text
    assert sum("comix: interrupted; continue with: comix run --resume" in ln for ln in screen) == 1, text
    assert "━" not in text and "Traceback" not in text and "KeyboardInterrupt" not in text
