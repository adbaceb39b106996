"""TensorBoard event files (``train.tensorboard=true``), read back with TensorBoard's own event
reader: one run per method and user, each scalar equal to the metrics.jsonl row it came from."""
import json

import pytest

from comix.cli import main
from test_cli import TINY, _user_dirs


def _scalars(folder):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    acc = EventAccumulator(str(folder))
    acc.Reload()
    return {tag: {e.step: e.value for e in acc.Scalars(tag)} for tag in acc.Tags()["scalars"]}


def test_event_files_per_method_and_user_hold_the_metrics_rows(tmp_path):
    pytest.importorskip("tensorboard")
    run = tmp_path / "run"
    spec = "fedavg:privacy.clip=0.05,privacy.noise_multiplier=1"
    assert main(["run", f"corpus={_user_dirs(tmp_path / 'data')}", f"run_dir={run}", *TINY,
                 f"methods=[comigs-1g1s,'{spec}']", "train.tensorboard=true"]) == 0
    for method in ("comigs-1g1s", "fedavg__privacy.clip=0.05_privacy.noise_multiplier=1"):
        rows = [json.loads(x) for x in (run / method / "metrics.jsonl").read_text().splitlines()]
        assert sorted(p.name for p in (run / method / "tensorboard").iterdir()) == ["alice", "bob", "carol"]
        for user in ("alice", "carol"):
            got = _scalars(run / method / "tensorboard" / user)
            mine = {r["round"]: r for r in rows if r["user"] == user}
            assert got["train/loss"] == pytest.approx({k: r["train_loss"] for k, r in mine.items()}, rel=1e-6)
            assert got["eval/test_ppl"] == pytest.approx({k: r["test_ppl"] for k, r in mine.items()}, rel=1e-6)
            assert got["traffic/bytes_up"] == {k: r["bytes_up"] for k, r in mine.items()}
            if method == "comigs-1g1s":  # the mean gate over layers, per expert
                want = {k: sum(layer[1] for layer in r["gates"]) / len(r["gates"]) for k, r in mine.items()}
                assert got["gates/expert_1"] == pytest.approx(want, rel=1e-6)
                want = {k: sum(r["gate_entropy"]) / len(r["gate_entropy"]) for k, r in mine.items()}
                assert got["gates/entropy"] == pytest.approx(want, rel=1e-6)
                assert got["router/valid_loss"] == pytest.approx({k: r["router_valid_loss"] for k, r in mine.items()},
                                                                 rel=1e-6)
            else:
                assert got["privacy/epsilon"] == pytest.approx({k: r["epsilon"] for k, r in mine.items()}, rel=1e-6)


def test_a_resumed_run_s_event_files_hold_each_round_once_as_the_resumed_run_wrote_it(tmp_path, monkeypatch):
    """A run killed in round 3 after TensorBoard got that round's rows (here altered, as a killed
    run's round can differ from the one the resume trains) but before its checkpoint: the resumed
    run purges what was written after round 2, so every tag holds one event per round, each equal
    to metrics.jsonl's row of the resumed run."""
    pytest.importorskip("tensorboard")
    from comix import tracking
    run = tmp_path / "run"
    args = ["run", f"corpus={_user_dirs(tmp_path / 'data')}", f"run_dir={run}", *TINY, "train.rounds=3",
            "methods=[fedavg]", "train.tensorboard=true"]

    class Killed(Exception):
        pass
    real = tracking.TensorBoardLog.log_rows

    def killed_in_round_3(self, rows):
        if rows and rows[0]["round"] == 3:
            real(self, [{**r, "train_loss": r["train_loss"] + 100.0} for r in rows])
            raise Killed
        real(self, rows)
    monkeypatch.setattr(tracking.TensorBoardLog, "log_rows", killed_in_round_3)
    with pytest.raises(Killed):
        main(args)
    monkeypatch.setattr(tracking.TensorBoardLog, "log_rows", real)
    # TensorBoard reads a folder's event files in name order, and a name starts with the writer's
    # second: a resume in the same second as the kill (only in a test) could sort before it
    import time
    time.sleep(1.1)
    assert main(["run", "--resume", str(run)]) == 0
    rows = [json.loads(x) for x in (run / "fedavg" / "metrics.jsonl").read_text().splitlines()]
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    for user in ("alice", "bob"):
        acc = EventAccumulator(str(run / "fedavg" / "tensorboard" / user))  # as TensorBoard reads them
        acc.Reload()
        events = acc.Scalars("train/loss")
        assert [e.step for e in events] == [1, 2, 3]
        want = {r["round"]: r["train_loss"] for r in rows if r["user"] == user}
        assert {e.step: e.value for e in events} == pytest.approx(want, rel=1e-6)


