"""Flower engine on loopback: every server on 127.0.0.1, every process stopped by PID.
Slow (each message starts a client process): marked ``flower``; ``-m "not flower"`` skips them."""
import json
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("flwr")
from comix.cli import main  # noqa: E402
from comix.engines.flower.deploy import Federation  # noqa: E402
from test_cli import _user_dirs  # noqa: E402

pytestmark = pytest.mark.flower
USERS = ["alice", "bob", "carol"]
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import soak  # noqa: E402  (bench/soak.py: the soak and its fault injector, bench/soak_app/)
from soak_client import FAULTS  # noqa: E402

# one fault of each kind; each round keeps one honest upload, the last is clean but for a corrupt one
SHORT_PLAN = {1: {0: "nan", 1: "shape", 2: "extra"}, 2: {0: "delay", 1: "crash", 2: "crash-after"},
              3: {0: "inf", 1: "dtype", 2: "missing"}, 4: {0: "specialist"}}


def _config(tmp_path, data, rounds=2, method="comigs-1g1s", eval_every=1):
    cfg = tmp_path / "tiny.yaml"
    cfg.write_text(f"""model: tiny-llama
corpus: {data}
methods: [{method}]
seed: 42
data: {{valid_tokens: 512, test_tokens: 256}}
train: {{rounds: {rounds}, local_steps: 2, batch_size: 2, seq_len: 32, tau: 2, router_steps: 1, eval_every: {eval_every},
        eval_splits: [valid, test]}}
""")
    return cfg


def _rows(path):
    return [json.loads(x) for x in path.read_text().splitlines()]


def test_unregistered_node_and_node_without_ca_are_refused(tmp_path):
    with Federation(tmp_path / "fed") as fed:
        fed.start_superlink()
        fed.start_supernode(0, {"data": "x"}, register=False)   # key never registered
        fed.start_supernode(1, {"data": "x"}, ca=False)         # cannot verify the SuperLink's certificate
        time.sleep(20)
        assert fed.nodes() == [] or all(n["status"] != "online" for n in fed.nodes())
        logs = fed.log_of("supernode0") + fed.log_of("supernode1")
    assert "CERTIFICATE_VERIFY_FAILED" in logs or "certificate verify failed" in logs.lower()


def test_a_deployment_whose_first_supernode_trains_in_executorch_equals_the_in_process_run(tmp_path):
    """``comix flower-demo --client-runtime executorch pytorch``: a SuperLink and two SuperNodes on
    loopback (TLS + auth), the first device's CoMiGS steps (its router steps included) in
    ExecuTorch's training runtime, the second's in PyTorch (one round: each message starts a device
    process, which exports its program again); the uploads and the scores equal an in-process run of the same recipe with the same runtimes per client."""
    pytest.importorskip("executorch.extension.training")
    fed = tmp_path / "fed"
    assert main(["flower-demo", "--clients", "2", "--rounds", "1", "--client-runtime", "executorch", "pytorch",
                 "--workdir", str(fed), "--timeout", "900"]) == 0
    a = _rows(fed / "run" / "comigs-1g1s" / "metrics.jsonl")
    assert {x["user"]: x.get("client_runtime") for x in a if "tokens" in x} == {"de": "executorch", "fr": None}
    assert main(["run", str(fed / "demo.yaml"), "data.users=[de,fr]", "train.client_runtime=[executorch,pytorch]",
                 f"run_dir={tmp_path / 'inproc'}"]) == 0
    b = _rows(tmp_path / "inproc" / "comigs-1g1s" / "metrics.jsonl")
    assert [(x["user"], x["bytes_up"], x["tokens"]) for x in a] == [(y["user"], y["bytes_up"], y["tokens"]) for y in b]
    scored = [(x, y) for x, y in zip(a, b) if "test_ppl" in y]
    assert len(scored) == 2 and all(x["test_ppl"] == pytest.approx(y["test_ppl"], rel=1e-4) for x, y in scored)


def test_the_soak_s_fault_plan_is_seeded_covers_every_kind_and_keeps_each_round_honest():
    plan = soak.make_plan(0, 16, 20, 0.1)
    assert plan == soak.make_plan(0, 16, 20, 0.1) != soak.make_plan(1, 16, 20, 0.1)
    assert {k for r in plan.values() for k in r.values()} == set(FAULTS)
    assert all(len(r) <= 8 for r in plan.values()) and not plan.get(19) and not plan.get(20)
    assert all(0 <= c < 16 for r in plan.values() for c in r)


