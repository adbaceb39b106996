import json

import pytest
import torch

from comix.algorithms import METHODS, ClientContext, ClientState, TrainConfig, make_algorithm, tensor_bytes
from comix.algorithms import base as base_module
from comix.algorithms.training import adapter_tensors, expert_params, load_adapters, router_params
from comix.data import SplitConfig, make_user_data
from comix.engines import run_method
from comix.engines.device import fresh_adapters
from comix.engines.inprocess import ClientModels
from comix.engines.server import TIMINGS
from comix.models import LoRAConfig, load_base_model, param_role


@pytest.fixture(scope="module")
def setup():
    model, tok = load_base_model("tiny-llama")
    corpus = {c: [f"{c} text {i} " * 30 + "x" * (i % 7) for i in range(20)] for c in ("a", "b", "c")}
    users = make_user_data(corpus, tok, SplitConfig(valid_tokens=600, test_tokens=300))
    return model, users


def _train(**kw):
    base = dict(rounds=2, local_steps=3, batch_size=2, seq_len=16, tau=2, router_steps=2, eval_every=1,
                eval_batch_size=4)
    base.update(kw)
    return TrainConfig(**base)


# a pool that 3 clients can share: E * k_c = 6 * 2 = 12 in [N * k_e, N * b] = [6, 12]
FEDAMOLE_SMALL = dict(pool=6, slots=4)


def _algo(name, n=3, experts=None, options=None, **train):
    opts = dict(options or {})
    if experts is not None and name.startswith("comigs"):
        opts["experts"] = experts
    if name.startswith("fedamole") or name == "fedmole":
        opts = {**FEDAMOLE_SMALL, **opts}
    return make_algorithm(name, LoRAConfig(r=4), _train(**train), n, **opts)


def _client(algo, model, users, c, seed=0):
    models = ClientModels(model, algo)
    m = models.for_client(c)
    state = ClientState(adapters=algo.adapters_of(fresh_adapters(m, seed + c)),
                        rng=torch.Generator().manual_seed(c).get_state())
    return ClientContext(c, m, users[c], algo.train), state


LORA = {"mlp_lora", "attention_lora"}
MIXTURE_1G = {"generalist", "attention_lora"}
EXPECTED_SHARED = {
    "local": set(), "comigs-2s": set(), "local-moe": set(), "local-moe-tr": set(),
    "comigs-1g1s": MIXTURE_1G, "comigs-1g1s-tr": MIXTURE_1G, "comigs-tr": MIXTURE_1G, "comigs-1gxs": MIXTURE_1G,
    "pfedmoe": MIXTURE_1G,
    # 2G: both experts are averaged (expert 1 carries the "specialist" slot name but is shared)
    "comigs-2g": {"generalist", "specialist", "attention_lora"},
    # FedAvg applied to a MoE: every expert; the routers stay (the authors' "experts" strategy)
    "fedavg-moe": {"generalist", "specialist", "attention_lora"},
    "fedavg-moe-tr": {"generalist", "specialist", "attention_lora"},
    "fedavg": LORA, "fedit": {"attention_lora"}, "fedit-ft": {"attention_lora"}, "pcl": LORA, "hetlora": LORA, "flexlora": LORA, "ffa-lora": LORA, "fedsa-lora": LORA,
    "fdlora-comigs": LORA,  # the global LoRA only: never the personal one or the fusion weights
    "fdlora-fedamole": {"attention_lora"},  # the shared adapter only: never the private (lagging) one
    # shared expert + token projection, the assigned domain experts and RSEA's embeddings
    "fedamole": {"amole_shared", "amole_router", "domain_expert", "embedding"},
    "fedamole-h": {"amole_shared", "amole_router", "domain_expert", "embedding"},
    "fedamole-vanilla": {"amole_shared", "amole_router", "domain_expert", "embedding"},  # mean router logits
    "fedamole-random": {"amole_shared", "amole_router", "domain_expert"},
    "fedamole-vanilla-random": {"amole_shared", "amole_router", "domain_expert"},
    "fedamole-r": {"amole_shared", "amole_router", "domain_expert"},
    "fedmole": {"amole_shared", "amole_router", "domain_expert"},
    "fedamole-a": {"amole_shared", "amole_router", "domain_expert", "embedding"},  # = fedamole-vanilla
    "fedamole-s": {"amole_router", "domain_expert", "embedding"},
    "flora": {"attention_lora"},  # this round's fresh LoRA; never the merged update it holds
    "feddpa-t": {"attention_lora"}, "feddpa-f": {"attention_lora"},  # the global LoRA; never the local one
    "fedlease": {"lease_expert"},  # at the warm-up's end: B of its LoRA (what the clustering reads), nothing else
    # its own LoRA (the others' mean of it comes back as their rest-of-world); never the rest-of-world
    # LoRA it was sent or its mixer
    "fedalt": {"personal_lora"},
    # the soft prompt only (PEFT's prompt encoder); never a base weight
    "fedprompt": {"prompt"}, "fedprompt-ft": {"prompt"}, "fedptuning": {"prompt"}, "fedptuning-ft": {"prompt"},
}
NAME_RULE = {"ffa-lora": lambda n: n.endswith("lora_B"), "fedsa-lora": lambda n: n.endswith("lora_A")}


