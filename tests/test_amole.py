"""The AMoLE layer (FedAMoLE eq. 8-15): the batched computation equals a per-expert reference in
outputs and gradients; routing follows the paper's equations."""
import math

import pytest
import torch
from torch import nn

from comix.models.amole import AMoLEConfig, AMoLELinear, amole_load_balance


def _layer(fused, seed=0, **cfg):
    torch.manual_seed(seed)
    base = nn.Linear(24, 20)
    layer = AMoLELinear(base, AMoLEConfig(dropout=0.0, **cfg), fused=fused)
    with torch.no_grad():
        layer.expert_B.normal_()  # non-zero experts, so every term is exercised
        if layer.shared is not None:
            layer.shared.lora_B.normal_()
    return layer


@pytest.mark.parametrize("cfg", [dict(), dict(router="vanilla"), dict(shared=False), dict(renormalize=True),
                                 dict(top_k=3, score_scale="r")])
@pytest.mark.parametrize("active", [3, 8])
def test_batched_experts_equal_the_per_expert_reference(cfg, active):
    fused, naive = _layer(True, **cfg), _layer(False, **cfg)
    naive.load_state_dict(fused.state_dict())
    ids = list(range(5, 5 + active))
    for layer in (fused, naive):
        layer.assign(ids)
    x = torch.randn(3, 7, 24)
    y_f, y_n = fused(x), naive(x)
    assert torch.allclose(y_f, y_n, atol=1e-5)
    y_f.square().mean().backward()
    y_n.square().mean().backward()
    for (name, p), q in zip(fused.named_parameters(), naive.parameters()):
        if p.requires_grad:
            assert (p.grad is None) == (q.grad is None), name
            if p.grad is not None:
                assert torch.allclose(p.grad, q.grad, atol=1e-5), name
    assert fused.expert_A.grad[active:].abs().sum() == 0  # empty slots never move


def test_routing_is_eq_10_softmax_over_the_assigned_experts():
    layer = _layer(True)
    layer.assign([0, 1, 2])
    x = torch.randn(5, 24)
    routing = layer.route(x)
    a = layer.expert_A[:3]
    scores = torch.stack([(x @ layer.token_proj.t() * (x @ a[j].t())).sum(-1) for j in range(3)], -1) / math.sqrt(24)
    assert torch.allclose(routing.probs, scores.softmax(-1), atol=1e-6)
    assert torch.allclose(routing.topk_weight, scores.softmax(-1).topk(2).values, atol=1e-6)  # not renormalised


def test_score_scale_r_divides_the_eq_10_scores_by_sqrt_r_as_the_authors_layer_does():
    """The authors' layer (model/mole/layer.py) scales by sqrt(r), not the paper's sqrt(d): with
    d = 24 and r = 8 the two give different probabilities, so a swapped scale is caught."""
    layer = _layer(True, score_scale="r")
    layer.assign([0, 1, 2])
    x = torch.randn(5, 24)
    a = layer.expert_A[:3]
    raw = torch.stack([(x @ layer.token_proj.t() * (x @ a[j].t())).sum(-1) for j in range(3)], -1)
    r = layer.expert_A.shape[1]
    assert r == 8 and torch.allclose(layer.route(x).probs, (raw / math.sqrt(r)).softmax(-1), atol=1e-6)
    assert not torch.allclose((raw / math.sqrt(r)).softmax(-1), (raw / math.sqrt(24)).softmax(-1), atol=1e-3)


def test_vanilla_router_only_picks_assigned_experts():
    layer = _layer(True, router="vanilla")
    layer.assign([29, 3])
    assert layer.vanilla_router.out_features == 30
    routing = layer.route(torch.randn(50, 24))
    assert routing.probs.shape == (50, 2) and set(routing.topk_index.unique().tolist()) <= {0, 1}


def test_assign_refuses_too_few_or_too_many_experts():
    layer = _layer(True)
    with pytest.raises(ValueError, match="takes 2..8 experts, got 1"):
        layer.assign([4])
    with pytest.raises(ValueError, match="got 9"):
        layer.assign(list(range(9)))


def test_load_balance_counts_top1_and_mean_probability():
    from comix.models.mixture import Routing
    probs = torch.tensor([[0.7, 0.2, 0.1], [0.6, 0.3, 0.1], [0.1, 0.1, 0.8], [0.2, 0.5, 0.3]])
    top_w, top_i = probs.topk(2, -1)
    lb = amole_load_balance(Routing(top_i, top_w, probs), 3)
    f = torch.tensor([2, 1, 1]) / 4
    assert lb.item() == pytest.approx(3 * float((f * probs.mean(0)).sum()))


def test_renormalize_makes_the_top_k_weights_sum_to_one_and_changes_the_output():
    plain, renorm = _layer(True, top_k=2), _layer(True, top_k=2, renormalize=True)
    renorm.load_state_dict(plain.state_dict())
    for layer in (plain, renorm):
        layer.assign([0, 1, 2, 3])
    x = torch.randn(6, 24)
    p, r = plain.route(x), renorm.route(x)
    assert torch.equal(p.topk_index, r.topk_index)
    assert torch.allclose(r.topk_weight.sum(-1), torch.ones(6), atol=1e-6)                   # renormalised ...
    assert torch.allclose(r.topk_weight, p.topk_weight / p.topk_weight.sum(-1, keepdim=True))  # ... of the same picks
    assert (p.topk_weight.sum(-1) < 0.999).all()  # without it they are the softmax's own, summing to less
    assert not torch.allclose(plain(x), renorm(x))
