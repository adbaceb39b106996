"""SCAFFOLD (train.scaffold, algorithms/scaffold.py): the client's corrected step and option II's
variate, what leaves the device (the variate's delta, never c_i), the server's c under client
sampling, a cohort equal to one client at a time, a killed and resumed run, the refusals."""
import json

import pytest
import torch

from comix.algorithms import ClientContext, ClientState, TrainConfig, make_algorithm
from comix.algorithms import scaffold
from comix.algorithms.training import expert_lr
from comix.cli import main
from comix.engines.device import fresh_adapters
from comix.engines.inprocess import ClientModels
from comix.engines.states import unpack
from comix.models import LoRAConfig
from test_aggregation import TINY
from test_algorithms import setup  # noqa: F401 (the shared tiny fixture: 3 users a, b, c)
from test_cohort import EXACT, _assert_same, _close, _run, setup64  # noqa: F401


def _algo(method, scaffold_on, n_clients=3, **kw):
    train = dict(rounds=2, local_steps=1, batch_size=2, seq_len=16, lr=5e-2, tau=50, router_steps=1)
    train.update(kw)
    return make_algorithm(method, LoRAConfig(r=4), TrainConfig(scaffold=scaffold_on, **train), n_clients)


def _one_round(method, setup, with_controls: bool):
    """One client round of ``method`` from a fixed start: c_i and c random and unequal (so a swap,
    a dropped c_i or an uploaded c_i shows), the payload's shared tensors off the fresh ones."""
    model, users = setup
    algo = _algo(method, with_controls)
    client_model = ClientModels(model, algo).for_client(0)
    state = ClientState(adapters=algo.adapters_of(fresh_adapters(client_model, 1)),
                        rng=torch.Generator().manual_seed(0).get_state())
    gen = torch.Generator().manual_seed(3)
    shared = {n: t + 0.01 * torch.randn(t.shape, generator=gen) for n, t in state.adapters.items() if algo.is_shared(n)}
    c = {n: torch.randn(t.shape, generator=gen) for n, t in shared.items()}
    c_i = {n: torch.randn(t.shape, generator=gen) for n, t in shared.items()}
    payload = dict(shared)
    if with_controls:
        payload = scaffold.with_controls(payload, c)
        state.extra[scaffold.LOCAL] = {n: t.clone() for n, t in c_i.items()}
    state, upload, _ = algo.client_round(ClientContext(0, client_model, users[0], algo.train), state, payload)
    return algo, shared, c, c_i, state, upload


def test_the_local_step_is_corrected_by_c_minus_c_i_on_the_shared_parameters_only(setup):
    """One local step from the same start and batch: SCAFFOLD's shared tensors are the plain step's
    minus lr (c - c_i) (a sign flipped, c and c_i swapped or the correction skipped fails); the
    private ones (CoMiGS's specialist and router) are the plain step's exactly."""
    algo, shared, c, c_i, state, upload = _one_round("comigs-1g1s", setup, True)
    *_, plain_state, _ = _one_round("comigs-1g1s", setup, False)
    lr = expert_lr(0, algo.train.rounds * algo.train.local_steps, algo.train)
    private = [n for n in state.adapters if not algo.is_shared(n)]
    assert private and shared
    for n in shared:
        assert torch.allclose(state.adapters[n], plain_state.adapters[n] - lr * (c[n] - c_i[n]), atol=1e-6), n
    for n in private:
        assert torch.equal(state.adapters[n], plain_state.adapters[n]), n