# DeepFusion and its baselines send whole device models: tests/test_deepfusion.py asserts what each
# device sends (its own model and data embedding; FedJETS: its compact MoE's weights)
ONE_SHOT = ("deepfusion", "deepfusion-ce", "fedkmt", "ofa-kd", "central-moe", "fedjets")


def test_an_upload_unlike_its_declaration_is_rejected_with_the_reason():
    algo = _algo("fedavg")
    ref = {"a.lora_A": torch.zeros(4, 8), "a.lora_B": torch.zeros(8, 4)}
    good = {n: torch.ones_like(t) for n, t in ref.items()}
    assert algo.check_upload(good, ref) is None
    bad = {"NaN or inf": {**good, "a.lora_A": torch.full((4, 8), float("inf"))},
           "shape (8, 4)": {**good, "a.lora_A": torch.ones(8, 4)},
           "dtype float64": {**good, "a.lora_B": torch.ones(8, 4, dtype=torch.float64)},
           "dtype bfloat16": {**good, "a.lora_B": torch.ones(8, 4, dtype=torch.bfloat16)},
           "undeclared": {**good, "a.mlp.experts.1.lora_A": torch.ones(4, 8)},
           "missing": {"a.lora_A": good["a.lora_A"]}}
    for reason, upload in bad.items():
        assert reason in algo.check_upload(upload, ref), reason


@pytest.mark.parametrize("method", [m for m in METHODS if m not in ("pretrained", "centralized", *ONE_SHOT)])
def test_upload_contains_exactly_the_declared_shared_tensors(setup, method):
    model, users = setup
    # PCL uploads only in its mixing rounds: make round 1 one of them
    algo = _algo(method, experts=[2, 1, 3] if method == "comigs-1gxs" else None,
                 options=dict(start_round=1) if method == "pcl" else dict(warmup=1) if method == "fedlease" else None)
    clients = [_client(algo, model, users, c) for c in range(3)]
    reference = {c: algo.upload_of(state.adapters) for c, (_, state) in enumerate(clients)}
    server_state, payloads = algo.server_init(reference)  # round 1's payloads, as the server sends them
    for c, (ctx, state) in enumerate(clients):
        state, upload, _ = algo.client_round(ctx, state, payloads[c])
        declared = algo.expected_upload(server_state, c, reference[c])  # FedAMoLE: its assigned experts
        assert set(upload) == set(declared) and algo.check_upload(upload, declared) is None
        assert all(isinstance(t, torch.Tensor) for t in upload.values())
        roles = {param_role(n) for n in upload}
        assert roles == EXPECTED_SHARED[method]
        assert "base" not in roles and not roles & {"fusion", "amole_slots", "mixer", "merged"}
        assert "personal_lora" not in roles or method == "fedalt"
        assert "router" not in roles
        assert all(NAME_RULE.get(method, lambda n: True)(n) for n in upload)
        if method == "comigs-2g":
            assert {n.split(".mlp.experts.")[1][0] for n in upload if ".experts." in n} == {"0", "1"}
        if "amole" in method or method == "fedmole":  # exactly the experts the server assigned, no other
            sent = {n for n in payloads[c] if param_role(n) == "domain_expert"}
            assert {n for n in upload if param_role(n) == "domain_expert"} == sent


