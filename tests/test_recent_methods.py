"""FLoRA, FedALT and FedDPA: each method's defining rule against a hand computation, what leaves and
what stays, which model is scored, and each layer against a re-implementation of its equations."""
import pytest
import torch

from comix.algorithms import ClientState, make_algorithm
from comix.algorithms.flora import STACK, stack
from comix.algorithms.training import expert_lr, load_adapters
from comix.engines.device import fresh_adapters
from comix.models import LoRAConfig, param_role
from comix.models.lora import LoRALinear
from test_algorithms import _client, _train, setup  # noqa: F401 (setup: the shared tiny fixture)


def _algo(name, n=3, rounds=2, **options):
    return make_algorithm(name, LoRAConfig(r=4), _train(rounds=rounds), n, **options)


def _round(algo, clients, payloads):
    uploads = {}
    for c, (ctx, state) in clients.items():
        state, uploads[c], _ = algo.client_round(ctx, state, payloads.get(c, {}))
        clients[c] = (ctx, state)
    return uploads


def test_round_linear_is_a_trainer_per_round_linear_to_zero():
    t = _train(lr=1.0, local_steps=4, schedule="round_linear")
    assert [expert_lr(s, 99, t) for s in range(8)] == [1.0, 0.75, 0.5, 0.25, 1.0, 0.75, 0.5, 0.25]


# -- FLoRA ---------------------------------------------------------------------------------------
def test_flora_s_stacked_product_is_the_mean_of_the_clients_products_at_heterogeneous_ranks(setup):
    model, users = setup
    algo = _algo("flora", ranks=[4, 2, 3])
    clients = {c: _client(algo, model, users, c) for c in range(3)}
    uploads = _round(algo, clients, {})
    assert {c: u[next(iter(u))].shape[0] for c, u in uploads.items()} == {0: 4, 1: 2, 2: 3}
    stacked = stack(uploads)
    for (module, ab), x in stacked.items():
        if ab != "lora_A":
            continue
        b = stacked[(module, "lora_B")]
        assert x.shape[0] == b.shape[1] == 9  # sum of the ranks
        want = sum(uploads[c][f"{module}.lora.lora_B"] @ uploads[c][f"{module}.lora.lora_A"] for c in range(3)) / 3
        assert torch.allclose(b @ x, want, atol=1e-6)
        # FedIT's mean of factors is not the mean of products: the point of stacking
        mean_b = sum(uploads[c][f"{module}.lora.lora_B"][:, :2] for c in range(3)) / 3
        mean_a = sum(uploads[c][f"{module}.lora.lora_A"][:2] for c in range(3)) / 3
        assert not torch.allclose(mean_b @ mean_a, want, atol=1e-6)


def test_flora_merges_each_stack_once_catches_up_a_client_that_missed_rounds_and_scores_the_global_model(setup):
    model, users = setup
    algo = _algo("flora")
    clients = {c: _client(algo, model, users, c) for c in range(3)}
    server, payloads = algo.server_init({})
    stacks = []
    for sampled in ([0, 1, 2], [0, 1]):  # client 2 misses round 2
        uploads = {}
        for c in sampled:
            ctx, state = clients[c]
            state, uploads[c], _ = algo.client_round(ctx, state, payloads[c])
            clients[c] = (ctx, state)
        stacks.append(stack(uploads))
        server, payloads = algo.server_round(server, uploads)
    assert {int(n.split(STACK)[1].split(".")[0]) for n in payloads[2]} == {1, 2}  # everything it has not merged
    assert {int(n.split(STACK)[1].split(".")[0]) for n in payloads[0]} == {2}
    want = {f"{m}.lora_merged": algo.scaling * sum(s[(m, "lora_B")] @ s[(m, "lora_A")] for s in stacks)
            for (m, ab) in stacks[0] if ab == "lora_A"}
    for c in range(3):
        ctx, state = clients[c]
        before = {n: t.clone() for n, t in state.adapters.items()}
        scored = algo.personal_adapters(ctx, state, payloads[c])
        assert all(torch.equal(state.adapters[n], t) for n, t in before.items())  # scoring changes no state
        for n, w in want.items():
            assert torch.allclose(scored[n], w, atol=1e-5), (c, n)
        assert all(not t.any() for n, t in scored.items() if n.endswith(".lora.lora_B"))  # base + merged only
        merged_once = algo.apply_payload(ClientState(adapters=dict(state.adapters), extra=dict(state.extra)),
                                         payloads[c])
        twice = algo.apply_payload(merged_once, payloads[c])  # a payload that arrives again merges nothing
        assert all(torch.equal(twice.adapters[n], scored[n]) for n in want)


