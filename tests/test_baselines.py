"""Each baseline's defining property, on a tiny random Llama."""
import json

import pytest
import torch

from comix.engines.states import unpack
from comix.algorithms import ClientState, make_algorithm
from comix.algorithms import base as base_module
from comix.algorithms.training import load_adapters, lm_loss
from comix.algorithms.fdlora import set_fusion
from comix.algorithms.hetero import lora_pairs
from comix.data import sample_batch
from comix.engines import run_method
from comix.engines.device import fresh_adapters
from comix.engines.inprocess import ClientModels
from comix.models import LoRAConfig, param_role
from test_algorithms import _client, _train, setup  # noqa: F401 (setup: the shared tiny fixture)


def _algo(name, n=3, **options):
    return make_algorithm(name, LoRAConfig(r=4), _train(), n, **options)


# -- HetLoRA -------------------------------------------------------------------------------------
def test_hetlora_zero_pads_to_the_max_rank_and_truncates_back():
    algo = _algo("hetlora", n=2, ranks=[2, 4], aggregation="uniform")
    a0, b0 = torch.arange(6.).reshape(2, 3), torch.ones(5, 2)
    a1, b1 = torch.full((4, 3), 2.), torch.full((5, 4), 3.)
    up = {0: {"b.mlp.up_proj.lora.lora_A": a0, "b.mlp.up_proj.lora.lora_B": b0}, 1: {"b.mlp.up_proj.lora.lora_A": a1, "b.mlp.up_proj.lora.lora_B": b1}}
    _, payloads = algo.server_round(None, up)
    glob_a = torch.cat([(a0 + a1[:2]) / 2, a1[2:] / 2])          # padding rows are zeros
    glob_b = torch.cat([(b0 + b1[:, :2]) / 2, b1[:, 2:] / 2], 1)
    assert payloads[1]["b.mlp.up_proj.lora.lora_A"].shape == (4, 3) and payloads[0]["b.mlp.up_proj.lora.lora_A"].shape == (2, 3)
    assert torch.allclose(payloads[1]["b.mlp.up_proj.lora.lora_A"], glob_a) and torch.allclose(payloads[1]["b.mlp.up_proj.lora.lora_B"], glob_b)
    assert torch.allclose(payloads[0]["b.mlp.up_proj.lora.lora_A"], glob_a[:2]) and torch.allclose(payloads[0]["b.mlp.up_proj.lora.lora_B"], glob_b[:, :2])


def test_hetlora_sparsity_weights_follow_update_norms():
    algo = _algo("hetlora", n=2, ranks=[2, 2])
    up0 = {"b.mlp.up_proj.lora.lora_A": torch.ones(2, 3), "b.mlp.up_proj.lora.lora_B": torch.zeros(4, 2)}   # dW = 0
    up1 = {"b.mlp.up_proj.lora.lora_A": torch.ones(2, 3), "b.mlp.up_proj.lora.lora_B": torch.ones(4, 2)}
    w = algo.weights({0: up0, 1: up1})
    assert w == {0: 0.0, 1: 1.0}
    _, payloads = algo.server_round(None, {0: up0, 1: up1})
    assert torch.equal(payloads[0]["b.mlp.up_proj.lora.lora_B"], up1["b.mlp.up_proj.lora.lora_B"])


def test_hetlora_self_prunes_and_holds_the_tail_at_zero(setup):
    model, users = setup
    algo = make_algorithm("hetlora", LoRAConfig(r=4), _train(local_steps=4), 3, ranks=[8, 8, 4], reg=5.0, gamma=0.5)
    ctx, state = _client(algo, model, users, 0)
    ranks = []
    for _ in range(3):
        state, upload, m = algo.client_round(ctx, state, {})
        ranks.append(m["rank"])
        assert algo.rank_of(upload) == m["rank"]  # only the active components travel
    assert ranks[0] == 8 and ranks[-1] < 8
    for a, b in lora_pairs(state.adapters).values():
        assert state.adapters[a][ranks[-1]:].abs().sum() == 0 and state.adapters[b][:, ranks[-1]:].abs().sum() == 0


