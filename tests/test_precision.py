"""Under ``precision=bf16`` every forward computes with the weights as they are *now*.

torch's autocast caches the bf16 copy of each fp32 leaf weight that requires grad until the
outermost autocast block exits; an optimiser step updates the weight in place, so a cached
autocast around a client's round hands every later forward of that round the copy made at its
start. LoRA factors reach their products through views and stay fresh; a weight handed to
``F.linear`` directly (an ``nn.Linear``'s, a Mixtral router's) does not. ``FreshCasts`` watches every
``F.linear`` of a trainable fp32 weight under CPU autocast and recomputes it from the weight's
current value; a forward whose output differs read a stale copy."""
import pytest
import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from comix.algorithms import make_algorithm
from comix.engines import run_method
from comix.models import LoRAConfig, load_base_model
from comix.runtime import resolve
from test_algorithms import FEDAMOLE_SMALL, _train, setup  # noqa: F401 (setup: the shared tiny fixture)
from test_deepfusion import DF, _domains


class FreshCasts(TorchFunctionMode):
    """Counts the F.linear calls under CPU autocast whose trainable fp32 weight has been updated
    since its first use in this watch (``after_update``), and those whose output is not the one
    its current bf16 value gives (``stale``, with the largest gap)."""

    def __init__(self):
        super().__init__()
        self.first_version, self.after_update, self.stale, self.gap = {}, 0, 0, 0.0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func is not F.linear or not torch.is_autocast_enabled("cpu"):
            return out
        x, w = args[0], args[1] if len(args) > 1 else kwargs["weight"]
        b = args[2] if len(args) > 2 else kwargs.get("bias")
        if not (isinstance(w, torch.nn.Parameter) and w.requires_grad and w.dtype == torch.float32):
            return out
        version = self.first_version.setdefault(id(w), w._version)
        if w._version == version:
            return out
        self.after_update += 1
        dtype = torch.get_autocast_dtype("cpu")
        with torch.autocast("cpu", enabled=False), torch.no_grad():
            ref = F.linear(x.to(dtype), w.detach().to(dtype), None if b is None else b.detach().to(dtype))
        if not torch.equal(out.detach(), ref):
            self.stale += 1
            self.gap = max(self.gap, float((out.detach().float() - ref.float()).abs().max()))
        return out


def test_an_update_inside_the_runs_autocast_reaches_the_next_forward():
    """The mechanism, in the run's own autocast (Runtime.autocast): one SGD step of an nn.Linear,
    then a forward in the same block sees the new weight."""
    lin = torch.nn.Linear(8, 8)
    opt = torch.optim.SGD(lin.parameters(), lr=1.0)
    x = torch.randn(4, 8)
    with resolve("cpu", "bf16").autocast(), FreshCasts() as watch:
        before = lin(x)
        before.sum().backward()
        opt.step()
        after = lin(x)
    assert not torch.equal(before, after)
    assert watch.after_update == 1 and watch.stale == 0


# each method with a trainable weight that a forward hands to F.linear directly, and its options:
# CoMiGS's routers (router steps every tau), FedALT's token mixer, AMoLE's vanilla router (whose
# RSEA embeddings, computed under the same autocast, must leave the device in fp32). FedLEASE's
# router is read through a view (``weight[rows]``, models/lease.py) and is fresh by construction.
ROUTED = {"comigs-1g1s": {}, "fedalt": {}, "fedamole-vanilla": FEDAMOLE_SMALL}


@pytest.mark.parametrize("method", sorted(ROUTED))
def test_every_forward_of_a_bf16_round_sees_the_last_step(setup, tmp_path, method):
    """A whole bf16 run (both rounds, router steps included): every forward of a trainable
    nn.Linear after its update computes with the updated weight. A round-wide cached autocast
    (the engine's, or one a method opens) fails this."""
    model, users = setup
    rt = resolve("cpu", "bf16")
    algo = make_algorithm(method, LoRAConfig(r=4), _train(rounds=2, local_steps=4, tau=2, lr=0.05),
                          len(users), **ROUTED[method])
    with FreshCasts() as watch:
        run_method(algo, rt.prepare_base(load_base_model("tiny-llama")[0]), users, tmp_path, seed=3, runtime=rt)
    assert watch.after_update > 0  # the run did update such a weight and use it again
    assert watch.stale == 0, f"{watch.stale} of {watch.after_update} forwards used a stale bf16 copy (gap {watch.gap})"


@pytest.mark.parametrize("method", ["deepfusion", "fedjets", "central-moe"])
def test_one_shot_devices_and_server_loops_under_bf16_see_the_last_step(tmp_path, method):
    """The methods that train whole weights: DeepFusion's devices (a pruned model, every
    nn.Linear trained) and its server's KD and MoE tuning, FedJETS's devices (the MoE's experts
    and router), the centralized bound's pooled MoE training."""
    from comix.cli import main
    data = _domains(tmp_path / "data")
    with FreshCasts() as watch:
        assert main(["compare", f"corpus={data}", f"run_dir={tmp_path / 'run'}", *DF, "precision=bf16",
                     "device=cpu", "--methods", method, "--seeds", "1"]) == 0
    assert watch.after_update > 0
    assert watch.stale == 0, f"{watch.stale} of {watch.after_update} forwards used a stale bf16 copy (gap {watch.gap})"


def test_fedamole_under_bf16_uploads_its_rsea_embeddings_in_fp32(setup, tmp_path, caplog):
    """RSEA's embeddings (Eq. 23, 25) are computed by hooks inside the round's autocast; they must
    leave the device in fp32 like every upload, or the server leaves every client out."""
    model, users = setup
    rt = resolve("cpu", "bf16")
    algo = make_algorithm("fedamole", LoRAConfig(r=4), _train(rounds=2), len(users), **FEDAMOLE_SMALL)
    uploads, real = [], algo.server_round
    algo.server_round = lambda state, up: uploads.append(up) or real(state, up)
    run_method(algo, rt.prepare_base(load_base_model("tiny-llama")[0]), users, tmp_path, seed=3, runtime=rt)
    assert "left out of the aggregate" not in caplog.text
    assert len(uploads) == 2 and all(len(up) == len(users) for up in uploads)
    embeddings = {n: t for up in uploads for u in up.values() for n, t in u.items() if n.startswith("rsea.")}
    assert embeddings and {t.dtype for t in embeddings.values()} == {torch.float32}