def test_flora_trains_a_fresh_lora_each_round_from_b_zero(setup, monkeypatch):
    model, users = setup
    algo = _algo("flora")
    ctx, state = _client(algo, model, users, 0)
    state, up1, _ = algo.client_round(ctx, state, {})
    server, payloads = algo.server_round(algo.server_init({})[0], {0: up1})
    starts = []
    real = algo.local_training
    monkeypatch.setattr(algo, "local_training", lambda ctx, st, gen: starts.append(
        {n: p.detach().clone() for n, p in ctx.model.named_parameters() if param_role(n) == "attention_lora"})
        or real(ctx, st, gen))
    state, up2, _ = algo.client_round(ctx, state, payloads[0])
    start = starts[0]
    assert all(not t.any() for n, t in start.items() if n.endswith("lora_B"))
    assert all(not torch.equal(t, up1[n]) for n, t in start.items() if n.endswith("lora_A"))


def test_flora_layer_equals_peft_s_merge_of_the_stacked_lora():
    """The authors merge the stacked LoRA with PEFT (r = sum r_k, lora_alpha = scaling * r): the
    merged matrix comix keeps equals PEFT's delta weight of that LoRA."""
    from peft import LoraConfig, get_peft_model
    torch.manual_seed(0)
    net = torch.nn.Sequential()
    net.add_module("q_proj", torch.nn.Linear(6, 5, bias=False))
    a, b = torch.randn(7, 6), torch.randn(5, 7)
    peft = get_peft_model(net, LoraConfig(r=7, lora_alpha=2.0 * 7, target_modules=["q_proj"], lora_dropout=0.0))
    peft.base_model.model.q_proj.lora_A["default"].weight.data.copy_(a)
    peft.base_model.model.q_proj.lora_B["default"].weight.data.copy_(b)
    layer = LoRALinear(torch.nn.Linear(6, 5, bias=False), LoRAConfig(r=2, alpha=4.0, rslora=False), merged=True)
    layer.lora_merged.data.copy_(2.0 * b @ a)
    assert torch.allclose(layer.lora_merged, peft.base_model.model.q_proj.get_delta_weight("default"), atol=1e-5)
    x = torch.randn(3, 6)
    want = layer.base(x) + x @ (2.0 * b @ a).t() + layer.lora.delta(x, layer.scaling)
    assert torch.allclose(layer(x), want, atol=1e-5)


# -- FedALT --------------------------------------------------------------------------------------
def test_fedalt_s_rest_of_world_is_the_mean_of_the_others_own_loras_never_the_client_s(setup):
    model, users = setup
    algo = _algo("fedalt", n=3)
    clients = {c: _client(algo, model, users, c) for c in range(3)}
    uploads = _round(algo, clients, {})
    assert all({param_role(n) for n in u} == {"personal_lora"} for u in uploads.values())
    _, payloads = algo.server_round(None, uploads)
    for c in range(3):
        others = [j for j in range(3) if j != c]
        assert set(payloads[c]) == {n.replace(".lora_local.", ".lora.") for n in uploads[c]}
        for n, t in uploads[c].items():
            row = payloads[c][n.replace(".lora_local.", ".lora.")]
            assert torch.allclose(row, sum(uploads[j][n] for j in others) / 2)  # A and B averaged apart
            assert not torch.allclose(row, sum(uploads[j][n] for j in range(3)) / 3)
    _, alone = algo.server_round(None, {1: uploads[1]})
    assert alone[1] == {} and set(alone[0]) == set(payloads[0])  # nobody else replied: keep the old one
    ctx, state = clients[0]
    with pytest.raises(ValueError, match="rest-of-world"):
        algo.apply_payload(state, dict(uploads[0]))  # the client's own LoRA is never overwritten


