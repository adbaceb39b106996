"""Task metrics on hand-made examples: Rouge-L, lowest-loss classification, MTA."""
import pytest
import torch

from comix.eval.tasks import choice_accuracy, continuation_losses, mta, rouge_l
from comix.models import load_base_model


def test_rouge_l_on_hand_made_pairs():
    assert rouge_l("the cat sat on the mat", "the cat sat on the mat") == pytest.approx(1.0)
    assert rouge_l("dogs bark", "the cat sat on the mat") == 0.0
    # LCS "the cat mat" = 3 of 4 predicted and 6 reference tokens: P 3/4, R 3/6, F = 2PR/(P+R) = 0.6
    assert rouge_l("the cat on mat", "the cat sat upon the mat") == pytest.approx(0.6)


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
