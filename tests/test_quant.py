"""A quantised frozen base (models/quant.py): each layer computes what bitsandbytes' own
dequantisation says, gradients reach the adapters and never the base, copies of the base share
its quantised state, and what cannot run quantised is refused before anything loads."""
import pytest
import torch

pytest.importorskip("bitsandbytes")
from comix.models import AdapterConfig, LoRAConfig, inject_adapters, load_base_model, param_role  # noqa: E402
from comix.models.amole import AMoLEConfig  # noqa: E402
from comix.models.quant import base_bytes, dequantized_weight, quantize_base, quantize_linear, shared_objects  # noqa: E402,E501

CPU = torch.device("cpu")


def _quantised(quant):
    model, _ = load_base_model("tiny-llama")
    return quantize_base(model, quant, torch.float32, CPU)


def _block_linears(model):
    import bitsandbytes as bnb
    return [m for m in model.modules() if isinstance(m, (bnb.nn.Linear4bit, bnb.nn.Linear8bitLt))]


def _train(model, x, steps, lr) -> float:
    """``steps`` AdamW steps of ``model``'s trainable parameters on the batch ``x``; the last loss."""
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr)
    for _ in range(steps):
        loss = model(input_ids=x, labels=x).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    return loss.item()


@pytest.mark.parametrize("quant", ["nf4", "int8"])
def test_a_quantised_layer_computes_with_bitsandbytes_dequantised_weight(quant):
    """NF4 dequantises the weight and multiplies in the compute dtype: equal to x W_deq^T to
    float precision. LLM.int8() also quantises the activations row-wise to int8 (Dettmers et al.
    2022, vector-wise quantisation): within 1 % of x W_deq^T."""
    model = _quantised(quant)
    layers = _block_linears(model)
    n_linear = sum(isinstance(m, torch.nn.Linear) for m in load_base_model("tiny-llama")[0].model.layers.modules())
    assert len(layers) == n_linear  # every linear of every block, nothing else
    x = torch.randn(5, layers[0].in_features)
    for layer in layers[:3]:
        with torch.no_grad():
            got, want = layer(x), x @ dequantized_weight(layer).t()
        tol = 1e-5 if quant == "nf4" else 1e-2
        assert (got - want).abs().max() <= tol * want.abs().max()
    torch.manual_seed(0)
    linear = torch.nn.Linear(576, 576, bias=False)  # SmolLM2's q_proj (tiny-llama's 32 columns are too few)
    torch.nn.init.normal_(linear.weight, std=0.02)
    w = linear.weight.detach()
    err = (dequantized_weight(quantize_linear(linear, quant, torch.float32, CPU)) - w).abs().mean() / w.abs().mean()
    assert 0 < err < (0.12 if quant == "nf4" else 0.01)  # quantised, and close: 4 bits (NF4 ~0.09) vs 8


@pytest.mark.parametrize("quant", ["nf4", "int8"])
@pytest.mark.parametrize("adapters", ["lora", "mixture", "amole"])
def test_gradients_reach_the_adapters_and_never_the_quantised_base(quant, adapters):
    model = _quantised(quant)
    cfg = {"lora": AdapterConfig(lora=LoRAConfig(r=4), mlp="lora"),
           "mixture": AdapterConfig(lora=LoRAConfig(r=4)),
           "amole": AdapterConfig(lora=LoRAConfig(r=4), attention=False, mlp="none",
                                  amole=AMoLEConfig(r=4, pool=4, slots=2, top_k=2))}[adapters]
    model = inject_adapters(model, cfg).train()
    for n, p in model.named_parameters():
        if p.requires_grad and n.endswith(("lora_B", "expert_B")):
            torch.nn.init.normal_(p, std=0.1)
    x = torch.randint(0, 200, (2, 16))
    model(input_ids=x, labels=x).loss.backward()
    base = [p for n, p in model.named_parameters() if param_role(n) == "base"]
    assert all(not p.requires_grad and p.grad is None for p in base)
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for n, p in model.named_parameters()
               if param_role(n) != "base")


