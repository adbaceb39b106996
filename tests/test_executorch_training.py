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
from test_algorithms import setup  # noqa: E402,F401  (the tiny Llama and three users: a fixture)


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


def test_the_trained_tensors_live_in_the_programs_external_weights_and_a_write_there_is_read(fedavg_model):
    """The adapters are the program's external mutable weights (a .ptd beside the .pte): each has
    memory of its own in the runtime (the .ptd stores equal tensors once: a fresh round's zero B
    factors), and a value written into the program's parameter is the one its next forward
    computes with (a program that read a copy made at load computes the old loss)."""
    model, x, y, program = fedavg_model
    named = expert_params(model)
    assert program.weights and len({program.params[n].data_ptr() for n, _ in named}) == len(named)
    program.load(named)
    before, _ = program.forward_backward(x, y)
    b = next(n for n, _ in named if "lora_B" in n)
    with torch.no_grad():
        program.params[b].add_(0.5)
    after, _ = program.forward_backward(x, y)
    assert abs(float(after) - float(before)) > 1e-4
    program.load(named)
    assert float(program.forward_backward(x, y)[0]) == pytest.approx(float(before), rel=1e-6)


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


# CoMiGS with a router step after every expert step (tau = 1): each expert step's forward reads the
# router the step before it trained, so a program holding a stale router drifts from the first one
ROUTED = ["train.tau=1", "train.router_steps=2"]


def _run(out, method, args, runtime, kill_after=None, monkeypatch=None):
    """``comix run`` on the tiny model; with ``kill_after``, killed once that round's checkpoint is
    written, then resumed as a user would (``comix run --resume``)."""
    from comix.cli import main
    from comix.engines import server
    from test_aggregation import TINY
    command = ["run", *TINY, *args, f"methods=[{method}]", f"train.client_runtime={runtime}", f"run_dir={out}"]
    if kill_after is None:
        assert main(command) == 0
        return

    class Killed(Exception):
        pass
    real = server.atomic_write

    def kill(path, write):
        real(path, write)
        if str(path).endswith("checkpoint.pt") and torch.load(path, weights_only=False)["round"] == kill_after:
            raise Killed
    monkeypatch.setattr(server, "atomic_write", kill)
    with pytest.raises(Killed):
        main(command)
    monkeypatch.setattr(server, "atomic_write", real)
    assert main(["run", "--resume", str(out)]) == 0


@pytest.mark.parametrize("method,args,runtime,kill_after", [
    ("fedavg", [], "executorch", None),
    ("comigs-1g1s", ROUTED, "[executorch,pytorch,executorch,pytorch]", 2)])
def test_a_run_whose_devices_train_in_executorch_equals_the_pytorch_run(tmp_path, monkeypatch, method, args, runtime,
                                                                        kill_after):
    """``train.client_runtime=executorch``: the devices' steps in the runtime (CoMiGS's router
    steps on validation batches too; there two devices of four, the run killed after round 2 and
    resumed), 3 rounds over 4 users; each round's payloads (server.jsonl's fingerprints) and each
    user's scores equal the PyTorch run's to 1e-5 relative (the program's gradients differ from
    autograd's in the last bits, 1e-7 measured above, which three rounds of AdamW do not lift past
    1e-5). Each device's row counts the tokens PyTorch's does and, in ExecuTorch, says so and
    holds the step's planned memory as its activations."""
    import json
    rows = {}
    for name in ("pytorch", "executorch"):
        out = tmp_path / name
        _run(out, method, args, "pytorch" if name == "pytorch" else runtime, kill_after if name != "pytorch" else None,
             monkeypatch)
        rows[name] = ([json.loads(ln)["payload_fingerprint"] for ln in (out / method / "server.jsonl").read_text()
                       .splitlines()], json.loads((out / method / "results.json").read_text())["per_user"],
                      [json.loads(ln) for ln in (out / method / "metrics.jsonl").read_text().splitlines()])
    (pt_prints, pt_users, pt_rows), (et_prints, et_users, et_rows) = rows["pytorch"], rows["executorch"]
    trained = [(a, b) for a, b in zip(pt_rows, et_rows) if "tokens" in a]
    assert len(trained) == 12 and all(a["user"] == b["user"] and a["tokens"] == b["tokens"] > 0 for a, b in trained)
    on = runtime.strip("[]").split(",")  # each client's runtime, clients in the order of the run's users
    for a, b in trained:
        executorch = on[list(pt_users).index(a["user"]) % len(on)] == "executorch"  # (one for all: index 0)
        assert "client_runtime" not in a and b.get("client_runtime") == ("executorch" if executorch else None)
        if executorch:  # the planner's memory for the step, not PyTorch's measured peak
            assert b["activation_mb"] > 0 and b["activation_mb"] != a["activation_mb"]
    assert len(pt_prints) == 3
    for a, b in zip(pt_prints, et_prints):
        assert a == pytest.approx(b, rel=1e-5)
    assert pt_prints[0] != pt_prints[-1]  # the rounds did train
    for user, metrics in pt_users.items():
        assert et_users[user]["test_ppl"] == pytest.approx(metrics["test_ppl"], rel=1e-5)