def test_fedalt_trains_its_own_lora_and_mixer_and_leaves_the_rest_of_world_alone(setup):
    model, users = setup
    algo = _algo("fedalt")
    clients = {c: _client(algo, model, users, c) for c in range(3)}
    _, payloads = algo.server_round(None, _round(algo, clients, {}))
    ctx, state = clients[0]
    algo.apply_payload(state, payloads[0])
    before = {n: t.clone() for n, t in state.adapters.items()}
    state, _, _ = algo.client_round(ctx, state, {})
    moved = {param_role(n) for n, t in state.adapters.items() if not torch.equal(t, before[n])}
    assert moved == {"personal_lora", "mixer"}
    assert all(p.grad is None or not p.requires_grad for n, p in ctx.model.named_parameters()
               if param_role(n) == "attention_lora")
    assert all(torch.equal(state.adapters[n], payloads[0][n]) for n in payloads[0])


def test_fedalt_layer_equals_the_authors_forward():
    """jmbian/FedALT lora.py: y = W x + sum_i softmax(route(x))_i * (alpha / r) B_i A_i x, per token."""
    torch.manual_seed(1)
    layer = LoRALinear(torch.nn.Linear(6, 5), LoRAConfig(r=3, alpha=12.0, rslora=False), personal=True, mixer=True)
    for w in (layer.lora, layer.lora_local):
        torch.nn.init.normal_(w.lora_B)
    x = torch.randn(2, 4, 6)
    gate = torch.softmax(x @ layer.lora_mixer.weight.t(), dim=-1)
    parts = [(x @ w.lora_A.t()) @ w.lora_B.t() * 4.0 for w in (layer.lora, layer.lora_local)]
    want = layer.base(x) + gate[..., 0:1] * parts[0] + gate[..., 1:2] * parts[1]
    assert torch.allclose(layer(x), want, atol=1e-5)
    assert not torch.allclose(layer(x), layer.base(x) + (parts[0] + parts[1]) / 2, atol=1e-4)  # weights per token


def test_recent_methods_run_end_to_end_and_score_each_round(setup, tmp_path):
    from comix.engines import run_method
    model, users = setup
    for name in ("flora", "fedalt"):
        algo = make_algorithm(name, LoRAConfig(r=4), _train(rounds=2), 3)
        results = run_method(algo, model, users, tmp_path / name, seed=3)
        assert set(results["per_user"]) == {u.name for u in users}
        assert all(v["test_ppl"] > 1 for v in results["per_user"].values())


# -- FedDPA --------------------------------------------------------------------------------------
def _roles_moved(before, after):
    return {param_role(n) for n, t in after.items() if not torch.equal(t, before[n])}


def test_feddpa_t_trains_the_global_lora_alone_first_then_local_beside_the_frozen_global_then_global(setup,
                                                                                                     monkeypatch):
    from comix.algorithms import feddpa
    model, users = setup
    algo = _algo("feddpa-t", local_weight=0.3)  # a != 0.5: the pair's order matters
    ctx, state = _client(algo, model, users, 0)
    seen = []
    real = feddpa.train_step

    def spy(m, *args, **kwargs):
        layer = feddpa.pairs(m)[0]
        seen.append((tuple(round(w, 6) for w in layer.instance_fusion.tolist()), layer.lora.lora_A.requires_grad,
                     layer.lora_local.lora_A.requires_grad))
        return real(m, *args, **kwargs)
    monkeypatch.setattr(feddpa, "train_step", spy)
    before = dict(state.adapters)
    state, up, _ = algo.client_round(ctx, state, {})
    assert _roles_moved(before, state.adapters) - {"fusion"} == {"attention_lora"}  # round 1: the global LoRA alone
    assert all(t.tolist() == [0.5, 0.5] for n, t in state.adapters.items() if param_role(n) == "fusion")  # export's
    assert seen == [((1.0, 0.0), True, False)] * 3 and {param_role(n) for n in up} == {"attention_lora"}
    seen.clear()
    before = dict(state.adapters)
    state, up, _ = algo.client_round(ctx, state, {})
    assert _roles_moved(before, state.adapters) == {"attention_lora", "personal_lora"}
    # local phase at (1 - a, a) = (global, local), then global alone
    assert seen == [((0.7, 0.3), False, True)] * 3 + [((1.0, 0.0), True, False)] * 3
    assert {param_role(n) for n in up} == {"attention_lora"}  # the local LoRA never leaves
    assert all(p.grad is None or not p.grad.any() for n, p in ctx.model.named_parameters() if param_role(n) == "base")


