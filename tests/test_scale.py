"""Many clients: client sampling per round, Dirichlet client splits, offloaded states
kept per round so that resume and memory do not depend on the number of clients."""
import json

import pytest
import torch

from comix.engines.states import unpack
from comix.algorithms import TrainConfig, make_algorithm
from comix.data import SplitConfig, make_user_data
from comix.data.partition import dirichlet_mixtures
from comix.engines import run_method
from comix.engines.server import sample_clients
from comix.models import LoRAConfig, load_base_model


@pytest.fixture(scope="module")
def many():
    model, tok = load_base_model("tiny-llama")
    corpus = {c: [f"{c} words {i} " * 25 for i in range(30)] for c in ("a", "b", "c", "d")}
    users = make_user_data(corpus, tok, SplitConfig(clients=12, alpha=0.3, valid_tokens=128, test_tokens=128))
    return model, users, corpus, tok


def _train(**kw):
    base = dict(rounds=3, local_steps=1, batch_size=2, seq_len=16, eval_every=3, eval_batch_size=4,
                clients_per_round=4)
    return TrainConfig(**{**base, **kw})


def test_sampling_is_seeded_and_full_by_default():
    t = TrainConfig(clients_per_round=3)
    assert sample_clients(10, t, 42, 1) == sample_clients(10, t, 42, 1) and len(sample_clients(10, t, 42, 1)) == 3
    assert sample_clients(10, t, 42, 1) != sample_clients(10, t, 42, 2) or sample_clients(10, t, 42, 3) != \
        sample_clients(10, t, 42, 1)
    assert sample_clients(10, TrainConfig(), 42, 1) == list(range(10))
    assert len(sample_clients(10, TrainConfig(client_fraction=0.25), 0, 1)) == 2  # round(2.5) = 2


def test_unsampled_clients_keep_their_state_and_metrics_say_who_took_part(many, tmp_path):
    model, users, _, _ = many
    algo = make_algorithm("comigs-1g1s", LoRAConfig(r=4), _train(), len(users))
    seen = []
    real = algo.server_round
    algo.server_round = lambda s, up: seen.append(sorted(up)) or real(s, up)
    run_method(algo, model, users, tmp_path / "run", seed=3, keep_checkpoints=True)
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    for rnd in (1, 2, 3):
        took_part = [r["user"] for r in rows if r["round"] == rnd and r["sampled"]]
        expected = sample_clients(len(users), algo.train, 3, rnd)
        assert took_part == [users[c].name for c in expected] and seen[rnd - 1] == expected  # only they aggregate
        assert all(r["bytes_up"] == 0 and "train_loss" not in r for r in rows if r["round"] == rnd and not r["sampled"])
    states = {c: unpack(s) for c, s in torch.load(tmp_path / "run" / "checkpoint.pt", weights_only=False)["clients"]["states"].items()}
    trained = {c for rnd in (1, 2, 3) for c in sample_clients(len(users), algo.train, 3, rnd)}
    assert all(states[c].step == 0 for c in range(len(users)) if c not in trained)   # untouched
    assert all(states[c].step >= 1 for c in trained)


def test_offloaded_resume_with_sampling_equals_uninterrupted(many, tmp_path):
    model, users, _, _ = many
    make = lambda: make_algorithm("fedavg", LoRAConfig(r=4), _train(), len(users))  # noqa: E731
    full = run_method(make(), model, users, tmp_path / "full", seed=5, offload=True)

    def killed(p):
        if p["round"] == 2:
            ck = torch.load(tmp_path / "cut" / "checkpoint.pt", weights_only=False)
            assert ck["clients"] == {"round": 2}  # no client state in the checkpoint: they are on disk
            raise KeyboardInterrupt
    with pytest.raises(KeyboardInterrupt):
        run_method(make(), model, users, tmp_path / "cut", seed=5, offload=True, progress=killed)
    resumed = run_method(make(), model, users, tmp_path / "cut", seed=5, offload=True, resume=True)
    assert resumed["per_user"] == full["per_user"]


