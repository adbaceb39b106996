"""Instruction data: templates, response-only loss, partitions, client splits."""
import pytest
import torch

from comix.data.instructions import (Example, NLIExample, client_splits, dirichlet_label_skew, task_per_client,
                                     tokenize_examples)
from comix.models import load_base_model


def test_loss_only_on_the_response_and_padding_ignored():
    _, tok = load_base_model("tiny-llama")
    exs = [Example("Say hi.", "hi"), Example("Add.", "3", input="1 + 2")]
    split = tokenize_examples(exs, tok)
    for ex, ids, labels in zip(exs, split.ids, split.labels):
        target = tok(ex.output, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        assert labels[labels != -100].tolist() == target and ids[-len(target):].tolist() == target
        assert tok.decode(ids[:len(ids) - len(target)]) == ex.prompt()
    assert "### Input:\n1 + 2" in exs[1].prompt() and "### Input" not in exs[0].prompt()
    x, y = split.sample(4, torch.Generator().manual_seed(0))
    pick = torch.randint(2, (4,), generator=torch.Generator().manual_seed(0)).tolist()
    for row, i in enumerate(pick):  # x: the sequence; y: its next tokens, -100 off the target and on padding
        n = len(split.ids[i]) - 1
        assert torch.equal(x[row, :n], split.ids[i][:-1]) and torch.equal(y[row, :n], split.labels[i][1:])
        assert (y[row, n:] == -100).all()


def test_snli_template_is_the_reference_one():
    ex = NLIExample("A man sleeps.", "Yes", input="Someone rests.", category="Yes")
    assert ex.prompt() == 'Suppose A man sleeps. Can we infer that "Someone rests."? Yes, No, or Maybe?\n'


def _examples(n_cats=5, per=40):
    return [Example(f"q{c}-{i}", f"a{c}-{i}", category=f"c{c}") for c in range(n_cats) for i in range(per)]


def test_dirichlet_label_skew_partitions_every_example_once_and_skews_with_small_alpha():
    exs = _examples()
    parts = dirichlet_label_skew(exs, 4, alpha=0.1, seed=1)
    flat = [e for p in parts for e in p]
    assert sorted(e.instruction for e in flat) == sorted(e.instruction for e in exs)
    assert parts == dirichlet_label_skew(exs, 4, alpha=0.1, seed=1)  # the same partition for every method
    dominant = [max(sum(e.category == c for e in p) for c in {e.category for e in exs}) / max(1, len(p))
                for p in parts if p]
    assert sum(dominant) / len(dominant) > 0.5
    flat100 = dirichlet_label_skew(exs, 4, alpha=100.0, seed=1)
    assert all(len({e.category for e in p}) == 5 for p in flat100)


def test_one_task_per_client_and_the_80_10_10_split_with_caps():
    parts = task_per_client(_examples(), 3, seed=0)
    assert [{e.category for e in p} for p in parts] == [{"c0"}, {"c1"}, {"c2"}]
    with pytest.raises(ValueError, match="5 tasks for 6 clients"):
        task_per_client(_examples(), 6, seed=0)
    many = [Example(str(i), "x") for i in range(3000)]
    gen, cls = client_splits(many, classification=False, seed=0), client_splits(many, classification=True, seed=0)
    assert (len(gen["train"]), len(gen["valid"]), len(gen["test"])) == (2400, 200, 50)
    assert len(cls["test"]) == 200
    assert not {e.instruction for e in gen["train"]} & {e.instruction for e in gen["test"]}


def test_real_loaders_read_local_files_of_the_hub_schema(tmp_path):
    import json
    from comix.data.instructions import dolly, natural_instructions, snli
    (tmp_path / "snli.jsonl").write_text("\n".join(json.dumps(r) for r in [
        {"premise": "A dog runs.", "hypothesis": "An animal moves.", "label": 0},
        {"premise": "A dog runs.", "hypothesis": "A cat sleeps.", "label": 2},
        {"premise": "A dog runs.", "hypothesis": "It is sunny.", "label": -1}]))
    nli = snli(data_files=tmp_path / "snli.jsonl")
    assert [e.output for e in nli] == ["Yes", "No"] and nli[0].input == "An animal moves."
    (tmp_path / "dolly.jsonl").write_text(json.dumps(
        {"instruction": "Name a color.", "context": "", "response": "Blue.", "category": "brainstorming"}))
    d = dolly(data_files=tmp_path / "dolly.jsonl")
    assert d == [Example("Name a color.", "Blue.", category="brainstorming")]
    (tmp_path / "ni.jsonl").write_text("\n".join(json.dumps(r) for r in [
        {"task_name": "task001_add", "id": "1", "definition": "Add the numbers.", "inputs": "1 2", "targets": "3"},
        {"task_name": "task002_neg", "id": "2", "definition": "Negate.", "inputs": "4", "targets": "-4"}]))
    ni = natural_instructions(data_files=tmp_path / "ni.jsonl", tasks=["task002_neg"])
    assert ni == [Example("Negate.", "-4", input="4", category="task002_neg")]


def test_bos_follows_the_tokenizer_s_own_convention():
    """A Llama-2-style tokenizer puts BOS before a text (as Gemma's and Llama-3's do): every prompt
    and every document of a stream starts with it, also when a long prompt is cut, and the labels
    never score it; a tokenizer that adds none (SmolLM2, GPT-2, the tiny models) gets none."""
    from comix.data.instructions import Example, tokenize_examples
    from comix.data.splits import tokenize_docs
    from comix.models.base import load_tokenizer
    from test_token_align import llama2_tokenizer

    bos_tok = llama2_tokenizer()
    ex = [Example("say hello", "hello world"), Example("hello " * 40, "world")]
    split = tokenize_examples(ex, bos_tok, max_len=16)
    for ids, labels in zip(split.ids, split.labels):
        assert ids[0] == 1 and (ids == 1).sum() == 1 and labels[0] == -100 and len(ids) <= 16
    assert split.ids[1][-2:].tolist() == [bos_tok.convert_tokens_to_ids("▁world"), bos_tok.eos_token_id]
    stream = tokenize_docs(["hello world", "world"], bos_tok).tolist()
    assert stream[0] == 1 and stream.count(1) == 2 and stream[stream.index(2) + 1] == 1
    plain = load_tokenizer("tiny-llama")
    assert tokenize_examples(ex[:1], plain, 64).ids[0][0] != plain.bos_token_id
