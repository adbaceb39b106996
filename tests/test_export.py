"""`comix export` / `comix.load_personal` (issue F1 part 2): the user's model outside comix has the
run's logits, in PEFT and merged form for plain LoRA, expert by expert and exactly through the
manifest for mixtures; bad input is one line and leaves nothing half-written."""
import json

import pytest
import torch

from comix.cli import main
from comix.personal import ExportError, export_personal, load_personal, rebuild
from comix.models import AdapterConfig, inject_adapters, load_base_model
from test_cli import TINY, _user_dirs


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("export")
    data = _user_dirs(root / "data")
    run = root / "run"
    assert main(["run", f"corpus={data}", f"run_dir={run}", "methods=[fedavg,comigs-1g1s,fdlora-comigs]", *TINY]) == 0
    return run


def _ids():
    return torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(0))


def _logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits


def test_rebuilt_model_is_the_run_s_model(run):
    """What export starts from scores as the run scored it (test perplexity to 1e-5)."""
    from comix.config import load_config
    from comix.data import load_corpus, make_user_data
    from comix.eval import perplexity

    cfg = load_config(str(run / "config.yaml"))
    for method in ("fedavg", "comigs-1g1s"):
        model, tok, info = rebuild(run / method, "bob")
        user = next(u for u in make_user_data(load_corpus(cfg.corpus), tok, cfg.data) if u.name == "bob")
        got = perplexity(model, user.test, cfg.train.seq_len, cfg.train.eval_batch_size)
        want = json.loads((run / method / "results.json").read_text())["per_user"]["bob"]["test_ppl"]
        assert got == pytest.approx(want, rel=1e-5)
        assert info["client"] == 1 and info["n_clients"] == 3


@pytest.mark.parametrize("method", ["fedavg", "fdlora-comigs"])
def test_plain_lora_exports_a_peft_folder_and_a_merged_model_with_the_run_s_logits(run, tmp_path, method):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    out = export_personal(run, "alice", tmp_path / "alice", method=method, merged=True)
    model, _, _ = rebuild(run / method, "alice")
    ids = _ids()
    want = _logits(model, ids)
    base, _ = load_base_model("tiny-llama")
    peft = PeftModel.from_pretrained(base, str(out)).eval()
    assert torch.allclose(_logits(peft, ids), want, atol=1e-5)
    merged = AutoModelForCausalLM.from_pretrained(str(out / "merged")).eval()
    assert torch.allclose(_logits(merged, ids), want, atol=1e-5)
    # and not the base: the adapters changed something
    assert not torch.allclose(_logits(load_base_model("tiny-llama")[0], ids), want, atol=1e-4)
    exact, _ = load_personal(out)
    assert torch.equal(_logits(exact, ids), want)


def test_a_mixture_exports_experts_routers_and_a_manifest_and_reloads_exactly(run, tmp_path):
    from peft import PeftModel
    from safetensors.torch import load_file

    out = export_personal(run, "carol", tmp_path / "carol", method="comigs-1g1s", static=True)
    man = json.loads((out / "manifest.json").read_text())
    assert man["kind"] == "mixture" and man["top_k"] == 2 and man["mlp_modules"] == ["gate_proj", "up_proj", "down_proj"]
    assert [e["role"] for e in man["experts"]] == ["generalist", "specialist"]
    assert len(man["base"]["sha256"]) == 64 and man["base"]["spec"] == "tiny-llama"
    assert "approximation" in man["static"] and sum(man["static"]["weights"]) == pytest.approx(1, abs=1e-4)
    routers = load_file(str(out / "routers.safetensors"))
    assert len(routers) == 2 and all(".mlp.router." in n for n in routers)
    model, _, info = rebuild(run / "comigs-1g1s", "carol")
    ids = _ids()
    exact, _ = load_personal(out)
    assert torch.equal(_logits(exact, ids), _logits(model, ids))
    # expert j's PEFT folder = the model whose router always picks expert j
    for j in range(2):
        single = inject_adapters(load_base_model("tiny-llama")[0], AdapterConfig(lora=info["algorithm"].lora,
                                                                                 mlp="mixture", n_experts=1))
        params = dict(single.named_parameters())
        with torch.no_grad():
            for n, t in info["adapters"].items():
                if f".experts.{j}." in n:
                    params[n.replace(f".experts.{j}.", ".experts.0.")].copy_(t)
                elif ".lora." in n:
                    params[n].copy_(t)
        peft = PeftModel.from_pretrained(load_base_model("tiny-llama")[0], str(out / "experts" / str(j))).eval()
        assert torch.allclose(_logits(peft, ids), _logits(single.eval(), ids), atol=1e-5)
    static = PeftModel.from_pretrained(load_base_model("tiny-llama")[0], str(out / "static")).eval()
    assert static(input_ids=ids).logits.shape == (2, 24, 257)


