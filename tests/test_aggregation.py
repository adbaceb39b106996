"""The server's combining rules and optimisers (comix/aggregation.py), against Flower's own
strategies on the same uploads round for round, and in runs: checkpointed and resumed exactly,
DP's noise before the step, SecAgg+'s sum, the refusals in one line."""
import json

import numpy as np
import pytest
import torch

from comix.aggregation import ServerConfig, ServerOptimizer, combine
from comix.algorithms import TrainConfig, average, make_algorithm
from comix.cli import main
from comix.models import LoRAConfig
from comix.privacy import GaussianSumNoise
from test_algorithms import setup  # noqa: F401 (the shared tiny fixture)

flwr_strategy = pytest.importorskip("flwr.serverapp.strategy")
from flwr.app import Array, ArrayRecord, MetricRecord, RecordDict  # noqa: E402


class _Reply:
    """What a Flower strategy reads of a reply Message: its content, and that it has no error
    (a real Message needs a running Flower app's run context)."""

    def __init__(self, arrays: dict[str, np.ndarray]):
        self.content = RecordDict({"arrays": ArrayRecord({k: Array(v) for k, v in arrays.items()}),
                                   "metrics": MetricRecord({"num-examples": 1})})

    def has_error(self) -> bool:
        return False


def _rounds(n_rounds=3, clients=4, seed=0):
    """Each round's uploads {client: {name: tensor}}, around a drifting global."""
    g = torch.Generator().manual_seed(seed)
    shapes = {"a.lora_A": (4, 6), "a.lora_B": (6, 4), "b.lora_A": (3,)}
    return [{c: {n: torch.randn(s, generator=g) * 0.1 + 0.05 * r for n, s in shapes.items()} for c in range(clients)}
            for r in range(n_rounds)]


def _flower(name, **kw):
    cls = {"fedavgm": "FedAvgM", "fedadam": "FedAdam", "fedyogi": "FedYogi", "fedadagrad": "FedAdagrad"}[name]
    return getattr(flwr_strategy, cls)(**kw)


FLOWER_ARGS = {  # the same hyper-parameters for both, in each one's names
    "fedavgm": (dict(optimizer="fedavgm", lr=0.7, momentum=0.9), dict(server_learning_rate=0.7, server_momentum=0.9)),
    "fedadam": (dict(optimizer="fedadam", lr=0.1, beta1=0.9, beta2=0.99, tau=1e-3),
                dict(eta=0.1, beta_1=0.9, beta_2=0.99, tau=1e-3)),
    "fedyogi": (dict(optimizer="fedyogi", lr=0.01, beta1=0.9, beta2=0.99, tau=1e-3),
                dict(eta=0.01, beta_1=0.9, beta_2=0.99, tau=1e-3)),
    "fedadagrad": (dict(optimizer="fedadagrad", lr=0.1, tau=1e-3), dict(eta=0.1, tau=1e-3)),
}


@pytest.mark.parametrize("name", sorted(FLOWER_ARGS))
def test_server_optimizers_equal_flowers_strategies_round_for_round(name):
    """Flower's FedAvgM / FedAdam / FedYogi / FedAdagrad and comix's server step fed the same
    uploads for three rounds give the same global tensors every round (a moment crossing tensors,
    a missing bias correction, a pseudo-gradient of the wrong sign or a sign flip in Yogi fails)."""
    ours_kw, theirs_kw = FLOWER_ARGS[name]
    algo = make_algorithm("fedavg", LoRAConfig(r=4), TrainConfig(), 4)
    algo.server_config = ServerConfig(**ours_kw)
    algo.server_optimizer = ServerOptimizer(algo.server_config)
    theirs = _flower(name, **theirs_kw)
    x = {n: t.clone() for n, t in _rounds()[0][0].items()}  # the round-1 global
    for rnd, uploads in enumerate(_rounds(), 1):
        algo.round_start = x
        ours = algo.aggregate(uploads)
        start = ArrayRecord({k: Array(v.numpy()) for k, v in x.items()})
        # what configure_train does to the strategy: remember the arrays the round starts from
        theirs.current_arrays = start if name == "fedavgm" else {k: a.numpy() for k, a in start.items()}
        new, _ = theirs.aggregate_train(rnd, [_Reply({n: t.numpy() for n, t in u.items()}) for u in uploads.values()])
        for n, t in ours.items():
            assert np.allclose(t.numpy(), new[n].numpy(), rtol=1e-5, atol=1e-7), (rnd, n)
        x = ours
    assert any(not torch.allclose(ours[n], average(uploads)[n]) for n in ours)  # it did step, not average