# -- FlexLoRA ------------------------------------------------------------------------------------
def test_flexlora_redistribution_is_exact_when_the_rank_allows():
    torch.manual_seed(0)
    algo = _algo("flexlora", n=3, ranks=[2, 2, 8])
    ups = {c: {"b.mlp.up_proj.lora.lora_A": torch.randn(2, 10), "b.mlp.up_proj.lora.lora_B": torch.randn(6, 2)} for c in (0, 1)}
    ups[2] = {"b.mlp.up_proj.lora.lora_A": torch.randn(8, 10) * (torch.arange(8) < 2)[:, None], "b.mlp.up_proj.lora.lora_B": torch.randn(6, 8)}
    mean = sum(algo.scaling(c) * u["b.mlp.up_proj.lora.lora_B"].double() @ u["b.mlp.up_proj.lora.lora_A"].double() for c, u in ups.items()) / 3
    _, payloads = algo.server_round(None, ups)
    rebuilt = lambda c: algo.scaling(c) * payloads[c]["b.mlp.up_proj.lora.lora_B"].double() @ payloads[c]["b.mlp.up_proj.lora.lora_A"].double()  # noqa: E731
    assert torch.linalg.matrix_rank(mean) == 6 and torch.allclose(rebuilt(2), mean, atol=1e-5)   # rank 6 <= 8: exact
    u, s, vh = torch.linalg.svd(mean)
    assert torch.allclose(rebuilt(0), (u[:, :2] * s[:2]) @ vh[:2], atol=1e-5)                     # best rank-2
    assert payloads[0]["b.mlp.up_proj.lora.lora_A"].shape == (2, 10) and payloads[2]["b.mlp.up_proj.lora.lora_B"].shape == (6, 8)


# -- FFA-LoRA, FedSA-LoRA ------------------------------------------------------------------------
def _final_states(tmp_path, method, users, model):
    algo = make_algorithm(method, LoRAConfig(r=4), _train(), 3)
    run_method(algo, model, users, tmp_path / method, seed=5, keep_checkpoints=True)
    return {c: unpack(s) for c, s in torch.load(tmp_path / method / "checkpoint.pt", weights_only=False)["clients"]["states"].items()}


def test_ffa_lora_keeps_a_frozen_and_identical_across_users(setup, tmp_path):
    model, users = setup
    algo = make_algorithm("ffa-lora", LoRAConfig(r=4), _train(), 3)
    states = _final_states(tmp_path, "ffa-lora", users, model)
    a_names = [n for n in states[0].adapters if n.endswith("lora_A")]
    b_names = [n for n in states[0].adapters if n.endswith("lora_B")]
    for n in a_names:
        assert torch.equal(states[0].adapters[n], states[1].adapters[n]) and torch.equal(states[1].adapters[n], states[2].adapters[n])
    init = fresh_adapters(ClientModels(model, algo).for_client(0), 5 + 1)  # the run's common init seed
    assert all(torch.equal(states[2].adapters[n], init[n]) for n in a_names)  # bit-identical to the init
    assert any(states[0].adapters[n].abs().sum() > 0 for n in b_names)          # B did train


def test_fedsa_lora_averages_a_and_keeps_b_local(setup, tmp_path):
    model, users = setup
    states = _final_states(tmp_path, "fedsa-lora", users, model)
    a = [n for n in states[0].adapters if n.endswith("lora_A")]
    b = [n for n in states[0].adapters if n.endswith("lora_B")]
    assert all(torch.equal(states[0].adapters[n], states[1].adapters[n]) for n in a)  # the final A is the average
    assert all(not torch.equal(states[0].adapters[n], states[1].adapters[n]) for n in b)
    rows = [json.loads(x) for x in (tmp_path / "fedsa-lora" / "metrics.jsonl").read_text().splitlines()]
    a_bytes = sum(states[0].adapters[n].numel() * 4 for n in a)
    assert rows[0]["bytes_up"] == a_bytes  # exactly the A matrices travel


