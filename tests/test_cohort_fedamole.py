"""FedAMoLE's family in cohorts (algorithms/cohort.py with models/amole.py's stacked AMoLE layers):
each client's experts in its own slots of a client-stacked layer, its empty slots masked out of its
routing, its load balance (eq. 19-20) over its own tokens and experts, its RSEA embeddings from its
own trained model, a fresh optimiser every round: equal to the clients trained one at a time on
every per-round metric, upload (the assigned experts by id, the embeddings) and final adapter, on
language-model windows and on instruction batches of unequal widths, and through a kill and resume.
The clients hold unequal numbers of experts (checked), so a mask that let a client route to an empty
slot, or a balance over all b slots, would show."""
import json

import pytest
import torch

from comix.algorithms import make_algorithm
from comix.engines.inprocess import ClientModels
from comix.engines.server import TIMINGS
from comix.models import LoRAConfig
from comix.models.amole import AMoLELinear, amole_load_balance, layer_load_balance
from comix.models.cohort import stack_clients
from test_algorithms import setup  # noqa: F401 (the shared tiny fixture: 3 users a, b, c)
from test_cohort import EXACT, _algo, _assert_same, _run, _train, instruction_setup, killed_and_resumed, setup64  # noqa: F401

# slots = pool: 12 expert places over 3 clients, each holding 2..6, so their counts differ
SMALL = dict(pool=6, slots=6)


def _counts(out):
    """Each round's experts per client and module (server.jsonl)."""
    return [row["experts_per_client"] for row in map(json.loads, (out / "server.jsonl").read_text().splitlines())
            if "experts_per_client" in row]


def _as_one_cohort(out):
    rows = [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines()]
    return {r.get("cohort") for r in rows if "train_loss" in r} == {3}


@pytest.mark.parametrize("method,options", [("fedamole", None), ("fedamole-vanilla", None),
                                            ("fedamole-random", None), ("fedamole", {"shared": False}),
                                            ("fedamole", {"beta": 1.0})])
def test_a_fedamole_cohort_trains_each_client_as_it_would_train_alone(setup64, tmp_path, method, options):
    """LM windows, AMoLE's dropout 0.05 (each client's masks from its own turn's generator); beta 1:
    the load balance's gradient large enough to show a balance over another client's tokens or over
    empty slots. In fp64 to ``EXACT``, as the other cohorts (tests/test_cohort.py)."""
    opts = {**SMALL, **(options or {})}
    seq = _run(setup64, tmp_path, method, 1, opts)
    together = _run(setup64, tmp_path, method, 3, opts)
    assert _as_one_cohort(together[3])
    assert any(len(set(n)) > 1 for rnd in _counts(together[3]) for n in rnd.values())  # unequal expert counts
    _assert_same(seq, together, rel=EXACT)


def test_a_fedamole_instruction_cohort_trains_each_client_as_it_would_train_alone(instruction_setup, tmp_path):
    """FedAMoLE's own task: instruction batches padded on to the cohort's widest row, each client's CE,
    load balance and dropout over its own batch's tokens, its embeddings over its own held-out examples."""
    train = dict(local_steps=4, batch_size=3)
    opts = {**SMALL, "beta": 1.0}
    seq = _run(instruction_setup, tmp_path, "fedamole", 1, opts, **train)
    together = _run(instruction_setup, tmp_path, "fedamole", 3, opts, **train)
    assert _as_one_cohort(together[3])
    _assert_same(seq, together, rel=EXACT)


def test_a_fedamole_cohort_killed_and_resumed_equals_an_uninterrupted_run(setup, tmp_path):
    full, resumed = killed_and_resumed(lambda: _algo("fedamole", 3, SMALL, rounds=3), setup, tmp_path)
    assert resumed["per_user"] == full["per_user"]

    def rows(d, name):
        return [{k: v for k, v in json.loads(ln).items() if k not in TIMINGS and not k.endswith("_s")}
                for ln in (d / name).read_text().splitlines()]
    assert rows(tmp_path / "killed", "metrics.jsonl") == rows(tmp_path / "full", "metrics.jsonl")
    assert _counts(tmp_path / "killed") == _counts(tmp_path / "full")