def test_nf4_and_int8_shrink_the_block_linears():
    """On one block of SmolLM2-135M's widths (tiny-llama's 32-wide layers are all per-layer overhead)."""
    from conftest import smollm2_block as block
    full = block()
    linear = sum(m.weight.numel() * 4 for m in full.model.layers.modules() if isinstance(m, torch.nn.Linear))
    other = base_bytes(full) - linear  # embeddings, norms, head: not quantised
    # 4 / 32 and 8 / 32 bits, plus their scales: NF4 with QLoRA's double quantisation keeps one 8-bit
    # scale per 64 weights (+ an fp32 one per 256 scales): 0.5 + 1/64 bytes a weight, 0.1289 of fp32
    # (measured 0.1295 with the code tables); without it an fp32 scale per 64: 0.1406; the weights
    # alone, scales not counted: 0.125. int8: one fp32 scale per output row
    for quant, least, most in (("nf4", 0.127, 0.135), ("int8", 0.25, 0.27)):
        quantised = base_bytes(quantize_base(block(), quant, torch.float32, CPU)) - other
        assert least * linear < quantised <= most * linear, quant


def test_copies_of_an_int8_base_share_its_state_and_train_as_one_alone():
    """The in-process engine copies the base for each adapter architecture. bitsandbytes keeps
    the int8 weight's scales in the layer's state: a copy must share it, or the second copy to
    train computes without scales once the first has taken them."""
    from comix.engines.inprocess import ClientModels
    from comix.runtime import resolve

    class Algo:  # two architectures, as FedAvg's and CoMiGS's
        def device_spec(self, c):
            return None

        def adapter_config(self, c):
            return AdapterConfig(lora=LoRAConfig(r=4), mlp="lora" if c == 0 else "mixture")

    def train(model):
        torch.manual_seed(1)
        return _train(model, torch.randint(0, 200, (4, 32), generator=torch.Generator().manual_seed(5)), 5, 2e-2)

    def second_architecture(models):
        torch.manual_seed(7)  # the same adapters' init in both cases
        return models.for_client(1).train()
    int8 = resolve("cpu", "fp32", False, "int8")
    alone = train(second_architecture(ClientModels(_quantised("int8"), Algo(), int8)))
    models = ClientModels(_quantised("int8"), Algo(), int8)
    train(models.for_client(0).train())
    second = second_architecture(models)
    assert train(second) == pytest.approx(alone, abs=1e-5)
    assert shared_objects(models.base) and all(any(s is t for t in shared_objects(models.base))
                                               for s in shared_objects(second))


def test_quant_is_checked_before_anything_loads(tmp_path, capsys, monkeypatch):
    import comix.models
    from comix.cli import main
    monkeypatch.setattr(comix.models, "load_base_model", lambda *a, **k: pytest.fail("model loaded"))
    assert main(["run", "model=tiny-llama", "quant=nf3", f"run_dir={tmp_path / 'a'}"]) == 2
    assert "quant must be one of none, int8, q4, nf4, auto (with a fleet) or one per client, got 'nf3'" in capsys.readouterr().err
    assert main(["run", "model=tiny-llama", "quant=nf4", "methods=[deepfusion]", "train.rounds=1",
                 "data.public_frac=0.1", "deepfusion.devices=[random-gpt2:2:64]", f"run_dir={tmp_path / 'b'}"]) == 2
    assert "quant=nf4 with deepfusion: device model(s) random-gpt2:2:64 start from random weights" \
        in capsys.readouterr().err  # a LoRA cannot teach a random base
    for method, why in (("fedjets", "compact MoE"), ("central-moe", "centralized reference")):
        assert main(["run", "model=tiny-llama", "quant=int8", f"methods=[{method}]", "train.rounds=1",
                     "data.public_frac=0.1", f"run_dir={tmp_path / 'c'}"]) == 2
        assert f"quant=int8 with {method}: " in (err := capsys.readouterr().err) and why in err
    assert not any((tmp_path / d).exists() for d in "abc")


