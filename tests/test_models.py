import math
import shutil

import pytest
import torch
from transformers.pytorch_utils import Conv1D

from comix.models import (AdapterConfig, LoRAConfig, LoRALinear, MixtureOfLoRAMLP, Routing,
                          inject_adapters, load_balance_loss, load_base_model, param_role,
                          routing_stats, select, set_record_stats, trainable_state)


def _close(a, b, tol=1e-5):
    """fp32 agreement to ``tol`` relative to the tensors' scale."""
    return (a - b).abs().max().item() <= tol * max(1.0, b.abs().max().item())


def _randomise_experts(layer, seed=0):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in layer.named_parameters():
            if p.requires_grad:
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)


@pytest.mark.parametrize("spec", ["tiny-llama", "tiny-gpt2"])
@pytest.mark.parametrize("n,k,compiled", [(1, 2, False), (2, 2, False), (3, 1, False), (4, 2, False), (8, 2, False),
                                          (8, 3, False), (2, 2, True), (8, 3, True)])
def test_fused_equals_naive_outputs_and_gradients(spec, n, k, compiled):
    import comix.models.mixture as mixture
    model, _ = load_base_model(spec)
    mlp = (model.model.layers[0] if spec == "tiny-llama" else model.transformer.h[0]).mlp
    d = model.config.hidden_size
    torch.manual_seed(1)
    fused = MixtureOfLoRAMLP(mlp, d, n, k, LoRAConfig(r=4), fused=True)
    mixture.set_compiled(fused, compiled)
    _randomise_experts(fused)
    naive = MixtureOfLoRAMLP(mlp, d, n, k, LoRAConfig(r=4), fused=False)
    naive.load_state_dict(fused.state_dict())
    x = torch.randn(3, 7, d)
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    y1, y2 = fused(x1), naive(x2)
    assert _close(y1, y2)
    w = torch.randn_like(y1)
    (y1 * w).sum().backward()
    (y2 * w).sum().backward()
    assert _close(x1.grad, x2.grad)
    for (name, p1), (_, p2) in zip(fused.named_parameters(), naive.named_parameters()):
        if p1.requires_grad:
            assert _close(p1.grad, p2.grad), name
    if compiled and shutil.which("g++"):  # the compiled path ran (eager only when compilation fails)
        assert fused._act_kind is not None and mixture._COMPILED not in (None, mixture.slot_hidden)


def test_mixture_is_weighted_sum_of_expert_mlps():
    """Definition check: y = sum_j p_j MLP_j(x) with p from top-k softmax (eq. 1)."""
    model, _ = load_base_model("tiny-llama")
    mlp = model.model.layers[0].mlp
    layer = MixtureOfLoRAMLP(mlp, 32, 4, 2, LoRAConfig(r=4))
    _randomise_experts(layer)
    x = torch.randn(5, 32)
    logits = layer.router(x)
    top, idx = logits.topk(2, -1)
    p = top.softmax(-1)
    expect = torch.stack([sum(p[t, s] * layer._expert_mlp(x[t:t + 1], int(idx[t, s]))[0] for s in range(2))
                          for t in range(5)])
    assert torch.allclose(layer(x), expect, atol=1e-5)


def test_single_expert_has_weight_one_and_no_router():
    model, _ = load_base_model("tiny-llama")
    layer = MixtureOfLoRAMLP(model.model.layers[0].mlp, 32, 1, 2, LoRAConfig(r=4))
    assert layer.router is None
    _randomise_experts(layer)
    x = torch.randn(4, 32)
    assert torch.allclose(layer(x), layer._expert_mlp(x, 0), atol=1e-6)
    assert torch.equal(layer.last_routing.topk_weight, torch.ones(4, 1))


