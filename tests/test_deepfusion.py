"""DeepFusion's building blocks: VAA, upcycling into a transformers MoE, structured pruning,
cosine KMeans clustering, proxy teachers, the KD loss and the data embedding."""
import copy
import hashlib
import json
import math
import re

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

from comix.algorithms.deepfusion_clusters import architecture_of, average_models, cluster_devices, proxy_teachers
from comix.models.kd import OFABranches, check_same_vocabulary, kd_loss
from comix.models.prune import block_influence, kept_layers, prune
from comix.models.upcycle import expert_params, upcycle
from comix.models.vaa import ViewAlignedAttention, pool_patches, stage_ends, stage_features


def _llama(seed=0, layers=4, inter=48, vocab=97):
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=inter, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      tie_word_embeddings=True)
    return LlamaForCausalLM(cfg).eval()


IDS = torch.randint(0, 97, (2, 11), generator=torch.Generator().manual_seed(1))


def test_vaa_shapes_for_stages_and_teacher_widths_unlike_the_student():
    vaa = ViewAlignedAttention(student_widths=[32, 32, 32], teacher_widths=[16, 24, 40], queries=12, d=16, heads=4)
    student = [torch.randn(2, 11, 32, requires_grad=True) for _ in range(3)]
    views = vaa(student)
    assert [tuple(v.shape) for v in views] == [(2, 4, 16), (2, 4, 24), (2, 4, 40)]
    teacher = [torch.randn(2, 11, c) for c in (16, 24, 40)]
    loss = vaa.loss(student, teacher)
    loss.backward()
    assert loss.item() > 0 and all(s.grad.abs().sum() > 0 for s in student)  # every stage feeds the view
    assert all(p.grad is not None for p in vaa.parameters())
    with pytest.raises(ValueError, match="multiple of the 3 stages"):
        ViewAlignedAttention([32] * 3, [16] * 3, queries=10)


def test_vaa_attention_mixes_stages():
    """The blended view of stage 1 depends on stage 2's features (the point of eq. 8)."""
    vaa = ViewAlignedAttention([8, 8], [8, 8], queries=4, d=8, heads=2)
    a = [torch.randn(1, 6, 8), torch.randn(1, 6, 8)]
    b = [a[0], torch.randn(1, 6, 8)]
    assert not torch.allclose(vaa(a)[0], vaa(b)[0])


def test_vaa_reads_student_features_scale_free():
    """Outlier-scaled student features (SmolLM2's residual stream) give the same view and an
    L_FM on the teacher's normalised scale, not one inflated by the outliers (vaa.py docstring)."""
    torch.manual_seed(0)
    vaa = ViewAlignedAttention([16, 16], [8, 8], queries=4, d=8, heads=2)
    student = [torch.randn(2, 6, 16), torch.randn(2, 6, 16)]
    loud = [s * 300.0 + 40.0 for s in student]
    assert all(torch.allclose(a, b, atol=1e-4) for a, b in zip(vaa(student), vaa(loud)))
    teacher = [torch.randn(2, 6, 8) * 50.0 for _ in range(2)]
    assert vaa.loss(loud, teacher).item() < 2 * 2  # ~1 per stage for an untrained VAA


def test_patch_pooling_ignores_padding_and_stages_end_where_they_should():
    x = torch.randn(1, 6, 3)
    padded = torch.cat([x, torch.full((1, 4, 3), 99.0)], dim=1)
    mask = torch.tensor([[1] * 6 + [0] * 4])
    assert torch.allclose(pool_patches(padded, 2, mask), pool_patches(x, 2))
    assert torch.allclose(pool_patches(x, 2), torch.stack([x[0, :3].mean(0), x[0, 3:].mean(0)])[None])
    assert stage_ends(30, 4) == [8, 15, 22, 30] and stage_ends(4, 4) == [1, 2, 3, 4]
    hs = tuple(torch.full((1, 1, 1), float(i)) for i in range(31))
    assert [int(h) for h in stage_features(hs, 4)] == [8, 15, 22, 30]
    with pytest.raises(ValueError, match="stages = 5"):
        stage_ends(4, 5)


def test_upcycled_moe_equals_the_dense_model_when_experts_are_identical():
    dense = _llama()
    moe = upcycle([copy.deepcopy(dense) for _ in range(3)], top_k=2, router_std=0.5)  # any gate
    assert type(moe).__name__ == "MixtralForCausalLM" and moe.config.num_local_experts == 3
    with torch.no_grad():
        assert torch.allclose(moe(IDS).logits, dense(IDS).logits, atol=1e-5)


def test_upcycling_takes_each_ffn_as_an_expert_and_averages_the_rest(tmp_path):
    models = [_llama(seed=s) for s in range(3)]
    moe = upcycle(models, top_k=2)
    sd = moe.state_dict()
    for i, m in enumerate(models):  # eq. 12
        mlp = m.model.layers[1].mlp
        assert torch.equal(sd["model.layers.1.mlp.experts.gate_up_proj"][i],
                           torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]))
        assert torch.equal(sd["model.layers.1.mlp.experts.down_proj"][i], mlp.down_proj.weight)
    for name in ("model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight", "model.norm.weight"):  # eq. 13
        assert torch.allclose(sd[name], torch.stack([m.state_dict()[name] for m in models]).mean(0))
    assert {id(p) for p in expert_params(moe)} == {id(moe.model.layers[i].mlp.experts.gate_up_proj) for i in
                                                   range(4)} | {id(moe.model.layers[i].mlp.experts.down_proj)
                                                                for i in range(4)}
    moe.save_pretrained(tmp_path / "moe")  # a real transformers MoE: loads without comix
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "moe")
    with torch.no_grad():
        assert torch.allclose(again(IDS).logits, moe(IDS).logits, atol=1e-6)


def test_upcycling_refuses_what_it_cannot_merge():
    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=97))
    with pytest.raises(ValueError, match="model 1 is GPT2LMHeadModel"):
        upcycle([_llama(), gpt2])
    with pytest.raises(ValueError, match="model 1 has intermediate_size = 64"):
        upcycle([_llama(), _llama(inter=64)])
    with pytest.raises(ValueError, match="top_k = 4"):
        upcycle([_llama(), _llama(seed=1)], top_k=4)