def test_dirichlet_clients_have_their_budget_and_skewed_mixtures(many):
    _, users, corpus, tok = many
    assert len(users) == 12 and len({len(u.train) for u in users}) == 1
    # disjoint while the categories last: 12 clients take 90 % of the training tokens
    whole = make_user_data(corpus, tok, SplitConfig())
    assert sum(len(u.train) for u in users) <= 0.9 * sum(len(u.train) for u in whole) + 12
    mix = dirichlet_mixtures(2000, 4, 0.1, torch.Generator().manual_seed(0))
    assert mix.max(1).values.median() > 0.9        # small alpha: one category dominates
    mix = dirichlet_mixtures(2000, 4, 100.0, torch.Generator().manual_seed(0))
    assert (mix - 0.25).abs().max() < 0.15          # large alpha: near uniform
    with pytest.raises(ValueError, match="data.clients"):
        SplitConfig(clients=4, mode="ood")


def test_a_packed_state_comes_back_equal_tensor_for_tensor_and_an_unpacked_one_passes_through():
    """Client states are saved as one flat buffer (engines/device.py ``pack``): every tensor of
    every dtype and shape, AdamW's state_dict nest included, comes back equal and its own copy."""
    from comix.algorithms import ClientState
    from comix.engines.states import pack
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.randn(3, 2))])
    opt.param_groups[0]["params"][0].grad = torch.randn(3, 2)
    opt.step()
    state = ClientState(adapters={"a": torch.randn(4, 5), "b": torch.zeros(0), "c": torch.randn(2).to(torch.bfloat16)},
                        optimizers={"experts": opt.state_dict()}, rng=torch.Generator().manual_seed(3).get_state(),
                        step=7, extra={"ranks": [1, 2], "t": (torch.tensor(5), "x")})
    back = unpack(pack(state))
    assert back.step == 7 and back.extra["ranks"] == [1, 2] and back.extra["t"][1] == "x"
    assert torch.equal(back.extra["t"][0], torch.tensor(5)) and torch.equal(back.rng, state.rng)
    for n, t in state.adapters.items():
        assert back.adapters[n].dtype == t.dtype and torch.equal(back.adapters[n], t)
    saved, got = state.optimizers["experts"]["state"][0], back.optimizers["experts"]["state"][0]
    assert all(torch.equal(saved[k], got[k]) for k in saved)
    assert back.optimizers["experts"]["param_groups"] == state.optimizers["experts"]["param_groups"]
    back.adapters["a"].add_(1)  # its own copy: the packed buffer and the original are untouched
    assert not torch.equal(back.adapters["a"], state.adapters["a"])
    assert unpack(state) is state  # a state saved before packing loads as it was
    odd = {"a": torch.ones(3), "b": torch.arange(5, dtype=torch.float64), "c": torch.ones(3, dtype=torch.bfloat16),
           "d": torch.arange(7, dtype=torch.int64)}  # offsets that are no multiple of 8 unless packed aligned
    back = unpack(pack(odd))
    assert all(back[k].dtype == t.dtype and torch.equal(back[k], t) for k, t in odd.items())


def test_a_device_that_missed_a_round_replays_a_re_sent_round_from_its_last_state(tmp_path):
    """RoundStore (a Flower device's files): trained in round 1, down in round 2, trained in
    round 3; the server restarts and re-sends round 3, which must start from round 1's state
    again, not from nothing (found by bench/soak.py)."""
    from comix.algorithms import ClientState
    from comix.engines.states import RoundStore

    def state(step):
        return ClientState(adapters={"a": torch.full((2,), float(step))}, step=step)
    for read, write, step in ((0, 0, 0), (0, 1, 1), (2, 3, 3)):  # init, round 1, round 3 (round 2 missed)
        store = RoundStore(tmp_path, read, write)  # a fresh process per message, as on Flower
        store[0] = state(step)
    replay = RoundStore(tmp_path, 2, 3)
    assert 0 in replay and replay[0].step == 1
    assert RoundStore(tmp_path, 3, 4)[0].step == 3
    assert sorted(p.name for p in tmp_path.iterdir()) == ["client0.round1.pt", "client0.round3.pt"]