def _router_client(setup, monkeypatch, method, client):
    """A client of ``method`` ready for a router step, and the list of splits its batches come from."""
    model, users = setup
    algo = _algo(method, tau=1)
    ctx, state = _client(algo, model, users, client)
    load_adapters(ctx.model, state.adapters)
    seen = []
    real = base_module.sample_batch  # the interleaved router steps are the base's (Algorithm.after_expert_step)
    monkeypatch.setattr(base_module, "sample_batch", lambda split, *a: seen.append(split) or real(split, *a))
    state.step = 1
    return algo, ctx, state, seen


def test_router_step_touches_only_the_router_and_reads_validation(setup, monkeypatch):
    users = setup[1]
    algo, ctx, state, seen = _router_client(setup, monkeypatch, "comigs-1g1s", 0)
    before = {n: p.detach().clone() for n, p in expert_params(ctx.model)}
    routers = {n: p.detach().clone() for n, p in router_params(ctx.model)}
    algo.after_expert_step(ctx, state, torch.Generator().manual_seed(0))
    assert len(seen) == algo.train.router_steps and all(s is users[0].valid for s in seen)
    assert all(torch.equal(p, before[n]) for n, p in expert_params(ctx.model))       # experts unchanged
    assert any(not torch.equal(p, routers[n]) for n, p in router_params(ctx.model))  # router moved
    assert all(p.grad is None for p in ctx.model.parameters())  # nothing left to leak or accumulate
    assert "router" in state.optimizers and "experts" not in state.optimizers


def test_router_step_minimises_validation_loss_plus_load_balance(setup):
    """Eq. 8: the router's loss carries lambda * load balance. With 4 experts and top-2 the
    balance term has a gradient (at n = 2 it is constant), so lambda changes the router step."""
    model, users = setup
    routers = []
    for lb_weight in (0.0, 10.0):
        algo = _algo("comigs-1gxs", experts=[4, 4, 4], tau=1, router_steps=1, lb_weight=lb_weight)
        ctx, state = _client(algo, model, users, 0)
        load_adapters(ctx.model, state.adapters)
        state.step = 1
        algo.after_expert_step(ctx, state, torch.Generator().manual_seed(0))
        routers.append({n: p.detach().clone() for n, p in router_params(ctx.model)})
    assert any(not torch.allclose(routers[0][n], routers[1][n]) for n in routers[0])


@pytest.mark.parametrize("method", ["comigs-1g1s", "local", "fdlora-comigs", "pfedmoe"])
def test_expert_steps_sample_training_batches_only(setup, monkeypatch, method):
    """Validation data reaches only router steps (Alg. 1): every batch of a round without router
    updates comes from the training split."""
    from comix.algorithms import base as base_module, fdlora as fdlora_module, pcl as pcl_module
    model, users = setup
    seen = []
    for module in (base_module, fdlora_module, pcl_module):
        real = module.sample_batch
        monkeypatch.setattr(module, "sample_batch", lambda split, *a, _r=real: seen.append(split) or _r(split, *a))
    algo = _algo(method, tau=1000)
    ctx, state = _client(algo, model, users, 1)
    algo.client_round(ctx, state, {})
    assert len(seen) == algo.train.local_steps and all(s is users[1].train for s in seen)


def test_tr_variant_routes_on_training_batches(setup, monkeypatch):
    users = setup[1]
    algo, ctx, state, seen = _router_client(setup, monkeypatch, "comigs-1g1s-tr", 1)
    algo.after_expert_step(ctx, state, torch.Generator())
    assert seen and all(s is users[1].train for s in seen)