def test_option_ii_variate_stays_on_the_device_and_only_its_delta_is_uploaded(setup):
    """c_i+ = c_i - c + (x - y) / (K lr) is kept in the client's state; the upload holds the shared
    tensors and c_i+ - c_i under the variate names, nothing else (the whole c_i+ uploaded, or c
    and c_i swapped in the formula, fails)."""
    algo, shared, c, c_i, state, upload = _one_round("comigs-1g1s", setup, True)
    lr = expert_lr(0, algo.train.rounds * algo.train.local_steps, algo.train)
    assert set(upload) == set(shared) | {scaffold.PREFIX + n for n in shared}
    for n, x in shared.items():
        y = state.adapters[n]
        new = c_i[n] - c[n] + (x - y) / lr
        assert torch.allclose(state.extra[scaffold.LOCAL][n], new, atol=1e-4), n
        assert torch.allclose(upload[scaffold.PREFIX + n], new - c_i[n], atol=1e-4), n
        assert torch.equal(upload[n], y)
    assert scaffold.ROUND not in state.extra  # the round's c is not kept


def test_without_scaffold_nothing_changes(setup):
    algo, shared, _, _, state, upload = _one_round("fedavg", setup, False)
    assert set(upload) == set(shared) and not state.extra


def test_the_server_moves_c_by_the_sampled_deltas_over_all_clients_and_means_the_models():
    """Two of four clients report: x <- their mean, c <- c + (delta_0 + delta_2) / 4 (Alg. 1 line 17;
    dividing by the two sampled clients fails); the secure-aggregation path, from the sum alone,
    gives the same payloads."""
    algo = _algo("fedavg", True, n_clients=4)
    gen = torch.Generator().manual_seed(0)
    names = ["model.layers.0.self_attn.q_proj.lora_A", "model.layers.0.self_attn.q_proj.lora_B"]
    x = {n: torch.randn(3, 2, generator=gen) for n in names}
    c = {n: torch.randn(3, 2, generator=gen) for n in names}
    algo.round_start = scaffold.with_controls(x, c)
    uploads = {k: scaffold.with_controls({n: torch.randn(3, 2, generator=gen) for n in names},
                                         {n: torch.randn(3, 2, generator=gen) for n in names}) for k in (0, 2)}
    _, payloads = algo.server_round(None, uploads)
    assert set(payloads) == {0, 1, 2, 3}
    for n in names:
        d = scaffold.PREFIX + n
        assert torch.allclose(payloads[1][n], (uploads[0][n] + uploads[2][n]) / 2)
        assert torch.allclose(payloads[3][d], c[n] + (uploads[0][d] + uploads[2][d]) / 4)
    total = {n: uploads[0][n] + uploads[2][n] for n in uploads[0]}
    _, from_sum = algo.server_round_of_sum(None, total, 2)
    for n in payloads[0]:
        assert torch.allclose(from_sum[0][n], payloads[0][n], atol=1e-6), n


SPEC = "fedavg:train.scaffold=true"
FOLDER = "fedavg__train.scaffold=true"