def test_pruning_keeps_the_most_influential_blocks_and_neurons_exactly():
    dense = _llama(layers=6)
    cal = torch.randint(0, 97, (3, 16), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        # block 3 made an identity (attention and FFN write nothing): the least influential
        dense.model.layers[3].self_attn.o_proj.weight.zero_()
        dense.model.layers[3].mlp.down_proj.weight.zero_()
        bi = block_influence(dense(cal, output_hidden_states=True).hidden_states)
        assert bi.shape == (6,) and bi[3].abs() < 1e-6 and 3 not in kept_layers(bi, 5)
        assert torch.allclose(prune(dense, cal)(IDS).logits, dense(IDS).logits, atol=1e-6)  # nothing removed
        small = prune(dense, cal, layers=3, intermediate=20)
        assert small.config.num_hidden_layers == 3 and small.model.layers[0].mlp.gate_proj.weight.shape == (20, 32)
        keep = kept_layers(bi, 3)
        # each kept block's neurons: the 20 of largest mean |silu(gate x) * up x| * ||down column||,
        # recomputed here from the FFN inputs of the calibration pass
        inputs = {}
        hooks = [dense.model.layers[i].mlp.register_forward_pre_hook(
            lambda m, a, i=i: inputs.__setitem__(i, a[0])) for i in keep]
        dense(cal)
        for h in hooks:
            h.remove()
        ref = copy.deepcopy(dense)
        ref.model.layers = torch.nn.ModuleList(ref.model.layers[i] for i in keep)
        ref.config.num_hidden_layers = 3
        for i, block in zip(keep, ref.model.layers):
            mlp = block.mlp
            act = (F.silu(mlp.gate_proj(inputs[i])) * mlp.up_proj(inputs[i])).abs().mean((0, 1))
            drop = torch.ones(48, dtype=torch.bool)
            drop[(act * mlp.down_proj.weight.norm(dim=0)).topk(20).indices] = False
            mlp.down_proj.weight[:, drop] = 0
        assert torch.allclose(small(IDS).logits, ref(IDS, use_cache=False).logits, atol=1e-5)
    with pytest.raises(ValueError, match="intermediate = 100"):
        prune(dense, cal, intermediate=100)
    with pytest.raises(ValueError, match="layers = 7"):
        prune(dense, cal, layers=7)


def test_width_pruning_equals_the_original_with_the_dropped_channels_held_at_zero():
    from comix.models.prune import calibrate, kept_channels
    dense = _llama(layers=3)
    cal = torch.randint(0, 97, (3, 16), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        small = prune(dense, cal, hidden=20)
        assert small.config.hidden_size == 20 and small.model.embed_tokens.weight.shape == (97, 20)
        assert small.model.layers[0].self_attn.q_proj.weight.shape == (32, 20)  # heads keep their size
        ch = kept_channels(calibrate(dense, cal)[2], 20)
        # the channels of largest mean |h| over the calibration pass's hidden states
        states = dense(cal, output_hidden_states=True).hidden_states
        assert set(ch.tolist()) == set(torch.stack([h.abs().mean((0, 1)) for h in states]).mean(0).topk(20).indices.tolist())
        ref = copy.deepcopy(dense)
        drop = torch.ones(32, dtype=torch.bool)
        drop[ch] = False
        ref.model.embed_tokens.weight[:, drop] = 0  # (tied: the head reads nothing there either)
        for block in ref.model.layers:
            block.self_attn.o_proj.weight[drop] = 0
            block.mlp.down_proj.weight[drop] = 0
        assert torch.allclose(small(IDS).logits, ref(IDS).logits, atol=1e-5)
        assert not torch.allclose(small(IDS).logits, dense(IDS).logits, atol=1e-3)
    with pytest.raises(ValueError, match="hidden = 33"):
        prune(dense, cal, hidden=33)


def test_pruned_devices_of_one_spec_start_from_one_model():
    """Every device (and the server) builds a spec's model alike: calibration is fixed text."""
    from comix.data import calibration_docs
    from comix.models import load_base_model
    from comix.models.devices import build_device_model
    base = load_base_model("tiny-llama")[0]
    a, b = (build_device_model("prune:1:16", base, calibration_docs()) for _ in range(2))
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    with pytest.raises(ValueError, match="needs calibration text"):  # models never read data themselves
        build_device_model("prune:1:16", base)


def test_cosine_kmeans_groups_clearly_separated_embeddings():
    gen = torch.Generator().manual_seed(0)
    centers = torch.eye(8)[:3] * 5
    groups = [0, 0, 0, 1, 1, 2, 2, 2, 2]
    emb = torch.stack([centers[g] + 0.3 * torch.randn(8, generator=gen) for g in groups])
    emb[3] *= 40  # a longer vector in the same direction: cosine ignores the norm
    labels = cluster_devices(emb, 3, seed=1)
    assert len(set(labels)) == 3 and all((labels[i] == labels[j]) == (groups[i] == groups[j])
                                         for i in range(9) for j in range(9))
    with pytest.raises(ValueError, match="K = 10 must lie in \\[1, N = 9\\]"):
        cluster_devices(emb, 10)
    with pytest.raises(ValueError, match="distinct device embeddings"):
        cluster_devices(torch.ones(4, 8), 2)


def test_proxy_teachers_average_each_architecture_of_a_domain():
    a0, a1, b0 = _llama(seed=0), _llama(seed=1), _llama(seed=2, inter=64)
    proxies = proxy_teachers([a0, b0, a1], labels=[0, 0, 0], k=1)
    (first, w1), (second, w2) = proxies[0]
    assert sorted([w1, w2]) == [pytest.approx(1 / 3), pytest.approx(2 / 3)]
    avg = first if architecture_of(first) == architecture_of(a0) else second
    name = "model.layers.0.mlp.up_proj.weight"
    assert torch.allclose(avg.state_dict()[name], (a0.state_dict()[name] + a1.state_dict()[name]) / 2)
    with pytest.raises(ValueError, match="different architectures"):
        average_models([a0, b0])
    with pytest.raises(ValueError, match="vocab_size 50"):
        check_same_vocabulary(_llama(vocab=50), a0)


def test_kd_loss_terms():
    student, teacher = _llama(seed=0), _llama(seed=3, layers=2)
    x, y = IDS[:, :-1], IDS[:, 1:]
    s_out, t_out = student(x, output_hidden_states=True), teacher(x, output_hidden_states=True)
    vaa = ViewAlignedAttention([32, 32], [32, 32], queries=4, d=16, heads=2)
    terms = kd_loss(s_out, t_out, y, vaa, stages=2, alpha=0.5, beta=2.0)
    assert terms["ce"].item() == pytest.approx(student(IDS, labels=IDS).loss.item(), rel=1e-5)
    assert terms["kl"] > 0 and terms["fm"] > 0
    assert terms["total"].item() == pytest.approx((terms["ce"] + 0.5 * terms["fm"] + 2.0 * terms["kl"]).item())
    same = kd_loss(s_out, s_out, y, None, stages=2, alpha=0.5, beta=1.0)  # a teacher equal to the student
    assert same["kl"].item() == pytest.approx(0, abs=1e-6) and same["fm"].item() == 0
    # OFA-KD: each intermediate stage's logits against the teacher's; zero-initialised branches
    # start as the student's own head on that stage
    ofa = OFABranches(student, stages=2)
    (z,) = ofa(stage_features(s_out.hidden_states, 2)[:-1])
    assert torch.allclose(z, student.lm_head(student.model.norm(s_out.hidden_states[2])), atol=1e-6)
    assert kd_loss(s_out, t_out, y, None, 2, alpha=1.0, beta=0.0, ofa=ofa)["fm"] > 0


def _tiny_encoder(path):
    from transformers import BertConfig, BertModel, BertTokenizerFast
    words = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "the", "cat", "sat", "dog", "ran", "on", "mat"]
    path.mkdir()
    (path / "vocab.txt").write_text("\n".join(words) + "\n")
    BertTokenizerFast(vocab_file=str(path / "vocab.txt")).save_pretrained(path)
    torch.manual_seed(0)
    BertModel(BertConfig(vocab_size=len(words), hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                         intermediate_size=32)).save_pretrained(path)
    return str(path)


def test_sentence_embedding_is_a_masked_mean_of_unit_norm(tmp_path):
    from comix.data.embed import SentenceEncoder
    enc = SentenceEncoder(_tiny_encoder(tmp_path / "enc"))
    alone = enc.encode(["the cat sat"])
    batched = enc.encode(["the cat sat", "the dog ran on the mat the mat the mat"])
    assert torch.allclose(alone[0], batched[0], atol=1e-5)  # padding never enters the mean
    assert torch.allclose(batched.norm(dim=1), torch.ones(2), atol=1e-5)
    texts = ["the cat sat", "the dog ran", "on the mat"]
    emb = enc.data_embedding(texts, examples=2, seed=3)
    idx = torch.randperm(3, generator=torch.Generator().manual_seed(3))[:2].sort().values.tolist()
    assert torch.allclose(emb, enc.encode([texts[i] for i in idx]).mean(0))
    with pytest.raises(ValueError, match="no training text"):
        enc.data_embedding([])


def test_minilm_from_its_wheel_separates_domains():
    from comix.data.embed import SentenceEncoder
    enc = SentenceEncoder()
    e = enc.encode(["The patient was given 5 mg of the drug twice daily.", "Dosage for adults with hypertension.",
                    "def parse(path): return open(path).read()", "for i in range(10): print(i)"])
    assert e.shape == (4, 384)
    sim = e @ e.T
    assert sim[0, 1] > sim[0, 2] and sim[2, 3] > sim[1, 3]


def _domains(root):
    import random
    rng = random.Random(0)
    words = {"med": "dose patient drug fever tablet".split(), "fin": "stock bond yield market price".split(),
             "code": "def return import class self".split()}
    for name, vocab in words.items():
        (root / name).mkdir(parents=True)
        for i in range(12):
            text = " ".join(rng.choice(vocab) for _ in range(80))
            if name == "fin":  # question-answer documents: Table II scores generated answers
                text = f"Question: {text[:120]}\nAnswer: {' '.join(rng.choice(vocab) for _ in range(6))}"
            (root / name / f"{i}.txt").write_text(text)
    return root


DF = ["model=tiny-llama", "train.rounds=1", "train.local_steps=2", "train.batch_size=2", "train.seq_len=32",
      "train.lr=0.001", "data.clients=5", "data.alpha=0.1", "data.public_frac=0.2", "data.test_tokens=256",
      "deepfusion.experts=3", "deepfusion.stages=2", "deepfusion.queries=4", "deepfusion.vaa_dim=16",
      "deepfusion.vaa_heads=2", "deepfusion.kd_steps=2", "deepfusion.tune_steps=2", "deepfusion.kd_batch=2",
      "deepfusion.embed_examples=4", "deepfusion.embed_tokens=32",
      "deepfusion.devices=[base,prune:2:32,random-gpt2:2:64,random-qwen2:2:64]"]


def test_deepfusion_one_shot_end_to_end(tmp_path, monkeypatch, capsys):
    """Each device sends exactly once, only its own trained model and its data embedding; the
    server's global MoE is a transformers Mixtral scored on the server's test data by domain."""
    from comix.algorithms.deepfusion import DeepFusion
    from comix.cli import main

    sent = []
    real = DeepFusion.client_round

    def spy(self, ctx, state, payload):
        state, upload, metrics = real(self, ctx, state, payload)
        sent.append((ctx.client, set(upload), {n: tuple(p.shape) for n, p in ctx.model.named_parameters()},
                     self.device_spec(ctx.client)))
        return state, upload, metrics
    monkeypatch.setattr(DeepFusion, "client_round", spy)
    data = _domains(tmp_path / "data")
    assert main(["compare", f"corpus={data}", f"run_dir={tmp_path}", *DF, "--methods", "deepfusion", "fedkmt",
                 "--seeds", "1"]) == 0
    run = tmp_path / "seed1"
    for method in ("deepfusion", "fedkmt"):
        ups = [s for s in sent if s[0] is not None][:5] if method == "deepfusion" else sent[5:]
        assert sorted(c for c, *_ in ups) == [0, 1, 2, 3, 4]  # every device once, one round only
        for c, names, shapes, spec in ups:
            assert names == {f"weights.{n}" for n in shapes} | {"data_embedding"}
        rows = [json.loads(x) for x in (run / method / "metrics.jsonl").read_text().splitlines()]
        devices = [r for r in rows if r.get("evaluated_by") != "server"]
        assert len(devices) == 5 and all(r["round"] == 1 for r in rows)
        for r in devices:  # the bytes are the device's model (fp32) and a 384-float embedding
            shapes = next(s for c, _, s, _ in ups if f"client{c}" == r["user"])
            assert r["bytes_up"] == 4 * (sum(math.prod(s) for s in shapes.values()) + 384)
        res = json.loads((run / method / "results.json").read_text())
        assert res["metric"] == "test_ppl" and set(res["per_user"]) == {"med", "fin", "code"}
        assert not list((run / method).glob("adapters/*.safetensors"))  # devices keep no adapters: no empty files
        assert all({"test_log_ppl", "test_token_acc", "test_base_log_ppl"} <= set(v) for v in res["per_user"].values())
        moe = AutoModelForCausalLM.from_pretrained(run / method / "global-moe")
        assert type(moe).__name__ == "MixtralForCausalLM" and moe.config.num_local_experts == 3
        report = json.loads((run / method / "server.jsonl").read_text().splitlines()[0])
        assert len(report["domains"]) == 5 and set(report["domains"]) <= {0, 1, 2}
        assert len(report["embedding_2d"]) == 5 and all(len(p) == 2 for p in report["embedding_2d"])
        assert (report["kd"][0]["fm"] > 0) == (method == "deepfusion")  # the logit-only baseline has no FM
        loads = [r["expert_load"] for r in rows if r.get("evaluated_by") == "server"]
        assert len(loads) == 3 and all(len(x) == 3 and sum(x) == pytest.approx(1, abs=1e-3) for x in loads)
    # different architectures took part
    assert len({spec for *_, spec in sent}) >= 2
    # Tables I-II and Fig. 7-8 in the comparison: the upload column is what the devices sent
    md = (tmp_path / "compare.md").read_text()
    assert "Stream perplexity (log)" in md and "Teacher-forced next-token accuracy" in md
    assert "Answer perplexity (log)" in md  # the QA domain's headline, the paper's
    assert "Token accuracy of generated answers" in md and "| dense base (deepfusion run) |" in md
    res = json.loads((run / "deepfusion" / "results.json").read_text())
    assert "test_answer_acc" in res["per_user"]["fin"] and "test_answer_acc" not in res["per_user"]["med"]
    fin = res["per_user"]["fin"]  # mixed QA and plain domains: the metric is the stream perplexity every one has
    assert fin["test_answer_ppl"] == pytest.approx(math.exp(fin["test_answer_log_ppl"])) and res["metric"] == "test_ppl"
    assert all(len(kd["grad"]["step"]) == len(kd["grad"]["fm"]) >= 1 for kd in
               json.loads((run / "deepfusion" / "server.jsonl").read_text().splitlines()[0])["kd"])
    total = json.loads((run / "deepfusion" / "results.json").read_text())["bytes_up_total"] / 2**20
    assert f"| deepfusion | {total:.2f} |" in md
    assert "| deepfusion | med" not in md and "| method | code | fin | med |" in md
    assert (tmp_path / "global-model.png").read_bytes()[:4] == b"\x89PNG"  # Fig. 7-9
    # the report: each device's true dominant domain beside its cluster, the experts' load per domain
    mixes = [row["mixture"] for row in json.loads((tmp_path / "partition.json").read_text()).values()]
    assert len(mixes) == 5 and all(set(m) == {"med", "fin", "code"} and sum(m.values()) == pytest.approx(1, abs=1e-3)
                                   for m in mixes)
    page = (tmp_path / "report.md").read_text()
    assert "expert load per test domain" in page and "| dominant true domain |" in page
    assert f"| client0 | {report['devices'][0]} | {report['domains'][0]} | {max(mixes[0], key=mixes[0].get)} |" in page
    # the premise of distillation: what each device knows of its own domain, beside the student
    known = report["in_domain"]
    assert set(known["devices"]) == {str(c) for c in report["clients"]} and set(known["student"]) == {"med", "fin", "code"}
    dom = max(mixes[0], key=mixes[0].get)
    assert f"| {known['devices'][str(report['clients'][0])][dom]:.4f} | {known['student'][dom]:.4f} |" in page
    # and on the public text the distillation runs on: each stream and all pooled, per character
    public = known["public"]
    assert set(public["student"]) == {"med", "fin", "code", "all"} and set(public["devices"]) == set(known["devices"])
    assert min(public["student"].values()) <= public["student"]["all"] <= max(public["student"].values())
    assert public["student"]["all"] != known["student"]["med"]  # not the test text again
    c0 = str(report["clients"][0])
    assert f"| {public['devices'][c0]['all']:.4f} | {public['student']['all']:.4f} |" in page
    # and in the run's log as soon as it is measured, before the distillation (server.jsonl has it after)
    log = " ".join(capsys.readouterr().err.split())
    assert f"public text, nats/char pooled: student {public['student']['all']:.4f}" in log
    assert log.index("nats/char pooled") < log.index("domain 0 distilled")


def test_deepfusion_refuses_bad_settings_in_one_line(tmp_path, capsys):
    from comix.cli import main
    data = _domains(tmp_path / "data")
    for override, msg in (("deepfusion.experts=6", "K = 6 must lie in [1, N = 5]"),
                          ("deepfusion.devices=[prune:x]", "'prune:x' must be prune:<layers>:<ffn>"),
                          ("deepfusion.devices=[random-rnn:2:64]", "random architectures are"),
                          ("train.rounds=2", "one-shot"), ("data.public_frac=0", "set data.public_frac")):
        assert main(["run", f"corpus={data}", f"run_dir={tmp_path / 'x'}", "methods=[deepfusion]", *DF,
                     override]) == 2
        err = capsys.readouterr().err
        assert msg in err and len(err.strip().splitlines()) == 1
        assert not (tmp_path / "x").exists()  # nothing written before the error


def test_central_moe_trains_the_same_moe_on_pooled_data_with_the_devices_budget(tmp_path):
    from comix.cli import main
    data = _domains(tmp_path / "data")
    assert main(["run", f"corpus={data}", f"run_dir={tmp_path / 'run'}", "methods=[central-moe]", *DF]) == 0
    rows = [json.loads(x) for x in (tmp_path / "run" / "central-moe" / "metrics.jsonl").read_text().splitlines()]
    assert sum(r.get("bytes_up", 0) for r in rows) == 0  # the data is central: nothing travels
    assert rows[0]["train_steps"] == 5 * 2  # N devices x local_steps: the devices' token budget
    res = json.loads((tmp_path / "run" / "central-moe" / "results.json").read_text())
    assert set(res["per_user"]) == {"med", "fin", "code"}
    moe = AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "central-moe" / "global-moe")
    assert moe.config.num_local_experts == 3
    # the experts started identical (K copies of the base) and the gate made them differ
    experts = moe.model.layers[0].mlp.experts.gate_up_proj
    assert not torch.allclose(experts[0], experts[1])


