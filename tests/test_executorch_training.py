"""A local step trained by ExecuTorch's training runtime (models/executorch_training.py) equals
PyTorch's: the program's loss and gradients are autograd's over the adapters only, and AdamW
steps over the program's gradients end where ``train_step`` ends."""
import pytest
import torch

from comix.algorithms import TrainConfig, make_algorithm
from comix.algorithms.training import apply_step, expert_params, lm_loss, make_optimizer, train_step
from comix.algorithms import ClientState
from comix.engines.device import fresh_adapters
from comix.engines.inprocess import ClientModels
from comix.models import LoRAConfig, load_base_model
from comix.models.executorch_training import ExecuTorchTraining

pytest.importorskip("executorch.extension.training")


@pytest.fixture(scope="module")
def fedavg_model():
    """FedAvg's client model over the tiny Llama (attention LoRA, 2x LoRA on the MLP), its B factors
    non-zero so every factor has a gradient."""
    base, _ = load_base_model("tiny-llama")
    algo = make_algorithm("fedavg", LoRAConfig(r=4), TrainConfig(), 3)
    model = ClientModels(base, algo).for_client(0)
    adapters = fresh_adapters(model, 1)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n in adapters:
                p.copy_(adapters[n] + 0.02 * torch.randn(p.shape, generator=gen) * ("lora_B" in n))
    gen = torch.Generator().manual_seed(1)
    x = torch.randint(0, 250, (2, 16), generator=gen)
    y = torch.randint(0, 250, (2, 16), generator=gen)
    y[0, :5] = -100  # instruction data: no loss on the prompt
    return model, x, y, ExecuTorchTraining(model, x, y)


def test_the_programs_loss_and_gradients_are_autograds_over_the_adapters_only(fedavg_model):
    model, x, y, program = fedavg_model
    named = expert_params(model)
    program.load(named)
    loss, grads = program.forward_backward(x, y)
    ref_loss = lm_loss(model, x, y)
    ref = torch.autograd.grad(ref_loss, [p for _, p in named])
    assert set(grads) == {n for n, _ in named} and all("lora" in n for n in grads)  # no base weight trained
    assert float(loss) == pytest.approx(float(ref_loss), rel=1e-6)
    for (n, _), g in zip(named, ref):
        assert torch.allclose(grads[n], g, atol=1e-6, rtol=1e-5), n


def test_adamw_steps_over_the_programs_gradients_end_where_train_step_ends(fedavg_model):
    """Three steps each way from the same adapters (the program reloaded after every update; a stale
    program, or gradients read before the backward, would drift from the first step on)."""
    model, x, y, program = fedavg_model
    named = expert_params(model)
    start = {n: p.detach().clone() for n, p in named}
    train = TrainConfig(lr=1e-2, grad_clip=1.0)
    gen = torch.Generator().manual_seed(2)
    batches = [(torch.randint(0, 250, x.shape, generator=gen), torch.randint(0, 250, y.shape, generator=gen))
               for _ in range(3)]
    opt = make_optimizer(named, ClientState(adapters={}), "experts", train)
    for bx, by in batches:
        program.load(named)
        _, grads = program.forward_backward(bx, by)
        apply_step([p for _, p in named], [grads[n] for n, _ in named], opt, train.grad_clip)
    executorch = {n: p.detach().clone() for n, p in named}
    with torch.no_grad():
        for n, p in named:
            p.copy_(start[n])
    opt = make_optimizer(named, ClientState(adapters={}), "experts", train)
    for bx, by in batches:
        train_step(model, bx, by, [p for _, p in named], opt, train.grad_clip)
    moved = 0.0
    for n, p in named:
        assert torch.allclose(executorch[n], p, atol=1e-5), n
        moved = max(moved, float((p - start[n]).abs().max()))
    assert moved > 1e-3  # the steps did move the adapters


def test_a_fedavg_run_whose_devices_train_in_executorch_equals_the_pytorch_run(tmp_path):
    """``train.client_runtime=executorch``: every device's steps in the runtime, 3 rounds of FedAvg
    over 3 users; each round's payloads (server.jsonl's fingerprints) and each user's scores equal
    the PyTorch run's to 1e-5 relative (the program's gradients differ from autograd's in the last
    bits, 1e-7 measured above, which three rounds of AdamW do not lift past 1e-5)."""
    import json
    from comix.cli import main
    from test_aggregation import TINY
    rows = {}
    for runtime in ("pytorch", "executorch"):
        out = tmp_path / runtime
        assert main(["run", *TINY, "methods=[fedavg]", f"train.client_runtime={runtime}", f"run_dir={out}"]) == 0
        rows[runtime] = ([json.loads(ln)["payload_fingerprint"] for ln in (out / "fedavg" / "server.jsonl").read_text()
                          .splitlines()], json.loads((out / "fedavg" / "results.json").read_text())["per_user"])
    (pt_prints, pt_users), (et_prints, et_users) = rows["pytorch"], rows["executorch"]
    assert len(pt_prints) == 3
    for a, b in zip(pt_prints, et_prints):
        assert a == pytest.approx(b, rel=1e-5)
    assert pt_prints[0] != pt_prints[-1]  # the rounds did train
    for user, metrics in pt_users.items():
        assert et_users[user]["test_ppl"] == pytest.approx(metrics["test_ppl"], rel=1e-5)


@pytest.mark.parametrize("args,words", [
    (["methods=[comigs-1g1s]"], "router steps"),
    (["methods=[fedit]"], "LoRA dropout"),
    (["methods=[hetlora]"], "writes its own"),
    (["methods=[fedavg]", "precision=bf16"], "precision=bf16"),
    (["methods=[fedavg]", "train.cohort=2"], "train.cohort=2"),
    (["methods=[fedavg]", "train.client_runtime=phone"], "train.client_runtime must be pytorch or executorch"),
])
def test_what_the_exported_step_cannot_run_is_refused_in_one_line_before_any_run_directory(tmp_path, capsys, args, words):
    from comix.cli import main
    from test_aggregation import TINY
    runtime = [] if any(a.startswith("train.client_runtime") for a in args) else ["train.client_runtime=executorch"]
    assert main(["run", *TINY, *args, *runtime, f"run_dir={tmp_path / 'r'}"]) != 0
    err = capsys.readouterr()
    assert words in err.out + err.err and not (tmp_path / "r").exists()
