"""Where a run's rows are tracked besides metrics.jsonl: TensorBoard event files
(``train.tensorboard=true``), an MLflow run (``train.mlflow=true``) and a W&B run
(``train.wandb=true``), each with the rows of metrics.jsonl as scalars per method and user,
written by the server loop as each round ends (so on Flower by the ServerApp, beside metrics.jsonl).

* TensorBoard: one writer per user under ``<method folder>/tensorboard/<user>/``; view with
  ``tensorboard --logdir <run folder>`` (each method and user one run of its list).
* MLflow: one MLflow run per method, in a local store ``<method folder>/mlflow.db`` (``mlflow ui
  --backend-store-uri sqlite:///<that file>``) or the server or store ``train.mlflow_uri`` names; the method's
  settings (train, lora, privacy, server) as its parameters; metrics ``<user>/<tag>``.
* W&B: one W&B run per method, offline by default (``<method folder>/wandb``; ``wandb sync
  <that folder>/wandb/offline-run-*`` uploads it later), online with ``train.wandb_mode=online``;
  the same parameters as its config, the same metrics.
A resumed run continues the same MLflow and W&B run (its id is kept in the method folder). Those
two receive a round only after its checkpoint is written, and a resume first sends what a killed
run had checkpointed but not yet sent (from metrics.jsonl), so each round reaches them once;
TensorBoard's events are purged from the resumed round on instead (``purge_step``).

Tags (step = round): ``train/loss``, ``train/update_norm``, ``eval/<split>_<metric>`` (perplexity,
accuracy, Rouge-L), ``gates/expert_<e>`` (the mean gate of expert e over layers, mixtures),
``gates/entropy`` (the mean per-token gate entropy over layers), ``router/valid_loss`` (the CE
CoMiGS's router steps read, ``router/train_loss`` for its ``-tr`` ablation),
``traffic/bytes_up`` / ``traffic/bytes_down`` and ``privacy/epsilon``. Each needs its package:
``pip install -e ".[tensorboard]"``, ``".[mlflow]"`` (mlflow-skinny), ``".[wandb]"``.
"""
from __future__ import annotations

from pathlib import Path

TAGS = {"train_loss": "train/loss", "update_norm": "train/update_norm", "bytes_up": "traffic/bytes_up",
        "bytes_down": "traffic/bytes_down", "epsilon": "privacy/epsilon", "router_valid_loss": "router/valid_loss",
        "router_train_loss": "router/train_loss"}


def check_tensorboard() -> None:
    """One line before any work when the package is missing."""
    check_tracker("tensorboard")


def check_tracker(key: str) -> None:
    """One line before any work when ``train.<key>``'s package is missing."""
    module, extra = {"tensorboard": ("tensorboard", "tensorboard"), "mlflow": ("mlflow", "mlflow"),
                     "wandb": ("wandb", "wandb")}[key]
    try:
        __import__(module)
    except ImportError:
        raise ValueError(f'train.{key} needs the {module} package: pip install -e ".[{extra}]"') from None


def scalars(row: dict) -> dict[str, float]:
    """The tracked scalars of one metrics.jsonl row, by tag (the module docstring's list)."""
    out = {tag: row[key] for key, tag in TAGS.items() if isinstance(row.get(key), (int, float))
           and not isinstance(row.get(key), bool)}
    out.update({f"eval/{k}": v for k, v in row.items()
                if k.startswith(("valid_", "test_")) and isinstance(v, (int, float)) and not isinstance(v, bool)})
    for e in range(max((len(layer) for layer in row.get("gates", [])), default=0)):
        mean = [layer[e] for layer in row["gates"] if len(layer) > e]
        out[f"gates/expert_{e}"] = sum(mean) / len(mean)
    if row.get("gate_entropy"):
        out["gates/entropy"] = sum(row["gate_entropy"]) / len(row["gate_entropy"])
    return out


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
            for tag, value in scalars(r).items():
                w.add_scalar(tag, value, step)
        for w in self.writers.values():
            w.flush()

    def close(self) -> None:
        for w in self.writers.values():
            w.close()


