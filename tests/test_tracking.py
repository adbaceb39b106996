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