def test_a_run_on_a_quantised_base_scores_close_to_the_full_precision_one(tmp_path):
    import json

    from comix.cli import main
    common = ["model=tiny-llama", "methods=[fedavg,comigs-1g1s]", "train.rounds=2", "train.local_steps=2",
              "train.batch_size=2", "train.seq_len=32", "data.valid_tokens=512", "data.test_tokens=512"]
    means = {}
    for quant in ("none", "nf4", "int8"):
        assert main(["run", *common, f"quant={quant}", f"run_dir={tmp_path / quant}"]) == 0
        means[quant] = {m: json.loads((tmp_path / quant / m / "results.json").read_text())["mean"]
                        for m in ("fedavg", "comigs-1g1s")}
    for quant in ("nf4", "int8"):
        for m, v in means[quant].items():
            assert v == pytest.approx(means["none"][m], rel=0.03) and v != means["none"][m]


def test_a_run_that_keeps_its_base_in_full_precision_gives_shared_base_clients_a_quantised_copy():
    """A comparison with DeepFusion keeps the base in full precision (its devices build their own
    models from it); a FedAvg client of the same quant=nf4 run still trains over an NF4 base."""
    from comix.algorithms import make_algorithm
    from comix.config import TrainConfig
    from comix.engines.inprocess import ClientModels
    from comix.models.quant import quant_of_base
    from comix.runtime import resolve

    base = load_base_model("tiny-llama")[0]
    models = ClientModels(base, make_algorithm("fedavg", LoRAConfig(), TrainConfig(), 2), resolve("cpu", "fp32", False, "nf4"))
    assert quant_of_base(models.for_client(0)) == "nf4" and quant_of_base(base) == "none"
    assert models.base_at("nf4") is models.base_at("nf4")  # quantised once, shared by the clients


@pytest.mark.parametrize("quant", ["nf4", "int8"])
def test_a_device_trains_its_own_model_qlora_s_way_and_uploads_it_merged(quant):
    """models/qlora.py: a LoRA on every block linear of a frozen quantised copy, nothing else
    trains, and the merged weights are deq(W) + scaling * B A under the model's own names; with
    NF4 the merged full-precision model computes what the adapted quantised one does."""
    import dataclasses

    from comix.models.lora import LoRALinear
    from comix.models.qlora import QLORA, merged_weights, qlora_model

    assert (QLORA.r, QLORA.alpha, QLORA.dropout, QLORA.scaling) == (64, 16.0, 0.1, 0.25)  # QLoRA's 7B script, alpha / r
    model = load_base_model("tiny-llama")[0]
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    q = qlora_model(model, quant, dataclasses.replace(QLORA, r=2), torch.float32, CPU).train()
    assert all(torch.equal(p, start[n]) for n, p in model.named_parameters())  # the device's model untouched
    wrapped = {n: m for n, m in q.named_modules() if isinstance(m, LoRALinear)}
    assert len(wrapped) == len(_block_linears(q)) == len(_block_linears(_quantised(quant)))  # every block linear
    assert {n for n, p in q.named_parameters() if p.requires_grad} == \
        {f"{w}.lora.{f}" for w in wrapped for f in ("lora_A", "lora_B")}  # the LoRA factors alone
    x = torch.randint(0, 200, (2, 16), generator=torch.Generator().manual_seed(3))
    _train(q, x, 3, 1e-2)
    merged = merged_weights(q)
    assert merged.keys() == start.keys()
    for n, t in merged.items():
        owner = n.rsplit(".", 1)[0]
        if owner not in wrapped:
            assert torch.equal(t, start[n]), n  # embeddings, norms and head as they were
            continue
        delta = t - dequantized_weight(wrapped[owner].base)
        assert 0 < torch.linalg.matrix_rank(delta) <= 2, n  # the trained rank-2 edit, over the dequantised base
        lora = wrapped[owner].lora
        assert torch.allclose(delta, wrapped[owner].scaling * (lora.lora_B @ lora.lora_A), atol=1e-6)
    if quant == "nf4":  # int8 quantises the activations too: only NF4 computes with deq(W) exactly
        loaded = model.load_state_dict(merged, strict=False)
        assert set(loaded.missing_keys) <= {"lm_head.weight"} and not loaded.unexpected_keys  # (tied to the embeddings)
        with torch.no_grad():
            want, got = q.eval()(input_ids=x).logits, model.eval()(input_ids=x).logits
        assert (got - want).abs().max() <= 1e-4 * want.abs().max()