# -- PCL -----------------------------------------------------------------------------------------
def test_pcl_trust_weights_are_a_distribution_favouring_helpful_peers(setup):
    model, users = setup
    algo = _algo("pcl", start_round=1, period=1)
    ctx, state = _client(algo, model, users, 0)
    state, mine, _ = algo.client_round(ctx, state, {})
    noisy = {n: t + 3 * torch.randn_like(t) for n, t in mine.items()}
    _, payloads = algo.server_round(None, {0: mine, 1: noisy, 2: mine})
    assert set(algo.peers(payloads[0])) == {0, 1, 2}
    w = algo.trust(ctx, state, algo.peers(payloads[0]))
    assert (w >= 0).all() and w.sum().item() == pytest.approx(1.0)
    assert w[1] < w[0] and w[0] == pytest.approx(w[2])
    # softmax of minus the validation perplexity (the authors' collab_run_client_level.py, T = 1)
    gen = torch.Generator().manual_seed(1000 * state.step + 0)
    batches = [sample_batch(users[0].valid, 2, 16, gen) for _ in range(algo.cfg.eval_batches)]
    ppl = []
    for j in (0, 1, 2):
        load_adapters(ctx.model, algo.peers(payloads[0])[j])
        with torch.no_grad():
            ppl.append(torch.tensor(sum(lm_loss(ctx.model, x, y).item() for x, y in batches) / len(batches)).exp())
    assert torch.allclose(w, torch.softmax(-torch.stack(ppl), 0), atol=1e-5)
    state, _, m = algo.client_round(ctx, state, payloads[0])
    assert len(m["trust"]) == 3 and sum(m["trust"]) == pytest.approx(1.0, abs=1e-3)


def test_pcl_mixes_after_round_five_then_every_second_round(setup, tmp_path):
    model, users = setup
    algo = make_algorithm("pcl", LoRAConfig(r=4), _train(rounds=8, local_steps=1), 3, eval_batches=2)
    assert [r for r in range(1, 9) if algo.mixes_after(r)] == [5, 7]
    run_method(algo, model, users, tmp_path / "pcl", seed=1)
    rows = [json.loads(x) for x in (tmp_path / "pcl" / "metrics.jsonl").read_text().splitlines()]
    sent = sorted({r["round"] for r in rows if r["bytes_up"] > 0})
    assert sent == [5, 7] and all(r["bytes_down"] == 0 for r in rows if r["round"] in (2, 3, 4, 5))
    assert {r["round"] for r in rows if "trust" in r} == {6, 8}  # mixed at the start of the next round


def test_pcl_whose_last_round_mixes_ends_on_the_mixed_model_it_scored(setup, tmp_path):
    """Mixing after the last round (7 of 7): the final payload relays every peer's LoRA, and each
    client ends on its trust-weighted mix of them, the model its final evaluation scored."""
    model, users = setup
    algo = make_algorithm("pcl", LoRAConfig(r=4), _train(rounds=7, local_steps=1), 3, eval_batches=2)
    assert algo.mixes_after(7)
    run_method(algo, model, users, tmp_path / "pcl", seed=1)
    assert (tmp_path / "pcl" / "results.json").exists()
    ctx, state = _client(algo, model, users, 0)
    state, _, _ = algo.client_round(ctx, state, {})  # round 1 sends nothing: peers made from its LoRA
    mine = algo.upload_of(state.adapters)
    peers = {j: {n: t + 0.01 * torch.randn_like(t) for n, t in mine.items()} for j in range(3)}
    _, payloads = algo.server_round(None, peers)
    expected = algo.personal_adapters(ctx, state, payloads[0])
    finished = algo.client_finish(ctx, ClientState(adapters=dict(state.adapters), step=state.step), payloads[0])
    assert not all(torch.equal(state.adapters[n], expected[n]) for n in expected)  # the mix is not its own
    assert all(torch.equal(finished.adapters[n], expected[n]) for n in expected)