def test_feddpa_f_trains_like_fedit_and_fine_tunes_the_local_lora_from_the_global_one_at_the_end(setup):
    model, users = setup
    algo = _algo("feddpa-f")
    ctx, state = _client(algo, model, users, 0)
    for _ in range(2):
        before = dict(state.adapters)
        state, _, _ = algo.client_round(ctx, state, {})
        assert _roles_moved(before, state.adapters) - {"fusion"} == {"attention_lora"}
    from comix.algorithms.feddpa import DynamicWeighting
    assert not isinstance(algo.scoring(ctx, state), DynamicWeighting)  # the global LoRA alone is scored
    final = {n: t + 0.01 for n, t in state.adapters.items() if param_role(n) == "attention_lora"}
    state = algo.client_finish(ctx, state, final)
    assert all(torch.equal(state.adapters[n], t) for n, t in final.items())  # the final global kept
    local = {n.replace(".lora.", ".lora_local."): t for n, t in final.items()}
    moved = [n for n, t in local.items() if not torch.equal(state.adapters[n], t)]
    assert moved and isinstance(algo.scoring(ctx, state), DynamicWeighting)
    # it started from the global LoRA: B moved a little from the global B, not from zero
    b = next(n for n in local if n.endswith("lora_B"))
    assert (state.adapters[b] - local[b]).abs().max() < local[b].abs().max()


def test_feddpa_s_dynamic_weights_are_the_authors_mean_cosine_and_causal(setup):
    """Global weight w * mean_j cos(e_t, ref_j) with e_t the local-adapter-only last hidden state
    (GlobalModel_generated.py get_weight); a position's weight and output never depend on later tokens."""
    from comix.algorithms.feddpa import DynamicWeighting, last_hidden, pairs
    model, users = setup
    algo = _algo("feddpa-t")
    ctx, state = _client(algo, model, users, 0)
    for n in state.adapters:  # both adapters non-zero so that the weights matter
        state.adapters[n] = torch.randn_like(state.adapters[n]) * 0.2 if n.endswith("lora_B") else state.adapters[n]
    load_adapters(ctx.model, state.adapters)
    ctx.model.eval()
    refs = torch.randn(6, ctx.model.config.hidden_size)
    x = users[0].test[:24].long().view(2, 12)
    weighting = DynamicWeighting(ctx.model, refs, instances=6, w=0.5, seed=0)  # all 6: no draw to reproduce
    with weighting, torch.no_grad():
        logits = ctx.model(input_ids=x).logits
        fusion = pairs(ctx.model)[0].instance_fusion.clone()
    e = last_hidden(ctx.model, x)
    want = 0.5 * torch.nn.functional.cosine_similarity(e[:, :, None], refs[None, None], dim=-1).mean(-1)
    assert torch.allclose(fusion[..., 0], want, atol=1e-5) and torch.allclose(fusion[..., 1], 1 - want, atol=1e-5)
    layer = pairs(ctx.model)[0]
    h = torch.randn(2, 12, layer.lora.lora_A.shape[1])
    layer.instance_fusion = fusion
    by_hand = layer.base(h) + fusion[..., :1] * layer.lora.delta(h, layer.scaling) + \
        fusion[..., 1:] * layer.lora_local.delta(h, layer.scaling)
    assert torch.allclose(layer(h), by_hand, atol=1e-5)
    layer.instance_fusion = None
    y = x.clone()
    y[:, 8:] = (y[:, 8:] + 1) % ctx.model.config.vocab_size  # change only the future of position 7
    with DynamicWeighting(ctx.model, refs, instances=6, w=0.5, seed=0), torch.no_grad():
        changed = ctx.model(input_ids=y).logits
    assert torch.allclose(changed[:, :8], logits[:, :8], atol=1e-5)
    assert all(m.instance_fusion is None for m in pairs(ctx.model))  # nothing left set after scoring