@pytest.mark.parametrize("base_cls", ["linear", "conv1d"])
def test_lora_init_scaling_and_frozen_base(base_cls):
    torch.manual_seed(0)
    base = torch.nn.Linear(10, 6) if base_cls == "linear" else Conv1D(6, 10)
    lora = LoRALinear(base, LoRAConfig(r=4, alpha=16))
    x = torch.randn(3, 10)
    assert torch.equal(lora(x), base(x))                   # B = 0: starts as the base layer
    assert lora.scaling == pytest.approx(16 / math.sqrt(4))  # rank-stabilised, not alpha / r
    bound = 1 / math.sqrt(10)                               # kaiming-uniform(a=sqrt 5) bound
    assert lora.lora.lora_A.abs().max() <= bound and lora.lora.lora_A.std() > bound / 4
    assert not any(p.requires_grad for p in base.parameters())
    with torch.no_grad():
        lora.lora.lora_B.normal_()
    expect = base(x) + 8.0 * x @ lora.lora.lora_A.t() @ lora.lora.lora_B.t()
    assert torch.allclose(lora(x), expect, atol=1e-5)


def test_two_lora_modules_equal_one_double_rank_module():
    cfg = LoRAConfig(r=4, alpha=16, modules=2)
    assert cfg.rank == 8 and cfg.scaling == pytest.approx(8.0)


def _routing(index, probs):
    index = torch.tensor(index)
    return Routing(index, torch.full(index.shape, 1.0 / index.shape[1]), torch.tensor(probs))


def test_load_balance_uniform_hand_computed():
    # 4 tokens, n = 3, top-1: expert counts 2, 1, 1 -> f = (.5, .25, .25)
    r = _routing([[0], [0], [1], [2]], [[.6, .2, .2], [.5, .3, .2], [.2, .7, .1], [.1, .1, .8]])
    p = torch.tensor([1.4, 1.3, 1.3]) / 4
    f = torch.tensor([.5, .25, .25])
    assert load_balance_loss(r, 3, "uniform").item() == pytest.approx(3 * (f * p).sum().item())
    assert load_balance_loss(r, 3, "uniform").item() == pytest.approx(3 * (.5 * .35 + .25 * .325 * 2))


def test_load_balance_generalist_favoured_hand_computed():
    # n = 3, top-2: f = (1, .5, .5); eq. 10 weights 1/5 (generalist), 2/5 (specialists), times n^2
    r = _routing([[0, 1], [0, 2]], [[.5, .3, .2], [.4, .2, .4]])
    p = [.45, .25, .3]
    eq10 = 1 / 5 * 1 * p[0] + 2 / 5 * .5 * p[1] + 2 / 5 * .5 * p[2]
    assert load_balance_loss(r, 3, "generalist").item() == pytest.approx(9 * eq10)
    # at n = 2 the generalist-favoured loss is the uniform one (paper App. C.4)
    r2 = _routing([[0], [1], [1]], [[.7, .3], [.4, .6], [.2, .8]])
    assert load_balance_loss(r2, 2, "generalist").item() == pytest.approx(load_balance_loss(r2, 2).item())
    assert load_balance_loss(r2, 2, "none").item() == 0.0
    with pytest.raises(ValueError, match="load_balance"):
        load_balance_loss(r2, 2, "bogus")


def test_load_balance_uses_router_input_and_reaches_router_only():
    model, tok = load_base_model("tiny-llama")
    inject_adapters(model, AdapterConfig(n_experts=4))
    ids = torch.randint(0, 256, (2, 16))
    model(input_ids=ids)
    layer = model.model.layers[0].mlp
    lb = load_balance_loss(layer.last_routing, 4)
    lb.backward()
    assert layer.router.weight.grad is not None and layer.router.weight.grad.abs().sum() > 0
    assert all(p.grad is None for p in layer.experts.parameters())