def test_a_short_soak_survives_one_fault_of_each_kind_and_equals_its_in_process_replay(tmp_path):
    """bench/soak.py on 4 SuperNodes for 4 rounds (TLS + auth): corrupt uploads of every kind, a
    reply held past the round's timeout, a device dying before and one after training (restarted
    with its key), and the ServerApp killed within round 3 (a device has trained it, the server
    has not aggregated it: the restarted server re-sends it and the devices replay it from round
    2's state) and resubmitted with the same command. Every fault is left out with its reason,
    and every round's aggregate and the final scores equal an in-process replay with the same
    devices training and the same uploads accepted; every process started is gone at the end."""
    fig = soak.soak(tmp_path / "soak", nodes=4, rounds=4, seed=0, timeout=60, plan=SHORT_PLAN, kill_server_after=2)
    assert fig["problems"] == []
    assert {k: (f["injected"], f["left_out"]) for k, f in fig["faults"].items()} == {k: (1, 1) for k in FAULTS}
    assert fig["server_kills"] == 1 and fig["killed_in_round"] == 3 and fig["submissions"] == 2
    assert fig["device_restarts"] == 2 and fig["aggregates_equal_to_replay"] == 4 and fig["rounds_completed"] == 4
    assert fig["tls"] and fig["processes_left"] == 0
    # the devices kept their private state (specialists, router, optimizer) on disk, keyed by client id
    states = {p.name.split(".")[0] for p in (tmp_path / "soak" / "state").rglob("client*.pt")}
    assert states == {f"client{c}" for c in range(4)}
    # the check itself can fail: one rejected upload logged as accepted, one aggregate altered
    out = tmp_path / "soak" / "flower" / "comigs-1g1s"
    rows = _rows(out / "metrics.jsonl")
    del next(r for r in rows if r["round"] == 1 and r["user"] == "user00")["failed"]
    (out / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    server = _rows(out / "server.jsonl")
    server[2]["payload_fingerprint"][0] *= 1 + 1e-5
    (out / "server.jsonl").write_text("".join(json.dumps(r) + "\n" for r in server))
    problems = soak.check(tmp_path / "soak", [f"user{c:02d}" for c in range(4)], SHORT_PLAN, 4)["problems"]
    assert any("round 1 client 0: nan not left out" in p for p in problems)
    assert any("rounds' aggregates equal the replay's" in p for p in problems)


def test_ray_simulation_equals_in_process(tmp_path):
    pytest.importorskip("ray")
    data = _user_dirs(tmp_path / "data")
    cfg = _config(tmp_path, data)
    assert main(["run", str(cfg), f"run_dir={tmp_path / 'inproc'}"]) == 0
    assert main(["run", str(cfg), f"run_dir={tmp_path / 'sim'}", "engine=flower-sim", "threads=2"]) == 0
    a = _rows(tmp_path / "sim" / "comigs-1g1s" / "metrics.jsonl")
    b = _rows(tmp_path / "inproc" / "comigs-1g1s" / "metrics.jsonl")
    assert [(x["user"], x["bytes_up"]) for x in a] == [(y["user"], y["bytes_up"]) for y in b]
    for x, y in zip(a, b):
        assert x["test_ppl"] == pytest.approx(y["test_ppl"], rel=1e-4)
    # Ray ran in a network namespace of its own whose only interface is loopback
    import os
    net = json.loads((tmp_path / "sim" / "network.json").read_text())
    assert net["interfaces"] == ["lo"] and net["netns"] != os.readlink("/proc/self/ns/net")


def test_ray_simulation_of_many_sampled_clients_equals_in_process(tmp_path):
    """Dirichlet clients and client sampling: the server loop draws the same clients on both
    engines, so a 40-client run with 5 clients per round gives the same numbers; with DP-FedAvg
    on, the clip runs on the (virtual) device and the seeded noise and the epsilon are the same."""
    pytest.importorskip("ray")
    cfg = tmp_path / "many.yaml"
    cfg.write_text("""model: tiny-llama
corpus: topics
methods: [fedavg]
seed: 7
data: {clients: 40, alpha: 0.5, valid_tokens: 128, test_tokens: 128}
train: {rounds: 2, local_steps: 1, batch_size: 2, seq_len: 32, clients_per_round: 5, eval_every: 2,
        eval_splits: [test]}
privacy: {clip: 0.05, noise_multiplier: 0.5}
""")
    assert main(["run", str(cfg), f"run_dir={tmp_path / 'inproc'}"]) == 0
    assert main(["run", str(cfg), f"run_dir={tmp_path / 'sim'}", "engine=flower-sim", "threads=2"]) == 0
    a = _rows(tmp_path / "sim" / "fedavg" / "metrics.jsonl")
    b = _rows(tmp_path / "inproc" / "fedavg" / "metrics.jsonl")
    assert [(x["user"], x["sampled"], x["bytes_up"]) for x in a] == [(y["user"], y["sampled"], y["bytes_up"]) for y in b]
    assert sum(x["sampled"] for x in a) == 2 * 5
    norms = [[x["update_norm"] for x in rows if x["sampled"]] for rows in (a, b)]
    assert norms[0] == pytest.approx(norms[1], rel=1e-4) and max(norms[0]) > 0.05  # clipped: the bound bites
    assert [x["epsilon"] for x in a] == [y["epsilon"] for y in b] and a[-1]["epsilon"] > a[0]["epsilon"]
    for x, y in zip(a, b):
        assert ("test_ppl" in x) == ("test_ppl" in y)
        if "test_ppl" in y:
            assert x["test_ppl"] == pytest.approx(y["test_ppl"], rel=1e-4)
    # the same run through Flower's SecAgg+ on Ray: the sampled devices' masked sum, unmasked by the
    # server, gives the in-process numbers within SecAgg+'s quantisation (test_secagg.py: the details)
    assert main(["run", str(cfg), f"run_dir={tmp_path / 'secure'}", "engine=flower-sim", "threads=2",
                 "privacy.secure_aggregation=true"]) == 0
    c = _rows(tmp_path / "secure" / "fedavg" / "metrics.jsonl")
    assert [(x["user"], x["sampled"]) for x in c] == [(y["user"], y["sampled"]) for y in b]
    assert [r["secure_sum_of"] for r in _rows(tmp_path / "secure" / "fedavg" / "server.jsonl")] == [5, 5]
    for x, y in zip(c, b):
        if "test_ppl" in y:
            assert x["test_ppl"] == pytest.approx(y["test_ppl"], rel=1e-3)


def test_ray_simulation_of_scaffold_under_sampling_and_secagg_equals_in_process(tmp_path):
    """SCAFFOLD's variates through Flower's messages (their names, the payload's c, the uploads'
    deltas) and through SecAgg+'s masked sum (c moves by the sum alone): the in-process numbers."""
    pytest.importorskip("ray")
    cfg = tmp_path / "scaffold.yaml"
    cfg.write_text("""model: tiny-llama
corpus: topics
methods: [fedavg]
seed: 3
data: {clients: 6, alpha: 0.5, valid_tokens: 128, test_tokens: 128}
train: {rounds: 3, local_steps: 2, batch_size: 2, seq_len: 32, clients_per_round: 3, eval_every: 3,
        eval_splits: [test], scaffold: true}
""")
    runs = {}
    for name, extra in (("inproc", []), ("sim", ["engine=flower-sim", "threads=2"]),
                        ("secure", ["engine=flower-sim", "threads=2", "privacy.secure_aggregation=true"])):
        assert main(["run", str(cfg), f"run_dir={tmp_path / name}", *extra]) == 0
        runs[name] = _rows(tmp_path / name / "fedavg" / "metrics.jsonl")
    b = runs["inproc"]
    for name, rel in (("sim", 1e-4), ("secure", 1e-3)):
        a = runs[name]
        assert [(x["user"], x["sampled"], x["bytes_up"] if name == "sim" else 0) for x in a] == \
            [(y["user"], y["sampled"], y["bytes_up"] if name == "sim" else 0) for y in b]
        for x, y in zip(a, b):
            if "test_ppl" in y:
                assert x["test_ppl"] == pytest.approx(y["test_ppl"], rel=rel), name


def test_ray_simulation_of_the_recent_lora_mixtures_equals_in_process(tmp_path):
    """FLoRA's catch-up stacks (a client that missed rounds merges every stack it lacks), FedALT's
    per-client rest-of-world, FedDPA's dynamic weighting and FedLEASE's clusters travel through
    Flower as in process."""
    pytest.importorskip("ray")
    cfg = tmp_path / "recent.yaml"
    cfg.write_text("""model: tiny-llama
corpus: topics
methods: [flora, fedalt]
seed: 5
data: {clients: 6, alpha: 0.5, valid_tokens: 128, test_tokens: 128}
train: {rounds: 3, local_steps: 1, batch_size: 2, seq_len: 32, clients_per_round: 2, eval_every: 3,
        eval_splits: [test]}
""")
    assert main(["run", str(cfg), f"run_dir={tmp_path / 'inproc'}"]) == 0
    assert main(["run", str(cfg), f"run_dir={tmp_path / 'sim'}", "engine=flower-sim", "threads=2"]) == 0
    # FedDPA's scoring hook and FedLEASE's clustering and per-round uploads, every client asked every
    # round, each pair of devices on its own base precision (NF4, int8, full), every other device
    # computing its batches in 2 slices, with a fleet whose
    # deadline leaves the slow third out (64 tokens a round: 0.64 s at 100 tokens/s against 0.5 s)
    fleet = tmp_path / "fleet.yaml"
    fleet.write_text("deadline_s: 0.5\nprofiles:\n  - {name: slow, share: 0.34, memory_mb: 4096, tokens_per_s: 100}\n"
                     "  - {name: fast, share: 0.66, memory_mb: 4096, tokens_per_s: 1000}\n")
    full = cfg.read_text().replace("methods: [flora, fedalt]", "methods: [feddpa-t, fedlease]").replace(
        "clients_per_round: 2", "clients_per_round: 0").replace(
        "seed: 5", f"seed: 5\nfedlease: {{warmup: 1}}\nquant: [nf4, nf4, int8, int8, none, none]\nfleet: {fleet}\n"
                   "micro_batches: [2, 1, 2, 1, 2, 1]")
    (tmp_path / "full.yaml").write_text(full)
    assert main(["run", str(tmp_path / "full.yaml"), f"run_dir={tmp_path / 'inproc2'}"]) == 0
    assert main(["run", str(tmp_path / "full.yaml"), f"run_dir={tmp_path / 'sim2'}", "engine=flower-sim", "threads=2"]) == 0
    for sim, inproc, method in (("sim", "inproc", "flora"), ("sim", "inproc", "fedalt"),
                                ("sim2", "inproc2", "feddpa-t"), ("sim2", "inproc2", "fedlease")):
        a, b = (_rows(tmp_path / run / method / "metrics.jsonl") for run in (sim, inproc))
        assert [(x["user"], x["sampled"], x["bytes_up"], x["bytes_down"]) for x in a] == \
            [(y["user"], y["sampled"], y["bytes_up"], y["bytes_down"]) for y in b]
        scored = [(x, y) for x, y in zip(a, b) if "test_ppl" in y]
        assert len(scored) == 6 and all(x["test_ppl"] == pytest.approx(y["test_ppl"], rel=1e-4) for x, y in scored)
        assert [x.get("dropped") for x in a] == [y.get("dropped") for y in b]
        if sim == "sim2":  # measured on the (virtual) device, each on its own base, the first two late
            assert all(x["base_mb"] == y["base_mb"] and x["tokens"] == y["tokens"] for x, y in zip(a, b) if x["sampled"])
            base = [x["base_mb"] for x in a if x["round"] == 2]  # clients 0..5 in order
            assert base[0] == base[1] != base[2] == base[3] != base[4] == base[5] and base[0] < base[4]
            assert [x["micro_batches"] for x in a if x["round"] == 2] == [2, 1, 2, 1, 2, 1]  # each its own slices
            assert [x.get("dropped") for x in a if x["round"] == 1] == ["deadline"] * 2 + [None] * 4


@pytest.mark.parametrize("quant", ["none", "nf4"])
def test_ray_simulation_of_deepfusion_equals_in_process(tmp_path, quant):
    """A method whose devices hold different models and upload once, and whose server scores its
    own global model: the same device uploads, server rows and global MoE on both engines; with
    nf4 each device quantises its own model (built from the full-precision base) and trains QLoRA."""
    pytest.importorskip("ray")
    from test_deepfusion import DF, _domains
    data = _domains(tmp_path / "data")
    common = [f"corpus={data}", "methods=[deepfusion]", *DF]
    if quant != "none":
        pytest.importorskip("bitsandbytes")
        common = [*common[:-1], "deepfusion.devices=[base,prune:2:32]", "deepfusion.qlora_r=2", f"quant={quant}"]
    assert main(["run", *common, f"run_dir={tmp_path / 'inproc'}"]) == 0
    assert main(["run", *common, f"run_dir={tmp_path / 'sim'}", "engine=flower-sim", "threads=2"]) == 0
    a = _rows(tmp_path / "sim" / "deepfusion" / "metrics.jsonl")
    b = _rows(tmp_path / "inproc" / "deepfusion" / "metrics.jsonl")
    def devices(rows):
        return [(x["user"], x["bytes_up"], x["device_model"], x["device_base"], round(x["train_loss"], 4))
                for x in rows if x.get("evaluated_by") != "server"]
    assert len(devices(b)) == 5 and devices(b) == devices(a) and {d[3] for d in devices(a)} == {quant}
    server = [(x, y) for x, y in zip(a, b) if y.get("evaluated_by") == "server"]
    assert len(server) == 3 and all(x["user"] == y["user"] for x, y in server)  # one row per domain
    for x, y in server:
        assert x["test_log_ppl"] == pytest.approx(y["test_log_ppl"], rel=1e-4)
    assert (tmp_path / "sim" / "deepfusion" / "global-moe" / "config.json").exists()