@pytest.mark.parametrize("rule", ["median", "trimmed_mean", "krum", "multikrum"])
@pytest.mark.parametrize("clients", [4, 5])
def test_robust_rules_equal_flowers_on_the_same_uploads(rule, clients):
    """FedMedian, FedTrimmedAvg (beta 0.2 at five clients cuts one at each end) and Krum /
    MultiKrum with f = 1 against comix's rules, odd and even client counts (numpy's median of an
    even count averages the middle two)."""
    uploads = _rounds(1, clients)[0]
    uploads[0] = {n: t * 50 for n, t in uploads[0].items()}  # one poisoned client
    cfg, theirs = {
        "median": (ServerConfig(aggregate="median"), flwr_strategy.FedMedian()),
        "trimmed_mean": (ServerConfig(aggregate="trimmed_mean", trim=0.2), flwr_strategy.FedTrimmedAvg(beta=0.2)),
        "krum": (ServerConfig(aggregate="krum", krum_f=1), flwr_strategy.Krum(num_malicious_nodes=1)),
        "multikrum": (ServerConfig(aggregate="krum", krum_f=1, krum_select=2),
                      flwr_strategy.MultiKrum(num_malicious_nodes=1, num_nodes_to_select=2)),
    }[rule]
    ours = combine(uploads, cfg)
    new, _ = theirs.aggregate_train(1, [_Reply({n: t.numpy() for n, t in u.items()}) for u in uploads.values()])
    for n, t in ours.items():
        assert np.allclose(t.numpy(), new[n].numpy(), rtol=1e-5, atol=1e-7), n
    if rule == "trimmed_mean" and int(0.2 * clients) == 0:
        return  # four clients: nothing cut, the mean itself (as Flower)
    mean = average(uploads)
    poisoned = float(sum((mean[n] - uploads[1][n]).norm() for n in mean))
    assert float(sum((ours[n] - uploads[1][n]).norm() for n in ours)) < poisoned  # closer to the honest ones


def test_dp_noise_lands_on_the_mean_before_the_step_and_secagg_steps_from_the_sum():
    """With DP the server steps from the noised mean (the noise is not stepped past); under SecAgg+
    it holds only the sum, and its step equals the step from the same uploads' mean."""
    uploads = _rounds(1)[0]
    start = {n: torch.zeros_like(t) for n, t in uploads[0].items()}
    cfg = ServerConfig(optimizer="fedadam")
    algo = make_algorithm("fedavg", LoRAConfig(r=4), TrainConfig(), 4)
    algo.server_config, algo.server_optimizer, algo.round_start = cfg, ServerOptimizer(cfg), start
    algo.aggregation_noise = GaussianSumNoise(0.5, seed=1, rnd=1)
    ours = algo.aggregate(uploads)
    want = ServerOptimizer(cfg).step(start, average(uploads, GaussianSumNoise(0.5, seed=1, rnd=1)))
    assert all(torch.equal(ours[n], want[n]) for n in ours)
    algo.aggregation_noise = None
    algo.server_optimizer = ServerOptimizer(cfg)
    total = {n: torch.stack([u[n] for u in uploads.values()]).sum(0) for n in uploads[0]}
    _, payloads = algo.server_round_of_sum(None, total, len(uploads))
    want = ServerOptimizer(cfg).step(start, average(uploads))
    assert all(torch.allclose(payloads[0][n], want[n], atol=1e-7) for n in want)


TINY = ["model=tiny-llama", "train.rounds=3", "train.local_steps=2", "train.batch_size=2", "train.seq_len=32",
        "data.valid_tokens=512", "data.test_tokens=512", "train.eval_every=3"]


def test_a_server_optimiser_run_killed_and_resumed_equals_the_uninterrupted_run(tmp_path, monkeypatch):
    """FedAdam's moments and step counts travel in checkpoint.pt: a run killed after round 2 and
    resumed sends the same payloads in round 3 (server.jsonl's fingerprints) as one that ran through."""
    from comix.engines import server
    spec = "fedavg:server.optimizer=fedadam"
    assert main(["run", *TINY, f"methods=['{spec}']", f"run_dir={tmp_path / 'full'}"]) == 0

    class Killed(Exception):
        pass
    real = server.atomic_write

    def kill_after_round_2(path, write):
        real(path, write)
        if str(path).endswith("checkpoint.pt") and torch.load(path, weights_only=False)["round"] == 2:
            raise Killed
    monkeypatch.setattr(server, "atomic_write", kill_after_round_2)
    with pytest.raises(Killed):
        main(["run", *TINY, f"methods=['{spec}']", f"run_dir={tmp_path / 'cut'}"])
    monkeypatch.setattr(server, "atomic_write", real)
    assert main(["run", "--resume", str(tmp_path / "cut")]) == 0
    folder = "fedavg__server.optimizer=fedadam"
    prints = [[json.loads(ln)["payload_fingerprint"] for ln in (d / folder / "server.jsonl").read_text().splitlines()]
              for d in (tmp_path / "full", tmp_path / "cut")]
    assert prints[0] == prints[1] and len(prints[0]) == 3
    plain = tmp_path / "plain"
    assert main(["run", *TINY, "methods=[fedavg]", f"run_dir={plain}"]) == 0
    assert [json.loads(ln)["payload_fingerprint"] for ln in (plain / "fedavg" / "server.jsonl").read_text()
            .splitlines()][1:] != prints[0][1:]  # the optimiser changed the payloads