class _KilledAt:
    """Counts the calls of ``cls.name``; the call numbered ``at`` (0: none) raises
    KeyboardInterrupt, a session's end. ``next_run(at)`` starts counting again."""

    def __init__(self, monkeypatch, cls, name: str):
        self.calls, self.at, real = [], 0, getattr(cls, name)

        def counted(obj, *a, **k):
            self.calls.append(1)
            if len(self.calls) == self.at:
                raise KeyboardInterrupt
            return real(obj, *a, **k)
        monkeypatch.setattr(cls, name, counted)

    def next_run(self, at: int = 0) -> None:
        self.calls.clear()
        self.at = at


def test_central_moe_in_rounds_killed_and_resumed_trains_as_one_uninterrupted_run(tmp_path, monkeypatch):
    """Rounds only checkpoint the central run: 2 rounds of 1 step, killed after the first and
    resumed, give the MoE and the scores of 1 round of 2 steps (weights, AdamW moments, batch
    generator, learning-rate schedule all carried), and the public tuning runs once, at the end."""
    from comix.algorithms.central_moe import CentralMoE
    from comix.cli import main
    kill = _KilledAt(monkeypatch, CentralMoE, "client_round")
    args = [f"corpus={_domains(tmp_path / 'data')}", *DF, "--seeds", "1", "--methods"]
    assert main(["compare", f"run_dir={tmp_path / 'one'}", *args, "central-moe"]) == 0
    kill.next_run(at=2)  # before the second round
    spec = "central-moe:train.rounds=2,train.local_steps=1"
    assert main(["compare", f"run_dir={tmp_path / 'two'}", *args, spec]) == 130
    kill.next_run()
    assert main(["compare", "--resume", str(tmp_path / "two")]) == 0 and len(kill.calls) == 1  # round 2 only
    one, two = tmp_path / "one" / "seed1" / "central-moe", next((tmp_path / "two" / "seed1").iterdir())
    rows = [json.loads(x) for x in (two / "server.jsonl").read_text().splitlines()]
    assert ["public" in r for r in rows] == [False, True]  # tuned once, after the last round
    steps = {(r["round"], r["train_steps"]) for r in map(json.loads, (two / "metrics.jsonl").read_text().splitlines())
             if "train_steps" in r}
    assert steps == {(1, 5), (2, 5)}  # N x local_steps a round
    assert json.loads((one / "server.jsonl").read_text())["public"] == rows[1]["public"]
    assert json.loads((one / "results.json").read_text())["per_user"] == \
        json.loads((two / "results.json").read_text())["per_user"]
    a, b = (AutoModelForCausalLM.from_pretrained(d / "global-moe").state_dict() for d in (one, two))
    assert all(torch.equal(a[n], b[n]) for n in a)
    assert not (two / "adapters").exists()  # the carried MoE is private state, not an adapter file


def test_fedjets_devices_train_their_assigned_experts_only(tmp_path, monkeypatch):
    from comix.algorithms.fedjets import FedJETS
    from comix.cli import main
    seen = []
    real = FedJETS.client_round

    def spy(self, ctx, state, payload):
        state, upload, metrics = real(self, ctx, state, payload)
        ids = lambda t: {n.split(".")[2] for n in t if n.startswith("e.")}  # noqa: E731
        seen.append((ctx.client, ids(payload), ids(upload), set(upload), dict(upload)))
        return state, upload, metrics
    monkeypatch.setattr(FedJETS, "client_round", spy)
    data = _domains(tmp_path / "data")
    assert main(["run", f"corpus={data}", f"run_dir={tmp_path / 'run'}", "methods=[fedjets]", *DF, "train.rounds=2",
                 "fedjets.experts=3", "fedjets.local_experts=2", "fedjets.top_k=1"]) == 0
    assert len(seen) == 10  # 5 devices x 2 rounds
    for c, sent_ids, up_ids, names, _ in seen:
        assert up_ids == sent_ids and len(up_ids) == 2  # its own experts, never another
        assert not any(n.startswith("router.") for n in names) and {"pref.0", "pref.1"} <= names
    # round 2's experts are the ones each device's data preferred in round 1
    for c, *_, up in seen[:5]:
        pref = torch.stack([up["pref.0"], up["pref.1"]]).mean(0)
        assert next(s[1] for s in seen[5:] if s[0] == c) == {str(i) for i in pref.topk(2).indices.tolist()}
    rows = [json.loads(x) for x in (tmp_path / "run" / "fedjets" / "metrics.jsonl").read_text().splitlines()]
    assert all(r["bytes_down"] > 0 and r["bytes_up"] > 0 for r in rows if "evaluated_by" not in r)
    assert AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "fedjets" / "global-moe").config.num_local_experts == 3