def test_a_sampled_scaffold_run_keeps_c_the_mean_of_every_client_s_c_i_and_resumes_exactly(tmp_path, monkeypatch):
    """Two of the three users a round (train.clients_per_round=2). c starts at 0 with every c_i and
    moves by the reporting deltas over N, so after each round c = (1/N) sum over *all* clients of
    c_i (read from the checkpoint: the server's c in the payloads, each client's c_i in its state);
    a run killed after round 2 and resumed sends the same round-3 payloads as one that ran through;
    the upload is twice the plain FedAvg's (each shared fp32 tensor and its variate's delta)."""
    from comix.engines import server
    args = [*TINY, "train.clients_per_round=2", f"methods=['{SPEC}']"]
    assert main(["run", *args, f"run_dir={tmp_path / 'full'}"]) == 0

    class Killed(Exception):
        pass
    real = server.atomic_write
    seen = {}

    def kill_after_round_2(path, write):
        real(path, write)
        if str(path).endswith("checkpoint.pt"):
            ck = torch.load(path, weights_only=False)
            seen[ck["round"]] = ck
            if ck["round"] == 2:
                raise Killed
    monkeypatch.setattr(server, "atomic_write", kill_after_round_2)
    with pytest.raises(Killed):
        main(["run", *args, f"run_dir={tmp_path / 'cut'}"])
    monkeypatch.setattr(server, "atomic_write", real)
    assert main(["run", "--resume", str(tmp_path / "cut")]) == 0
    prints = [[json.loads(ln)["payload_fingerprint"] for ln in (d / FOLDER / "server.jsonl").read_text().splitlines()]
              for d in (tmp_path / "full", tmp_path / "cut")]
    assert prints[0] == prints[1] and len(prints[0]) == 3
    for ck in seen.values():
        states = {c: unpack(s) for c, s in ck["clients"]["states"].items()}
        _, c = scaffold.split_controls(ck["payloads"][0])
        held = [s.extra.get(scaffold.LOCAL, {}) for s in states.values()]
        assert c and any(held)
        for n, t in c.items():
            mean = sum(h.get(n, torch.zeros_like(t)) for h in held) / len(states)
            assert torch.allclose(t, mean, atol=1e-5), n
    rows = [json.loads(ln) for ln in (tmp_path / "full" / FOLDER / "metrics.jsonl").read_text().splitlines()]
    plain = tmp_path / "plain"
    assert main(["run", *TINY, "train.clients_per_round=2", "methods=[fedavg]", f"run_dir={plain}"]) == 0
    plain_rows = [json.loads(ln) for ln in (plain / "fedavg" / "metrics.jsonl").read_text().splitlines()]
    up = {r["bytes_up"] for r in rows if r.get("sampled")}
    assert up == {2 * b for b in {r["bytes_up"] for r in plain_rows if r.get("sampled")}}
    assert {r["sampled"] for r in rows if "sampled" in r} == {True, False}  # clients did sit rounds out


@pytest.mark.parametrize("method", ["fedavg", "comigs-1g1s"])
def test_a_scaffold_cohort_trains_each_client_as_it_would_train_alone(setup64, tmp_path, method):
    """The correction in CohortAdamW (each member's c - c_i on its rows, after its step at its lr)
    equals the sequential executor's: uploads (variate deltas included), metrics and final
    adapters, in fp64 to ``EXACT`` (tests/test_cohort.py). A variate is a weight difference over
    K * lr (option II), so in fp32 it carries the weights' summation-order differences enlarged by
    |w| / |w - w_round| (1.7e-4 in a CoMiGS variate on an AMD EPYC)."""
    seq = _run(setup64, tmp_path, method, 1, scaffold=True, rounds=3)
    together = _run(setup64, tmp_path, method, 3, scaffold=True, rounds=3)
    _assert_same(seq, together, rel=EXACT)
    controls = [n for n in together[1][1][0] if scaffold.is_control(n)]
    assert controls
    plain = _run(setup64, tmp_path / "plain", method, 3, rounds=3)
    name = next(n for n in plain[1][2][0])  # round 3: the variates of round 2 have corrected the steps
    assert not _close(plain[1][2][0][name], together[1][2][0][name])


@pytest.mark.parametrize("args,words", [
    (["methods=['local:train.scaffold=true']"], "shares nothing"),
    (["methods=['fdlora-comigs:train.scaffold=true']"], "writes its own"),
    (["methods=['fedamole:train.scaffold=true']"], "writes its own"),
    (["methods=[fedavg]", "train.scaffold=true", "privacy.clip=1"], "privacy.*"),
    (["methods=[fedavg]", "train.scaffold=true", "privacy.server_clip=1"], "privacy.server_clip"),
    (["methods=[fedavg]", "train.scaffold=true", "server.aggregate=median"], "server.aggregate=median"),
    (["methods=[fedavg]", "train.scaffold=often"], "'train.scaffold' expects bool"),
])
def test_scaffold_refuses_what_it_cannot_reach_in_one_line_before_any_run_directory(tmp_path, capsys, args, words):
    assert main(["run", *TINY, *args, f"run_dir={tmp_path / 'r'}"]) != 0
    err = capsys.readouterr()
    assert words in err.out + err.err and not (tmp_path / "r").exists()

