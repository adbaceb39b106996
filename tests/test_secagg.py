"""Secure aggregation: comix's Flower ServerApp and ClientApp run Flower's own
SecAgg+ (SecAggPlusWorkflow, secaggplus_mod) over a loopback Grid in this process, so every
message the server receives can be inspected. The real deployment path (Ray simulation) is in
test_flower.py."""
import copy
import json
import uuid

import numpy as np
import pytest
import torch

pytest.importorskip("flwr")
from flwr.app import Context, Error, Message, RecordDict  # noqa: E402
from flwr.app.message.message import make_message  # noqa: E402
from flwr.common import bytes_to_ndarray  # noqa: E402
from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS, Key  # noqa: E402
from flwr.supercore.task_identity import TaskIdentity  # noqa: E402

from comix.engines.flower import client_app  # noqa: E402
from comix.engines.flower.server_app import serve_on  # noqa: E402
from comix.engines.flower.wire import from_arrays  # noqa: E402
from test_cli import _user_dirs  # noqa: E402

STEP = 2 * 8.0 / 2**22  # SecAgg+'s quantisation step with comix's defaults (privacy.secagg_*)


class LoopbackGrid:
    """Flower's Grid in one process: each message goes straight to comix's ClientApp with its
    node's context (kept across messages, as a SuperNode keeps it). ``received`` holds every reply
    the server got; ``drop`` = {client: stage} makes that client fail at a SecAgg+ stage (a
    device lost mid-protocol)."""

    def __init__(self, n: int, state_dir, drop=None):
        TaskIdentity.task_id, TaskIdentity.run_id, TaskIdentity.node_id = 1, 1, 0
        self.contexts = {100 + c: Context(run_id=1, node_id=100 + c, state=RecordDict(), run_config={},
                                          node_config={"partition-id": c, "state-dir": str(state_dir)})
                         for c in range(n)}
        self.drop, self.sent, self.received = drop or {}, [], []

    def get_node_ids(self):
        return list(self.contexts)

    def send_and_receive(self, messages, timeout=None):
        out = []
        for msg in messages:  # a copy, as if it crossed the network (Flower's workflow reuses one content)
            msg = make_message(copy.deepcopy(msg.metadata), copy.deepcopy(msg.content))
            msg.metadata.__dict__["_message_id"] = uuid.uuid4().hex  # the SuperLink would set it
            self.sent.append(msg)
            node = msg.metadata.dst_node_id
            stage = msg.content.config_records[RECORD_KEY_CONFIGS].get("stage") \
                if RECORD_KEY_CONFIGS in msg.content.config_records else None
            try:
                if stage is not None and self.drop.get(node - 100) == stage:
                    raise ConnectionError("device lost")
                reply = client_app.app(msg, self.contexts[node])
            except Exception as err:  # what a SuperNode reports for a failed ClientApp
                reply = Message(Error(code=0, reason=str(err)), reply_to=msg)
            self.received.append(reply)
            out.append(reply)
        return out


def _recipe(tmp_path, data, secure: bool, rounds=2, privacy="", extra=""):
    cfg = tmp_path / f"recipe-{secure}-{rounds}{'-fleet' if extra else ''}.yaml"
    cfg.write_text(f"""{extra}model: tiny-llama
corpus: {data}
methods: [fedavg]
seed: 42
data: {{valid_tokens: 512, test_tokens: 256}}
train: {{rounds: {rounds}, local_steps: 2, batch_size: 2, seq_len: 32, eval_every: 1, eval_splits: [test]}}
privacy: {{secure_aggregation: {str(secure).lower()} {privacy}}}
""")
    return cfg


def _serve(tmp_path, name, cfg, drop=None):
    grid = LoopbackGrid(3, tmp_path / name / "state", drop)
    serve_on(grid, {"config": str(cfg), "method": "fedavg", "run-dir": str(tmp_path / name), "clients": 3,
                    "seed": -1, "timeout": 60, "wait": 1})
    rows = [json.loads(x) for x in (tmp_path / name / "fedavg" / "metrics.jsonl").read_text().splitlines()]
    final = next(m for m in grid.sent if m.metadata.message_type == "train.finish")  # the last aggregate
    return grid, from_arrays(final.content["payload"]), rows