def test_fedjets_aggregates_experts_over_their_holders_only():
    from comix.algorithms import TrainConfig
    from comix.algorithms.base import ServerContext
    from comix.algorithms.fedjets import FedJETS
    from comix.models import LoRAConfig
    algo = FedJETS(LoRAConfig(), TrainConfig(rounds=3), n_clients=2, experts=3, local_experts=1, top_k=1)
    algo.server = ServerContext(base=_llama(layers=2), seed=0)
    state, payloads = algo.server_init({})
    before = state["weights"]["model.layers.0.mlp.experts.down_proj"].clone()
    uploads = {}
    for c, p in payloads.items():
        up = {n: (t + c + 1 if not n.startswith("router.") else t) for n, t in p.items() if not n.startswith("router.")}
        up.update({f"pref.{i}": torch.tensor([0.1, 0.2, 0.7]) for i in range(2)})
        uploads[c] = up
    new, next_payloads = algo.server_round(state, uploads)
    held = {c: int(next(n for n in p if n.startswith("e.0.")).split(".")[2]) for c, p in payloads.items()}
    after = new["weights"]["model.layers.0.mlp.experts.down_proj"]
    for gid in range(3):
        holders = [c for c, g in held.items() if g == gid]
        want = before[gid] + sum(c + 1 for c in holders) / len(holders) if holders else before[gid]
        assert torch.allclose(after[gid], want)
    name = "model.norm.weight"  # a non-expert weight: the mean over every device (+1, +2)
    assert torch.allclose(new["weights"][name], state["weights"][name] + 1.5)
    assert new["assignment"] == {0: [2], 1: [2]}  # the preferred expert next round


def test_qa_cases_have_domains_and_well_formed_questions():
    import re

    from comix.data import load_corpus
    from comix.data.qa import CHOICE_DOMAINS, OPEN_DOMAINS
    choice, again, opened = load_corpus("qa-choice"), load_corpus("qa-choice"), load_corpus("qa-open")
    assert choice == again  # deterministic
    assert set(choice) == set(CHOICE_DOMAINS) and set(opened) == set(OPEN_DOMAINS) and len(choice) >= 4
    letters = {k: 0 for k in "ABCD"}
    for domain, docs in choice.items():
        assert len(docs) >= 200
        for doc in docs[:200]:
            m = re.search(r"\nAnswer: \(([A-D])\)(.*)$", doc)
            assert m, doc
            if domain != "exams":  # the stated letter carries the stated option, which the question hides
                opts = dict(re.findall(r"\(([A-D])\) (.*?)(?= \([A-D]\) |\n)", doc.split("\n")[1] + "\n"))
                assert len(opts) == 4 and opts[m.group(1)] == m.group(2).strip()
                letters[m.group(1)] += 1
    assert min(letters.values()) > 100  # the answer's position is spread over the four letters
    assert all(d.startswith("Question: ") and "\nAnswer: " in d for docs in opened.values() for d in docs)


def test_mmedbench_and_finqa_loaders_read_local_files_of_the_real_schema(tmp_path):
    from comix.data.qa import finqa, mmedbench
    med = tmp_path / "English.jsonl"
    med.write_text(json.dumps({"question": "Which vitamin deficiency causes scurvy?", "answer": "Vitamin C",
                               "options": {"A": "Vitamin A", "B": "Vitamin C", "C": "Vitamin D", "D": "Vitamin K"},
                               "meta_info": "step1", "answer_idx": "B", "rationale": "...", "human_checked": 0}) + "\n")
    out = mmedbench(data_files={"English": str(med)}, languages=["English"])
    assert out == {"English": ["Question: Which vitamin deficiency causes scurvy?\n(A) Vitamin A (B) Vitamin C "
                               "(C) Vitamin D (D) Vitamin K\nAnswer: (B) Vitamin C"]}
    fin = tmp_path / "train.json"
    fin.write_text(json.dumps([{"pre_text": ["Revenue grew."], "post_text": ["End."], "table": [["year", "2009"],
                                ["revenue", "5"]], "id": "ADI/2009/page_49.pdf-1",
                                "qa": {"question": "What was revenue in 2009?", "answer": "5"}},
                               {"pre_text": [], "post_text": [], "table": [], "id": "AAPL/2012/page_3.pdf-2",
                                "question": "Growth?", "answer": "10%"}]))
    out = finqa(data_files=str(fin))
    assert list(out) == ["2009", "2012"]
    assert out["2009"] == ["Context: Revenue grew. year | 2009\nrevenue | 5 End.\nQuestion: What was revenue in "
                           "2009?\nAnswer: 5"]
    assert out["2012"] == ["Context: \nQuestion: Growth?\nAnswer: 10%"]


def test_device_cache_reuses_a_device_phase_only_when_every_input_matches(tmp_path, monkeypatch):
    """DeepFusion, FedKMT and OFA-KD differ only on the server: with ``device_cache`` the second
    method gets the first one's uploads byte for byte without training, and a change of the
    data, the steps or the seed trains again."""
    from comix.algorithms.deepfusion import DeepFusion
    from comix.cli import main

    monkeypatch.setenv("COMIX_CACHE", str(tmp_path / "cache"))
    sent = {}
    real = DeepFusion.client_round

    def spy(self, ctx, state, payload):
        state, upload, metrics = real(self, ctx, state, payload)
        sent.setdefault(self.name, {})[ctx.client] = (upload, metrics)
        return state, upload, metrics
    monkeypatch.setattr(DeepFusion, "client_round", spy)
    data = _domains(tmp_path / "data")
    cached = [*DF, "deepfusion.device_cache=true"]
    assert main(["compare", f"corpus={data}", f"run_dir={tmp_path / 'a'}", *cached,
                 "--methods", "deepfusion", "fedkmt", "--seeds", "1"]) == 0
    assert all("device_cache" not in m for _, m in sent["deepfusion"].values())
    assert all(m["device_cache"] == "hit" for _, m in sent["fedkmt"].values())
    for c, (upload, metrics) in sent["deepfusion"].items():
        again, again_metrics = sent["fedkmt"][c]
        assert again.keys() == upload.keys() and all(torch.equal(again[n], t) for n, t in upload.items())
        assert again_metrics["train_loss"] == metrics["train_loss"]
        # the logged digest is of the uploaded weights alone (not the data embedding), hit or trained
        weights = hashlib.sha256()
        for n, t in sorted((n, t) for n, t in upload.items() if n.startswith("weights.")):
            weights.update(n.encode())
            weights.update(t.contiguous().view(torch.uint8).numpy().tobytes())
        assert metrics["upload_digest"] == again_metrics["upload_digest"] == weights.hexdigest()[:16]
        assert metrics["device_steps"] == again_metrics["device_steps"] == 2
    # each device its own trained weights: two clients of one spec start alike and upload apart
    digests = [m["upload_digest"] for _, m in sent["deepfusion"].values()]
    assert len(set(digests)) == len(digests)
    for i, change in enumerate((["data.alpha=0.5", "--seeds", "1"], ["train.local_steps=3", "--seeds", "1"],
                                ["--seeds", "2"])):
        sent.clear()
        assert main(["compare", f"corpus={data}", f"run_dir={tmp_path / str(i)}", *cached, *change[:-2],
                     "--methods", "ofa-kd", *change[-2:]]) == 0
        assert not any("device_cache" in m for _, m in sent["ofa-kd"].values()), change


