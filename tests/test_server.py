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
