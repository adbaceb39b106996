"""Task metrics on hand-made examples: Rouge-L, lowest-loss classification, MTA."""
import pytest
import torch

from comix.eval.tasks import choice_accuracy, continuation_losses, mta, rouge_l
from comix.models import load_base_model


@pytest.mark.parametrize("impl", ["rouge", "rouge-score"])
def test_rouge_l_on_hand_made_pairs(impl):
    assert rouge_l("the cat sat on the mat", "the cat sat on the mat", impl) == pytest.approx(1.0)
    assert rouge_l("dogs bark", "the cat sat on the mat", impl) == 0.0
    # LCS "the cat mat" = 3 of 4 predicted and 6 reference tokens: P 3/4, R 3/6, F = 2PR/(P+R) = 0.6;
    # the authors' package counts *distinct* words (its Ngrams are sets): R 3/5, so F = 2/3
    want = 2 / 3 if impl == "rouge" else 0.6
    assert rouge_l("the cat on mat", "the cat sat upon the mat", impl) == pytest.approx(want, rel=1e-6)
    assert rouge_l("", "the cat", impl) == 0.0


def test_the_authors_rouge_is_case_sensitive_and_splits_sentences_on_periods():
    """The authors' ``rouge`` 1.0.1 (the default) keeps case and punctuation in whitespace tokens
    and takes a summary-level LCS over '.'-split sentences; ``rouge_score`` lower-cases and drops
    punctuation: the same pair scores differently, by hand."""
    # '.' ends a sentence ("mat." reads "mat") but "The" != "the": LCS = cat sat on the mat, 5 of
    # the prediction's 5 distinct words and the reference's 6: P 1, R 5/6, F = 2PR/(P+R) = 10/11
    assert rouge_l("the cat sat on the mat", "The cat sat on the mat.", "rouge") == pytest.approx(10 / 11, rel=1e-6)
    assert rouge_l("the cat sat on the mat", "The cat sat on the mat.", "rouge-score") == pytest.approx(1.0)
    # summary level: each reference sentence's union LCS with the prediction's sentences (two
    # sentences of 3 tokens, each found whole in the one-sentence prediction): R = P = 6/6
    assert rouge_l("a b c d e f", "a b c. d e f", "rouge") == pytest.approx(1.0, rel=1e-6)
    assert rouge_l("d e f a b c", "a b c. d e f", "rouge") == pytest.approx(1.0, rel=1e-6)
    assert rouge_l("d e f a b c", "a b c. d e f", "rouge-score") == pytest.approx(0.5)


def test_continuation_losses_match_a_manual_computation_and_pick_the_lowest():
    model, tok = load_base_model("tiny-llama")
    prompt, choices = "Is it? ", ["Yes", "No", "Maybe"]
    losses = continuation_losses(model, tok, prompt, choices)
    for c, loss in zip(choices, losses):
        p = tok(prompt, add_special_tokens=False)["input_ids"]
        full = p + tok(c, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        ids = torch.tensor([full])
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0, :-1]
        manual = torch.nn.functional.cross_entropy(logits[len(p) - 1:], ids[0, len(p):])
        assert loss.item() == pytest.approx(manual.item(), rel=1e-5)
    best = choices[int(losses.argmin())]
    assert choice_accuracy(model, tok, [prompt, prompt], choices, [best, "nothing"]) == 0.5


def test_mta_is_the_mean_over_clients():
    assert mta({"a": 0.5, "b": 1.0}) == 0.75


def test_answer_nll_scores_the_answer_tokens_given_the_question_only():
    from comix.eval.tasks import answer_nll
    model, _ = load_base_model("tiny-llama")
    gen = torch.Generator().manual_seed(0)
    pairs = [(torch.randint(0, 256, (n,), generator=gen), torch.randint(0, 256, (k,), generator=gen))
             for n, k in ((5, 3), (9, 2), (4, 6))]
    total, count = answer_nll(model, pairs, pad_id=0, batch_size=2)
    want = 0.0
    with torch.no_grad():
        for q, a in pairs:  # one pair at a time, no padding: the answer's tokens, each given all before it
            logp = torch.log_softmax(model(input_ids=torch.cat([q, a])[None]).logits[0].float(), -1)
            want -= sum(logp[len(q) - 1 + i, a[i]].item() for i in range(len(a)))
    assert count == 11 and total == pytest.approx(want, rel=1e-5)
