"""FedAMoLE on the algorithm contract: aggregation by expert id, assignments within
Definition IV.1's constraints, the embedding set kept out of training, exact embeddings."""
import json
import math

import pytest
import torch

from comix.algorithms import fedamole as fedamole_module
from comix.algorithms.fedamole import expert_name
from comix.engines import run_method
from comix.models import param_role
from test_algorithms import _algo, _client, setup  # noqa: F401 (setup: the shared tiny fixture)

M = "model.layers.0.self_attn.q_proj"


def _start(setup, method="fedamole", options=None):
    model, users = setup
    algo = _algo(method, options=options)
    clients = [_client(algo, model, users, c) for c in range(3)]
    reference = {c: algo.upload_of(s.adapters) for c, (_, s) in enumerate(clients)}
    server, payloads = algo.server_init(reference)
    return algo, clients, server, payloads


def test_each_expert_is_averaged_over_its_holders_only_and_unassigned_ones_stay(setup):
    algo, clients, server, payloads = _start(setup, options=dict(assignment="fixed"))
    pool_before = {n: t.clone() for n, t in server["pool"].items()}
    uploads = {}
    for c, (ctx, state) in enumerate(clients):
        _, up, _ = algo.client_round(ctx, state, payloads[c])
        uploads[c] = up
    d = server["assignment"][M].clone()
    server, _ = algo.server_round(server, uploads)
    for gid in range(algo.cfg.pool):
        name = expert_name(M, gid, "B")
        holders = [c for c in range(3) if d[c, gid]]
        assert holders and set(holders) == {c for c in uploads if name in uploads[c]}
        assert torch.allclose(server["pool"][name], torch.stack([uploads[c][name] for c in holders]).mean(0))
    shared = f"{M}.shared.lora_B"
    assert torch.allclose(server["shared"][shared], torch.stack([u[shared] for u in uploads.values()]).mean(0))
    # an expert nobody held this round keeps its value (drop expert 0's holders' uploads)
    for up in uploads.values():
        for ab in "AB":
            up.pop(expert_name(M, 0, ab), None)
    kept = server["pool"][expert_name(M, 0, "A")].clone()
    server, _ = algo.server_round(server, uploads)
    assert torch.equal(server["pool"][expert_name(M, 0, "A")], kept)
    assert not torch.equal(pool_before[expert_name(M, 1, "B")], server["pool"][expert_name(M, 1, "B")])


@pytest.mark.parametrize("method", ["fedamole", "fedamole-r", "fedamole-h"])
def test_every_round_s_assignment_satisfies_the_constraints(setup, tmp_path, method):
    model, users = setup
    algo = _algo(method, rounds=3)
    seen = []
    real = algo.server_round

    def spy(state, uploads):
        state, payloads = real(state, uploads)
        seen.append(({m: d.clone() for m, d in state["assignment"].items()}, payloads))
        return state, payloads
    algo.server_round = spy
    run_method(algo, model, users, tmp_path / method, seed=0)
    lo, hi = algo.bounds
    for assignment, payloads in seen:
        for m, d in assignment.items():
            assert (d.sum(0) == algo.k_c).all() and (d.sum(1) >= lo).all() and (d.sum(1) <= hi).all()
        for c, p in payloads.items():  # a client receives exactly its assigned experts
            got = {n for n in p if param_role(n) == "domain_expert" and n.endswith("lora_A")}
            want = {expert_name(m, g, "A") for m, d in assignment.items() for g in d[c].nonzero().flatten().tolist()}
            assert got == want
    report = [json.loads(x) for x in (tmp_path / method / "server.jsonl").read_text().splitlines()]
    assert len(report) == 3 and all(r["rsea_s"] >= 0 and r["aggregate_s"] >= r["rsea_s"] for r in report)
    for row, (assignment, _) in zip(report, seen):  # Fig. 8's bars are the solved assignment
        assert row["experts_per_client"] == {m: d.sum(1).tolist() for m, d in assignment.items()}
        if method != "fedamole-r":  # and its relevance matrix is clients x pool (random: none)
            assert [len(r) for r in row["relevance"]["s"]] == [algo.cfg.pool] * len(users)