def test_expert_steps_leave_the_router_alone(setup):
    model, users = setup
    algo = _algo("comigs-1g1s", tau=1000)  # no router update in this round
    ctx, state = _client(algo, model, users, 0)
    routers = {n: t.clone() for n, t in state.adapters.items() if param_role(n) == "router"}
    state, _, _ = algo.client_round(ctx, state, {})
    assert all(torch.equal(state.adapters[n], t) for n, t in routers.items())
    gen = [n for n in state.adapters if param_role(n) == "specialist"]
    assert gen and all(p.grad is None for p in ctx.model.parameters())


def test_optimizer_state_is_per_client(setup):
    model, users = setup
    algo = _algo("fedavg")
    ctx0, s0 = _client(algo, model, users, 0)
    s0, _, _ = algo.client_round(ctx0, s0, {})
    snap = {k: v.clone() for k, v in s0.optimizers["experts"]["state"][0].items()}
    ctx1, s1 = _client(algo, model, users, 1)
    s1, _, _ = algo.client_round(ctx1, s1, {})
    assert all(torch.equal(s0.optimizers["experts"]["state"][0][k], v) for k, v in snap.items())
    assert not torch.equal(s0.optimizers["experts"]["state"][0]["exp_avg"],
                           s1.optimizers["experts"]["state"][0]["exp_avg"])
    assert s1.optimizers["experts"]["state"][0]["step"].item() == algo.train.local_steps  # fresh moments


def test_server_averages_generalists_and_never_sees_specialists(setup):
    model, users = setup
    algo = _algo("comigs-1gxs", experts=[2, 1, 4])
    uploads, states = {}, {}
    for c in range(3):
        ctx, st = _client(algo, model, users, c)
        states[c], uploads[c], _ = algo.client_round(ctx, st, {})
    _, payloads = algo.server_round(None, uploads)
    name = next(n for n in uploads[0] if param_role(n) == "generalist")
    expect = torch.stack([uploads[c][name] for c in range(3)]).mean(0)
    for c in range(3):
        assert torch.allclose(payloads[c][name], expect)
        assert all(param_role(n) in ("generalist", "attention_lora") for n in payloads[c])
    assert not any(param_role(n) == "router" for n in states[1].adapters)  # n = 1: no router
    assert sum(param_role(n) == "specialist" for n in states[2].adapters) > 0
    spec = next(n for n in states[0].adapters if param_role(n) == "specialist")
    algo.apply_payload(states[0], payloads[0])
    assert torch.equal(states[0].adapters[name], expect)
    with pytest.raises(ValueError, match="not a shared parameter"):
        algo.apply_payload(states[0], {spec: states[0].adapters[spec]})


def _tiny_run(tmp_path, method, users, model, rounds=3, **kw):
    algo = _algo(method, rounds=rounds, **kw)
    return run_method(algo, model, users, tmp_path / method, seed=7, resume=True)


def test_resume_equals_uninterrupted(setup, tmp_path):
    model, users = setup
    full = _tiny_run(tmp_path / "full", "comigs-1g1s", users, model)

    class Killed(Exception):
        pass

    def kill_after_two(p):
        if p["round"] == 2:
            raise Killed

    algo = _algo("comigs-1g1s", rounds=3)
    with pytest.raises(Killed):
        run_method(algo, model, users, tmp_path / "killed", seed=7, progress=kill_after_two)
    with open(tmp_path / "killed" / "metrics.jsonl", "a") as fh:  # a partial line from round 3
        fh.write(json.dumps({"round": 3, "user": "a"}) + "\n")
    resumed = run_method(_algo("comigs-1g1s", rounds=3), model, users, tmp_path / "killed", seed=7, resume=True)
    assert resumed["per_user"] == full["per_user"]
    def rows(d, name):  # every number but the wall-clock timings
        return [{k: v for k, v in json.loads(ln).items() if k not in TIMINGS} for ln in (d / name).read_text().splitlines()]
    for name in ("metrics.jsonl", "server.jsonl"):
        assert rows(tmp_path / "killed", name) == rows(tmp_path / "full" / "comigs-1g1s", name)
    assert [r["round"] for r in rows(tmp_path / "killed", "server.jsonl")] == [1, 2, 3]