def test_generate_prints_a_completion_from_an_export(run, tmp_path, capsys):
    out = export_personal(run, "bob", tmp_path / "bob", method="fedavg")
    capsys.readouterr()
    assert main(["generate", str(out), "der hund", "--max-new-tokens", "5"]) == 0
    assert capsys.readouterr().out.startswith("der hund")


def test_bad_exports_are_one_line_and_leave_nothing(run, tmp_path, capsys):
    def fails(argv, words):
        assert main(argv) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and words in err[0], err

    out = tmp_path / "out"
    fails(["export", str(run), "--user", "dave", "--out", str(out), "--method", "fedavg"], "--user 'dave' is not a user")
    fails(["export", str(run), "--user", "bob", "--out", str(out)], "holds 3 methods")
    fails(["export", str(run), "--user", "bob", "--out", str(out), "--method", "hetlora"], "has no finished method")
    fails(["export", str(tmp_path), "--user", "bob", "--out", str(out)], "is not a comix run")
    (run / "fedavg" / "adapters" / "bob.safetensors").rename(tmp_path / "bob.safetensors")
    try:
        fails(["export", str(run), "--user", "bob", "--out", str(out), "--method", "fedavg"], "has no adapters for user 'bob'")
    finally:
        (tmp_path / "bob.safetensors").rename(run / "fedavg" / "adapters" / "bob.safetensors")
    assert not out.exists() and not list(tmp_path.glob(".out-*"))  # no half-written folder
    done = export_personal(run, "bob", out, method="fedavg")
    fails(["export", str(run), "--user", "bob", "--out", str(out), "--method", "fedavg"], "exists")
    other, _ = load_base_model("tiny-llama", seed=1)  # same architecture, other weights
    with pytest.raises(ExportError, match="the base model's weights differ"):
        load_personal(done, base=other)
    fails(["generate", str(tmp_path), "hi"], "not a `comix export` folder")


def test_the_python_face_runs_exports_and_reloads(tmp_path):
    """comix.run / comix.export / comix.load_personal, as the README and examples/ use them."""
    import comix
    from comix.api import overrides_of

    assert overrides_of(["seed=1"], {"train": {"rounds": 2}, "train.lr": 0.01, "methods": ["fedavg"]}) == \
        ["seed=1", "train.rounds=2", "train.lr=0.01", 'methods=["fedavg"]']
    data = _user_dirs(tmp_path / "data")
    settings = dict(arg.split("=", 1) for arg in TINY)
    results = comix.run(None, *[f"{k}={v}" for k, v in settings.items()], corpus=str(data), methods=["fedavg"],
                        run_dir=str(tmp_path / "run"), quiet=True)
    assert [r["method"] for r in results] == ["fedavg"] and set(results[0]["per_user"]) == {"alice", "bob", "carol"}
    out = comix.export(tmp_path / "run", user="alice", out=tmp_path / "alice")
    model, tok = comix.load_personal(out)
    assert tok is not None and model(input_ids=_ids()).logits.shape == (2, 24, 257)
