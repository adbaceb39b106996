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
