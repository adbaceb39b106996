"""quant=q4 (models/quant.py): HQQ's 4-bit asymmetric grid per group of 32, zero not rounded. It
finds a grid the weights already lie on (the offline SmolLM2 is a Q4_1 GGUF), computes with its
own dequantised weight, passes gradients to the adapters only, stores ~0.17x of fp32 linears, and
on the real model costs at most 1 % perplexity."""
import pytest
import torch

pytest.importorskip("hqq")
from comix.models import AdapterConfig, LoRAConfig, inject_adapters, load_base_model, param_role  # noqa: E402
from comix.models.quant import base_bytes, dequantized_weight, quant_of_base, quantize_base, quantize_linear  # noqa: E402

CPU = torch.device("cpu")


def _on_q4_1_grid(out_f=64, in_f=128, seed=0):
    """A weight that lies on a Q4_1 grid: per row and group of 32, min + scale * {0..15}, the group's
    min and max on codes 0 and 15 (as GGUF's Q4_1 quantiser sets them)."""
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (out_f, in_f // 32, 32), generator=g).float()
    codes[..., 0], codes[..., 1] = 0, 15
    # d and m in 16 bits, as GGUF stores them (ggml's block_q4_1)
    scale = (torch.rand(out_f, in_f // 32, 1, generator=g) * 0.01 + 1e-3).half().float()
    low = (-8 * scale + torch.randn(out_f, in_f // 32, 1, generator=g) * 1e-3).half().float()
    return (low + scale * codes).reshape(out_f, in_f)


def test_q4_finds_a_q4_1_grid_again_and_computes_with_its_dequantised_weight():
    linear = torch.nn.Linear(128, 64, bias=True)
    w = _on_q4_1_grid()
    linear.weight.data = w.clone()
    bias = linear.bias.detach().clone()
    q = quantize_linear(linear, "q4", torch.float32, CPU)
    deq = dequantized_weight(q)
    assert ((deq - w).norm() / w.norm()).item() < 1e-5
    x = torch.randn(5, 128)
    with torch.no_grad():
        assert torch.allclose(q(x), x @ deq.t() + bias, atol=1e-5)
    normal = torch.nn.Linear(128, 64)  # Gaussian weights are not on a grid: 4 bits cost something
    w = normal.weight.detach().clone()
    assert 0.01 < ((dequantized_weight(quantize_linear(normal, "q4", torch.float32, CPU)) - w).norm() / w.norm()).item() < 0.2


@pytest.mark.parametrize("adapters", ["lora", "mixture"])
def test_q4_gradients_reach_the_adapters_and_never_the_base(adapters):
    model, _ = load_base_model("tiny-llama")
    model = quantize_base(model, "q4", torch.float32, CPU)
    assert quant_of_base(model) == "q4"
    cfg = {"lora": AdapterConfig(lora=LoRAConfig(r=4), mlp="lora"), "mixture": AdapterConfig(lora=LoRAConfig(r=4))}[adapters]
    model = inject_adapters(model, cfg).train()
    for n, p in model.named_parameters():
        if p.requires_grad and n.endswith("lora_B"):
            torch.nn.init.normal_(p, std=0.1)
    x = torch.randint(0, 200, (2, 16))
    model(input_ids=x, labels=x).loss.backward()
    base = [p for n, p in model.named_parameters() if param_role(n) == "base"]
    assert base and all(not p.requires_grad and p.grad is None for p in base)
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for n, p in model.named_parameters() if param_role(n) != "base")


def test_q4_stores_a_sixth_of_the_fp32_linears_counting_its_scales_and_zeros():
    from conftest import smollm2_block as block
    full = block()
    linear = sum(m.weight.numel() * 4 for m in full.model.layers.modules() if isinstance(m, torch.nn.Linear))
    other = base_bytes(full) - linear
    quantised = base_bytes(quantize_base(block(), "q4", torch.float32, CPU)) - other
    # 4 bits a weight + a 16-bit scale (GGUF Q4_1's own) and an fp32 zero per 32: 0.5 + 0.1875 bytes of 4
    assert quantised == pytest.approx(0.171875 * linear, rel=0.01)


@pytest.mark.real_model
def test_q4_costs_the_real_model_at_most_one_percent_perplexity():
    """SmolLM2-135M on 4 x 256 tokens of the built-in multilingual text: the q4 base within 1 % of
    fp32 (NF4 costs ~40 % on the same weights)."""
    import copy

    from comix.data import builtin
    from comix.eval.perplexity import perplexity
    model, tok = load_base_model("smollm2-135m")
    text = " ".join(builtin("multilingual")["de"][:20])
    ids = torch.tensor(tok(text, add_special_tokens=False)["input_ids"][:4 * 256 + 1])
    full = perplexity(model, ids, 256, 4)
    q4 = perplexity(quantize_base(copy.deepcopy(model), "q4", torch.float32, CPU), ids, 256, 4)
    assert abs(q4 / full - 1) <= 0.01, (full, q4)