def _wandb_records(path):
    """The records of a W&B offline run file (``run-<id>.wandb``), as W&B's protobuf ``Record``s.
    The file is W&B's LevelDB-style log: a 7-byte header (":W&B", magic 0xBEE1, version 0), then
    32 KiB blocks of records, each a 7-byte header (CRC32C, length, type: 1 full, 2 first, 3 middle,
    4 last) and its bytes; the reader that shipped with wandb's Python package is gone from 0.31."""
    import struct

    from wandb.proto import wandb_internal_pb2
    data, pos, block, out, part = path.read_bytes(), 7, 32768, [], b""
    assert data[:4] == b":W&B"
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        part += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(part)
            out.append(record)
            part = b""
        elif kind == 0:
            break
    return out


def test_mlflow_and_wandb_runs_hold_each_round_once_across_a_kill_and_resume(tmp_path, monkeypatch):
    """A run tracked in MLflow (its local store) and W&B (offline), killed after round 2's
    checkpoint but before round 2 reached them, then resumed: each tracker has one run (the same
    MLflow run id, the same W&B id), the method's settings as its parameters, and every metric
    once per round, equal to metrics.jsonl's (read back with MLflow's client and W&B's records)."""
    pytest.importorskip("mlflow")
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_SILENT", "true")
    from comix import tracking
    run = tmp_path / "run"
    args = ["run", f"corpus={_user_dirs(tmp_path / 'data')}", f"run_dir={run}", *TINY, "train.rounds=3",
            "methods=[fedavg]", "train.mlflow=true", "train.wandb=true", "train.lr=0.003"]

    class Killed(Exception):
        pass
    real = tracking.RunTrackers.log_round

    def killed_in_round_2(self, rnd, rows):
        if rnd == 2:
            raise Killed
        real(self, rnd, rows)
    monkeypatch.setattr(tracking.RunTrackers, "log_round", killed_in_round_2)
    with pytest.raises(Killed):
        main(args)
    folder = run / "fedavg"
    from mlflow.tracking import MlflowClient
    client = MlflowClient(tracking_uri=f"sqlite:///{folder / 'mlflow.db'}")
    assert client.get_run((folder / "mlflow_run_id").read_text()).info.status == "FAILED"  # not "finished" when killed
    monkeypatch.setattr(tracking.RunTrackers, "log_round", real)
    assert main(["run", "--resume", str(run)]) == 0
    assert client.get_run((folder / "mlflow_run_id").read_text()).info.status == "FINISHED"
    rows = [json.loads(x) for x in (folder / "metrics.jsonl").read_text().splitlines()]
    want = {(r["user"], r["round"]): r["train_loss"] for r in rows}
    runs = client.search_runs([client.get_experiment_by_name("comix").experiment_id])
    assert [r.info.run_id for r in runs] == [(folder / "mlflow_run_id").read_text()]
    assert runs[0].data.params["train.lr"] == "0.003" and runs[0].data.params["method"] == "fedavg"
    for user in ("alice", "bob"):
        history = client.get_metric_history(runs[0].info.run_id, f"{user}/train/loss")
        assert sorted(m.step for m in history) == [1, 2, 3]
        assert {m.step: m.value for m in history} == pytest.approx({k: v for (u, k), v in want.items() if u == user})
    files = sorted(folder.glob("wandb/offline-run-*/run-*.wandb"))
    run_id = (folder / "wandb_run_id").read_text()
    assert len(files) == 2 and all(f.name == f"run-{run_id}.wandb" for f in files)  # one run, two sessions
    logged, config, exits = {}, {}, []
    for f in files:
        for record in _wandb_records(f):
            kind = record.WhichOneof("record_type")
            if kind == "exit":
                exits.append(record.exit.exit_code)
            if kind == "history":
                items = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item}
                for user in ("alice", "bob"):
                    logged.setdefault(user, []).append((items["round"], items[f"{user}/train/loss"]))
            elif kind in ("config", "run"):  # the run's first record carries its config
                updates = record.config.update if kind == "config" else record.run.config.update
                config.update({u.key: json.loads(u.value_json) for u in updates})
    for user, values in logged.items():
        assert [s for s, _ in values] == [1, 2, 3]
        assert dict(values) == pytest.approx({k: v for (u, k), v in want.items() if u == user})
    assert config["train.lr"] == "0.003"
    assert exits == [1, 0]  # the killed session ended its W&B run as failed, the resumed one as finished
