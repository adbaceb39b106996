"""Many clients: client sampling per round, Dirichlet client splits, offloaded states
kept per round so that resume and memory do not depend on the number of clients."""
import json

import pytest
import torch

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
    states = torch.load(tmp_path / "run" / "checkpoint.pt", weights_only=False)["clients"]["states"]
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
