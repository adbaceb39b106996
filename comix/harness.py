"""An exported user model in EleutherAI's lm-evaluation-harness.

A plain-LoRA export is a standard PEFT folder, so lm-eval's own ``hf`` model scores it with nothing
of comix installed::

    lm_eval --model hf --model_args pretrained=BASE_FOLDER,peft=EXPORT --tasks TASK --include_path TASKS

A mixture (CoMiGS, pFedMoE, FedAMoLE, ...) is not a PEFT format: its per-layer token routers live
in comix, so it is scored through the model registered here as ``comix``, which rebuilds the
export with ``comix.load_personal`` (the base checked against the manifest's weight hash) and hands
the model to lm-eval's ``HFLM``: everything else (batching, tokenisation, the task's metrics) is
lm-eval's. lm-eval 0.4.13 discovers no plugins, so its command line runs with the model registered
first::

    python -m comix.harness --model comix --model_args personal=EXPORT --tasks TASK --include_path TASKS

(any other ``lm_eval`` argument as usual; ``pip install 'comix[harness]'``).
"""
from __future__ import annotations

import sys

from lm_eval.api.registry import register_model
from lm_eval.models.huggingface import HFLM


@register_model("comix")
class ComixLM(HFLM):
    """lm-eval's HF causal LM around ``comix.load_personal(personal)``."""

    def __init__(self, personal: str, **kwargs):
        from .personal import load_personal
        model, tok = load_personal(personal)
        kwargs.pop("pretrained", None)  # the export names its own base
        super().__init__(pretrained=model, tokenizer=tok, **kwargs)


def main(argv: list[str] | None = None) -> None:
    """lm_eval's command line with the ``comix`` model registered."""
    from lm_eval.__main__ import cli_evaluate
    sys.argv = ["lm_eval", *(sys.argv[1:] if argv is None else argv)]
    cli_evaluate()


if __name__ == "__main__":
    main()