# -- FDLoRA --------------------------------------------------------------------------------------
def test_fdlora_outer_optimizer_is_sgd_with_momentum():
    algo = _algo("fdlora-comigs", n=2)
    theta = {"w": torch.zeros(2)}
    s, _ = algo.server_init({0: theta, 1: theta})
    s, p = algo.server_round(s, {0: {"w": torch.tensor([1., 1.])}, 1: {"w": torch.tensor([3., 1.])}})
    assert torch.equal(p[0]["w"], torch.tensor([2., 1.]))            # m = -mean; theta = mean (lr 1)
    s, p = algo.server_round(s, {0: {"w": torch.tensor([2., 1.])}, 1: {"w": torch.tensor([2., 1.])}})
    assert torch.equal(p[1]["w"], torch.tensor([3., 1.5]))           # m = 0.5 m + 0 -> theta += 0.5 * mean step


def test_fdlora_local_steps_alternate_global_alone_then_personal_alone(setup, monkeypatch):
    """CoMiGS's FDLoRA: even local steps train the global LoRA with the personal one switched off
    (fusion (1, 0)), odd steps the personal LoRA with the global one off (0, 1); each step's
    gradient reaches only its own adapter, both train in a round, and the model scored afterwards
    computes with the (0.5, 0.5) average again."""
    from comix.algorithms import fdlora
    model, users = setup
    algo = make_algorithm("fdlora-comigs", LoRAConfig(r=4), _train(local_steps=4), 3)
    ctx, state = _client(algo, model, users, 0)
    seen, real = [], fdlora.train_step

    def spy(model, x, y, params, *rest, **kw):
        fusion = {tuple(m.lora_fusion.tolist()) for m in model.modules() if getattr(m, "lora_fusion", None) is not None}
        names = {n for n, p in model.named_parameters() if any(p is q for q in params)}
        seen.append((fusion, {param_role(n) for n in names}))
        return real(model, x, y, params, *rest, **kw)
    monkeypatch.setattr(fdlora, "train_step", spy)
    before = dict(state.adapters)
    state, upload, _ = algo.client_round(ctx, state, {})
    assert {param_role(n) for n in upload} == {"attention_lora", "mlp_lora"}  # the personal LoRA stays home
    assert [f for f, _ in seen] == [{(1.0, 0.0)}, {(0.0, 1.0)}, {(1.0, 0.0)}, {(0.0, 1.0)}]
    assert [r for _, r in seen] == [{"attention_lora", "mlp_lora"}, {"personal_lora"}] * 2
    for role in ("mlp_lora", "personal_lora"):
        assert any(not torch.equal(before[n], t) for n, t in state.adapters.items() if param_role(n) == role), role
    assert {tuple(m.lora_fusion.tolist()) for m in ctx.model.modules()
            if getattr(m, "lora_fusion", None) is not None} == {(0.5, 0.5)}
    # each adapter its own AdamW, kept across rounds: after two rounds each has taken its 4 steps
    state, _, _ = algo.client_round(ctx, state, upload)
    steps = {k: {int(float(v["step"])) for v in state.optimizers[k]["state"].values()} for k in ("global", "personal")}
    assert steps == {"global": {4}, "personal": {4}}
    assert len(state.optimizers["personal"]["state"]) == sum(param_role(n) == "personal_lora" for n in state.adapters)


def test_fdlora_fuses_on_validation_batches_and_never_takes_a_search_worse_than_its_start(setup, monkeypatch):
    """AdaFusion reads the user's few-shot validation batches (not its training data), and a search
    whose result scores worse than the (0.5, 0.5) start keeps the start."""
    import nevergrad as ng
    from comix.algorithms import fdlora
    model, users = setup
    algo = make_algorithm("fdlora-comigs", LoRAConfig(r=4), _train(local_steps=2), 3)
    ctx, state = _client(algo, model, users, 0)
    state, upload, _ = algo.client_round(ctx, state, {})
    read, real = [], fdlora.sample_batch
    monkeypatch.setattr(fdlora, "sample_batch", lambda t, *a: read.append(t) or real(t, *a))

    class Worse:  # a search that ends far from the optimum: both weights at the bound, opposite signs
        def __init__(self, parametrization, budget):
            self.parametrization = parametrization

        def minimize(self, objective):
            return type("Found", (), {"value": [1.5, -1.5]})()
    monkeypatch.setattr(ng.optimizers, "NGOpt", Worse)
    state = algo.client_finish(ctx, state, upload)
    assert len(read) == algo.fewshot_batches and all(t is users[0].valid for t in read)
    assert state.extra["fusion"] == (0.5, 0.5)