@pytest.fixture(scope="module")
def plain_and_secure(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("secagg")
    data = _user_dirs(tmp_path / "data")
    plain = _serve(tmp_path, "plain", _recipe(tmp_path, data, False))
    secure = _serve(tmp_path, "secure", _recipe(tmp_path, data, True))
    return tmp_path, data, plain, secure


def _uploads(grid):
    """The clear uploads the server received in plain rounds, in order of arrival."""
    return [from_arrays(r.content["upload"]) for r in grid.received
            if not r.has_error() and "upload" in r.content.array_records]


def test_secure_aggregate_equals_the_plain_mean_within_quantisation(plain_and_secure):
    _, _, (_, plain_payload, plain_rows), (_, secure_payload, secure_rows) = plain_and_secure
    assert sorted(plain_payload) == sorted(secure_payload) and plain_payload
    for n, t in plain_payload.items():
        # two rounds, each within one quantisation step per value (stochastic rounding, mean of 3)
        assert torch.allclose(secure_payload[n], t, atol=3 * STEP, rtol=0), n
    assert any(not torch.equal(secure_payload[n], t) for n, t in plain_payload.items())  # it was quantised
    for a, b in zip(plain_rows, secure_rows):
        assert a["user"] == b["user"] and a["test_ppl"] == pytest.approx(b["test_ppl"], rel=1e-3)


def test_the_server_never_receives_an_upload_in_the_clear(plain_and_secure):
    _, _, (plain_grid, _, _), (secure_grid, _, _) = plain_and_secure
    clear = _uploads(plain_grid)[:3]  # round 1: the same payload, so the same uploads in both runs
    assert len(clear) == 3 and not _uploads(secure_grid)
    train = [r for r in secure_grid.received if r.metadata.message_type == "train"]
    assert len(train) == 2 * 4 * 3 and not any(r.has_error() for r in train)  # 2 rounds x 4 stages x 3 devices
    # every tensor record the secure devices sent back is empty (secaggplus_mod cleared the upload) ...
    assert all(len(rec) == 0 for r in train for rec in r.content.array_records.values())
    # ... and what came instead are masked integer vectors, uniform in [0, 2^32), none of the values
    arrays = [bytes_to_ndarray(b) for r in train
              for b in r.content.config_records[RECORD_KEY_CONFIGS].get(Key.MASKED_PARAMETERS, [])]
    assert len(arrays) == 2 * 3 * (1 + len(clear[0]))  # the weight, then one array per uploaded tensor
    assert all(a.dtype == np.int64 and (a >= 0).all() and (a < 2**32).all() for a in arrays)
    assert np.concatenate([a.ravel() for a in arrays]).mean() / 2**32 == pytest.approx(0.5, abs=0.01)
    values = {float(v) for up in clear for t in up.values() for v in t.flatten()[:100]}
    assert not values & {float(v) for a in arrays for v in a.ravel()[:500]}


def test_a_client_lost_mid_protocol_leaves_the_others_sum(plain_and_secure):
    tmp_path, data, _, _ = plain_and_secure
    plain_grid, _, _ = _serve(tmp_path, "plain-1", _recipe(tmp_path, data, False, rounds=1))
    grid, payload, rows = _serve(tmp_path, "dropout", _recipe(tmp_path, data, True, rounds=1),
                                 drop={1: "collect_masked_vectors"})
    r1 = {r["user"]: r for r in rows}
    assert "failed" in r1["bob"] and "failed" not in r1["alice"] and "failed" not in r1["carol"]
    clear = _uploads(plain_grid)[:3]  # alice, bob, carol in round 1
    for n, t in payload.items():  # the mean of alice's and carol's uploads, unmasked without bob's shares
        assert torch.allclose(t, (clear[0][n] + clear[2][n]) / 2, atol=2 * STEP, rtol=0), n
    server = [json.loads(x) for x in (tmp_path / "dropout" / "fedavg" / "server.jsonl").read_text().splitlines()]
    assert server[0]["secure_sum_of"] == 2
    assert "SecAgg+" in (tmp_path / "dropout" / "fedavg" / "privacy.md").read_text()


def test_deadlines_and_availability_drop_the_same_devices_under_secure_aggregation(plain_and_secure):
    """A device past the round's deadline leaves SecAgg+ before masking (the server cannot drop a
    masked update): the same devices count as without it. (An unavailable one is not asked, on
    either path; with 3 devices one more away would leave SecAgg+ below its threshold.)"""
    tmp_path, data, _, _ = plain_and_secure
    fleet = tmp_path / "fleet.yaml"  # clients 0, 1, 2 take the profiles in order
    fleet.write_text("deadline_s: 10\nprofiles:\n"
                     "  - {name: fast, share: 0.34, memory_mb: 100000, tokens_per_s: 1000}\n"
                     "  - {name: slow, share: 0.33, memory_mb: 100000, tokens_per_s: 1}\n"
                     "  - {name: fast, share: 0.33, memory_mb: 100000, tokens_per_s: 1000}\n")
    runs = {}
    for secure in (False, True):
        cfg = _recipe(tmp_path, data, secure, rounds=3, extra=f"fleet: {fleet}\n")
        _, payload, _ = _serve(tmp_path, f"fleet-{secure}", cfg)
        server = [json.loads(x) for x in (tmp_path / f"fleet-{secure}" / "fedavg" / "server.jsonl").read_text().splitlines()]
        runs[secure] = payload, [s.get("dropped", {}) for s in server]
    assert runs[True][1] == runs[False][1]
    assert all(d.get("1") == "deadline" for d in runs[True][1])  # the slow device, every round
    sums = [json.loads(x)["secure_sum_of"] for x in (tmp_path / "fleet-True" / "fedavg" / "server.jsonl").read_text().splitlines()]
    assert sums == [2, 2, 2]
    for n, t in runs[True][0].items():  # the aggregate of the same devices, within SecAgg+'s quantisation
        assert torch.allclose(t, runs[False][0][n], atol=6 * STEP, rtol=0), n


def test_dp_noise_on_the_secure_sum_is_the_plain_run_s_noise(plain_and_secure):
    tmp_path, data, _, _ = plain_and_secure
    dp = ", clip: 0.05, noise_multiplier: 1.0"
    _, plain, _ = _serve(tmp_path, "dp-plain", _recipe(tmp_path, data, False, rounds=1, privacy=dp))
    _, secure, _ = _serve(tmp_path, "dp-secure", _recipe(tmp_path, data, True, rounds=1, privacy=dp))
    for n, t in plain.items():
        assert torch.allclose(secure[n], t, atol=2 * STEP, rtol=0), n


def test_secure_aggregation_refusals_are_one_line_before_any_model_loads(tmp_path, capsys, monkeypatch):
    import comix.models
    from test_cli import _fails
    monkeypatch.setattr(comix.models, "load_base_model", lambda *a, **k: pytest.fail("model loaded"))
    run = ["run", "model=tiny-llama", f"run_dir={tmp_path / 'r'}", "privacy.secure_aggregation=true"]
    _fails(capsys, [*run, "methods=[fedavg]"], "privacy.secure_aggregation runs on Flower")
    _fails(capsys, [*run, "methods=[hetlora]", "engine=flower-sim"],
           "hetlora cannot run with privacy.secure_aggregation: its server step needs more than the sum")
    _fails(capsys, [*run, "methods=[local]", "engine=flower-sim"], "local cannot run with privacy.secure_aggregation")
    _fails(capsys, [*run, "methods=[fedavg]", "privacy.secagg_threshold=2.5"], "privacy.secagg_threshold must be")
    _fails(capsys, [*run, "methods=[fedavg]", "privacy.secagg_clip_range=0"], "privacy.secagg_clip_range must be")
    assert not (tmp_path / "r").exists()
    # what the methods that fit have in common: the base server step, a mean of fixed uploads
    from comix.algorithms import REGISTRY
    fits = {n for n, (cls, *_) in REGISTRY.items() if cls.secure_aggregation_refusal() is None}
    assert {"fedavg", "fedit", "ffa-lora", "fedsa-lora", "comigs-1g1s"} <= fits
    assert not fits & {"hetlora", "flexlora", "fedamole", "pcl", "fdlora-comigs", "deepfusion", "centralized", "local"}


def test_a_device_refuses_to_mask_what_the_server_could_no_longer_reject():
    """Masked, a NaN or an out-of-range value would reach the sum unseen (Flower's quantiser clips
    silently), so the device checks what the server's check_upload checks in the clear."""
    from comix.engines.flower.client_app import secure_upload_problem
    ok = {"a": torch.zeros(3), "b": torch.full((2,), 7.9)}
    assert secure_upload_problem(ok, 8.0) is None
    assert "NaN or inf" in secure_upload_problem({**ok, "c": torch.tensor([0.0, float("nan")])}, 8.0)
    assert "beyond privacy.secagg_clip_range = 8" in secure_upload_problem({**ok, "c": torch.tensor([-8.5])}, 8.0)
    assert secure_upload_problem({**ok, "c": torch.tensor([-8.5])}, 16.0) is None
