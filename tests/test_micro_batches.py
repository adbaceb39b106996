"""Micro-batches (gradient accumulation): a batch computed in slices takes the one step the whole
batch takes (each slice weighted by its share of the targets), on every method's loop; a fleet
slices a device's batches before it quantises its base, and only as far as its budget needs."""
import json

import pytest
import torch

from comix.algorithms.training import lm_loss, train_step
from comix.cli import main
from comix.models import AdapterConfig, LoRAConfig, inject_adapters, load_base_model

COMMON = ["model=tiny-llama", "train.rounds=2", "train.local_steps=2", "train.batch_size=4", "train.seq_len=32",
          "data.valid_tokens=512", "data.test_tokens=512", "train.tau=1", "train.router_steps=1"]


def _lora_model():
    model, _ = load_base_model("tiny-llama")
    model = inject_adapters(model, AdapterConfig(mlp="lora", lora=LoRAConfig(r=4)))
    torch.manual_seed(0)
    for n, p in model.named_parameters():
        if p.requires_grad:  # B = 0 at init would leave A without a gradient
            torch.nn.init.normal_(p, std=0.05)
    return model


def _step(model, x, y, micro, extra=None):
    params = [p for p in model.parameters() if p.requires_grad]
    before = [p.detach().clone() for p in params]
    opt = torch.optim.SGD(params, lr=1.0)  # the update is the gradient itself
    loss = train_step(model, x, y, params, opt, 0.0, None, micro, extra)
    return loss, [b - p.detach() for b, p in zip(before, params)]


@pytest.mark.parametrize("micro", [2, 3, 4])
def test_a_batch_in_slices_takes_the_whole_batch_s_step_weighting_each_slice_by_its_targets(micro):
    torch.manual_seed(1)
    x = torch.randint(0, 200, (4, 16))
    y = torch.randint(0, 200, (4, 16))
    y[0, :12] = -100  # instruction data: slices hold unequal numbers of targets (prompts masked)
    y[3, 2:] = -100
    whole_model, sliced_model = _lora_model(), _lora_model()
    whole, g_whole = _step(whole_model, x, y, 1)
    sliced, g_sliced = _step(sliced_model, x, y, micro)
    assert sliced == pytest.approx(float(whole), rel=1e-5)
    for a, b in zip(g_whole, g_sliced):
        assert torch.allclose(a, b, atol=1e-6, rtol=1e-4)
    # an extra term of the parameters alone (a regulariser) counts once, not once per slice
    reg = lambda m: lambda: 0.5 * sum((p ** 2).sum() for p in m.parameters() if p.requires_grad)  # noqa: E731
    m1, m2 = _lora_model(), _lora_model()
    _, g1 = _step(m1, x, y, 1, reg(m1))
    _, g2 = _step(m2, x, y, micro, reg(m2))
    for a, b in zip(g1, g2):
        assert torch.allclose(a, b, atol=1e-6, rtol=1e-4)


def test_a_slice_without_targets_is_skipped_not_a_nan():
    x = torch.randint(0, 200, (4, 16))
    y = torch.randint(0, 200, (4, 16))
    y[:2] = -100
    loss, grads = _step(_lora_model(), x, y, 2)
    assert torch.isfinite(loss) and all(torch.isfinite(g).all() for g in grads)
    model = _lora_model()
    assert float(loss) == pytest.approx(float(lm_loss(model, x, y).detach()), rel=1e-5)


