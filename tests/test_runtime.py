"""Device and precision plumbing: bf16 on the CPU, states kept on the CPU, no
hard-coded devices; the CUDA tests run where a GPU is present and are skipped elsewhere."""
import re
from pathlib import Path

import pytest
import torch

from comix.engines.states import unpack
from comix.algorithms import make_algorithm
from comix.config import ConfigError, load_config
from comix.engines import run_method
from comix.engines.device import Device
from comix.engines.states import StateStore
from comix.engines.inprocess import ClientModels
from comix.models import LoRAConfig, load_base_model, param_role
from comix.runtime import Runtime, resolve, to_cpu
from test_algorithms import _train, setup  # noqa: F401 (setup: the shared tiny fixture)

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_resolve_names_the_bad_value():
    assert resolve("auto", "fp32").device.type == ("cuda" if torch.cuda.is_available() else "cpu")
    assert resolve("cpu", "bf16").dtype == torch.bfloat16
    with pytest.raises(ValueError, match="precision must be one of fp32, bf16, fp16, got 'int8'"):
        resolve("cpu", "int8")
    with pytest.raises(ValueError, match="device must be auto, cpu, cuda or cuda:N, got 'tpu'"):
        resolve("tpu")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="no CUDA device is available"):
            resolve("cuda:0")
        with pytest.raises(ValueError, match="fp16 needs a CUDA device"):
            resolve("cpu", "fp16")
    with pytest.raises(ConfigError, match="precision must be"):
        load_config(None, ["precision=fp8"])
    with pytest.raises(ConfigError, match="device must be"):
        load_config(None, ["device=gpu0"])


def test_compile_setting_reaches_every_mixture_and_changes_no_number(setup, tmp_path):
    """compile=auto is on for CUDA only; a compiled run (training and evaluation) gives the
    eager run's numbers; what it compiles is the mixture layers' slot work."""
    from comix.models.mixture import MixtureOfLoRAMLP
    assert load_config(None, ["compile=auto"]).compile is None and load_config(None, ["compile=true"]).compile
    with pytest.raises(ConfigError, match="compile must be auto, true or false, got 'maybe'"):
        load_config(None, ["compile=maybe"])
    assert resolve("cpu", "fp32").compile is False and resolve("cpu", "fp32", True).compile is True
    model, users = setup
    algo = make_algorithm("comigs-1g1s", LoRAConfig(r=4), _train(rounds=2), len(users))
    layers = [m for m in ClientModels(model, algo, Runtime(compile=True)).for_client(0).modules()
              if isinstance(m, MixtureOfLoRAMLP)]
    assert layers and all(m.compiled for m in layers)
    eager = _run(tmp_path / "eager", "comigs-1g1s", users, model, Runtime())
    compiled = _run(tmp_path / "compiled", "comigs-1g1s", users, model, Runtime(compile=True))
    for u in eager["per_user"]:
        assert compiled["per_user"][u]["test_ppl"] == pytest.approx(eager["per_user"][u]["test_ppl"], rel=1e-5)


def _run(tmp_path, name, users, model, runtime, **train):
    algo = make_algorithm(name, LoRAConfig(r=4), _train(rounds=2, **train), len(users))
    base = runtime.prepare_base(model)
    return run_method(algo, base, users, tmp_path / f"{name}-{runtime.precision}", seed=1, keep_checkpoints=True,
                      runtime=runtime)


@pytest.mark.parametrize("method", ["comigs-1g1s", "fedavg"])
def test_bf16_on_the_cpu_is_close_to_fp32_with_fp32_masters(setup, tmp_path, method):
    model, users = setup
    fp32 = _run(tmp_path, method, users, load_base_model("tiny-llama")[0], Runtime())
    bf16_model = load_base_model("tiny-llama")[0]
    bf16 = _run(tmp_path, method, users, bf16_model, resolve("cpu", "bf16"))
    # bf16 keeps 8 mantissa bits: perplexities within 2 % of fp32 (measured here: < 0.05 %)
    for u in fp32["per_user"]:
        assert bf16["per_user"][u]["test_ppl"] == pytest.approx(fp32["per_user"][u]["test_ppl"], rel=0.02)
    assert all(p.dtype == torch.bfloat16 for p in bf16_model.parameters())  # the frozen base, stored in bf16
    states = torch.load(tmp_path / f"{method}-bf16" / "checkpoint.pt", weights_only=False)["clients"]["states"]
    states = {c: unpack(s) for c, s in states.items()}  # saved packed (engines/device.py)
    for state in states.values():
        assert all(t.dtype == torch.float32 and t.device.type == "cpu" for t in state.adapters.values())
        moments = [v for opt in state.optimizers.values() for s in opt["state"].values() for v in s.values()]
        assert moments and all(v.device.type == "cpu" for v in moments)
        assert all(v.dtype == torch.float32 for v in moments if v.dim() > 0)