def test_fdlora_fusion_lowers_the_validation_objective(setup):
    model, users = setup
    algo = make_algorithm("fdlora-comigs", LoRAConfig(r=4), _train(local_steps=6), 3, budget=30)
    ctx, state = _client(algo, model, users, 0)
    state, _, _ = algo.client_round(ctx, state, {})
    # a harmful global LoRA (as if the federation were far from this user): fusion should shrink it
    payload = {n: t + (0.5 * torch.randn_like(t) if param_role(n) == "mlp_lora" else 0)
               for n, t in state.adapters.items() if algo.is_shared(n)}
    gen = torch.Generator().manual_seed(0)
    batches = [sample_batch(users[0].valid, 2, 16, gen) for _ in range(algo.fewshot_batches)]
    state = algo.client_finish(ctx, state, payload)
    w = state.extra["fusion"]

    def val(weights):
        load_adapters(ctx.model, state.adapters)
        set_fusion(ctx.model, weights)
        with torch.no_grad():
            return sum(lm_loss(ctx.model, x, y).item() for x, y in batches) / len(batches)
    assert abs(w[0]) < 0.5 and val(w) < val((0.5, 0.5))
    fusion = [t for n, t in state.adapters.items() if param_role(n) == "fusion"]
    assert fusion and all(torch.allclose(t, torch.tensor(w, dtype=t.dtype)) for t in fusion)


# -- mixtures trained jointly (pFedMoE, Local-/FedAvg-MoE) -----------------------------------------
@pytest.mark.parametrize("method", ["pfedmoe", "local-moe", "fedavg-moe"])
def test_joint_router_updates_use_training_batches_only(setup, method, monkeypatch):
    model, users = setup
    algo = _algo(method)
    ctx, state = _client(algo, model, users, 0)
    ctx.data = type(users[0])(users[0].name, users[0].train, torch.zeros(0, dtype=users[0].valid.dtype), users[0].test)
    real = base_module.sample_batch  # training batches only: the validation split is empty anyway
    monkeypatch.setattr(base_module, "sample_batch",
                        lambda split, *a: real(split, *a) if split is users[0].train else pytest.fail("router step sampled a batch"))
    routers = {n: t.clone() for n, t in state.adapters.items() if param_role(n) == "router"}
    state, upload, _ = algo.client_round(ctx, state, {})
    assert any(not torch.equal(state.adapters[n], t) for n, t in routers.items())  # the router trained ...
    assert "router" not in state.optimizers                                        # ... with the experts


def test_fedavg_moe_keeps_routers_local_unless_asked():
    up = {c: {"b.mlp.router.weight": torch.full((2, 3), float(c))} for c in (0, 1)}
    assert not _algo("fedavg-moe", n=2).is_shared("b.mlp.router.weight")  # the authors' "experts"
    assert _algo("fedavg-moe", n=2).is_shared("b.mlp.experts.1.up_proj.lora_A")
    shared = _algo("fedavg-moe", n=2, share_router=True)                     # their "all"
    _, p = shared.server_round(None, up)
    assert shared.is_shared("b.mlp.router.weight") and torch.equal(p[0]["b.mlp.router.weight"], torch.full((2, 3), 0.5))
    assert not _algo("pfedmoe").is_shared("b.mlp.router.weight")


def test_client_states_keep_their_private_extras(setup, tmp_path):
    model, users = setup
    states = _final_states(tmp_path, "fdlora-comigs", users, model)
    assert all(isinstance(s, ClientState) and len(s.extra["fusion"]) == 2 for s in states.values())


