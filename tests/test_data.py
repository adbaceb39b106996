import json
import math
import re

import pytest
import torch

from comix.data import (SplitConfig, builtin, check_seq_len, load_corpus, make_user_data, sample_batch,
                        token_table, user_dirs)
from comix.data.corpora import ag_news, clean_wiki40b, common_corpus, slimpajama, wiki40b
from comix.eval import perplexity, split_nll
from comix.models import load_base_model


@pytest.fixture(scope="module")
def tok():
    return load_base_model("tiny-llama")[1]


@pytest.mark.parametrize("name,cats", [("multilingual", ["de", "fr", "it", "nl"]),
                                       ("topics", ["code", "docs", "literature", "lexicon"])])
def test_builtin_corpora_are_big_and_clean(name, cats):
    corpus = builtin(name)
    assert list(corpus) == cats
    for cat, docs in corpus.items():
        text = "\n".join(docs)
        assert len(text) >= 1_500_000, cat
        if cat in ("code", "docs"):  # Python source and docs legitimately mention <tags> and &amp;
            continue
        assert not re.search(r"</?(p|span|div|a|h\d)\b[^>]*>", text), cat
        assert "class=\"" not in text and "&amp;" not in text and "&nbsp;" not in text, cat


def test_multilingual_is_in_its_language():
    corpus = builtin("multilingual")
    marks = {"de": " und ", "fr": " les ", "it": " della ", "nl": " het "}
    for lang, word in marks.items():
        text = " ".join(corpus[lang][:50])
        assert all(text.count(word) >= 3 * " ".join(corpus[other][:50]).count(word)
                   for other in marks if other != lang), lang


def test_unknown_corpus_error():
    with pytest.raises(ValueError, match="unknown corpus 'nope'"):
        load_corpus("nope")


def test_user_dirs(tmp_path):
    (tmp_path / "alice").mkdir()
    (tmp_path / "alice" / "a.txt").write_text("hello there")
    (tmp_path / "bob").mkdir()
    (tmp_path / "bob" / "b.jsonl").write_text(json.dumps({"text": "one"}) + "\n" + json.dumps({"text": "two"}))
    assert load_corpus(str(tmp_path)) == {"alice": ["hello there"], "bob": ["one", "two"]}
    (tmp_path / "carol").mkdir()
    with pytest.raises(ValueError, match="carol holds no text"):
        user_dirs(tmp_path)
    (tmp_path / "carol" / "c.jsonl").write_text("{broken")
    with pytest.raises(ValueError, match="c.jsonl:1: expected a JSON object"):
        user_dirs(tmp_path)


def test_online_loaders_on_local_files_shaped_like_the_hub(tmp_path):
    ag = tmp_path / "ag.jsonl"
    ag.write_text("\n".join(json.dumps({"text": f"news {i}", "label": i % 4}) for i in range(8)))
    out = ag_news(data_files=ag)
    assert list(out) == ["world", "sports", "business", "scitech"] and out["sports"] == ["news 1", "news 5"]
    wk = tmp_path / "de.jsonl"
    wk.write_text(json.dumps({"wikidata_id": "Q1", "version_id": "1",
                              "text": "\n_START_ARTICLE_\nBerlin\n_START_PARAGRAPH_\nEine Stadt._NEWLINE_Groß."}))
    assert wiki40b(["de"], data_files={"de": wk})["de"] == ["Berlin\nEine Stadt.\nGroß."]
    sp = tmp_path / "sp.jsonl"
    sp.write_text("\n".join(json.dumps({"text": f"t{i}", "meta": {"redpajama_set_name": s}})
                            for i, s in enumerate(["RedPajamaArXiv", "RedPajamaBook", "RedPajamaC4"])))
    assert slimpajama(["arxiv", "book"], data_files=sp) == {"arxiv": ["t0"], "book": ["t1"]}
    cc = tmp_path / "cc.jsonl"
    cc.write_text(json.dumps({"text": "tender text", "identifier": "x"}))
    assert common_corpus(["tenders"], data_files={"tenders": cc}) == {"tenders": ["tender text"]}
    assert clean_wiki40b("_START_SECTION_\nA_NEWLINE_B") == "A\nB"


def _toy_corpus():
    return {c: [f"{c} document number {i} " * 20 for i in range(30)] for c in ("alpha", "beta", "gamma")}