def test_recipes_give_fedjets_devices_the_one_shot_devices_step_budget():
    """Fair comparison (Fig. 8-9): a FedJETS device takes, over its rounds, as many local steps as
    a DeepFusion device takes once; every recipe compares all five methods (the two-family recipe,
    sized for a CPU, only the one-shot KD methods)."""
    from pathlib import Path

    from comix.config import load_config
    from comix.specs import spec_config, split_spec
    recipes = sorted((Path(__file__).parents[1] / "configs" / "deepfusion").glob("*.yaml"))
    assert len(recipes) == 16
    gemma = [p for p in recipes if "-gemma-" in p.name]
    assert [p.name for p in gemma] == ["cpu-qa-open-gemma-n4.yaml", "paper-qa-open-gemma-n16.yaml"]
    for path in gemma:
        two = load_config(str(path))
        # the one-shot KD methods and the controls (CE only; FedKMT and VAA beside untrained teachers) on
        # the same 3 seeds, each its own split, on public text of the devices' own domains (the
        # premise's ground), teachers of two families trained long enough
        assert {"deepfusion", "deepfusion-ce", "fedkmt", "deepfusion:device_steps=0", "fedkmt:device_steps=0"} \
            <= set(two.methods), path.name
        assert two.seeds == [42, 62, 82] and not two.data.public_corpus and two.data.public_frac > 0
        assert len(set(two.data.seed.values())) == 3, path.name
        assert two.train.local_steps >= 200 and "gemma3-270m" in two.deepfusion.devices
        assert any(not d.startswith("gemma") for d in two.deepfusion.devices), path.name
    # at the paper's N, teachers that can be ahead of the student on the pooled public text: the
    # student's own family at full width among them, and 3x the CPU case's device steps
    paper = load_config(str(gemma[1]))
    assert paper.data.clients == 16 and "base" in paper.deepfusion.devices and paper.train.local_steps == 600
    # the alpha sweep: the KD methods, alpha chosen on the server's validation documents, trained
    # teachers and the untrained-teacher control, 3 seeds; at the paper's scale (a GPU job) the same
    # question with a second family (Gemma-3-270M) among the devices
    sweep = [p for p in recipes if p.name.endswith("-alpha-sweep.yaml")]
    assert [p.name for p in sweep] == ["cpu-qa-open-hetero-n8-alpha-sweep.yaml", "paper-qa-choice-hetero-n16-alpha-sweep.yaml",
                                       "paper-qa-open-hetero-n16-alpha-sweep.yaml"]
    for path in sweep:
        cfg = load_config(str(path))
        assert {split_spec(m)[0] for m in cfg.methods} == {"deepfusion", "deepfusion-ce", "fedkmt"}
        assert len([m for m in cfg.methods if "alpha=" in m]) >= 3 and "deepfusion:device_steps=0" in cfg.methods
        # and VAA at the student's own lr, where the student's updates carry more of the feature match
        assert any(spec_config(cfg, m).deepfusion.feature_lr == cfg.deepfusion.kd_lr for m in cfg.methods
                   if m.startswith("deepfusion:alpha=")), path.name
        assert cfg.data.server_valid_docs > 0 and cfg.train.local_steps >= 200 and len(cfg.seeds) >= 3
        assert cfg.data.public_categories == ["literature"], path.name  # public text of no test domain
        assert ("gemma3-270m" in cfg.deepfusion.devices) == path.name.startswith("paper"), path.name
        df = cfg.deepfusion  # the other baselines from the same recipe: FedJETS on DeepFusion's budgets
        assert cfg.fedjets.public_steps == df.experts * df.kd_steps + df.tune_steps, path.name
        for rounds, steps in re.findall(r"fedjets:train.rounds=(\d+),train.local_steps=(\d+)", path.read_text()):
            assert int(rounds) * int(steps) == cfg.train.local_steps, path.name
    for path in (p for p in recipes if p not in gemma + sweep):
        cfg = load_config(str(path))
        assert {split_spec(m)[0] for m in cfg.methods} == {"deepfusion", "deepfusion-ce", "fedkmt", "ofa-kd", "fedjets",
                                                           "central-moe"}
        fedjets = spec_config(cfg, next(m for m in cfg.methods if m.startswith("fedjets")))
        assert fedjets.train.rounds > 1 and cfg.train.rounds == 1, path.name
        assert fedjets.train.rounds * fedjets.train.local_steps == cfg.train.local_steps, path.name
        # and the server's public data: as many batches of the same size as DeepFusion's server draws
        df = cfg.deepfusion
        assert fedjets.fedjets.public_steps == df.experts * df.kd_steps + df.tune_steps, path.name
        assert fedjets.fedjets.public_batch == df.kd_batch and fedjets.fedjets.experts == df.experts, path.name


def test_public_tuning_draws_the_budgeted_public_batches_and_trains_every_moe_weight(monkeypatch):
    from comix.algorithms import TrainConfig
    from comix.algorithms import global_moe as module
    from comix.runtime import Runtime
    moe = upcycle([_llama(seed=s) for s in range(2)], top_k=1)
    before = {n: p.detach().clone() for n, p in moe.named_parameters()}
    public = torch.randint(0, 97, (400,), generator=torch.Generator().manual_seed(2))
    drawn = []
    real = module.sample_batch
    monkeypatch.setattr(module, "sample_batch", lambda t, b, *a: drawn.append(b) or real(t, b, *a))
    report = module.public_tuning(moe, public, 7, 3, 1e-3, 0.001, TrainConfig(seq_len=8), Runtime(), 0)
    assert drawn == [3] * 7 and report["public_batches"] == 7
    assert all(not torch.equal(p, before[n]) for n, p in moe.named_parameters())


# -- the KD terms as eq. 10-11 define them, and what distillation and tuning optimise ---------
def _kd_setup():
    student, teacher = _llama(seed=0), _llama(seed=3, layers=2)
    x, y = IDS[:, :-1], IDS[:, 1:]
    return student, teacher, x, y, teacher(x, output_hidden_states=True)


def test_kd_kl_is_teacher_to_student_at_temperature_with_t_squared_summed_over_the_vocabulary():
    student, teacher, x, y, t_out = _kd_setup()
    s_out = student(x, output_hidden_states=True)
    t_out.logits = t_out.logits * 8  # a confident teacher: far from the student, so KL is not symmetric
    T = 2.0
    got = kd_loss(s_out, t_out, y, None, stages=2, alpha=0.0, beta=1.0, temperature=T)["kl"].item()
    p_t = F.softmax(t_out.logits / T, -1)
    log_s = F.log_softmax(s_out.logits / T, -1)
    want = (p_t * (p_t.log() - log_s)).sum(-1).mean() * T ** 2           # KL(teacher || student), eq. 10
    reverse = (log_s.exp() * (log_s - p_t.log())).sum(-1).mean() * T ** 2
    no_temp = F.kl_div(F.log_softmax(s_out.logits, -1), F.softmax(t_out.logits, -1), reduction="none").sum(-1).mean()
    assert got == pytest.approx(want.item(), rel=1e-4)
    for wrong in (reverse.item(), want.item() / T ** 2, want.item() / s_out.logits.shape[-1], no_temp.item()):
        assert got != pytest.approx(wrong, rel=1e-2)


def test_vaa_feature_loss_reaches_the_student_and_the_vaa_module():
    student, teacher, x, y, t_out = _kd_setup()
    vaa = ViewAlignedAttention([32, 32], [32, 32], queries=4, d=16, heads=2)
    s_out = student(x, output_hidden_states=True)
    kd_loss(s_out, t_out, y, vaa, stages=2, alpha=1.0, beta=0.0)["fm"].backward()
    # the student's features are not detached before VAA: FM alone moves the student's blocks
    assert student.model.layers[0].mlp.down_proj.weight.grad.abs().sum() > 0
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in vaa.parameters() if p.requires_grad)


def _deepfusion(feature="deepfusion", **options):
    from comix.algorithms import TrainConfig, make_algorithm
    from comix.algorithms.base import ServerContext
    from comix.models import LoRAConfig
    algo = make_algorithm(feature, LoRAConfig(), TrainConfig(rounds=1, seq_len=8), 2, experts=1, top_k=1, stages=2,
                          queries=4, vaa_dim=16, vaa_heads=2, kd_steps=2, kd_batch=2, **options)
    algo.server = ServerContext(base=None, seed=0)
    return algo


def test_distillation_optimises_the_weighted_sum_over_proxies_with_fm_and_vaa_at_its_own_lr(monkeypatch):
    from comix.algorithms import deepfusion as module
    algo = _deepfusion(alpha=0.7, beta=1.3, temperature=2.0, kd_lr=1e-4, feature_lr=1e-3)
    student = _llama(seed=0)
    teachers = [(_llama(seed=3, layers=2), 0.25), (_llama(seed=4, layers=2), 0.75)]
    public = torch.randint(0, 97, (400,), generator=torch.Generator().manual_seed(2))
    checked = []
    real_step = module.step_on

    def spy(loss, params, opt, clip, scaler=None, measure=None):
        x = batches[-1][0]
        with torch.no_grad():
            s_out = student(input_ids=x.long(), output_hidden_states=True)
            want = sum(w * kd_loss(s_out, t(input_ids=x.long(), output_hidden_states=True), batches[-1][1].long(),
                                   vaa, 2, 0.7, 1.3, 2.0)["total"]
                       for (t, w), vaa in zip(teachers, vaas))
        checked.append((loss.item(), want.item()))
        groups = {id(p): g["lr"] for g in opt.param_groups for p in g["params"]}
        assert all(groups[id(p)] == 1e-3 for v in vaas for p in v.parameters())      # VAA is optimised ...
        assert all(groups[id(p)] == 1e-4 for p in student.parameters())              # ... at its own lr
        real_step(loss, params, opt, clip, scaler, measure)

    batches, vaas = [], []
    real_sample, real_feature = module.sample_batch, algo._feature_module
    monkeypatch.setattr(module, "sample_batch", lambda *a: batches.append(real_sample(*a)) or batches[-1])
    monkeypatch.setattr(module, "step_on", spy)
    before = []

    def feature_module(s, t):
        vaas.append(real_feature(s, t))
        before.extend(p.detach().clone() for p in vaas[-1].parameters())
        return vaas[-1]
    monkeypatch.setattr(algo, "_feature_module", feature_module)
    log = algo.distill(student, teachers, public, torch.Generator().manual_seed(0))
    assert len(checked) == 2 and all(a == pytest.approx(b, rel=1e-4) for a, b in checked)
    assert all(not torch.equal(p, q) for p, q in zip(before, (p for v in vaas for p in v.parameters())))
    assert set(log["steps"]) == {"ce", "fm", "kl"} and all(len(v) == 2 for v in log["steps"].values())
    assert log["fm"] == pytest.approx(sum(log["steps"]["fm"]) / 2, abs=1e-3) and log["fm"] > 0


def test_gate_tuning_trains_everything_but_the_experts():
    algo = _deepfusion()
    moe = upcycle([_llama(seed=s) for s in range(2)], top_k=1)
    before = {n: p.detach().clone() for n, p in moe.named_parameters()}
    experts = {id(p) for p in expert_params(moe)}
    public = torch.randint(0, 97, (400,), generator=torch.Generator().manual_seed(2))
    algo.tune(moe, public, torch.Generator().manual_seed(0))
    for n, p in moe.named_parameters():
        assert torch.equal(p, before[n]) == (id(p) in experts), n