@pytest.mark.parametrize("args,words", [
    (["methods=[fedalt]"], "not plain LoRA or a LoRA mixture"),
    (["methods=[fedit]"], "LoRA dropout"),
    (["methods=[hetlora]"], "writes its own"),
    (["methods=[fedavg]", "precision=bf16"], "precision=bf16"),
    (["methods=[fedavg]", "train.cohort=2"], "train.cohort=2"),
    (["methods=[fedavg]", "train.client_runtime=phone"], "train.client_runtime must be pytorch or executorch"),
    (["methods=[fedavg]", "train.client_runtime=[executorch,phone,pytorch,pytorch]"],
     "train.client_runtime must be pytorch or executorch"),
    (["methods=[fedavg]", "train.client_runtime=[executorch,pytorch]"], "2 runtimes for 4 clients"),
])
def test_what_the_exported_step_cannot_run_is_refused_in_one_line_before_any_run_directory(tmp_path, capsys, args, words):
    from comix.cli import main
    from test_aggregation import TINY
    runtime = [] if any(a.startswith("train.client_runtime") for a in args) else ["train.client_runtime=executorch"]
    assert main(["run", *TINY, *args, *runtime, f"run_dir={tmp_path / 'r'}"]) != 0
    err = capsys.readouterr()
    assert words in err.out + err.err and not (tmp_path / "r").exists()


def test_a_mixture_round_in_executorch_runs_every_step_there_and_uploads_what_the_method_declares(setup, monkeypatch):
    """CoMiGS-1GxS (a user with experts [2, 1, 3]: one without a router), router steps after every
    expert step: each expert step and each router step is one forward-backward of the program, no
    step runs in PyTorch, and what leaves each device is exactly the method's declared upload."""
    from comix.algorithms import base as base_module
    from comix.models import param_role
    from comix.models.executorch_training import ExecuTorchTraining as Program
    from test_algorithms import EXPECTED_SHARED, _algo, _client
    model, users = setup
    algo = _algo("comigs-1gxs", experts=[2, 1, 3], client_runtime="executorch", tau=1, router_steps=2)
    assert algo.executorch_refusal() is None
    calls = []
    real = Program.forward_backward
    monkeypatch.setattr(Program, "forward_backward", lambda self, x, y: calls.append(1) or real(self, x, y))

    def no_pytorch_step(*a, **k):
        raise AssertionError("a PyTorch step on an ExecuTorch device")
    monkeypatch.setattr(base_module, "train_step", no_pytorch_step)
    clients = [_client(algo, model, users, c) for c in range(3)]
    reference = {c: algo.upload_of(state.adapters) for c, (_, state) in enumerate(clients)}
    server_state, payloads = algo.server_init(reference)
    for c, (ctx, state) in enumerate(clients):
        calls.clear()
        state, upload, _ = algo.client_round(ctx, state, payloads[c])
        routed = algo.experts[c] > 1
        assert len(calls) == algo.train.local_steps * (1 + routed * algo.train.router_steps)
        declared = algo.expected_upload(server_state, c, reference[c])
        assert set(upload) == set(declared) and algo.check_upload(upload, declared) is None
        assert {param_role(n) for n in upload} == EXPECTED_SHARED["comigs-1gxs"]


def test_an_executorch_mixture_step_minimises_the_ce_plus_the_load_balance():
    """One SGD step of a CoMiGS-1G3S model (top-2 of 4 experts: in 1G1S every token goes to both
    experts and the uniform balance is constant) (load balance at weight 1, B factors non-zero) through
    the program ends where ``train_step`` with the same load balance ends, and away from where the
    CE alone would take it: a program exported without the load balance (eq. 7-8) is caught here,
    where the runs' default weight of 0.01 moves their scores below their tolerance."""
    from comix.algorithms.base import ClientContext
    from comix.algorithms.comigs import CoMiGS
    from comix.algorithms.training import executorch_step
    base, _ = load_base_model("tiny-llama")
    algo = CoMiGS(LoRAConfig(r=4), TrainConfig(lb_weight=1.0), 3, experts=4)
    model = ClientModels(base, algo).for_client(0)
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for n, p in named:
            if "lora_B" in n:
                p.copy_(0.02 * torch.randn(p.shape, generator=gen))
    start = {n: p.detach().clone() for n, p in named}
    x = torch.randint(0, 250, (2, 16), generator=gen)
    y = torch.randint(0, 250, (2, 16), generator=gen)
    load_balance, settings = algo._load_balance(ClientContext(client=0, model=model, data=None, train=algo.train))

    def one_step(step) -> dict:
        with torch.no_grad():
            for n, p in named:
                p.copy_(start[n])
        step(torch.optim.SGD([p for _, p in named], lr=1.0))
        return {n: p.detach().clone() for n, p in named}
    executorch = one_step(lambda opt: executorch_step(model, x, y, named, opt, 0.0, load_balance, settings))
    pytorch = one_step(lambda opt: train_step(model, x, y, [p for _, p in named], opt, 0.0, extra=load_balance))
    ce_only = one_step(lambda opt: train_step(model, x, y, [p for _, p in named], opt, 0.0))
    routers = [n for n in start if "router" in n]
    assert routers
    for n in start:
        assert torch.allclose(executorch[n], pytorch[n], atol=1e-6), n
    assert max(float((pytorch[n] - ce_only[n]).abs().max()) for n in routers) > 1e-3