def test_splits_by_document_without_overlap(tok):
    corpus = _toy_corpus()
    users = make_user_data(corpus, tok, SplitConfig(valid_frac=0.2, test_frac=0.2))
    assert [u.name for u in users] == ["alpha", "beta", "gamma"]
    for u in users:
        texts = {s: set(tok.decode(u.tokens(s).tolist()).split("<eos>")) - {""} for s in ("train", "valid", "test")}
        assert not (texts["train"] & texts["valid"]) and not (texts["train"] & texts["test"])
        assert not (texts["valid"] & texts["test"])
        assert all(t.startswith(u.name) for s in texts for t in texts[s])
    assert "TRAIN" in token_table(users) and "alpha" in token_table(users)


def test_ood_mixture_and_quantity_skew(tok):
    corpus = _toy_corpus()
    users = make_user_data(corpus, tok, SplitConfig(mode="ood", test_tokens=3000, train_tokens=[4000, 1000, 1000]))
    text = tok.decode(users[0].test.tolist())
    assert all(text.count(c) > 5 for c in corpus)             # every category in the mixture
    assert torch.equal(users[0].test, users[2].test) and len(users[0].test) == 3000
    assert [len(u.train) for u in users] == [4000, 1000, 1000]
    with pytest.raises(ValueError, match=r"data.train_tokens\[0\]"):
        make_user_data(corpus, tok, SplitConfig(train_tokens=[10**9, 1, 1]))


def test_ood_mixture_shares_stay_equal_when_the_cap_exceeds_the_smallest_category(tok):
    corpus = _toy_corpus()
    corpus[next(iter(corpus))] = corpus[next(iter(corpus))][:6]  # one small category
    users = make_user_data(corpus, tok, SplitConfig(mode="ood", test_tokens=10**7))
    smallest = min(len(make_user_data(corpus, tok, SplitConfig(mode="in"))[i].test) for i in range(len(corpus)))
    assert len(users[0].test) == smallest * len(corpus)  # n equal shares of the smallest split


def test_seq_len_longer_than_split(tok):
    users = make_user_data(_toy_corpus(), tok, SplitConfig(test_tokens=50))
    with pytest.raises(ValueError, match="seq_len 64 is longer than user 'alpha'.s test split"):
        check_seq_len(users, 64)


def test_sample_batch_targets_are_shifted_inputs():
    tokens = torch.arange(100, dtype=torch.int32)
    x, y = sample_batch(tokens, 4, 10, torch.Generator().manual_seed(0))
    assert x.shape == (4, 10) and torch.equal(y, x + 1)


class _Uniform(torch.nn.Module):
    """Logits that are all zero: every token has NLL log(V)."""

    def __init__(self, vocab):
        super().__init__()
        self.vocab, self.w = vocab, torch.nn.Parameter(torch.zeros(1))
        self.seen = []

    def forward(self, input_ids):
        self.seen.append(input_ids.clone())
        return type("Out", (), {"logits": torch.zeros(*input_ids.shape, self.vocab) + 0 * self.w})()


def test_perplexity_counts_every_token_once():
    model = _Uniform(50)
    tokens = torch.randint(0, 50, (1001,))
    total, n = split_nll(model, tokens, seq_len=64, batch_size=4)
    assert n == 1000 and total == pytest.approx(1000 * math.log(50), rel=1e-6)
    assert perplexity(model, tokens, 64) == pytest.approx(50, rel=1e-5)
    inputs = torch.cat([b.reshape(-1) for b in model.seen[:5]])  # first call's windows, in order
    assert torch.equal(inputs[:1000], tokens[:1000])


def test_perplexity_matches_model_loss_on_one_window():
    model, tok = load_base_model("tiny-llama")
    tokens = torch.randint(0, 256, (65,))
    expect = model(input_ids=tokens[None, :64].long(), labels=tokens[None, :64].long()).loss
    # HF's loss over 64 inputs predicts 63 tokens; ours predicts all 64 targets of the window
    total, n = split_nll(model, tokens, 64)
    logits = model(input_ids=tokens[None, :64].long()).logits[0]
    manual = torch.nn.functional.cross_entropy(logits, tokens[1:].long(), reduction="sum").item()
    assert n == 64 and total == pytest.approx(manual, rel=1e-5)
    assert total / n == pytest.approx((expect.item() * 63 + torch.nn.functional.cross_entropy(
        logits[-1:], tokens[-1:].long()).item()) / 64, rel=1e-5)