def test_ofa_loss_enhances_the_target_and_ignores_unlabelled_tokens():
    from comix.models.kd import ofa_loss
    gen = torch.Generator().manual_seed(0)
    s, t = torch.randn(2, 3, 7, generator=gen), torch.randn(2, 3, 7, generator=gen)
    y = torch.tensor([[1, 4, -100], [0, 6, 2]])
    keep = y.reshape(-1) != -100
    log_s, p_t = F.log_softmax(s.reshape(-1, 7)[keep], -1), F.softmax(t.reshape(-1, 7)[keep], -1)
    target = F.one_hot(y.reshape(-1)[keep], 7).bool()
    weight = torch.where(target, (1 + p_t) ** 1.5 - 1, p_t ** 1.5)  # target class enhanced, others p^eps
    assert ofa_loss(s, t, y, eps=1.5).item() == pytest.approx((-(weight * log_s).sum(-1)).mean().item(), rel=1e-5)
    assert ofa_loss(s, t, y, eps=1.0).item() == pytest.approx((-(p_t * log_s).sum(-1)).mean().item(), rel=1e-5)


def test_ofa_branches_have_heads_of_their_own():
    _, teacher, x, y, t_out = _kd_setup()
    torch.manual_seed(0)
    student = LlamaForCausalLM(LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=4,
                                           num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False))
    ofa = OFABranches(student, stages=3)
    assert not {id(p) for p in ofa.parameters()} & {id(p) for p in student.parameters()}
    s_out = student(x, output_hidden_states=True)
    terms = kd_loss(s_out, t_out, y, None, 3, alpha=1.0, beta=0.0, ofa=ofa)
    terms["fm"].backward()
    assert student.lm_head.weight.grad is None or student.lm_head.weight.grad.abs().sum() == 0
    assert all(h.weight.grad.abs().sum() > 0 for h in ofa.heads)
    assert student.model.layers[0].mlp.down_proj.weight.grad.abs().sum() > 0  # the stages themselves learn


def test_generated_answer_accuracy_counts_reference_tokens_the_greedy_answer_matches():
    from comix.data.splits import answer_pairs
    from comix.eval.tasks import generated_token_accuracy
    model = _llama(layers=2)
    gen = torch.Generator().manual_seed(5)
    pairs = [(torch.randint(1, 97, (n,), generator=gen), torch.randint(1, 97, (m,), generator=gen))
             for n, m in ((4, 3), (7, 5), (2, 4))]
    correct = total = 0
    with torch.no_grad():
        for q, a in pairs:  # greedy decoding one question at a time, no padding
            ids = q[None]
            for want in a.tolist():
                nxt = int(model(ids).logits[0, -1].argmax())
                correct, total = correct + (nxt == want), total + 1
                ids = torch.cat([ids, torch.tensor([[nxt]])], 1)
        # a reference the model is made to produce scores 100 %
        q = pairs[0][0]
        forced = []
        ids = q[None]
        for _ in range(3):
            forced.append(int(model(ids).logits[0, -1].argmax()))
            ids = torch.cat([ids, torch.tensor([[forced[-1]]])], 1)
    got = generated_token_accuracy(model, pairs, pad_id=0, batch_size=2)
    assert got == pytest.approx(100 * correct / total)
    assert generated_token_accuracy(model, [(q, torch.tensor(forced))], pad_id=0) == 100.0

    class Tok:  # words as token ids
        def __call__(self, text, add_special_tokens=True):
            return {"input_ids": [len(w) for w in text.split()]}
    got = answer_pairs(["Question: what is up\nAnswer: the sky", "no marker here"], Tok(), 5)
    assert len(got) == 1 and got[0][0].tolist() == [9, 4, 2, 2, 7] and got[0][1].tolist() == [3, 3]


def test_public_data_from_another_corpus_and_a_bad_category_in_one_line(tmp_path, capsys):
    from comix.cli import main
    from comix.data.splits import SplitConfig, make_server_data
    from comix.models import load_base_model
    data, other = _domains(tmp_path / "data"), tmp_path / "other"
    (other / "lit").mkdir(parents=True)
    for i in range(3):
        (other / "lit" / f"{i}.txt").write_text("in the beginning was the word " * 20)
    tok = load_base_model("tiny-llama")[1]
    from comix.data import load_corpus
    cfg = SplitConfig(public_frac=0.2, public_corpus=str(other), public_categories=["lit"])
    server = make_server_data(load_corpus(str(data)), tok, cfg, load_corpus(str(other)))
    assert list(server.public) == ["public:lit"] and set(server.test) == {"med", "fin", "code"}
    from comix.data.splits import tokenize_docs
    assert torch.equal(server.public["public:lit"], tokenize_docs(load_corpus(str(other))["lit"], tok))
    assert main(["run", f"corpus={data}", f"run_dir={tmp_path / 'run'}", *DF, "methods=[deepfusion]",
                 f"data.public_corpus={other}", "data.public_categories=[poems]"]) == 2
    assert "data.public_categories: ['poems'] not in data.public_corpus" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


def test_the_embedding_map_separates_what_the_clustering_separates():
    from comix.algorithms.deepfusion_clusters import embedding_map
    e = torch.tensor([[1.0, 0.01, 0], [1.0, -0.01, 0], [0, 0.01, 1.0], [0.02, 0, 1.0]])
    pts = torch.tensor(embedding_map(e * torch.tensor([[3.0], [1.0], [2.0], [5.0]])))  # scale-free (cosine)
    assert pts.shape == (4, 2)
    assert (pts[0, 0] - pts[1, 0]).abs() < 0.05 and (pts[2, 0] - pts[3, 0]).abs() < 0.05
    assert (pts[0, 0] - pts[2, 0]).abs() > 1.0


def test_gradient_shares_are_each_kd_term_s_gradient_norm_on_the_student():
    """Planted terms: FM's gradient is -3 times CE's, KL has none: norms 1 : 3 : 0, shares 0.25 /
    0.75 / 0, and FM points against the rest (cosine -1)."""
    from comix.algorithms.deepfusion_measures import gradient_shares
    w = torch.nn.Parameter(torch.ones(4))
    x = torch.tensor([1.0, 2.0, 2.0, 4.0])  # |x| = 5
    parts = {"ce": (w * x).sum(), "fm": -3 * (w * x).sum(), "kl": torch.zeros(())}
    log = {"step": [], "ce": [], "fm": [], "kl": [], "cos_fm_rest": []}
    gradient_shares(parts, [w], log, step=7)
    assert log["step"] == [7] and log["ce"] == [[5.0, 0.25]] and log["fm"] == [[15.0, 0.75]] and log["kl"] == [[0.0, 0.0]]
    assert log["cos_fm_rest"] == [pytest.approx(-1.0)]


def test_gradient_shares_read_ce_s_gradient_off_the_step_s_own_backward_pass(monkeypatch):
    """Given the whole loss's gradient (the KD step's backward), CE's is the whole minus FM's and
    KL's: the same log as three backward passes, with two."""
    from comix.algorithms.deepfusion_measures import gradient_shares
    w = torch.nn.Parameter(torch.ones(4))
    x, z = torch.tensor([1.0, 2.0, 2.0, 4.0]), torch.tensor([0.0, 1.0, -1.0, 3.0])
    parts = {"ce": (w * x).sum(), "fm": -3 * (w * x).sum() + (w * z).sum(), "kl": (w * w * z).sum()}
    whole = torch.autograd.grad(sum(parts.values()), [w], retain_graph=True)
    three, two = ({"step": [], "ce": [], "fm": [], "kl": [], "cos_fm_rest": []} for _ in range(2))
    gradient_shares(parts, [w], three, step=1)
    calls, real_grad = [], torch.autograd.grad
    monkeypatch.setattr(torch.autograd, "grad", lambda *a, **k: calls.append(1) or real_grad(*a, **k))
    gradient_shares(parts, [w], two, step=1, whole=list(whole))
    assert len(calls) == 2 and three["ce"] == [[5.0, pytest.approx(three["ce"][0][1])]]
    assert two == {k: [pytest.approx(v, abs=1e-6) for v in vs] for k, vs in three.items()}


def test_logging_the_gradient_shares_leaves_distillation_unchanged():
    """The step's backward pass serves the measurement: a run logging every step trains the student
    to the same weights as one logging none."""
    students = []
    for every in (1, 0):
        algo, student = _deepfusion(alpha=0.7, beta=1.3, grad_log_every=every), _llama(seed=0)
        teachers = [(_llama(seed=3, layers=2), 0.25), (_llama(seed=4, layers=2), 0.75)]
        public = torch.randint(0, 97, (400,), generator=torch.Generator().manual_seed(2))
        log = algo.distill(student, teachers, public, torch.Generator().manual_seed(0))
        assert len(log.get("grad", {}).get("step", [])) == (2 if every else 0)
        students.append(student.state_dict())
    assert all(torch.equal(students[0][k], students[1][k]) for k in students[0])
    assert not torch.equal(students[0]["model.layers.0.mlp.down_proj.weight"],
                           _llama(seed=0).state_dict()["model.layers.0.mlp.down_proj.weight"])


