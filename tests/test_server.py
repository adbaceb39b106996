"""The server loop's fault handling: bad or missing replies are logged, never aggregated."""
import json

import pytest
import torch

from comix.algorithms import TrainConfig, make_algorithm
from comix.data import SplitConfig, make_user_data
from comix.engines.states import StateStore
from comix.engines.inprocess import InProcess
from comix.engines.server import serve
from comix.models import LoRAConfig, load_base_model


@pytest.fixture(scope="module")
def setup():
    model, tok = load_base_model("tiny-llama")
    corpus = {c: [f"{c} text {i} " * 30 for i in range(12)] for c in ("a", "b", "c")}
    return model, make_user_data(corpus, tok, SplitConfig(valid_tokens=400, test_tokens=200))


class Faulty(InProcess):
    """Client 1 misbehaves in round 1 as ``fault`` says; the others are honest."""

    def __init__(self, *a, fault: str):
        super().__init__(*a)
        self.fault, self.aggregates = fault, []

    def train(self, payloads):
        self.aggregates.append(payloads)
        replies = super().train(payloads)  # counts the round
        if self.round == 1:
            upload, metrics = replies[1]
            name = next(iter(upload))
            if self.fault == "nan":
                upload[name] = upload[name].clone().fill_(float("nan"))
            elif self.fault == "extra":
                upload["model.layers.0.mlp.experts.1.up_proj.lora_A"] = torch.zeros(2)
            elif self.fault == "shape":
                upload[name] = upload[name][:1]
            elif self.fault == "dead":
                replies[1] = "node died"
        return replies


@pytest.mark.parametrize("fault,reason", [("nan", "NaN"), ("extra", "undeclared"), ("shape", "shape"),
                                          ("dead", "node died")])
def test_bad_replies_are_rejected_and_the_rest_aggregated(setup, tmp_path, fault, reason, caplog):
    model, users = setup
    algo = make_algorithm("fedavg", LoRAConfig(r=4), TrainConfig(rounds=2, local_steps=2, batch_size=2, seq_len=16,
                                                                   eval_every=2, eval_batch_size=4), 3)
    transport = Faulty(algo, model, users, 0, StateStore(), fault=fault)
    seen = {}
    real = algo.server_round

    def spy(state, uploads):
        seen.setdefault("uploads", dict(uploads))
        return real(state, uploads)
    algo.server_round = spy
    with caplog.at_level("WARNING", logger="comix.server"):
        serve(algo, transport, [u.name for u in users], tmp_path, seed=0)
    assert set(seen["uploads"]) == {0, 2}  # client 1's round-1 reply never reached the aggregate
    name = next(iter(seen["uploads"][0]))
    expect = (seen["uploads"][0][name] + seen["uploads"][2][name]) / 2
    assert torch.allclose(transport.aggregates[1][1][name], expect)  # weights renormalised over 2
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert reason in rows[1]["failed"] and rows[1]["bytes_up"] == 0 and "failed" not in rows[4]
    assert "client 1 left out" in caplog.text


def test_eval_clients_scores_a_seeded_sample_between_full_rounds_without_changing_any_score(tmp_path):
    """train.eval_clients=1: rounds before the last score one client, drawn from (seed, round);
    the last round scores all; a sampled client's score equals a full evaluation's (scoring
    changes no state)."""
    import json

    from comix.cli import main
    from comix.engines.server import eval_sample
    common = ["model=tiny-llama", "methods=[fedavg]", "train.rounds=3", "train.local_steps=2", "train.batch_size=2",
              "train.seq_len=32", "train.eval_every=1", "data.valid_tokens=512", "data.test_tokens=256"]
    for name, extra in (("all", []), ("sample", ["train.eval_clients=1"])):
        assert main(["run", *common, *extra, f"run_dir={tmp_path / name}"]) == 0
    rows = {name: [json.loads(x) for x in (tmp_path / name / "fedavg" / "metrics.jsonl").read_text().splitlines()]
            for name in ("all", "sample")}
    users = sorted({r["user"] for r in rows["all"]})
    scored = {rnd: sorted(r["user"] for r in rows["sample"] if r["round"] == rnd and "test_ppl" in r) for rnd in (1, 2, 3)}
    assert [len(scored[r]) for r in (1, 2, 3)] == [1, 1, len(users)]
    from comix.config import load_config
    train = load_config(None, [*common, "train.eval_clients=1"]).train
    assert all(scored[r] == [users[c] for c in eval_sample(len(users), train, 42, r)] for r in (1, 2))
    full = {(r["round"], r["user"]): r["test_ppl"] for r in rows["all"]}
    assert all(r["test_ppl"] == full[r["round"], r["user"]] for r in rows["sample"] if "test_ppl" in r)
    assert len({tuple(eval_sample(len(users), train, s, 1)) for s in range(20)}) > 1  # the draw varies