def test_feddpa_s_instance_embedding_is_computed_with_the_local_adapter_alone(setup):
    """get_weight embeds the instance with the local adapter (the global one switched off)."""
    from comix.algorithms.feddpa import last_hidden
    model, users = setup
    algo = _algo("feddpa-t")
    ctx, state = _client(algo, model, users, 0)
    x = users[0].test[:12].long().view(1, 12)

    def embedding(role, scale):
        adapters = {n: (torch.randn_like(t) * scale if param_role(n) == role and n.endswith("lora_B") else t)
                    for n, t in state.adapters.items()}
        load_adapters(ctx.model, adapters)
        return last_hidden(ctx.model, x)
    torch.manual_seed(0)
    plain = embedding("personal_lora", 0.0)
    assert torch.equal(embedding("attention_lora", 0.5), plain)  # the global LoRA plays no part
    assert not torch.allclose(embedding("personal_lora", 0.5), plain, atol=1e-4)  # the local one does


def test_feddpa_generates_with_the_prompt_s_last_token_weight_at_every_position(setup):
    """GlobalModel_generated.py computes one weight an instance (its prompt's last token) before
    ``generate``: every position of a cached generation, the prompt's included, uses it."""
    from comix.algorithms.feddpa import DynamicWeighting, pairs, set_mixing
    model, users = setup
    algo = _algo("feddpa-t")
    ctx, state = _client(algo, model, users, 0)
    for n in state.adapters:
        state.adapters[n] = torch.randn_like(state.adapters[n]) * 0.3 if n.endswith("lora_B") else state.adapters[n]
    load_adapters(ctx.model, state.adapters)
    ctx.model.eval()
    refs = torch.randn(6, ctx.model.config.hidden_size)
    x = users[0].test[:20].long().view(2, 10)
    with DynamicWeighting(ctx.model, refs, instances=6, w=0.5, seed=0), torch.no_grad():
        ctx.model(input_ids=x)
        causal = pairs(ctx.model)[0].instance_fusion.clone()
        out = ctx.model.generate(input_ids=x, attention_mask=torch.ones_like(x), max_new_tokens=2, do_sample=False,
                                 output_logits=True, return_dict_in_generate=True, pad_token_id=0)
    assert not torch.allclose(causal[:, :1], causal[:, -1:], atol=1e-4)  # the weights do vary by position
    last = causal[:, -1]
    for step, logits in enumerate(out.logits):  # each step against a full forward at the one weight
        seq = out.sequences[:, :x.shape[1] + step]
        set_mixing(ctx.model, last[:, None, :].expand(seq.shape[0], seq.shape[1], 2))
        with torch.no_grad():
            want = ctx.model(input_ids=seq).logits[:, -1]
        set_mixing(ctx.model, None)
        assert torch.allclose(logits, want, atol=1e-4), step
    with torch.no_grad():  # the causal weights would give another prefill
        set_mixing(ctx.model, causal)
        other = ctx.model(input_ids=x).logits[:, -1]
        set_mixing(ctx.model, None)
    assert not torch.allclose(out.logits[0], other, atol=1e-4)


# -- FedLEASE ------------------------------------------------------------------------------------
def _authors_lease_forward(layer, x, m, own):
    """lei-wang-link/FedLEASE peft/tuners/lora.py (adaptive=True), transcribed: softmax over 2M - 1
    logits, top-M renormalised, logits M.. mapped to the own expert, a masked sum per pick."""
    rows = list(range(m)) + list(range(layer.slots, layer.slots + m - 1))
    route = torch.softmax(x @ layer.lease_router.weight[rows].t(), dim=-1)
    top_w, top_i = torch.topk(route, m, dim=-1)
    top_w = top_w / top_w.sum(-1, keepdim=True)
    mapping = torch.arange(route.shape[-1])
    mapping[m:] = own
    result = layer.base(x)
    for k in range(m):
        experts = mapping[top_i[:, :, k]]
        w = top_w[:, :, k].unsqueeze(-1)
        for i in range(m):
            mask = experts == i
            if mask.any():
                e = layer.lease_experts[i]
                masked = torch.zeros_like(w)
                masked[mask] = w[mask]
                result = result + masked * ((x @ e.lora_A.t()) @ e.lora_B.t()) * layer.scaling
    return result