# -- FDLoRA as FedAMoLE's baseline (fdlora-fedamole) -------------------------------------------------
def test_fdlora_fedamole_outer_step_is_torch_s_nesterov_sgd_after_a_plain_first_mean():
    algo = _algo("fdlora-fedamole", n=2)
    gen = torch.Generator().manual_seed(0)
    theta0 = {"w": torch.randn(3, 2, generator=gen)}
    s, p = algo.server_init({0: theta0, 1: theta0})
    ups = [{c: {"w": torch.randn(3, 2, generator=gen)} for c in range(2)} for _ in range(4)]
    s, p = algo.server_round(s, ups[0])
    assert torch.allclose(p[0]["w"], (ups[0][0]["w"] + ups[0][1]["w"]) / 2)  # the first aggregation: a mean
    ref = torch.nn.Parameter(p[0]["w"].clone())
    sgd = torch.optim.SGD([ref], lr=1.0, momentum=0.5, nesterov=True)
    for up in ups[1:]:
        s, p = algo.server_round(s, up)
        ref.grad = ref.detach() - (up[0]["w"] + up[1]["w"]) / 2  # pseudo-gradient theta - mean
        sgd.step()
        assert torch.allclose(p[1]["w"], ref.detach(), atol=1e-6)


def test_fdlora_fedamole_private_adapter_lags_syncs_every_5_rounds_and_never_leaves(setup):
    model, users = setup
    algo = make_algorithm("fdlora-fedamole", LoRAConfig(r=4), _train(local_steps=1, rounds=7), 3)
    ctx, state = _client(algo, model, users, 0)
    assert all(param_role(n) == "attention_lora" for n in state.adapters)
    synced = {}
    for rnd in range(1, 8):
        state, upload, _ = algo.client_round(ctx, state, {})
        assert set(upload) == set(state.adapters)  # the shared adapter only
        assert all(upload[n] is not state.extra["private"][n] for n in upload)
        if rnd in (1, 6):  # the authors' cur_round = rnd - 1 = 0, 5
            assert all(torch.equal(state.extra["private"][n], t) for n, t in state.adapters.items())
            synced = {n: t.clone() for n, t in state.extra["private"].items()}
        else:
            assert all(torch.equal(state.extra["private"][n], synced[n]) for n in synced)
            assert any(not torch.equal(state.adapters[n], synced[n]) for n in synced)


def test_fdlora_fedamole_fuses_every_round_on_held_out_data_and_scores_the_fusion(setup, monkeypatch):
    from comix.algorithms import fdlora_fedamole as module
    model, users = setup
    algo = make_algorithm("fdlora-fedamole", LoRAConfig(r=4), _train(local_steps=2), 3)
    ctx, state = _client(algo, model, users, 0)
    state, up, _ = algo.client_round(ctx, state, {})
    payload = {n: t + 0.3 * torch.randn_like(t) for n, t in up.items()}  # the next shared adapter
    seen, calls = [], []
    real_sample, real_fuse = module.sample_batch, module.fuse_adapters
    monkeypatch.setattr(module, "sample_batch", lambda t, *a: seen.append(t) or real_sample(t, *a))
    monkeypatch.setattr(module, "fuse_adapters", lambda w, s, p: calls.append(list(w)) or real_fuse(w, s, p))
    scored = algo.personal_adapters(ctx, state, payload)
    train, aux = algo.split(users[0].train)
    assert len(seen) == algo.fusion_batches and all(t.data_ptr() == aux.data_ptr() for t in seen)
    # NGOpt from (0, 0) with budget 5, then the fusion it found builds the scored model:
    # w_s * shared + w_p * private, A and B alike, w in [-1.5, 1.5]
    assert 2 <= len(calls) <= algo.budget + 1 and calls[0] == [0.0, 0.0]
    w, private = calls[-1], state.extra["private"]
    assert all(abs(v) <= 1.5 for v in w)
    assert all(torch.allclose(scored[n], w[0] * payload[n] + w[1] * private[n]) for n in scored)
    assert all(torch.equal(state.adapters[n], up[n]) for n in up)  # training goes on from the shared one

    def fusion_batches():
        out = []
        monkeypatch.setattr(module, "sample_batch", lambda t, *a: out.append(real_sample(t, *a)) or out[-1])
        algo.personal_adapters(ctx, state, payload)
        return [x for x, _ in out]
    one = fusion_batches()
    state.step += algo.train.local_steps  # as after the next round: its fusion reads other held-out batches
    two = fusion_batches()
    state.step -= algo.train.local_steps
    assert len(one) == len(two) == algo.fusion_batches and not all(torch.equal(a, b) for a, b in zip(one, two))
    assert all(torch.equal(a, b) for a, b in zip(one, fusion_batches()))  # and the same round the same ones
    final = algo.client_finish(ctx, state, payload)
    assert final.extra["fused"] and algo.personal_adapters(ctx, final, {}) is final.adapters


