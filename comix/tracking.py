"""TensorBoard event files of a run (``train.tensorboard=true``): the rows of metrics.jsonl as
scalars, one writer per user under ``<method folder>/tensorboard/<user>/``, written by the server
loop as each round ends (so on Flower by the ServerApp, beside metrics.jsonl). View them with
``tensorboard --logdir <run folder>``: each method and user is one run of TensorBoard's list.

Tags (step = round): ``train/loss``, ``train/update_norm``, ``eval/<split>_<metric>`` (perplexity,
accuracy, Rouge-L), ``gates/expert_<e>`` (the mean gate of expert e over layers, mixtures),
``traffic/bytes_up`` / ``traffic/bytes_down`` and ``privacy/epsilon``. Needs the ``tensorboard``
package (``pip install -e ".[tensorboard]"``): torch.utils.tensorboard writes through it.
"""
from __future__ import annotations

from pathlib import Path

TAGS = {"train_loss": "train/loss", "update_norm": "train/update_norm", "bytes_up": "traffic/bytes_up",
        "bytes_down": "traffic/bytes_down", "epsilon": "privacy/epsilon"}


def check_tensorboard() -> None:
    """One line before any work when the package is missing."""
    try:
        import tensorboard  # noqa: F401
    except ImportError:
        raise ValueError('train.tensorboard needs the tensorboard package: pip install -e ".[tensorboard]"') from None


class TensorBoardLog:
    """One SummaryWriter per user; ``purge_from`` (a resumed run's first round) drops the events a
    killed run had written for that round and later, as metrics.jsonl drops its rows."""

    def __init__(self, out_dir: Path, purge_from: int | None = None):
        self.root, self.purge_from, self.writers = Path(out_dir) / "tensorboard", purge_from, {}

    def _writer(self, user: str):
        if user not in self.writers:
            from torch.utils.tensorboard import SummaryWriter
            self.writers[user] = SummaryWriter(str(self.root / user), purge_step=self.purge_from)
        return self.writers[user]

    def log_rows(self, rows: list[dict]) -> None:
        for r in rows:
            w, step = self._writer(str(r["user"])), r["round"]
            for key, tag in TAGS.items():
                if isinstance(r.get(key), (int, float)):
                    w.add_scalar(tag, r[key], step)
            for key, value in r.items():
                if key.startswith(("valid_", "test_")) and isinstance(value, (int, float)):
                    w.add_scalar(f"eval/{key}", value, step)
            for e in range(max((len(layer) for layer in r.get("gates", [])), default=0)):
                mean = [layer[e] for layer in r["gates"] if len(layer) > e]
                w.add_scalar(f"gates/expert_{e}", sum(mean) / len(mean), step)
        for w in self.writers.values():
            w.flush()

    def close(self) -> None:
        for w in self.writers.values():
            w.close()