def _layers(setup, router="amole"):
    """One AMoLE layer of the tiny model's client architecture alone and stacked for two clients
    that hold 2 and 3 of its 4 slots, with random non-zero factors each."""
    model, _ = setup
    algo = make_algorithm("fedamole", LoRAConfig(r=4), _train(), 3, pool=6, slots=4, router=router)
    single = ClientModels(model, algo).for_client(0)
    stacked = stack_clients(single, 2)
    name = next(n for n, m in single.named_modules() if isinstance(m, AMoLELinear))
    alone, both = single.get_submodule(name), stacked.get_submodule(name)
    g = torch.Generator().manual_seed(3)
    ids = [[1, 4], [0, 2, 5]]
    tensors = [{n: torch.randn(p.shape, generator=g) for n, p in alone.named_parameters() if p.requires_grad}
                for _ in ids]
    with torch.no_grad():
        for c, t in enumerate(tensors):
            for n, p in both.named_parameters():
                if p.requires_grad:
                    p[c].copy_(t[n])
    both.assign_clients(ids)
    return alone, both, tensors, ids


@pytest.mark.parametrize("router", ["amole", "vanilla"])
def test_a_stacked_amole_layer_routes_each_client_over_its_own_experts_only(setup, router):
    """Client c's rows through the stacked layer equal the layer alone holding c's experts: outputs,
    routing and the load balance over its own tokens (``own``), with its own expert count."""
    alone, both, tensors, ids = _layers(setup, router)
    alone.eval(), both.eval()  # no dropout: the outputs compare exactly
    x = torch.randn(2 * 5, alone.base.in_features, generator=torch.Generator().manual_seed(4))
    y = both(x)
    routing = both.last_routing
    width = [5, 3]  # client 1's batch padded from 3 tokens to 5
    own = torch.tensor([[1] * 5, [1] * 3 + [0] * 2])
    balance = layer_load_balance(both, own)
    for c in range(2):
        with torch.no_grad():
            for n, p in alone.named_parameters():
                if p.requires_grad:
                    p.copy_(tensors[c][n])
        alone.assign(ids[c])
        rows = x[5 * c:5 * c + 5]
        assert torch.allclose(y[5 * c:5 * c + 5], alone(rows), atol=1e-5)
        n = len(ids[c])
        probs = routing.probs[5 * c:5 * c + 5]
        assert torch.allclose(probs[:, :n], alone.last_routing.probs, atol=1e-6)
        assert float(probs[:, n:].abs().max()) == 0.0  # an empty slot gets no probability
        alone(rows[:width[c]])
        want = amole_load_balance(alone.last_routing, n)
        assert float(balance[c]) == pytest.approx(float(want), rel=1e-5)
    assert both.experts_of(0) == 2 and both.experts_of(1) == 3


def test_the_fedamole_family_runs_in_cohorts_and_fdlora_on_its_tasks_says_why():
    for m in ("fedamole", "fedamole-random", "fedamole-vanilla", "fedamole-vanilla-random", "fedmole", "fedamole-s",
              "fedamole-h"):
        algo = make_algorithm(m, LoRAConfig(r=4), _train(), 3, pool=6, slots=4)
        assert algo.cohort_refusal() is None, m
    assert "client_round" in make_algorithm("fdlora-fedamole", LoRAConfig(r=4), _train(), 3).cohort_refusal()


def test_a_state_loaded_its_own_way_below_the_cohort_form_keeps_its_method_out_of_cohorts():
    """A subclass that writes its own load_state (or save_state) under a parent's cohort form would
    load a cohort the parent's way: it is refused, naming the step, until it writes the cohort form too."""
    from comix.algorithms.fedamole import FedAMoLE

    class OwnLoad(FedAMoLE):
        def load_state(self, model, adapters):
            return super().load_state(model, adapters)

    class OwnSave(FedAMoLE):
        def save_state(self, model, state):
            return super().save_state(model, state)
    for cls, step in ((OwnLoad, "load_state"), (OwnSave, "save_state")):
        algo = cls(LoRAConfig(r=4), _train(), 3, pool=6, slots=4)
        assert step in algo.cohort_refusal()