@pytest.mark.parametrize("spec", ["tiny-llama", "tiny-gpt2", "tiny-qwen2"])
def test_injection_roles_and_names(spec):
    model, _ = load_base_model(spec)
    inject_adapters(model, AdapterConfig(n_experts=3))
    state = trainable_state(model)
    roles = {param_role(n) for n in state}
    assert roles == {"generalist", "specialist", "router", "attention_lora"}
    gen = select(state, "generalist")
    assert gen and all(".mlp.experts.0." in n for n in gen)
    assert all(".mlp.experts.0." not in n for n in select(state, "specialist"))
    assert all(not p.requires_grad for n, p in model.named_parameters() if param_role(n) == "base")
    assert all(p.requires_grad for n, p in model.named_parameters() if param_role(n) != "base")


def test_injection_plain_lora_counts_match_comigs_upload_ratio():
    """CoMiGS-1G1S uploads half of what FedAvg with 2x LoRA modules uploads (paper Sec. 4.5)."""
    m1, _ = load_base_model("tiny-llama")
    inject_adapters(m1, AdapterConfig(n_experts=2))
    m2, _ = load_base_model("tiny-llama")
    inject_adapters(m2, AdapterConfig(mlp="lora", lora=LoRAConfig(modules=2)))
    shared = sum(t.numel() for t in select(trainable_state(m1), "generalist", "attention_lora").values())
    fedavg = sum(t.numel() for t in trainable_state(m2).values())
    assert shared * 2 == fedavg


def test_routing_stats():
    model, _ = load_base_model("tiny-gpt2")
    inject_adapters(model, AdapterConfig(n_experts=4, top_k=2))
    set_record_stats(model)
    model(input_ids=torch.randint(0, 256, (2, 9)))
    stats = routing_stats(model)
    assert len(stats) == model.config.n_layer
    for s in stats:
        assert s["mean_gate"].shape == (4,) and s["mean_gate"].sum().item() == pytest.approx(1.0, abs=1e-5)
        assert s["top1"].shape == (2, 9) and s["top1"].max() < 4
        # the mean of each token's own entropy (not the entropy of the mean gate): top-2 of 4, so
        # between 0 and log 2, and below the mean gate's entropy over 4 unless every token mixes alike
        assert 0 < float(s["entropy"]) <= math.log(2) + 1e-6
        mean = s["mean_gate"]
        assert float(s["entropy"]) < float(-(mean * mean.log()).sum())


def test_gate_entropy_is_each_token_s_entropy_averaged_per_client():
    from comix.models.mixture import gate_entropy
    even, sure = torch.full((3, 2), 0.5), torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 0.0]])
    assert float(gate_entropy(even)) == pytest.approx(math.log(2))
    assert float(gate_entropy(sure)) == 0.0  # one expert a token, though the mean gate is mixed
    assert gate_entropy(torch.stack([even, sure])).tolist() == pytest.approx([math.log(2), 0.0])


def test_hf_local_directory_and_unknown_spec(tmp_path):
    model, tok = load_base_model("tiny-llama")
    model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    again, tok2 = load_base_model(str(tmp_path))
    ids = torch.tensor([tok.encode("abc")])
    assert torch.allclose(model(input_ids=ids).logits, again(input_ids=ids).logits)
    with pytest.raises(ValueError, match="unknown model spec 'no-such-model-xyz'"):
        load_base_model("no-such-model-xyz")


@pytest.mark.real_model
def test_real_smollm2_loads_and_predicts_english():
    import time
    load_base_model("smollm2-135m")              # first call may build the cache
    t0 = time.time()
    model, tok = load_base_model("smollm2-135m")
    load_s = time.time() - t0
    assert model.config.num_hidden_layers == 30 and model.config.hidden_size == 576
    ids = torch.tensor([tok.encode("The capital of France is Paris. The capital of Germany is Berlin.")])
    ppl = model(input_ids=ids, labels=ids).loss.exp().item()
    assert ppl < 30, ppl
    assert load_s < 5, load_s  # cached safetensors (target < 2 s on an idle machine)
