"""Writing files so that nothing is ever half-made: one helper every layer may use (data,
models, algorithms, engines, the CLI), so no layer reaches into a higher one for it."""
from __future__ import annotations

import errno
import os
import shutil
import tempfile
from pathlib import Path
from typing import Callable


def cache_dir() -> Path:
    """comix's cache (converted models, tokenised text, the DeepFusion device cache): ``$COMIX_CACHE``,
    else ``~/.cache/comix``."""
    return Path(os.environ.get("COMIX_CACHE", Path.home() / ".cache" / "comix"))


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def atomic_write(path: Path, write: Callable[[str], None]) -> None:
    """Write through a temp file in the same directory, then rename: never a half-written file.
    The file gets the mode a plain ``open`` would give it (mkstemp's is 0600), so every file of a
    run shares one mode."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        write(tmp)
        os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, path)
    except (OSError, RuntimeError) as err:
        # a full disk surfaces as ENOSPC, or from torch.save as "unexpected pos ..." (its zip writer)
        free = shutil.disk_usage(path.parent).free
        if getattr(err, "errno", None) == errno.ENOSPC or free < 2**20 or "unexpected pos" in str(err):
            raise OSError(errno.ENOSPC, f"no space left on the device of {path.parent} ({free / 2**20:.1f} MB free) "
                          f"while writing {path.name}; the previous {path.name}, if any, is intact") from None
        raise
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def publish_dir(tmp: Path, target: Path, marker: str) -> None:
    """Move the finished folder ``tmp`` to ``target`` in one rename. Processes that build the same
    cache at once (pytest-xdist's workers, two runs started together on a fresh machine) race here:
    the first rename wins and the others drop their copies, since a rename onto a non-empty folder
    fails (ENOTEMPTY) and removing the winner's folder would pull it from under its readers. Only a
    ``target`` without the file ``marker`` (left by an older layout) is replaced."""
    try:
        os.replace(tmp, target)
    except OSError:
        if (target / marker).exists():
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            shutil.rmtree(target, ignore_errors=True)
            os.replace(tmp, target)