def _role_count(model, *roles):
    return sum(p.numel() for n, p in model.named_parameters() if param_role(n) in roles)


def test_comigs_upload_ratio_to_fedavg(setup, tmp_path):
    """CoMiGS-1G1S uploads the attention LoRA and one rank-r expert per MLP; parameter-matched
    FedAvg uploads the attention LoRA and 2 rank-r modules per MLP (paper Sec. 4.5, Table 3)."""
    model, users = setup
    bytes_of = {}
    for m in ("comigs-1g1s", "fedavg"):
        _tiny_run(tmp_path, m, users, model, rounds=1)
        rows = [json.loads(x) for x in (tmp_path / m / "metrics.jsonl").read_text().splitlines()]
        bytes_of[m] = rows[0]["bytes_up"]
        assert all(r["bytes_up"] > 0 and r["bytes_down"] == r["bytes_up"] for r in rows)
    mix = ClientModels(model, _algo("comigs-1g1s")).for_client(0)
    attention, generalist = _role_count(mix, "attention_lora"), _role_count(mix, "generalist")
    expected = (attention + generalist) / (attention + 2 * generalist)  # 0.64 on tiny-llama, r = 4
    assert bytes_of["comigs-1g1s"] / bytes_of["fedavg"] == pytest.approx(expected, rel=1e-9)


TWO_X = ("local", "fedavg", "ffa-lora", "fedsa-lora", "pcl", "fdlora-comigs", "hetlora", "flexlora")


@pytest.mark.parametrize("spec", ["tiny-llama", "tiny-gpt2"])
def test_two_x_lora_baselines_train_as_many_parameters_as_1g1s(spec):
    """Paper Sec. 4.2 "2x LoRA modules": equal adapter parameters, up to 1G1S's router; the
    attention LoRA has rank r in every method (the authors' models/model.py)."""
    model, _ = load_base_model(spec)
    mix = ClientModels(model, _algo("comigs-1g1s")).for_client(0)
    target = _role_count(mix, "generalist", "specialist", "attention_lora")
    assert _role_count(mix, "router") > 0
    for name in TWO_X:
        m = ClientModels(model, _algo(name)).for_client(0)
        assert _role_count(m, "mlp_lora", "attention_lora", "personal_lora") == target, name
        assert _role_count(m, "attention_lora") == _role_count(mix, "attention_lora"), name


def test_round_one_starts_every_client_from_one_common_start(setup):
    """The shared tensors of round 1 are the same for all clients, even when their architectures
    differ (1GXS: users with 2 and 4 experts draw their initialisations differently)."""
    model, users = setup
    algo = _algo("comigs-1gxs", experts=[2, 4, 4])
    from comix.engines.device import Device
    from comix.engines.states import StateStore
    models, store = ClientModels(model, algo), StateStore()
    initial = {c: Device(algo, models.for_client(c), users[c], c, 0, store).init() for c in range(3)}
    assert any(not torch.equal(initial[0][n], initial[1][n]) for n in initial[0])  # the trap is armed
    _, payloads = algo.server_init(initial)
    for c in (1, 2):
        assert payloads[c].keys() == payloads[0].keys()
        assert all(torch.equal(payloads[c][n], payloads[0][n]) for n in payloads[0])