def test_fedlease_layer_equals_the_authors_adaptive_top_m_and_always_picks_the_own_expert():
    from comix.models.lease import LeaseConfig, LeaseLinear
    torch.manual_seed(2)
    layer = LeaseLinear(torch.nn.Linear(6, 5), LeaseConfig(r=2, alpha=8.0, slots=4)).eval()
    for e in layer.lease_experts:
        torch.nn.init.normal_(e.lora_B)
    x = torch.randn(2, 7, 6)
    assert torch.allclose(layer(x), layer.base(x) + (x @ layer.lease_experts[0].lora_A.t())
                          @ layer.lease_experts[0].lora_B.t() * 4.0, atol=1e-5)  # warm-up: one plain LoRA
    for m, own in ((3, 1), (4, 3), (2, 0)):
        layer.lease_state.data = torch.tensor([float(m), float(own)])
        assert torch.allclose(layer(x), _authors_lease_forward(layer, x, m, own), atol=1e-5), (m, own)
        w = layer.expert_weights(x)
        assert w.shape[-1] == m and (w[..., own] > 0).all() and torch.allclose(w.sum(-1), torch.ones(2, 7))


def test_fedlease_clusters_clients_by_their_b_matrices_and_picks_the_count_by_silhouette():
    from comix.algorithms.fedlease import client_distances, cluster_clients
    torch.manual_seed(0)
    dirs = [torch.randn(4, 2) for _ in range(3)]
    groups = [0, 0, 1, 1, 2, 2, 2]
    names = [f"m.layers.{i}.self_attn.{p}.lease_experts.0.lora_B" for i in range(2) for p in ("q_proj", "v_proj")]
    uploads = {c: {n: dirs[g] + 0.05 * torch.randn(4, 2) for n in names} for c, g in enumerate(groups)}
    d = client_distances(uploads, list(range(7)))
    by_hand = sum(1 - torch.nn.functional.cosine_similarity(uploads[0][n].flatten(), uploads[3][n].flatten(), dim=0)
                  for n in names) / len(names)
    assert d[0, 3] == pytest.approx(float(by_hand), abs=1e-5) and d[0, 0] == 0 and d[3, 0] == d[0, 3]
    labels = cluster_clients(d, max_clusters=4)
    assert len(set(labels)) == 3  # three groups, not 2 or 4
    assert all((labels[a] == labels[b]) == (groups[a] == groups[b]) for a in range(7) for b in range(7))
    assert len(set(cluster_clients(d, max_clusters=2))) == 2  # never more than allowed


def test_fedlease_uploads_nothing_in_warm_up_b_at_its_end_then_own_expert_and_router_averaged_per_cluster(setup):
    model, users = setup
    algo = _algo("fedlease", n=3, rounds=4, warmup=2, max_clusters=2)
    clients = {c: _client(algo, model, users, c) for c in range(3)}
    server, payloads = algo.server_init({})
    reference = {c: algo.upload_of(clients[c][1].adapters) for c in range(3)}
    uploads = {}
    for rnd in (1, 2, 3):
        uploads = {}
        for c, (ctx, state) in clients.items():
            state, uploads[c], _ = algo.client_round(ctx, state, payloads[c])
            clients[c] = (ctx, state)
            expected = algo.expected_upload(server, c, reference[c])
            assert set(uploads[c]) == set(expected) and algo.check_upload(uploads[c], expected) is None
        if rnd == 1:
            assert all(u == {} for u in uploads.values())
        if rnd == 2:
            assert all(n.endswith("lease_experts.0.lora_B") for u in uploads.values() for n in u) and uploads[0]
            warmed = {c: dict(clients[c][1].adapters) for c in range(3)}
        if rnd == 3:
            groups = server["groups"]
            for c, u in uploads.items():
                assert {param_role(n) for n in u} == {"lease_expert", "lease_router"}
                assert {int(n.split(".lease_experts.")[1][0]) for n in u if "lease_experts" in n} == {groups[c]}
        server, payloads = algo.server_round(server, uploads)
        if rnd == 2:  # the scored model after the warm-up is each client's own LoRA
            for c, (ctx, state) in clients.items():
                scored = algo.personal_adapters(ctx, state, payloads[c])
                assert all(torch.equal(scored[n], t) for n, t in warmed[c].items())
    groups = server["groups"]
    assert sorted(set(groups)) == [0, 1]
    for c in range(3):
        for n, t in payloads[c].items():
            if "lease_experts" in n:
                g = int(n.split(".lease_experts.")[1][0])
                members = [j for j in range(3) if groups[j] == g]
                assert torch.allclose(t, sum(uploads[j][n] for j in members) / len(members))
            elif param_role(n) == "lease_router":
                members = [j for j in range(3) if groups[j] == groups[c]]
                assert torch.allclose(t, sum(uploads[j][n] for j in members) / len(members))
        assert {int(n.split(".lease_experts.")[1][0]) for n in payloads[c] if "lease_experts" in n} == {0, 1}
        # scored after a clustered round: the cluster means and the cluster's router it receives
        # (main.py evaluates after client.load_params(aggregated_params[client_id])), not what it trained
        ctx, state = clients[c]
        scored = algo.personal_adapters(ctx, state, payloads[c])
        sent = {n: t for n, t in payloads[c].items() if n != "lease.plan"}
        assert sent and all(torch.equal(scored[n], t) for n, t in sent.items())
        assert any(not torch.equal(scored[n], state.adapters[n]) for n in sent)