@pytest.mark.parametrize("args,words", [
    (["methods=['fdlora-comigs:server.optimizer=fedadam']"], "steps an optimiser of its own"),
    (["methods=['fedlease:server.aggregate=median']"], "not one combination of the uploads"),
    (["methods=['fedamole:server.aggregate=krum']"], "upload different tensors"),
    (["methods=[local]", "server.optimizer=fedadam"], "shares nothing"),
    (["methods=[fedavg]", "server.aggregate=median", "privacy.noise_multiplier=1", "privacy.clip=1"],
     "DP-FedAvg does not cover"),
    (["methods=[fedavg]", "server.aggregate=krum", "privacy.secure_aggregation=true"], "SecAgg+ hides"),
    (["methods=[fedavg]", "server.optimizer=adam"], "server.optimizer must be one of"),
    (["methods=[fedavg]", "server.trim=0.5"], "server.trim must be in [0, 0.5)"),
    (["methods=[fedavg]", "server.lr=fast"], "server.lr must be a number"),
])
def test_what_cannot_run_is_refused_in_one_line_before_any_run_directory(tmp_path, capsys, args, words):
    assert main(["run", *TINY, *args, f"run_dir={tmp_path / 'r'}"]) != 0
    err = capsys.readouterr()
    assert words in err.out + err.err and not (tmp_path / "r").exists()


# -- FedProx (train.prox_mu) -------------------------------------------------------------------------
def _prox_round(method, mu, setup_model, users):
    from comix.algorithms import ClientContext, ClientState
    from comix.engines.device import fresh_adapters
    from comix.engines.inprocess import ClientModels
    algo = make_algorithm(method, LoRAConfig(r=4), TrainConfig(rounds=2, local_steps=4, batch_size=2, seq_len=16,
                                                               lr=5e-2, prox_mu=mu, tau=2, router_steps=1), 3)
    model = ClientModels(setup_model, algo).for_client(0)
    state = ClientState(adapters=algo.adapters_of(fresh_adapters(model, 1)), rng=torch.Generator().manual_seed(0).get_state())
    payload = {n: t + 0.01 for n, t in state.adapters.items() if algo.is_shared(n)}
    state, upload, _ = algo.client_round(ClientContext(0, model, users[0], algo.train), state, payload)
    return algo, payload, state, upload


def test_fedprox_keeps_the_shared_adapters_near_the_rounds_payload_and_leaves_private_ones_alone(setup):
    """With a large mu the shared tensors end the round near the payload (an anchor that moved
    with the weights, or one taken before the payload was applied, would not hold them there),
    while the private ones (CoMiGS's specialist) still train as far as without the term."""
    model, users = setup
    free = _prox_round("comigs-1g1s", 0.0, model, users)
    held = _prox_round("comigs-1g1s", 1e3, model, users)
    drift = [float(sum((up[n] - pay[n]).norm() for n in pay)) for _, pay, _, up in (free, held)]
    assert drift[1] < 0.5 * drift[0]  # AdamW steps ~lr whatever the gradient: held within a few steps' reach
    algo = held[0]
    private = [n for n in held[2].adapters if not algo.is_shared(n) and "lora_B" in n]
    reach = [float(sum(s.adapters[n].norm() for n in private)) for _, _, s, _ in (free, held)]
    assert private and reach[1] > 0.5 * reach[0]  # B starts at 0: how far the specialists trained


def test_the_proximal_term_is_mu_half_the_squared_distance_of_the_shared_parameters_only():
    from comix.algorithms.fedprox import proximal_anchor, proximal_term
    shared, private = torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(2))
    anchor = proximal_anchor([("s", shared), ("p", private)], lambda n: n == "s")
    with torch.no_grad():
        shared += torch.tensor([1.0, 2.0, 0.0])
        private += 5.0
    term = proximal_term(anchor, mu=0.5)
    assert float(term.detach()) == pytest.approx(0.25 * (1 + 4))
    term.backward()
    assert torch.allclose(shared.grad, 0.5 * torch.tensor([1.0, 2.0, 0.0])) and private.grad is None
    stacked = torch.nn.Parameter(torch.zeros(2, 3))
    per_client = proximal_term([(stacked, torch.tensor([[1.0, 0, 0], [0, 0, 2.0]]))], mu=2.0, clients=2)
    assert per_client.tolist() == [1.0, 4.0]  # each client's own distance


def test_fedprox_refuses_what_it_cannot_reach_in_one_line(tmp_path, capsys):
    for method, words in (("local", "shares nothing"), ("fdlora-comigs", "its own local training")):
        assert main(["run", *TINY, f"methods=[{method}]", "train.prox_mu=0.01", f"run_dir={tmp_path / 'r'}"]) != 0
        assert words in capsys.readouterr().err and not (tmp_path / "r").exists()