class _RecordingNGOpt:
    """Stands in for nevergrad's NGOpt: keeps the objective it is handed, returns the start."""
    objectives = []

    def __init__(self, parametrization, budget):
        self.parametrization = parametrization

    def minimize(self, objective):
        _RecordingNGOpt.objectives.append(objective)
        return self.parametrization


@pytest.mark.parametrize("method,l1,reduce", [("fdlora-comigs", 0.05, "sum"), ("fdlora-fedamole", 0.05, "mean")])
def test_fdlora_fusion_objective_adds_its_l1_term_to_the_held_out_loss(setup, monkeypatch, method, l1, reduce):
    """The fusion objective is the held-out LM loss plus l1 x |w| (CoMiGS's FDLoRA: AdaFusion's
    |w|_1, a sum; FedAMoLE's baseline: the mean, fdlora_fedamole.py). With the LM loss held
    constant, the objective's rise from w = 0 is the L1 term alone: dropping it, its weight or
    its reduction fails this."""
    import nevergrad as ng
    from comix.algorithms import fdlora, fdlora_fedamole
    model, users = setup
    module = fdlora if method == "fdlora-comigs" else fdlora_fedamole
    monkeypatch.setattr(ng.optimizers, "NGOpt", _RecordingNGOpt)
    monkeypatch.setattr(module, "lm_loss", lambda *a: torch.tensor(2.0))
    _RecordingNGOpt.objectives.clear()
    algo = make_algorithm(method, LoRAConfig(r=4), _train(local_steps=2), 3, l1=l1)
    ctx, state = _client(algo, model, users, 0)
    state, up, _ = algo.client_round(ctx, state, {})
    if method == "fdlora-comigs":
        algo.client_finish(ctx, state, up)
    else:
        algo.personal_adapters(ctx, state, up)
    objective = _RecordingNGOpt.objectives[0]
    import numpy as np
    w = np.array([0.6, -1.0])
    term = l1 * (np.abs(w).sum() if reduce == "sum" else np.abs(w).mean())
    assert objective(w) - objective(np.zeros(2)) == pytest.approx(term, rel=1e-6)
    assert objective(np.zeros(2)) == pytest.approx(2.0)


def test_fdlora_fedamole_trains_with_adamw_decay_on_the_training_part_only(setup, monkeypatch):
    from comix.algorithms import fdlora_fedamole as module
    model, users = setup
    algo = make_algorithm("fdlora-fedamole", LoRAConfig(r=4), _train(weight_decay=0.0), 3)
    assert algo.train.weight_decay == 0.01  # the authors' AdamW default for FDLoRA
    ctx, state = _client(algo, model, users, 1)
    seen = []
    real = module.sample_batch
    monkeypatch.setattr(module, "sample_batch", lambda t, *a: seen.append(t) or real(t, *a))
    algo.client_round(ctx, state, {})
    train, _ = algo.split(users[1].train)
    assert seen and all(t.data_ptr() == train.data_ptr() and len(t) == len(train) for t in seen)