def test_fedlease_moves_the_warmed_lora_to_its_cluster_s_slot_and_trains_only_its_expert_and_router(setup):
    model, users = setup
    algo = _algo("fedlease", n=3, warmup=1, max_clusters=2)
    clients = {c: _client(algo, model, users, c) for c in range(3)}
    server, payloads = algo.server_init({})
    server, payloads = algo.server_round(server, _round(algo, clients, payloads))  # round 1 ends the warm-up
    c = 0
    ctx, state = clients[c]
    g = server["groups"][c]
    warm = {n: t.clone() for n, t in state.adapters.items() if ".lease_experts.0." in n}
    assert any(t.any() for n, t in warm.items() if n.endswith("lora_B"))
    seen = {}
    real = algo.local_training
    algo.local_training = lambda ctx, st, gen: seen.update({n: t.clone() for n, t in st.adapters.items()}) or \
        real(ctx, st, gen)
    state, up, _ = algo.client_round(ctx, state, payloads[c])
    for n, t in warm.items():  # the warmed LoRA sits in slot g when training starts; slot 0 starts afresh
        assert torch.equal(seen[n.replace(".lease_experts.0.", f".lease_experts.{g}.")], t)
    moved = {n for n, t in state.adapters.items() if not torch.equal(t, seen[n])}
    assert moved and all(param_role(n) == "lease_router" or f".lease_experts.{g}." in n for n in moved)
    assert all(t.tolist() == [2.0, float(g)] for n, t in state.adapters.items() if param_role(n) == "lease_state")


def test_a_client_s_dropout_does_not_depend_on_the_clients_before_it(setup, tmp_path):
    """Dropout masks come from torch's global generator, seeded per client round by the device:
    client 1 trains the same alone as after client 0, as it does in its own Flower process."""
    from comix.engines.device import Device
    from comix.engines.inprocess import ClientModels
    model, users = setup
    algo = _algo("fedit")  # dropout 0.05 (FedAMoLE Sec. V-A-4)
    models = ClientModels(model, algo)
    uploads = []
    for order, process_seed in (([1], 123), ([0, 1], 456)):  # a process whose generator is elsewhere
        torch.manual_seed(process_seed)
        store = {}
        devices = {c: Device(algo, models.for_client(c), users[c], c, 7, store) for c in order}
        for c in order:
            devices[c].init()
            up, _ = devices[c].train({})
        uploads.append(up)
    assert all(torch.equal(uploads[0][n], uploads[1][n]) for n in uploads[0])


@pytest.mark.parametrize("method", ["fedalt", "flora", "fedlease"])
def test_fresh_adapters_draw_every_tensor_of_the_new_layers_from_the_seed(setup, method):
    """A client's initial state depends on the seed alone (not on what the shared model held or
    on torch's global generator), so every engine starts every client alike."""
    from comix.engines.device import fresh_adapters
    from comix.engines.inprocess import ClientModels
    model, _ = setup
    algo = _algo(method, rounds=3, **({"warmup": 1} if method == "fedlease" else {}))
    m = ClientModels(model, algo).for_client(0)
    first = fresh_adapters(m, 3)
    with torch.no_grad():
        for p in m.parameters():
            if p.dtype.is_floating_point and param_role(next(n for n, q in m.named_parameters() if q is p)) != "base":
                p.add_(torch.randn_like(p))
    torch.manual_seed(99)
    again = fresh_adapters(m, 3)
    assert all(torch.equal(first[n], again[n]) for n in first)