def test_the_server_s_validation_documents_are_its_own_held_out_public_ones_and_score_as_valid(tmp_path):
    """data.server_valid_docs: per domain the last public documents, never distilled on, disjoint
    from the test split and from every device's data; the global model is scored on them as
    valid_* beside test_* (what DeepFusion's own settings are chosen on, never test)."""
    from types import SimpleNamespace

    from comix.algorithms.global_moe import score_on_server
    from comix.algorithms.training import TrainConfig
    from comix.data import load_corpus, make_user_data
    from comix.data.splits import SplitConfig, make_server_data
    from comix.models import load_base_model
    from comix.runtime import Runtime
    data = _domains(tmp_path / "data")
    model, tok = load_base_model("tiny-llama")
    corpus = load_corpus(str(data))
    plain = make_server_data(corpus, tok, SplitConfig(public_frac=0.34))
    cfg = SplitConfig(public_frac=0.34, server_valid_docs=1)
    server = make_server_data(corpus, tok, cfg)
    held = {n: server.valid[n] for n in corpus}
    for n in corpus:
        assert torch.equal(torch.cat([server.public[n], held[n]]), plain.public[n])  # cut from the public share
    devices = make_user_data(corpus, tok, cfg)
    streams = [t for u in devices for t in (u.train, u.valid, u.test)] + list(server.test.values())
    for n, v in held.items():
        window = v[12:132].tolist()  # inside a document: no device and no test split holds it
        assert not any(_contains(s.tolist(), window) for s in streams)
        assert _contains(plain.public[n].tolist(), window)
    assert set(server.valid_answers) == {"fin"}  # QA documents give question / answer pairs
    ctx = SimpleNamespace(data=server, base=model, runtime=Runtime())
    row = score_on_server(model, ctx, TrainConfig(seq_len=16, eval_batch_size=4, max_new_tokens=2))
    assert {"valid_ppl", "test_ppl"} <= set(row["med"]) and "valid_answer_ppl" in row["fin"]
    assert "valid_ppl" not in score_on_server(model, SimpleNamespace(data=plain, base=model, runtime=Runtime()),
                                              TrainConfig(seq_len=16, eval_batch_size=4, max_new_tokens=2))["med"]
    with pytest.raises(ValueError, match="set data.public_frac too"):
        SplitConfig(server_valid_docs=2)


def _server_base_and_moved(root):
    """Server data of the three test domains, the tiny base and a copy of it with one weight moved."""
    from comix.data import load_corpus
    from comix.data.splits import SplitConfig, make_server_data
    from comix.models import load_base_model
    base, tok = load_base_model("tiny-llama")
    server = make_server_data(load_corpus(str(_domains(root))), tok, SplitConfig(public_frac=0.34))
    moved = copy.deepcopy(base)
    with torch.no_grad():
        next(moved.parameters()).add_(0.05)
    return server, base, moved


def test_the_dense_base_is_scored_once_per_process_and_again_when_anything_it_reads_changes(tmp_path, monkeypatch):
    """Every method of a comparison scores the same dense base beside its global model: the base's
    rows are computed once per process, keyed by its weights, the test data and the settings."""
    from types import SimpleNamespace

    import comix.algorithms.global_moe as gm
    from comix.algorithms.training import TrainConfig
    from comix.runtime import Runtime
    server, base, other = _server_base_and_moved(tmp_path / "data")
    calls, real = [], gm._scores
    monkeypatch.setattr(gm, "_scores", lambda m, prefix, *a: calls.append((m, prefix)) or real(m, prefix, *a))
    monkeypatch.setattr(gm, "_BASE_SCORES", {})
    cfg, n = TrainConfig(seq_len=16, eval_batch_size=4, max_new_tokens=2), len(server.test)
    ctx = SimpleNamespace(data=server, base=base, runtime=Runtime())
    first = gm.score_on_server(other, ctx, cfg)
    assert [p for m, p in calls if m is base] == ["test_base"] * n and [p for m, p in calls if m is other] == ["test"] * n
    second = gm.score_on_server(base, ctx, cfg)  # another global model, the same base: not scored again
    assert len([m for m, p in calls if p == "test_base"]) == n
    for d in server.test:
        assert second[d]["test_base_log_ppl"] == first[d]["test_base_log_ppl"] == second[d]["test_log_ppl"]
        assert first[d]["test_log_ppl"] != first[d]["test_base_log_ppl"]
    third = gm.score_on_server(base, SimpleNamespace(data=server, base=other, runtime=Runtime()), cfg)  # another base
    assert all(third[d]["test_base_log_ppl"] == first[d]["test_log_ppl"] for d in server.test)
    gm.score_on_server(base, ctx, TrainConfig(seq_len=32, eval_batch_size=4, max_new_tokens=2))  # other settings
    assert len([m for m, p in calls if p == "test_base"]) == 3 * n


def test_the_premise_is_measured_once_per_process_and_again_when_anything_it_reads_changes(tmp_path, monkeypatch):
    """FedKMT, DeepFusion and CE only read the same cached devices and student: the premise (every
    model scored on test and public text) is measured once per process, keyed by the student's and
    each device's weights, the data and the window; a caller's copy is its own."""
    from types import SimpleNamespace

    import comix.algorithms.deepfusion_measures as dm
    from comix.runtime import Runtime
    server, base, device = _server_base_and_moved(tmp_path / "data")
    calls, real = [], dm.split_token_stats
    monkeypatch.setattr(dm, "split_token_stats", lambda m, *a: calls.append(m) or real(m, *a))
    monkeypatch.setattr(dm, "_PREMISES", {})
    ctx = SimpleNamespace(data=server, base=base, runtime=Runtime())
    per_measure = 2 * 2 * len(server.test)  # student and one device, on test and public streams
    first = dm.in_domain_scores({0: device}, ctx, 16)
    assert len(calls) == per_measure and first["devices"]["0"] != first["student"]
    first["student"]["med"] = -1.0  # a caller's edit does not reach the next caller
    second = dm.in_domain_scores({0: device}, ctx, 16)
    assert len(calls) == per_measure and second["student"]["med"] != -1.0
    assert second["devices"] == first["devices"] and second["public"] == first["public"]
    # another device's weights (untrained teachers), another client id, another student, another window
    moved = copy.deepcopy(device)
    with torch.no_grad():
        next(moved.parameters()).add_(0.05)
    third = dm.in_domain_scores({0: moved}, ctx, 16)
    assert len(calls) == 2 * per_measure and third["devices"]["0"] != second["devices"]["0"]
    assert set(dm.in_domain_scores({1: device}, ctx, 16)["devices"]) == {"1"} and len(calls) == 3 * per_measure
    dm.in_domain_scores({0: device}, SimpleNamespace(data=server, base=moved, runtime=Runtime()), 16)
    dm.in_domain_scores({0: device}, ctx, 32)
    assert len(calls) == 5 * per_measure
    # other public text (the test text the same): measured again
    public = SimpleNamespace(test=server.test, public={d: t[:-1] for d, t in server.public.items()})
    dm.in_domain_scores({0: device}, SimpleNamespace(data=public, base=base, runtime=Runtime()), 16)
    assert len(calls) == 6 * per_measure


def _contains(seq: list[int], window: list[int]) -> bool:
    return any(seq[i:i + len(window)] == window for i in range(len(seq) - len(window) + 1))


def test_device_steps_0_is_the_untrained_teacher_control_devices_send_their_starting_weights(tmp_path, monkeypatch):
    """deepfusion.device_steps=0: every device uploads exactly the weights it started from (the
    server distils teachers that learned nothing); with steps, the uploads differ from them."""
    from comix.algorithms.deepfusion import DeepFusion
    from comix.cli import main
    same = {}
    real = DeepFusion.client_round

    def spy(self, ctx, state, payload):
        state, upload, metrics = real(self, ctx, state, payload)
        start = self._initial[self.device_spec(ctx.client)]
        same.setdefault(self.device_steps, []).append(
            all(torch.equal(upload[f"weights.{n}"], t) for n, t in start.items() if f"weights.{n}" in upload))
        assert math.isfinite(metrics["train_loss"])
        logged.setdefault(self.device_steps, set()).add(metrics["device_steps"])  # the control's 0, not train's 2
        return state, upload, metrics
    logged, phases = {}, []
    monkeypatch.setattr(DeepFusion, "client_round", spy)
    monkeypatch.setattr("comix.algorithms.deepfusion.phase_step", lambda *event: phases.append(event))
    data = _domains(tmp_path / "data")
    assert main(["compare", f"corpus={data}", f"run_dir={tmp_path / 'run'}", *DF, "deepfusion.kd_steps=1",
                 "deepfusion.tune_steps=1", "--methods", "deepfusion:device_steps=0", "deepfusion", "--seeds", "1"]) == 0
    assert same[0] == [True] * 5 and same[2] == [False] * 5
    assert logged == {0: {0}, 2: {2}}
    # each device step is reported (a Gemma device trains most of an hour on a CPU); the control reports none
    assert sorted(e for e in phases if "device steps" in e[0]) == sorted(
        (f"client {c}'s device steps", j, 2) for c in range(5) for j in (1, 2))


def test_ce_only_never_reads_a_teacher_beside_untrained_devices_it_scores_as_beside_trained_ones(tmp_path):
    """CE only (alpha = beta = 0) trains its students on the public CE alone: its scores beside
    untrained devices equal, bit for bit, its scores beside trained ones (so its control row needs
    no trained device), where DeepFusion's, whose students learn from the teachers, differ. One
    teacher family has its own tokenizer: its aligned distributions reach the loss too."""
    from comix.cli import main
    from test_token_align import _device_of_another_family
    data = _domains(tmp_path / "data")
    folder, _ = _device_of_another_family(tmp_path / "other-family")
    options = [o for o in DF if not o.startswith("deepfusion.devices")] + [f"deepfusion.devices=[base,prune:2:32,{folder}]"]
    specs = ["deepfusion-ce", "deepfusion-ce:device_steps=0", "deepfusion", "deepfusion:device_steps=0"]
    assert main(["compare", f"corpus={data}", f"run_dir={tmp_path / 'run'}", *options, "deepfusion.kd_steps=2",
                 "deepfusion.tune_steps=1", "--methods", *specs, "--seeds", "1"]) == 0
    server = json.loads((tmp_path / "run" / "seed1" / "deepfusion-ce" / "server.jsonl").read_text().splitlines()[0])
    assert str(folder) in server["devices"] and any("aligned_share" in kd for kd in server["kd"])

    def scores(spec: str) -> dict:
        got = json.loads((tmp_path / "run" / "seed1" / spec.replace(":", "__") / "results.json").read_text())
        return {d: {k: v for k, v in row.items() if k.startswith("test_") and "base" not in k}
                for d, row in got["per_user"].items()}
    ce, ce_untrained, df, df_untrained = map(scores, specs)
    assert ce and ce == ce_untrained
    assert df != df_untrained