@pytest.mark.parametrize("method", ["fedavg", "comigs-1g1s", "feddpa-t", "fdlora-comigs"])
def test_every_method_s_loop_trains_in_slices_as_in_one_batch(tmp_path, monkeypatch, method):
    """Each loop (the shared one, CoMiGS's router steps, FedDPA's and FDLoRA's own) honours the
    device's micro-batches: its training forwards read slices of 2 rows, not the batch of 4; the
    run scores as the run without slices, to rounding; the metrics say how each device computed."""
    import comix.algorithms.training as training
    rows_read, real = [], training.lm_loss
    monkeypatch.setattr(training, "lm_loss", lambda model, x, y: rows_read.append(len(x)) or real(model, x, y))
    scores = {}
    for micro in (1, 2):
        rows_read.clear()
        run = tmp_path / str(micro)
        assert main(["run", *COMMON, f"methods=[{method}]", f"micro_batches={micro}", f"run_dir={run}"]) == 0
        assert set(rows_read) == {4 // micro}
        folder = next(p for p in run.iterdir() if (p / "results.json").exists())
        scores[micro] = json.loads((folder / "results.json").read_text())["mean"]
        rows = [json.loads(x) for x in (folder / "metrics.jsonl").read_text().splitlines()]
        assert {r["micro_batches"] for r in rows if "micro_batches" in r} == {micro}
    assert scores[2] == pytest.approx(scores[1], rel=1e-4)


def test_micro_batches_auto_slices_the_small_devices_instead_of_quantising_them(tmp_path):
    from comix.config import load_config
    from comix.data import load_corpus, make_user_data
    from comix.engines.device import training_memory
    from comix.specs import build_algorithm
    common = [*COMMON, "methods=[local]", "train.rounds=1"]
    cfg = load_config(None, common)
    model, tok = load_base_model("tiny-llama")
    need = training_memory(model, build_algorithm(cfg, "local", 4), make_user_data(load_corpus(cfg.corpus), tok,
                                                                                   cfg.data)[0], micro_batches=(1, 2, 4))
    assert need["none", 1] > need["none", 2] > need["none", 4]  # a slice's activations are smaller
    budget = (need["none", 1] + need["none", 2]) / 2  # full precision fits in 2 slices, not in 1
    fleet = tmp_path / "fleet.yaml"
    fleet.write_text(f"profiles:\n  - {{name: small, share: 0.5, memory_mb: {budget}, tokens_per_s: 1}}\n"
                     "  - {name: big, share: 0.5, memory_mb: 100000, tokens_per_s: 1}\n")
    run = tmp_path / "run"
    assert main(["run", *common, f"fleet={fleet}", "quant=auto", "micro_batches=auto", f"run_dir={run}"]) == 0
    rows = [json.loads(x) for x in (run / "local" / "metrics.jsonl").read_text().splitlines()]
    got = {r["user"]: (r["quant"], r["micro_batches"]) for r in rows if "micro_batches" in r}
    assert got == {"de": ("none", 2), "fr": ("none", 2), "it": ("none", 1), "nl": ("none", 1)}
    assert main(["run", *common, "micro_batches=auto", f"run_dir={tmp_path / 'bad'}"]) == 2
    assert main(["run", *common, "micro_batches=[1,2]", f"run_dir={tmp_path / 'bad'}"]) == 2
    assert not (tmp_path / "bad").exists()


@pytest.mark.parametrize("device, precision", [("cpu", "bf16"),
                                               pytest.param("cuda", "fp32", marks=pytest.mark.skipif(
                                                   not torch.cuda.is_available(), reason="needs a CUDA device"))])
def test_the_memory_plan_measures_the_base_where_and_as_the_run_holds_it(device, precision):
    # a run's base is on its device and in its dtype before its fleet is planned: the measured
    # step follows it (on an H200 the adapters stayed on the CPU and the step failed; on a CPU a
    # bf16 base met the fp32 adapters without the run's autocast and failed too)
    from comix.config import load_config
    from comix.data import load_corpus, make_user_data
    from comix.engines.device import training_memory
    from comix.runtime import resolve
    from comix.specs import build_algorithm
    cfg = load_config(None, [*COMMON, "methods=[local]"])
    model, tok = load_base_model("tiny-llama")
    user, algo = make_user_data(load_corpus(cfg.corpus), tok, cfg.data)[0], build_algorithm(cfg, "local", 4)
    cpu_fp32 = training_memory(model, algo, user, micro_batches=(1, 2))
    held = training_memory(resolve(device, precision).prepare_base(load_base_model("tiny-llama")[0]), algo, user,
                           micro_batches=(1, 2))
    assert held["none", 1] > held["none", 2] > 0  # a slice's activations are smaller, wherever measured
    if precision == "bf16":  # bf16 weights and activations: less than fp32 at every slicing
        assert all(held[k] < cpu_fp32[k] for k in cpu_fp32)
