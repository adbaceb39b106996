"""A tokenizer's own convention for special tokens, applied wherever comix tokenises text.

Gemma (1/2/3), Llama-2/3 and Mistral tokenizers put BOS before every text and their models
degrade badly without it (lm-evaluation-harness adds it for Gemma for this reason); GPT-2 and
SmolLM2 add nothing. FedAMoLE's authors tokenise each prompt with the tokenizer's defaults
(``data/preprocess.py``: ``tokenizer(sources)``, the labels' BOS dropped), so their Llama-3.2
prompts start with BOS. comix follows the tokenizer: ``leading_special_ids`` is what it puts
before a text, added to each instruction prompt and each document of a token stream.
"""
from __future__ import annotations


def leading_special_ids(tokenizer) -> list[int]:
    """The ids ``tokenizer`` puts before a text by its own convention (``add_special_tokens``):
    its encoding of a text with them, minus the encoding without, when the latter ends it."""
    text = "a"
    plain = tokenizer(text, add_special_tokens=False)["input_ids"]
    full = tokenizer(text)["input_ids"]
    k = len(full) - len(plain)
    for start in range(k + 1):  # where the plain encoding sits inside the full one
        if full[start:start + len(plain)] == plain:
            return list(full[:start])
    return []
