"""`comix export` / `comix.load_personal`: the user's model outside comix has the
run's logits, in PEFT and merged form for plain LoRA, expert by expert and exactly through the
manifest for mixtures; bad input is one line and leaves nothing half-written."""
import json

import pytest
import torch

from comix.cli import main
from comix.personal import ExportError, export_personal, load_personal, rebuild, resolve_method_dir
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
    printed = capsys.readouterr()
    assert printed.out.startswith("der hund")
    assert "model: fedavg for user bob on tiny-llama" in printed.err and "random weights" in printed.err


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
    fails(["generate", str(tmp_path), "hi"], "is neither a `comix export` folder")
    fails(["export", str(run), "--user", "bob", "--out", str(out / "m"), "--method", "comigs-1g1s", "--merged"],
          "--merged: comigs-1g1s is a mixture of LoRA experts")
    assert not (out / "m").exists()


def test_an_export_of_a_tiny_model_loads_with_auto_peft_offline_in_a_process_without_comix(run, tmp_path):
    """The tiny model exists nowhere but in comix: its export carries base/, which every PEFT
    folder names, so plain transformers + peft load it with no network and give the run's logits."""
    import os
    import subprocess
    import sys

    out = export_personal(run, "alice", tmp_path / "alice", method="fedavg")
    assert (out / "base" / "config.json").exists()
    assert json.loads((out / "adapter_config.json").read_text())["base_model_name_or_path"] == str((out / "base").resolve())
    model, _, _ = rebuild(run / "fedavg", "alice")
    ids = _ids()
    torch.save(ids, tmp_path / "ids.pt")
    code = ("import sys, torch\nassert 'comix' not in sys.modules\nfrom peft import AutoPeftModelForCausalLM\n"
            f"m = AutoPeftModelForCausalLM.from_pretrained({str(out)!r}).eval()\n"
            f"ids = torch.load({str(tmp_path / 'ids.pt')!r})\n"
            f"with torch.no_grad(): torch.save(m(input_ids=ids).logits, {str(tmp_path / 'got.pt')!r})\n"
            "assert 'comix' not in sys.modules\n")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    done = subprocess.run([sys.executable, "-c", code], env=env, cwd=tmp_path, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    assert torch.allclose(torch.load(tmp_path / "got.pt"), _logits(model, ids), atol=1e-5)


def test_static_export_reaches_for_no_network_and_generate_takes_peft_and_merged_folders(run, tmp_path, capsys,
                                                                                        monkeypatch):
    import socket

    def refuse(*args, **kwargs):
        raise AssertionError("the export reached for the network")
    monkeypatch.setattr(socket.socket, "connect", refuse)
    mix = export_personal(run, "bob", tmp_path / "mix", method="comigs-1g1s", static=True)
    plain = export_personal(run, "bob", tmp_path / "plain", method="fedavg", merged=True)
    for folder in (mix / "experts" / "0", mix / "static", plain / "merged"):
        capsys.readouterr()
        assert main(["generate", str(folder), "der hund", "--max-new-tokens", "3"]) == 0, folder
        assert capsys.readouterr().out.startswith("der hund")


def test_the_python_face_runs_exports_and_reloads(tmp_path):
    """comix.run / compare / export / load_personal / report in one process, in the order
    docs/export.md shows them: running a method must not shadow ``comix.compare`` by a submodule."""
    import comix
    from comix.api import overrides_of

    assert overrides_of(["seed=1"], {"train": {"rounds": 2}, "train.lr": 0.01, "methods": ["fedavg"]}) == \
        ["seed=1", "train.rounds=2", "train.lr=0.01", 'methods=["fedavg"]']
    data = _user_dirs(tmp_path / "data")
    settings = dict(arg.split("=", 1) for arg in TINY)
    results = comix.run(None, *[f"{k}={v}" for k, v in settings.items()], corpus=str(data), methods=["fedavg"],
                        run_dir=str(tmp_path / "run"), quiet=True)
    assert [r["method"] for r in results] == ["fedavg"] and set(results[0]["per_user"]) == {"alice", "bob", "carol"}
    assert results.run_dir == tmp_path / "run"
    grid = comix.compare(None, *[f"{k}={v}" for k, v in settings.items()], corpus=str(data), methods=["pretrained"],
                         seeds=[1], run_dir=str(tmp_path / "grid"), quiet=True)
    assert set(grid) == {"pretrained"} and set(grid["pretrained"]) == {1} and grid.run_dir == tmp_path / "grid"
    out = comix.export(results.run_dir, user="alice", out=tmp_path / "alice")
    model, tok = comix.load_personal(out)
    assert tok is not None and model(input_ids=_ids()).logits.shape == (2, 24, 257)
    page, md = comix.report(tmp_path / "run", routing=False)
    assert page == tmp_path / "run" / "report.html" and "## Results" in md.read_text()


def test_no_submodule_shadows_a_function_of_the_python_face():
    """``import comix.x`` sets the attribute ``comix.x`` to the module: a submodule named like one of
    ``comix.__all__`` (``compare.py`` once did) replaces that function as soon as anything imports it."""
    import pkgutil

    import comix
    modules = {m.name for m in pkgutil.iter_modules(comix.__path__)}
    assert not modules & set(comix.__all__), modules & set(comix.__all__)


TASK = """task: comix_tiny_choice
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: answer
metric_list:
  - metric: acc
"""


def _harness_task(folder):
    """A multiple-choice task on local files, as a user would write one (no network)."""
    folder.mkdir()
    docs = [{"question": "the cat sat on", "choices": [" a mat", " der hund", " import"], "answer": 0},
            {"question": "der hund lief", "choices": [" the mat", " im park", " return"], "answer": 1},
            {"question": "def f(): return", "choices": [" cat", " park", " import class"], "answer": 2}]
    (folder / "docs.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
    (folder / "tiny.yaml").write_text(TASK.format(data=folder / "docs.jsonl"))
    return folder


def _harness(model, model_args, tasks_dir):
    """lm-eval's evaluator (what its command line calls): per-choice log-likelihoods and accuracy."""
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager
    import comix.harness  # noqa: F401  registers the ``comix`` model
    out = simple_evaluate(model=model, model_args=model_args, tasks=["comix_tiny_choice"], log_samples=True,
                          task_manager=TaskManager(include_path=str(tasks_dir)), device="cpu", batch_size=1)
    samples = out["samples"]["comix_tiny_choice"]
    lls = [[(args, r[0][0]) for args, r in zip(s["arguments"], s["resps"])] for s in samples]
    return lls, out["results"]["comix_tiny_choice"]["acc,none"]


def test_lm_eval_harness_scores_an_exported_adapter_and_a_mixture(run, tmp_path):
    """Plain LoRA: lm-eval's own ``hf`` model with ``peft=`` and the ``comix`` model give the same
    log-likelihoods (PEFT's loader and comix's agree), not the base's. A mixture through ``comix``:
    lm-eval scores exactly the rebuilt personal model (each choice's log-likelihood recomputed here)."""
    pytest.importorskip("lm_eval")
    tasks = _harness_task(tmp_path / "tasks")
    base, tok = load_base_model("tiny-llama")
    base.save_pretrained(str(tmp_path / "base"))
    tok.save_pretrained(str(tmp_path / "base"))
    plain = export_personal(run, "alice", tmp_path / "alice", method="fedavg")
    via_peft, acc = _harness("hf", f"pretrained={tmp_path / 'base'},peft={plain}", tasks)
    via_comix, _ = _harness("comix", f"personal={plain}", tasks)
    bare, _ = _harness("hf", f"pretrained={tmp_path / 'base'}", tasks)
    def values(lls):
        return torch.tensor([[ll for _, ll in doc] for doc in lls])
    assert torch.allclose(values(via_peft), values(via_comix), atol=1e-4) and 0 <= acc <= 1
    assert not torch.allclose(values(via_peft), values(bare), atol=1e-3)

    mixture = export_personal(run, "bob", tmp_path / "bob", method="comigs-1g1s")
    got, _ = _harness("comix", f"personal={mixture}", tasks)
    model, _ = load_personal(mixture)
    from comix.harness import ComixLM
    lm = ComixLM(personal=str(mixture), batch_size=1)
    assert sum(len(doc) for doc in got) == 9
    for doc in got:
        for (context, continuation), ll in doc:  # the requests lm-eval built from the task
            ctx, cont = lm._encode_pair(context, continuation)
            ids = torch.tensor([ctx + cont])
            logp = torch.log_softmax(_logits(model, ids[:, :-1]).double(), -1)[0, len(ctx) - 1:]
            assert ll == pytest.approx(float(logp.gather(-1, torch.tensor(cont)[:, None]).sum()), abs=1e-4)


def test_layers_without_a_peft_form_and_global_models_export_and_reload(tmp_path):
    """FedAMoLE's AMoLE layers and soft prompts have no PEFT form: comix's own (adapters + manifest)
    reloads with the run's logits. DeepFusion's model is the server's: its Mixtral folder is
    exported for every user and reloads as plain transformers."""
    from transformers import AutoModelForCausalLM
    from test_deepfusion import DF, _domains
    data = _user_dirs(tmp_path / "data")
    run = tmp_path / "run"
    assert main(["run", f"corpus={data}", f"run_dir={run}", "methods=[fedamole:pool=6,slots=4,fedprompt]", *TINY]) == 0
    ids = _ids()
    for method in ("fedamole:pool=6,slots=4", "fedprompt"):
        out = export_personal(run, "carol", tmp_path / method.replace(":", "_"), method=method)
        man = json.loads((out / "manifest.json").read_text())
        assert man["kind"] == "comix" and man["peft"] is None and "no PEFT form" in man["note"]
        model, _ = load_personal(out)
        want, _, _ = rebuild(resolve_method_dir(run, method), "carol")
        assert torch.equal(_logits(model, ids), _logits(want, ids)), method
        base, _ = load_base_model("tiny-llama")
        if method.startswith("fedamole"):
            _amole_expert_folders_are_their_forced_routing(model, out, ids)
        mine = _logits(model, ids)[:, -ids.shape[1]:]  # (a soft prompt's virtual tokens come first)
        assert not torch.allclose(mine, _logits(base, ids), atol=1e-4)  # the adapters count
    df = tmp_path / "df"
    assert main(["run", f"corpus={_domains(tmp_path / 'domains')}", "methods=[deepfusion]", f"run_dir={df}", *DF]) == 0
    out = tmp_path / "df-export"
    assert main(["export", str(df), "--out", str(out)]) == 0
    model, tok = load_personal(out)
    saved = AutoModelForCausalLM.from_pretrained(str(df / "deepfusion" / "global-moe")).eval()
    assert type(model).__name__ == "MixtralForCausalLM" and tok is not None
    assert torch.equal(_logits(model, ids), _logits(saved, ids))
    # no device form of the server's global MoE: one line, nothing written
    with pytest.raises(ExportError, match="global MoE"):
        export_personal(df, None, tmp_path / "df-pte", format="gguf")
    assert not (tmp_path / "df-pte").exists()
    # a method with a model per user needs --user (one line)
    assert main(["export", str(run), "--method", "fedprompt", "--out", str(tmp_path / "x")]) == 2


def _amole_expert_folders_are_their_forced_routing(model, out, ids):
    """Each ``experts/<id>`` PEFT folder of a FedAMoLE export is the comix model whose routers give
    that expert weight 1 where the client holds it (and nothing else): logits to 1e-5."""
    from peft import PeftModel
    from comix.models.amole import AMoLELinear
    from comix.models.mixture import Routing
    man = json.loads((out / "manifest.json").read_text())
    assert man["experts"] and all((out / e["peft"] / "adapter_config.json").exists() for e in man["experts"])
    layers = [m for m in model.modules() if isinstance(m, AMoLELinear)]
    # exactly the global experts the client holds in some module (an empty slot, id -1, is none)
    held = sorted({i for m in layers for i in m.slot_ids[:m.n_active].tolist()})
    assert [e["id"] for e in man["experts"]] == held and min(held) >= 0
    assert sorted(p.name for p in (out / "experts").iterdir()) == sorted(map(str, held))
    for entry in man["experts"][:2]:
        j = entry["id"]

        def forced(x, m, j=j):
            held = m.slot_ids[:m.n_active].tolist()
            idx = torch.full((x.shape[0], 1), held.index(j) if j in held else 0, dtype=torch.long)
            return Routing(idx, torch.full((x.shape[0], 1), 1.0 if j in held else 0.0), None)
        for m in layers:
            m.route = lambda x, m=m: forced(x, m)
        try:
            want = _logits(model, ids)
        finally:
            for m in layers:
                del m.route
        base, _ = load_base_model("tiny-llama")
        peft = PeftModel.from_pretrained(base, str(out / entry["peft"])).eval()
        assert torch.allclose(_logits(peft, ids), want, atol=1e-5), j


def test_flora_fedalt_and_feddpa_export_what_they_hold(tmp_path):
    """FLoRA's merged update and FedALT's mixer survive the run folder: the rebuilt model scores as
    the run scored it; FedDPA's PEFT folder is its pair at the authors' fixed weights, with a caveat."""
    from peft import PeftModel

    from comix.config import load_config
    from comix.data import load_corpus, make_user_data
    from comix.eval import perplexity

    data = _user_dirs(tmp_path / "data")
    run = tmp_path / "run"
    assert main(["run", f"corpus={data}", f"run_dir={run}", "methods=[flora,fedalt,feddpa-t]", *TINY]) == 0
    cfg = load_config(str(run / "config.yaml"))
    for method in ("flora", "fedalt"):
        model, tok, _ = rebuild(run / method, "bob")
        user = next(u for u in make_user_data(load_corpus(cfg.corpus), tok, cfg.data) if u.name == "bob")
        got = perplexity(model, user.test, cfg.train.seq_len, cfg.train.eval_batch_size)
        assert got == pytest.approx(json.loads((run / method / "results.json").read_text())["per_user"]["bob"]["test_ppl"],
                                    rel=1e-5)
        man = json.loads((export_personal(run, "bob", tmp_path / method, method=method) / "manifest.json").read_text())
        assert man["kind"] == "comix" and "caveat" not in man
    out = export_personal(run, "bob", tmp_path / "feddpa", method="feddpa-t")
    man = json.loads((out / "manifest.json").read_text())
    assert man["kind"] == "lora" and "fixed weights (0.5, 0.5)" in man["caveat"]
    model, _, _ = rebuild(run / "feddpa-t", "bob")
    peft = PeftModel.from_pretrained(load_base_model("tiny-llama")[0], str(out)).eval()
    assert torch.allclose(_logits(peft, _ids()), _logits(model, _ids()), atol=1e-5)


@pytest.mark.parametrize("spec", ["tiny-gpt2", "tiny-llama"])
def test_a_peft_folder_gives_comix_s_logits_on_either_weight_layout_and_mixed_ranks(tmp_path, spec):
    """GPT-2's Conv1D stores its weight (in, out), Llama's Linear (out, in): the PEFT folder says
    which (fan_in_fan_out) and each module's rank and alpha (an FDLoRA pair fused into one LoRA of
    twice the rank on the MLP, each half weighed by its fusion weight, beside rank-r attention
    LoRAs), so PEFT computes exactly comix's model on either layout."""
    from peft import PeftModel

    from comix.algorithms.fdlora import set_fusion
    from comix.models import LoRAConfig
    from comix.personal import write_peft_lora
    from comix.personal.peft_forms import _lora_modules
    model = inject_adapters(load_base_model(spec, dropout=0.0)[0],
                            AdapterConfig(lora=LoRAConfig(r=4, alpha=8), mlp="lora", personal=True)).eval()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if ".lora" in n:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
    set_fusion(model, (0.7, -0.4))
    modules = _lora_modules(model)
    assert {a.shape[0] for a, *_ in modules.values()} == {4, 8}  # rank r on attention, the 2r pair on the MLP
    write_peft_lora(modules, tmp_path / "peft", spec)
    config = json.loads((tmp_path / "peft" / "adapter_config.json").read_text())
    assert config["fan_in_fan_out"] is (spec == "tiny-gpt2")
    base = load_base_model(spec, dropout=0.0)[0]
    ids = _ids()
    want = _logits(model, ids)
    assert not torch.allclose(_logits(base, ids), want, atol=1e-3)
    peft = PeftModel.from_pretrained(base, str(tmp_path / "peft")).eval()
    assert torch.allclose(_logits(peft, ids), want, atol=1e-5)


def test_the_static_adapter_is_the_experts_weighed_by_the_user_s_last_mean_gates(run, tmp_path):
    """--static: the weights are the user's gate per expert in the last evaluation, averaged over
    layers, and PEFT's "cat" combination makes every module's weight change the sum of the
    experts' changes at those weights (the attention LoRA, in every expert's folder, once)."""
    from peft import PeftModel

    out = export_personal(run, "bob", tmp_path / "bob", method="comigs-1g1s", static=True)
    weights = json.loads((out / "manifest.json").read_text())["static"]["weights"]
    rows = [json.loads(x) for x in (run / "comigs-1g1s" / "metrics.jsonl").read_text().splitlines()]
    gates = [r["gates"] for r in rows if r.get("user") == "bob" and "gates" in r]
    assert len(gates) == 2 and gates[0] != gates[-1] and len({tuple(layer) for layer in gates[-1]}) > 1
    assert weights == pytest.approx(torch.tensor(gates[-1], dtype=torch.float64).mean(0).tolist(), abs=1e-6)

    def delta(folder):
        base = load_base_model("tiny-llama")[0]
        before = {n: t.clone() for n, t in base.state_dict().items()}
        merged = PeftModel.from_pretrained(base, str(folder)).merge_and_unload()
        return {n: t - before[n] for n, t in merged.state_dict().items()}

    static, experts = delta(out / "static"), [delta(out / "experts" / str(j)) for j in range(len(weights))]
    changed = [n for n, d in static.items() if d.abs().max() > 0]
    assert any(".mlp." in n for n in changed) and any(".self_attn." in n for n in changed)
    for n in static:
        assert torch.allclose(static[n], sum(w * e[n] for w, e in zip(weights, experts)), atol=1e-6), n