def test_the_embedding_set_is_never_trained_on(setup, monkeypatch):
    model, users = setup
    algo, clients, server, payloads = _start(setup)
    seen = []
    real = fedamole_module.sample_batch
    monkeypatch.setattr(fedamole_module, "sample_batch", lambda t, *a: seen.append(t) or real(t, *a))
    ctx, state = clients[1]
    algo.client_round(ctx, state, payloads[1])
    train, aux = algo.split(users[1].train)
    assert seen and all(t.data_ptr() == train.data_ptr() and len(t) == len(train) for t in seen)
    assert len(train) + len(aux) == len(users[1].train) and len(aux) >= algo.train.seq_len + 1


def test_uploaded_embeddings_are_the_means_of_eq_23_and_25(setup):
    model, users = setup
    algo, clients, server, payloads = _start(setup)
    ctx, state = clients[0]
    state, upload, _ = algo.client_round(ctx, state, payloads[0])
    algo.load_state(ctx.model, state.adapters)
    module = dict(ctx.model.named_modules())[M]
    captured = []
    handle = module.register_forward_hook(lambda m, args, out: captured.append(args[0].reshape(-1, 32)))
    _, aux = algo.split(users[0].train)
    L = algo.train.seq_len
    n = min(algo.embed_examples, (len(aux) - 1) // L)
    with torch.no_grad():
        ctx.model(input_ids=aux[:n * L].long().reshape(n, L))
    handle.remove()
    h = torch.cat(captured)
    assert torch.allclose(upload[f"rsea.{M}.token"], (h @ module.token_proj.t()).mean(0), atol=1e-5)
    gid = module.slot_ids[0].item()
    assert torch.allclose(upload[f"rsea.{M}.expert.{gid}"], (h @ module.expert_A[0].t()).mean(0), atol=1e-5)
    noisy = _algo("fedamole", options=dict(embed_noise=0.5))
    _, up2, _ = noisy.client_round(ctx, _client(noisy, model, users, 0)[1], payloads[0])
    assert not torch.allclose(up2[f"rsea.{M}.token"], upload[f"rsea.{M}.token"])


def test_an_impossible_assignment_fails_at_config_time_with_one_line(tmp_path, capsys):
    from comix.cli import main
    assert main(["run", "model=tiny-llama", "corpus=multilingual", "methods=[fedamole]",
                 f"run_dir={tmp_path / 'run'}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("comix: error: fedamole: infeasible assignment: E * k_c = 30 * 2 = 60 picks must lie "
                              "in [N * k_e, N * b] = [8, 32] for N = 4 clients")


def test_fedit_is_lora_on_q_and_v_with_peft_scaling(setup):
    from comix.engines.inprocess import ClientModels
    from comix.models.lora import LoRALinear
    model, _ = setup
    algo = _algo("fedit")
    m = ClientModels(model, algo).for_client(0)
    adapted = {n.rsplit(".", 1)[-1] for n, mod in m.named_modules() if isinstance(mod, LoRALinear)}
    assert adapted == {"q_proj", "v_proj"}
    lora = next(mod for mod in m.modules() if isinstance(mod, LoRALinear))
    assert lora.scaling == algo.lora.alpha / algo.lora.r and lora.dropout.p == 0.05


# -- which model is scored, optimiser state, RSEA's inputs --------------------------------
def test_the_scored_adapters_are_the_client_s_post_training_adapters(setup):
    """The authors' main.py tests each client after train_experts and before aggregate."""
    algo, clients, server, payloads = _start(setup)
    uploads, trained = {}, {}
    for c, (ctx, state) in enumerate(clients):
        state, uploads[c], _ = algo.client_round(ctx, state, payloads[c])
        trained[c] = {n: t.clone() for n, t in state.adapters.items()}
    server, nxt = algo.server_round(server, uploads)
    for c, (ctx, state) in enumerate(clients):
        scored = algo.personal_adapters(ctx, state, nxt[c])
        assert scored.keys() == trained[c].keys()
        assert all(torch.equal(scored[n], trained[c][n]) for n in scored)
        aggregated = algo.apply_payload(type(state)(adapters=dict(state.adapters)), nxt[c]).adapters
        assert any(n not in scored or not torch.equal(aggregated[n], scored[n]) for n in aggregated)
        assert algo.client_finish(ctx, state, nxt[c]).adapters is state.adapters  # keeps its own model


def test_an_expert_moved_to_another_slot_never_trains_with_another_expert_s_moments(setup):
    """A fresh Adam every round (node.py): after reassignment, the first step of every expert is
    Adam's first step, |delta| = lr wherever the gradient is not ~0 (no inherited moments)."""
    model, users = setup
    algo = _algo("fedamole", options=dict(assignment="random"), local_steps=1, weight_decay=0.0, lr=1e-3,
                 schedule="round_decay", lr_decay=1.0,
                 optimizer_state="run")
    assert algo.train.optimizer_state == "round"  # FedAMoLE always, whatever the config says
    clients = [_client(algo, model, users, c) for c in range(3)]
    server, payloads = algo.server_init({c: algo.upload_of(s.adapters) for c, (_, s) in enumerate(clients)})
    for _ in range(2):  # two rounds: the second starts from a new random assignment
        uploads = {}
        for c, (ctx, state) in enumerate(clients):
            before = {n: t.clone() for n, t in payloads[c].items()}
            state, uploads[c], _ = algo.client_round(ctx, state, payloads[c])
            assert state.optimizers == {}  # nothing carried to the next round
            for n, t in before.items():
                if param_role(n) != "domain_expert" or not n.endswith("lora_B"):
                    continue
                step = (state.adapters[n] - t).abs()
                moved = step[step > 1e-7]  # the experts the batch routed to
                at_lr = ((moved - 1e-3).abs() < 2e-5).float().mean() if moved.numel() else 0
                assert at_lr > 0.9, (n, at_lr)
        server, payloads = algo.server_round(server, uploads)


def test_optimizer_state_run_keeps_a_client_s_moments_and_round_drops_them(setup):
    model, users = setup
    for mode, kept in (("run", True), ("round", False)):
        algo = _algo("fedit", optimizer_state=mode)
        ctx, state = _client(algo, model, users, 0)
        state, up, _ = algo.client_round(ctx, state, {})
        assert ("experts" in state.optimizers) == kept
        state, _, _ = algo.client_round(ctx, state, up)
        if kept:
            assert all(s["step"] == 2 * algo.train.local_steps for s in state.optimizers["experts"]["state"].values())


def _planted_uploads(algo, clients, payloads, server):
    """Real uploads whose embeddings are replaced: client c's token embedding is 10 e_c, expert
    j's embedding 10 (e_{j mod 3} + e_{j+1 mod 3}), so expert j prefers clients j and j + 1."""
    uploads = {}
    for c, (ctx, state) in enumerate(clients):
        _, uploads[c], _ = algo.client_round(ctx, state, payloads[c])
    eye = torch.eye(algo.cfg.r)
    for c, up in uploads.items():
        for n in list(up):
            if n.startswith("rsea.") and n.endswith(".token"):
                up[n] = 10 * eye[c]
            elif n.startswith("rsea.") and ".expert." in n:
                j = int(n.rsplit(".", 1)[1])
                up[n] = 10 * (eye[j % 3] + eye[(j + 1) % 3])
    planted = torch.zeros(3, algo.cfg.pool, dtype=torch.bool)
    for j in range(algo.cfg.pool):
        planted[j % 3, j] = planted[(j + 1) % 3, j] = True
    return uploads, planted


@pytest.mark.parametrize("scale", ["d", "r"])
def test_the_uploaded_embeddings_decide_the_assignment_at_the_layer_s_score_scale(setup, scale):
    algo, clients, server, payloads = _start(setup, options=dict(score_scale=scale))
    uploads, planted = _planted_uploads(algo, clients, payloads, server)
    server, _ = algo.server_round(server, uploads)
    for m, d in server["assignment"].items():
        assert torch.equal(d, planted), m  # every expert went to the two clients it was planted on
    rel = server["report"]["relevance"]
    d_scale = 32 if scale == "d" else algo.cfg.r  # tiny-llama hidden size / LoRA rank
    assert rel["s"][0][0] == pytest.approx(100 / math.sqrt(d_scale))  # client 0 . expert 0 = 10 * 10
    assert rel["p"][0][0] == pytest.approx(float(torch.softmax(torch.tensor([100., 0, 100]) / math.sqrt(d_scale), 0)[0]))


# the journal's "FedAMoLE (vanilla router)" is the arXiv version's FedAMoLE-A (Sec. 5.5: only the
# AMoLE module is replaced, RSEA stays; the same 86.90 in both tables)
@pytest.mark.parametrize("method", ["fedamole-vanilla", "fedamole-a"])
def test_vanilla_router_with_rsea_re_solves_every_round_from_the_uploaded_router_logits(setup, method):
    algo, clients, server, payloads = _start(setup, method=method)
    assert algo.cfg.router == "vanilla" and algo.assignment == "rsea"
    for rnd in range(2):
        uploads = {}
        for c, (ctx, state) in enumerate(clients):
            _, uploads[c], _ = algo.client_round(ctx, state, payloads[c])
            logits = [n for n in uploads[c] if n.startswith("rsea.")]
            assert logits and all(n.endswith(".router") and uploads[c][n].shape == (algo.cfg.pool,) for n in logits)
        want = torch.zeros(3, algo.cfg.pool, dtype=torch.bool)
        for j in range(algo.cfg.pool):  # this round expert j prefers clients j + rnd and j + rnd + 1
            want[(j + rnd) % 3, j] = want[(j + rnd + 1) % 3, j] = True
        for c, up in uploads.items():
            for n in [n for n in up if n.startswith("rsea.")]:
                up[n] = 20.0 * want[c].double().float()
        server, payloads = algo.server_round(server, uploads)
        assert all(torch.equal(d, want) for d in server["assignment"].values())


def test_pool_and_first_assignment_follow_the_run_s_seed(setup):
    from comix.algorithms.base import ServerContext
    model, users = setup

    def first(seed):
        algo = _algo("fedamole")
        algo.server = ServerContext(base=None, seed=seed)
        clients = [_client(algo, model, users, c) for c in range(3)]
        server, _ = algo.server_init({c: algo.upload_of(s.adapters) for c, (_, s) in enumerate(clients)})
        return server["pool"][expert_name(M, 0, "A")], server["assignment"][M]
    (a1, d1), (a1b, d1b), (a2, d2) = first(1), first(1), first(2)
    assert torch.equal(a1, a1b) and torch.equal(d1, d1b)
    assert not torch.equal(a1, a2)


def test_the_load_balance_term_is_in_the_optimised_loss(setup):
    """beta * sum over modules of eq. 19 enters the gradient: with a large beta the router
    (token projection) moves differently after one step."""
    model, users = setup
    moved = []
    for beta in (0.0, 10.0):
        algo = _algo("fedamole", options=dict(beta=beta, assignment="fixed"), local_steps=1)
        ctx, state = _client(algo, model, users, 0)
        server, payloads = algo.server_init({c: algo.upload_of(_client(algo, model, users, c)[1].adapters)
                                             for c in range(3)})
        state, _, _ = algo.client_round(ctx, state, payloads[0])
        moved.append(state.adapters[f"{M}.token_proj"])
        reg = algo.forward_loss(ctx.model)
        from comix.models.amole import amole_load_balance
        terms = [amole_load_balance(m.last_routing, m.n_active) for m in fedamole_module.amole_modules(ctx.model).values()]
        assert reg.item() == pytest.approx(beta * torch.stack(terms).sum().item(), rel=1e-5)
    assert not torch.allclose(moved[0], moved[1])


def test_the_token_projection_leaves_the_device_and_is_averaged(setup):
    algo, clients, server, payloads = _start(setup, options=dict(assignment="fixed"))
    uploads = {c: algo.client_round(ctx, state, payloads[c])[1] for c, (ctx, state) in enumerate(clients)}
    name = f"{M}.token_proj"
    assert all(name in up for up in uploads.values())
    server, nxt = algo.server_round(server, uploads)
    mean = torch.stack([up[name] for up in uploads.values()]).mean(0)
    assert all(torch.allclose(p[name], mean) for p in nxt.values())


def test_dp_noise_reaches_every_expert_mean_scaled_by_its_holders_and_spares_the_embeddings(setup):
    """DP-FedAvg on FedAMoLE (comix/privacy.py): each expert's mean over its holders gets noise of
    std sigma x clip / holders on its sum; the RSEA embeddings are outside the clip (dp_exempt)."""
    from comix.privacy import GaussianSumNoise, clip_upload

    algo, clients, server, payloads = _start(setup, options=dict(assignment="fixed"))
    uploads = {}
    for c, (ctx, state) in enumerate(clients):
        _, up, _ = algo.client_round(ctx, state, payloads[c])
        clipped, norm = clip_upload(up, payloads[c], 1e-4, algo.dp_exempt)
        rsea = [n for n in up if n.startswith("rsea.")]
        assert all(torch.equal(clipped[n], up[n]) for n in rsea)  # exempt: untouched
        rest = math.sqrt(sum(float((clipped[n] - payloads[c].get(n, 0)).pow(2).sum()) for n in clipped if n not in rsea))
        assert rest == pytest.approx(1e-4, rel=1e-3) and norm > 1e-4
        uploads[c] = clipped
    d = server["assignment"][M].clone()
    clean, _ = algo.server_round({k: (dict(v) if isinstance(v, dict) else v) for k, v in server.items()}, uploads)
    std = 3.0
    algo.aggregation_noise = GaussianSumNoise(std, seed=0, rnd=1)
    noisy, _ = algo.server_round(server, uploads)
    for gid in range(algo.cfg.pool):
        name = expert_name(M, gid, "A")
        holders = int(d[:, gid].sum())
        diff = noisy["pool"][name] - clean["pool"][name]
        assert diff.std().item() == pytest.approx(std / holders, rel=0.3)
    shared = f"{M}.shared.lora_A"
    assert (noisy["shared"][shared] - clean["shared"][shared]).std().item() == pytest.approx(std / 3, rel=0.3)


def test_assignment_churn_counts_the_experts_a_client_did_not_train_the_round_before():
    from comix.comparison import assignment_churn

    def listing(*ids, mod="m.q"):
        return [[f"{mod}.experts.{i}.lora_A", [2, 4], "float32"] for i in ids] + [[f"{mod}.shared.lora_A", [2, 4], "float32"]]
    rows = [{"round": 1, "signatures": {"a": listing(1, 2), "b": listing(3, 4)},
             "uploads": {"0": {"sig": "a", "bytes": 1}, "1": {"sig": "b", "bytes": 1}}},
            {"round": 2, "signatures": {"c": listing(1, 5)},  # client 0 keeps 1, gets 5; client 1 keeps both
             "uploads": {"0": {"sig": "c", "bytes": 1}, "1": {"sig": "b", "bytes": 1}}}]
    assert assignment_churn(rows) == [pytest.approx((0.5 + 0.0) / 2)]