def test_quantised_devices_train_qlora_s_way_and_upload_their_merged_model(tmp_path, monkeypatch):
    """quant=nf4: each device trains a LoRA (rank ``qlora_r``) over its own model frozen in NF4 and
    sends its whole model merged, under the same names: embeddings, norms and head as they
    started, each block linear its dequantised start plus a trained edit of rank <= r. The server
    reads it as before, and a device phase cached at full precision is not reused for it. Both
    runs compute each device batch of 2 in 2 slices (micro_batches), as every method's loop does."""
    pytest.importorskip("bitsandbytes")
    import comix.algorithms.training as training
    from comix.algorithms.deepfusion import DeepFusion
    from comix.cli import main
    from comix.models.quant import dequantized_weight, quantize_linear

    monkeypatch.setenv("COMIX_CACHE", str(tmp_path / "cache"))
    sent, rows_read, on_device = {}, [], []
    real, real_loss = DeepFusion.client_round, training.lm_loss

    def spy(self, ctx, state, payload):
        on_device.append(True)
        state, upload, metrics = real(self, ctx, state, payload)
        on_device.clear()
        sent[ctx.client] = (upload, metrics, self._initial[self.device_spec(ctx.client)])
        return state, upload, metrics
    monkeypatch.setattr(DeepFusion, "client_round", spy)
    monkeypatch.setattr(training, "lm_loss", lambda m, x, y: (on_device and rows_read.append(len(x))) or real_loss(m, x, y))
    data = _domains(tmp_path / "data")
    args = [f"corpus={data}", *DF[:-1], "deepfusion.devices=[base,prune:2:32]", "deepfusion.qlora_r=2",
            "deepfusion.device_cache=true", "methods=[deepfusion]", "micro_batches=2"]
    assert main(["run", *args, f"run_dir={tmp_path / 'none'}"]) == 0  # fills the cache at full precision
    assert all(m["device_base"] == "none" for _, m, _ in sent.values())
    assert set(rows_read) == {1}  # the device steps read slices of 1 row
    sent.clear()
    assert main(["run", *args, "quant=nf4", f"run_dir={tmp_path / 'nf4'}"]) == 0
    assert sorted(sent) == [0, 1, 2, 3, 4]
    for c, (upload, metrics, start) in sent.items():
        assert "device_cache" not in metrics and metrics["device_base"] == "nf4"
        weights = {n[8:]: t for n, t in upload.items() if n.startswith("weights.")}
        assert set(upload) == {f"weights.{n}" for n in weights} | {"data_embedding"}
        block = {n for n in weights if ".layers." in n and n.endswith("_proj.weight")}
        assert len(block) == 7 * sum(1 for n in weights if n.endswith("input_layernorm.weight"))
        assert metrics["device_params"] == sum(2 * sum(weights[n].shape) for n in block)  # the LoRA factors
        for n, t in weights.items():
            if n not in block:
                assert torch.equal(t, start[n]), n
                continue
            linear = torch.nn.Linear(t.shape[1], t.shape[0], bias=False)
            linear.weight.data = start[n].float().clone()
            edit = t - dequantized_weight(quantize_linear(linear, "nf4", torch.float32, torch.device("cpu")))
            assert 0 < torch.linalg.matrix_rank(edit) <= 2, n
    assert json.loads((tmp_path / "nf4" / "deepfusion" / "results.json").read_text())["metric"] == "test_ppl"
    # what each device spent, measured on the model it trained: the same tokens, a smaller frozen
    # base, and the LoRA factors alone as its trainable state (weights, gradients, AdamW's moments)
    full, quantised = ([json.loads(x) for x in (tmp_path / run / "deepfusion" / "metrics.jsonl").read_text().splitlines()
                        if "device_params" in x] for run in ("none", "nf4"))
    assert len(full) == len(quantised) == 5
    for a, b in zip(full, quantised):
        assert b["tokens"] == a["tokens"] > 0 and b["quant"] == "nf4"
        assert b["base_mb"] < a["base_mb"] and b["trainable_mb"] == round(b["device_params"] * 16 / 2**20, 3)


def test_a_server_phase_killed_after_a_domain_resumes_there_with_the_numbers_of_an_uninterrupted_run(tmp_path,
                                                                                                   monkeypatch):
    """Each distilled domain is kept (student, KD log, both RNGs) until the MoE is scored: a resume
    distils only the domains left (none after a kill while scoring), and every number equals the
    uninterrupted run's."""
    from comix.algorithms.deepfusion import DeepFusion
    from comix.cli import main

    kill = _KilledAt(monkeypatch, DeepFusion, "distill")
    args = [f"corpus={_domains(tmp_path / 'data')}", *DF, "--methods", "deepfusion", "--seeds", "1"]
    assert main(["compare", f"run_dir={tmp_path / 'a'}", *args]) == 0 and len(kill.calls) == 3
    kill.next_run(at=2)  # during the second domain
    assert main(["compare", f"run_dir={tmp_path / 'b'}", *args]) == 130
    method = tmp_path / "b" / "seed1" / "deepfusion"
    assert [p.name for p in (method / "distilled").iterdir()] == ["domain0.safetensors"]  # no temp file left
    kill.next_run()
    assert main(["compare", "--resume", str(tmp_path / "b")]) == 0
    assert len(kill.calls) == 2 and not (method / "distilled").exists()  # domains 1 and 2, then cleared
    runs = [json.loads((tmp_path / r / "seed1" / "deepfusion" / "server.jsonl").read_text().splitlines()[0])
            for r in "ab"]
    for run in runs:  # each domain's own wall time: the one number an interruption may change
        assert all(kd.pop("seconds") > 0 for kd in run["kd"])
    assert runs[0]["kd"] == runs[1]["kd"] and runs[0]["tune"] == runs[1]["tune"]
    results = [json.loads((tmp_path / r / "seed1" / "deepfusion" / "results.json").read_text())["per_user"]
               for r in "ab"]
    assert results[0] == results[1]
    # killed while the server scores its MoE (the distillation all done): the resume distils nothing
    import comix.algorithms.deepfusion as df
    real_score = df.score_on_server

    def killed_while_scoring(*a, **k):
        monkeypatch.setattr(df, "score_on_server", real_score)
        raise KeyboardInterrupt
    monkeypatch.setattr(df, "score_on_server", killed_while_scoring)
    assert main(["compare", f"run_dir={tmp_path / 'd'}", *args]) == 130
    method = tmp_path / "d" / "seed1" / "deepfusion"
    assert sorted(p.name for p in (method / "distilled").iterdir()) == [f"domain{d}.safetensors" for d in range(3)]
    kill.next_run()
    assert main(["compare", "--resume", str(tmp_path / "d")]) == 0
    assert kill.calls == [] and not (method / "distilled").exists()
    assert json.loads((method / "results.json").read_text())["per_user"] == results[0]
    # a finished domain of other inputs (here: another alpha) is not reused
    from comix.algorithms.global_moe import DistilledDomains
    base = torch.nn.Linear(2, 2)
    gen = torch.Generator().manual_seed(0)
    one = DistilledDomains(tmp_path / "c", {"alpha": 1.0}, torch.zeros(4, dtype=torch.int32), base)
    one.save(one.key(0, [], gen), 0, base, {"ce": 1.0}, gen)
    assert one.load(one.key(0, [], gen), 0, base, gen) == {"ce": 1.0}
    other = DistilledDomains(tmp_path / "c", {"alpha": 10.0}, torch.zeros(4, dtype=torch.int32), base)
    assert other.load(other.key(0, [], gen), 0, base, gen) is None
    assert one.load(one.key(0, [(base, 0.5)], gen), 0, base, gen) is None  # other teachers


@pytest.mark.parametrize("tied", [True, False])
def test_a_device_s_fused_update_with_sparse_tied_rows_is_the_plain_adamw_update(tied):
    """A full fine-tuning device's update (make_optimizer(fused=True) inside
    sparse_tied_embedding_grads) is the plain AdamW update, float rounding apart: the tied weight's
    gradient is the same dense sum. The embedding is switched back after, and an untied one (whose
    sparse gradient AdamW would refuse) is never switched."""
    import contextlib

    from comix.algorithms.base import ClientState
    from comix.algorithms.training import TrainConfig, make_optimizer, sparse_tied_embedding_grads, train_step
    cfg = LlamaConfig(vocab_size=97, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                      num_key_value_heads=2, tie_word_embeddings=tied)

    def trained(fast: bool):
        torch.manual_seed(0)
        model = LlamaForCausalLM(cfg)
        params = list(model.named_parameters())
        opt = make_optimizer(params, ClientState(adapters={}), "model", TrainConfig(lr=1e-2), fused=fast)
        gen = torch.Generator().manual_seed(1)
        with sparse_tied_embedding_grads(model) if fast else contextlib.nullcontext() as switched:
            assert model.get_input_embeddings().sparse is (fast and tied) and bool(switched) is (fast and tied)
            for _ in range(3):
                x = torch.randint(0, 97, (2, 9), generator=gen)
                train_step(model, x[:, :-1], x[:, 1:], [p for _, p in params], opt, 0.0)
        assert not model.get_input_embeddings().sparse  # switched back
        return model
    plain, fast = trained(False), trained(True)
    torch.manual_seed(0)
    start = LlamaForCausalLM(cfg).get_input_embeddings().weight
    assert (plain.get_input_embeddings().weight - start).abs().max() > 1e-3  # the steps moved the embedding
    for (name, a), (_, b) in zip(plain.named_parameters(), fast.named_parameters()):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6, msg=name)