def _flat(params: dict, prefix: str = "") -> dict[str, str]:
    out = {}
    for k, v in params.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = str(v)
    return out


class RunTrackers:
    """The MLflow and W&B runs of one method (``train.mlflow`` / ``train.wandb``): each round's
    rows once checkpointed (``log_round``), and on a resume the checkpointed rounds a killed run
    had not sent yet (``catch_up``). ``tracked_round`` in the method folder says how far they got."""

    def __init__(self, out_dir: Path, train, name: str, params: dict):
        self.out_dir, self.mlflow, self.wandb = Path(out_dir), None, None
        self.mark = self.out_dir / "tracked_round"
        params = _flat(params)
        if train.mlflow:
            from mlflow.tracking import MlflowClient
            # MLflow 3's local store is a SQLite file (its file store is in maintenance mode and refused)
            uri = train.mlflow_uri or f"sqlite:///{(self.out_dir / 'mlflow.db').resolve()}"
            self.mlflow = MlflowClient(tracking_uri=uri)
            id_file = self.out_dir / "mlflow_run_id"
            if id_file.exists():  # a resumed run: the same MLflow run, running again
                self.mlflow_run = id_file.read_text().strip()
                self.mlflow.update_run(self.mlflow_run, status="RUNNING")
            else:
                experiment = self.mlflow.get_experiment_by_name("comix")
                eid = experiment.experiment_id if experiment else self.mlflow.create_experiment("comix")
                self.mlflow_run = self.mlflow.create_run(eid, run_name=name).info.run_id
                id_file.write_text(self.mlflow_run)
                from mlflow.entities import Param
                items = list(params.items())
                for i in range(0, len(items), 100):  # MLflow's batch limit
                    self.mlflow.log_batch(self.mlflow_run, params=[Param(k, v[:6000]) for k, v in items[i:i + 100]])
        if train.wandb:
            import wandb
            id_file = self.out_dir / "wandb_run_id"
            import uuid
            run_id = id_file.read_text().strip() if id_file.exists() else uuid.uuid4().hex[:12]
            id_file.write_text(run_id)
            self.wandb = wandb.init(project="comix", name=name, id=run_id, resume="allow", dir=str(self.out_dir),
                                    mode=train.wandb_mode, config=params, reinit="create_new")

    def log_round(self, rnd: int, rows: list[dict]) -> None:
        """Round ``rnd``'s rows (metrics.jsonl's), sent to each tracker, then marked as sent."""
        if self.mlflow is not None:
            from mlflow.entities import Metric
            import time
            now = int(time.time() * 1000)
            metrics = [Metric(f"{r['user']}/{tag}", float(v), now, rnd) for r in rows for tag, v in scalars(r).items()]
            for i in range(0, len(metrics), 1000):
                self.mlflow.log_batch(self.mlflow_run, metrics=metrics[i:i + 1000])
        if self.wandb is not None:
            self.wandb.log({f"{r['user']}/{tag}": v for r in rows for tag, v in scalars(r).items()} | {"round": rnd},
                           step=rnd)
        self.mark.write_text(str(rnd))

    def catch_up(self, start: int, metrics_path: Path) -> None:
        """The rounds up to ``start`` (the checkpoint's) that never reached the trackers."""
        import json
        sent = int(self.mark.read_text()) if self.mark.exists() else 0
        rows = [json.loads(ln) for ln in metrics_path.read_text().splitlines()] if metrics_path.exists() else []
        for rnd in range(sent + 1, start + 1):
            self.log_round(rnd, [r for r in rows if r["round"] == rnd])

    def close(self, failed: bool = False) -> None:
        """End the tracked runs (as failed: the run stopped before its last round; a resume reopens them)."""
        if self.mlflow is not None:
            self.mlflow.set_terminated(self.mlflow_run, status="FAILED" if failed else "FINISHED")
        if self.wandb is not None:
            self.wandb.finish(exit_code=1 if failed else 0)