def test_a_device_hands_back_cpu_tensors_and_keeps_its_model_on_its_device(setup):
    model, users = setup
    runtime = resolve("auto", "fp32")
    algo = make_algorithm("comigs-1g1s", LoRAConfig(r=4), _train(), 3)
    net = ClientModels(runtime.prepare_base(load_base_model("tiny-llama")[0]), algo, runtime).for_client(0)
    device = Device(algo, net, users[0], 0, 0, StateStore(), runtime)
    shared = device.init()
    upload, _ = device.train(shared)
    assert upload and all(t.device.type == "cpu" for t in upload.values())
    assert all(p.device == runtime.device or p.device.type == runtime.device.type for p in net.parameters())
    assert {param_role(n) for n in upload} == {"generalist", "attention_lora"}


SOURCE = Path(__file__).resolve().parents[1] / "comix"
# Where a device may be named: the runtime (resolution, moving states to the CPU) and the CPU
# copies that client states are made of, by design.
ALLOWED = {"runtime.py": None, "algorithms/base.py": {"adapter_tensors"}}
HARD_CODED = re.compile(r"""\.cuda\(|\.cpu\(\)|device\s*=\s*["'](cpu|cuda)|["']cuda:\d""")


def test_no_tensor_is_put_on_a_hard_coded_device():
    offenders = []
    for path in SOURCE.rglob("*.py"):
        rel = path.relative_to(SOURCE).as_posix()
        if rel in ALLOWED and ALLOWED[rel] is None:
            continue
        function = ""
        for number, line in enumerate(path.read_text().splitlines(), 1):
            m = re.match(r"\s*def (\w+)", line)
            function = m.group(1) if m else function
            if HARD_CODED.search(line) and function not in (ALLOWED.get(rel) or ()):
                offenders.append(f"{rel}:{number}: {line.strip()}")
    assert not offenders, "\n".join(offenders)


def test_to_cpu_moves_nested_optimizer_state():
    state = {"state": {0: {"step": torch.tensor(3.0), "exp_avg": torch.ones(2)}}, "param_groups": [{"lr": 1e-3}]}
    out = to_cpu(state)
    assert out["param_groups"] == [{"lr": 1e-3}] and torch.equal(out["state"][0]["exp_avg"], torch.ones(2))
    assert out is not state and out["state"] is not state["state"]  # new containers, the states untouched
    assert isinstance(to_cpu((torch.ones(1), [torch.zeros(1)])), tuple)


@CUDA
@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_cuda_run_matches_the_cpu_and_keeps_states_on_the_cpu(setup, tmp_path, precision):
    model, users = setup
    cpu = _run(tmp_path / "cpu", "comigs-1g1s", users, load_base_model("tiny-llama")[0], Runtime())
    gpu = _run(tmp_path / "gpu", "comigs-1g1s", users, load_base_model("tiny-llama")[0], resolve("cuda", precision))
    for u in cpu["per_user"]:
        assert gpu["per_user"][u]["test_ppl"] == pytest.approx(cpu["per_user"][u]["test_ppl"], rel=0.03)
    states = torch.load(tmp_path / "gpu" / f"comigs-1g1s-{precision}" / "checkpoint.pt", weights_only=False)["clients"]["states"]
    states = {c: unpack(s) for c, s in states.items()}  # each tensor back on the device it was saved from
    assert all(t.device.type == "cpu" for s in states.values() for t in s.adapters.values())


def test_progress_inside_a_round_reaches_the_listener_and_nothing_without_one():
    """K: long phases report (phase, done, total) to whatever the runner installed."""
    from comix import progress
    from comix.algorithms.training import TrainConfig
    from comix.algorithms.global_moe import train_moe_on_public
    from comix.models.upcycle import upcycle
    from comix.runtime import Runtime
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    dense = LlamaForCausalLM(LlamaConfig(vocab_size=50, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=2))
    moe = upcycle([dense, dense], top_k=1)
    heard = []
    progress.listen(lambda *a: heard.append(a))
    try:
        train_moe_on_public(moe, torch.randint(0, 50, (200,)), 3, 2, list(moe.parameters()), 1e-3, 0.0,
                            TrainConfig(seq_len=8), Runtime(), torch.Generator().manual_seed(0))
    finally:
        progress.listen(None)
    assert heard == [("MoE steps on public data", j, 3) for j in range(3)]
    progress.step("nobody listens", 1, 2)  # no listener: nothing happens