def test_the_recent_methods_train_loras_of_fedit_s_size_as_their_authors_compare_them(setup):
    """Each paper compares at FedIT's LoRA (q_proj and v_proj, the same rank): FLoRA's client LoRA
    is FedIT's (FLoRA Sec. 5, homogeneous ranks); FedDPA's global and local adapters are each
    FedIT's (FedDPA Sec. 4); FedALT's own LoRA and its frozen rest-of-world are each FedIT's, its
    mixer the only addition (FedALT Sec. 4); a FedLEASE client trains its cluster's expert, FedIT's
    LoRA at the experts' rank, and its router."""
    from comix.engines.inprocess import ClientModels
    model, _ = setup

    def sizes(algo, c=0):
        """{(role, trained by the local optimiser): parameters} of client c's model."""
        m = ClientModels(model, algo).for_client(c)
        fresh_adapters(m, 0)
        trained = {n for n, _ in algo.train_params(m)}
        out = {}
        for n, p in m.named_parameters():
            if param_role(n) != "base":
                key = (param_role(n), n in trained)
                out[key] = out.get(key, 0) + p.numel()
        return out
    lora = sizes(_algo("fedit"))[("attention_lora", True)]
    assert sizes(_algo("fedit")) == {("attention_lora", True): lora} and lora > 0
    flora = sizes(_algo("flora"))
    assert {k: v for k, v in flora.items() if k[1]} == {("attention_lora", True): lora}  # the merged update: frozen
    dpa = sizes(_algo("feddpa-t"))
    assert dpa[("attention_lora", True)] == dpa[("personal_lora", True)] == lora
    alt = sizes(_algo("fedalt"))
    assert alt[("personal_lora", True)] == lora and alt[("attention_lora", False)] == lora  # own trains, RoW frozen
    assert {k for k in alt if k[1]} == {("personal_lora", True), ("mixer", True)}
    for r in (4, 8):
        lease = sizes(_algo("fedlease", rounds=3, warmup=1, r=r))
        fedit_r = sizes(make_algorithm("fedit", LoRAConfig(r=r), _train(), 3))[("attention_lora", True)]
        assert lease[("lease_expert", True)] == fedit_r and ("lease_router", True) in lease


def test_fedalt_under_dp_releases_one_noised_sum_and_each_rest_of_world_is_it_minus_the_own_upload(setup):
    """Client-level DP for FedALT: one Gaussian noise a round on the sum of the uploads (the one
    release the accountant counts), each client's rest-of-world that noised sum minus its own
    upload over the others' count; a per-client noise (n releases) or a noise-free payload fails."""
    from comix.privacy import GaussianSumNoise, clip_upload
    model, users = setup
    algo = _algo("fedalt", n=3)
    clients = {c: _client(algo, model, users, c) for c in range(3)}
    uploads = _round(algo, clients, {})
    # on the device the whole upload is clipped (no payload tensor shares its names): the sum's sensitivity
    clipped, norm = clip_upload(uploads[0], {}, 1e-3)
    assert norm > 1e-3 and sum(float(t.pow(2).sum()) for t in clipped.values()) ** 0.5 == pytest.approx(1e-3, rel=1e-4)
    calls = []

    def noise(t):
        calls.append(t.shape)
        return GaussianSumNoise(0.5, seed=3, rnd=1)(t)
    algo.aggregation_noise = noise
    _, noisy = algo.server_round(None, uploads)
    names = sorted(uploads[0])
    assert len(calls) == len(names)  # one draw per tensor of the sum, not one per client
    released = {c: {n: noisy[c][n.replace(".lora_local.", ".lora.")] * 2 + uploads[c][n] for n in names} for c in range(3)}
    plain = {n: sum(uploads[c][n] for c in range(3)) for n in names}
    for n in names:
        assert torch.allclose(released[0][n], released[1][n], atol=1e-5) and torch.allclose(released[1][n], released[2][n], atol=1e-5)
        assert (released[0][n] - plain[n]).std() == pytest.approx(0.5, rel=0.2)
    algo.aggregation_noise = None
    _, clean = algo.server_round(None, uploads)
    for n in names:  # without noise: exactly the others' mean
        row = n.replace(".lora_local.", ".lora.")
        assert torch.allclose(clean[0][row], (uploads[1][n] + uploads[2][n]) / 2, atol=1e-6)