def test_training_helps_and_pretrained_is_the_base(setup, tmp_path):
    model, users = setup
    pre = _tiny_run(tmp_path, "pretrained", users, model)
    from comix.eval import perplexity
    assert pre["per_user"]["a"]["test_ppl"] == pytest.approx(perplexity(model, users[0].test, 16, 4))
    for m in ("local", "centralized", "comigs-1g1s"):
        res = _tiny_run(tmp_path, m, users, model, rounds=3)
        assert res["mean_test_ppl"] < pre["mean_test_ppl"], m
    rows = [json.loads(x) for x in (tmp_path / "comigs-1g1s" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows[-1]["gates"]) == 2 and len(rows[-1]["gates"][0]) == 2


def test_same_seed_same_numbers(setup, tmp_path):
    model, users = setup
    a = _tiny_run(tmp_path / "a", "fedavg", users, model, rounds=1)
    b = _tiny_run(tmp_path / "b", "fedavg", users, model, rounds=1)
    assert a["per_user"] == b["per_user"]


def test_tensor_bytes():
    assert tensor_bytes({"a": torch.zeros(3, 4), "b": torch.zeros(2, dtype=torch.float16)}) == 52


def test_frozen_base_shared_between_architectures(setup):
    model, _ = setup
    algo = _algo("comigs-1gxs", experts=[1, 4, 4])
    models = ClientModels(model, algo)
    m1, m4 = models.for_client(0), models.for_client(1)
    assert models.for_client(2) is m4 and m1 is not m4
    assert m1.lm_head.weight.data_ptr() == model.lm_head.weight.data_ptr() == m4.lm_head.weight.data_ptr()
    assert {n for n in adapter_tensors(m1) if ".experts.0." in n} == {
        n for n in adapter_tensors(m4) if ".experts.0." in n}  # the generalist has one shape for all


def test_offloaded_client_states_give_the_same_numbers(setup, tmp_path):
    model, users = setup
    mem = run_method(_algo("comigs-1g1s", rounds=2), model, users, tmp_path / "mem", seed=3)
    disk = run_method(_algo("comigs-1g1s", rounds=2), model, users, tmp_path / "disk", seed=3, offload=True,
                      keep_checkpoints=True)
    assert disk["per_user"] == mem["per_user"]
    # by default a finished method keeps its metrics and final adapters, not what resume needed
    assert not (tmp_path / "mem" / "checkpoint.pt").exists() and (tmp_path / "disk" / "checkpoint.pt").exists()
    from safetensors.torch import load_file
    saved = load_file(tmp_path / "mem" / "adapters" / "b.safetensors")
    assert any(param_role(n) == "specialist" for n in saved) and len(list((tmp_path / "mem" / "adapters").iterdir())) == 3
    # one file per client and round, the previous round's kept (resume reads the checkpointed one)
    assert sorted(p.name for p in (tmp_path / "disk" / "clients").iterdir()) == [
        f"client{c}.round{r}.pt" for c in range(3) for r in (1, 2)]


def test_expert_schedule_and_optimizer_follow_the_authors_code():
    """Cosine from lr to lr/10 over rounds x local steps, no warm-up (torch's CosineAnnealingLR
    with eta_min = lr/10, as epfml/CoMiGS clients.py); AdamW betas (0.9, 0.95), weight decay 1e-2."""
    from comix.algorithms import expert_lr
    from comix.algorithms.training import make_optimizer
    train = TrainConfig(rounds=3, local_steps=5)
    p = torch.nn.Parameter(torch.zeros(1))
    ref_opt = torch.optim.AdamW([p], lr=train.lr)
    ref = torch.optim.lr_scheduler.CosineAnnealingLR(ref_opt, T_max=15, eta_min=train.lr / 10)
    for step in range(15):
        assert expert_lr(step, 15, train) == pytest.approx(ref.get_last_lr()[0], rel=1e-9), step
        ref_opt.step()
        ref.step()
    opt = make_optimizer([("p", p)], ClientState(adapters={}), "experts", train)
    assert opt.defaults["betas"] == (0.9, 0.95) and opt.defaults["weight_decay"] == 0.01
    assert train.grad_clip == 0 and train.warmup_frac == 0


def _effective(method, *overrides, path=None):
    from comix.config import load_config
    from comix.specs import spec_config
    return spec_config(load_config(path, [f"methods=[{method}]", *overrides]), method).train


OPTIMIZER_KEYS = ("lr", "schedule", "lr_decay", "weight_decay", "betas", "optimizer_state")
FEDAMOLE_FAMILY = {"fedamole", "fedamole-random", "fedamole-vanilla", "fedamole-vanilla-random", "fedamole-r",
                   "fedamole-a", "fedmole", "fedamole-s", "fedamole-h", "fedit", "fedit-ft", "fedprompt",
                   "fedprompt-ft", "fedptuning", "fedptuning-ft", "fdlora-fedamole"}


@pytest.mark.parametrize("method", METHODS)
def test_each_method_s_effective_optimiser_and_its_source(method):
    """Without a recipe a method trains with its authors' optimiser: FedAMoLE and the baselines of
    its paper with Adam 5e-5 decayed x0.99 a round, fresh each round (journal Sec. V-A-4, node.py);
    FLoRA and FedALT with their authors' Trainer (AdamW 3e-4, linear decay within a round); every other method with CoMiGS's (App. B.1). A key the user sets wins, on the command line or
    in a recipe."""
    from comix.algorithms import REGISTRY
    got = {k: getattr(_effective(method), k) for k in OPTIMIZER_KEYS}
    cls = REGISTRY[method][0]
    if method in FEDAMOLE_FAMILY:
        assert got == dict(lr=5e-5, schedule="round_decay", lr_decay=0.99, weight_decay=0.0, betas=[0.9, 0.999],
                           optimizer_state="round")
        assert "FedAMoLE journal Sec. V-A-4" in cls.train_defaults_source
    elif method in ("flora", "fedalt", "feddpa-t", "feddpa-f", "fedlease"):  # a transformers Trainer per round
        assert got == dict(lr=3e-3 if method == "fedlease" else 3e-4, schedule="round_linear", lr_decay=0.99,
                           weight_decay=0.05 if method in ("fedalt", "fedlease") else 0.0, betas=[0.9, 0.999],
                           optimizer_state="round")
        assert _effective(method).grad_clip == 1.0  # the Trainer's max_grad_norm
        assert _effective(method, "train.grad_clip=0").grad_clip == 0
        assert {"flora": "ATP-1010/FederatedLLM main.py", "fedalt": "jmbian/FedALT client.py",
                "feddpa-t": "Lydia-yang/FedDPA main.py", "feddpa-f": "Lydia-yang/FedDPA main.py",
                "fedlease": "lei-wang-link/FedLEASE client.py"}[method] in \
            cls.train_defaults_source
    else:
        assert got == dict(lr=2e-3, schedule="cosine", lr_decay=0.99, weight_decay=0.01, betas=[0.9, 0.95],
                           optimizer_state="run")
        assert "CoMiGS App. B.1" in cls.train_defaults_source
    # a recipe's shared optimizer_state never hands moments across rounds where the authors build a
    # new optimiser every round (FLoRA's fresh LoRA would inherit the last one's Adam moments)
    fresh = method in ("flora", "fedalt", "feddpa-t", "feddpa-f", "fedlease") or cls.__name__ == "FedAMoLE"
    assert bool(cls.fresh_optimizer_each_round) == fresh
    assert _effective(method, "train.optimizer_state=run").optimizer_state == ("round" if fresh else "run")
    if method not in ("centralized", "pretrained", "central-moe") and not cls.needs_server_data:
        from comix.config import load_config
        from comix.specs import build_algorithm
        cfg = load_config(None, [f"methods=[{method}]", "train.optimizer_state=run", "train.rounds=6"])
        assert build_algorithm(cfg, method, 10).train.optimizer_state == ("round" if fresh else "run")
    assert _effective(method, "train.lr=0.01", "train.betas=[0.8,0.9]").lr == 0.01
    assert _effective(method, "train.betas=[0.8,0.9]").betas == [0.8, 0.9]


def test_a_recipe_s_train_keys_and_a_run_s_saved_config_keep_their_optimiser(tmp_path):
    from comix.config import load_config, to_dict
    import yaml
    recipe = tmp_path / "r.yaml"
    recipe.write_text("methods: [fedamole]\ntrain: {lr: 0.001, local_steps: 2}\n")
    t = _effective("fedamole", path=str(recipe))
    assert t.lr == 0.001 and t.weight_decay == 0.0  # the recipe's lr; the method's other defaults
    saved = tmp_path / "config.yaml"  # what a run writes, reloaded on --resume or by a Flower device
    saved.write_text(yaml.safe_dump(to_dict(load_config(str(recipe)))))
    again = _effective("fedamole", path=str(saved))
    assert {k: getattr(again, k) for k in OPTIMIZER_KEYS} == {k: getattr(t, k) for k in OPTIMIZER_KEYS}
