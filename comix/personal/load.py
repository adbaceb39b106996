"""Loading an exported user model: exactly (``load_personal``, from comix's manifest) or any
folder ``comix generate`` is given (a comix export, a plain PEFT folder or a merged model)."""
from __future__ import annotations

import json
from pathlib import Path

from torch import nn

from .run_folder import MANIFEST, ExportError, weights_sha256


def load_personal(folder: str | Path, base: nn.Module | None = None):
    """(model, tokenizer) of an exported user model, rebuilt exactly as the run left it: the base
    (``base``, or the manifest's spec) is checked against the manifest's weight hash first."""
    from safetensors.torch import load_file

    from ..config import load_config
    from ..models import inject_adapters, load_base_model
    from ..specs import build_algorithm

    folder = Path(folder)
    if not (folder / MANIFEST).exists():
        raise ExportError(f"{folder} holds no {MANIFEST}: not a `comix export` folder")
    man = json.loads((folder / MANIFEST).read_text())
    if man["kind"] == "global-moe":  # a plain transformers folder (Mixtral) with its tokenizer
        from transformers import AutoModelForCausalLM, AutoTokenizer
        path = str(folder / man["model"])
        tok = AutoTokenizer.from_pretrained(path) if (folder / man["model"] / "tokenizer_config.json").exists() else None
        return AutoModelForCausalLM.from_pretrained(path).eval(), tok
    tok = None
    if base is None:
        base, tok = load_base_model(man["base"]["spec"], dropout=0.0)
    got = weights_sha256(base)
    if got != man["base"]["sha256"]:
        raise ExportError(f"{folder}: the base model's weights differ from the one it was trained on "
                          f"(sha256 {got[:12]} != {man['base']['sha256'][:12]}, {man['base']['spec']})")
    cfg = load_config(text=man["config"])
    algo = build_algorithm(cfg, man["method"], man["n_clients"])
    model = inject_adapters(base, algo.adapter_config(man["client"]))
    algo.load_state(model, load_file(str(folder / man["adapters"])))
    return model.eval(), tok


def load_any(folder: str | Path):
    """(model, tokenizer) of what ``comix generate`` is given: a ``comix export`` folder (exact,
    ``load_personal``; a device export: its ExecuTorch program, a ``PteModel``, or its GGUF file read
    back by transformers), a ``.pte`` file of one, a plain PEFT LoRA folder (its
    ``base_model_name_or_path``: a folder, a hub id or one of comix's built-in model names) or a
    merged / plain transformers model folder."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from .formats import is_device_export, load_device
    folder = Path(folder)
    if folder.suffix == ".pte" and folder.is_file():
        folder = folder.parent  # the program of a device export: its tokenizer and manifest beside it
    if is_device_export(folder):
        return load_device(folder)[:2]
    if (folder / MANIFEST).exists():
        return load_personal(folder)
    if (folder / "adapter_config.json").exists():
        from peft import PeftModel

        from ..models import load_base_model
        base_ref = json.loads((folder / "adapter_config.json").read_text())["base_model_name_or_path"]
        base, tok = load_base_model(base_ref, dropout=0.0)
        if (folder / "tokenizer_config.json").exists():
            tok = AutoTokenizer.from_pretrained(str(folder))
        return PeftModel.from_pretrained(base, str(folder)).eval(), tok
    if (folder / "config.json").exists():
        return AutoModelForCausalLM.from_pretrained(str(folder)).eval(), AutoTokenizer.from_pretrained(str(folder))
    raise ExportError(f"{folder} is neither a `comix export` folder (manifest.json), a PEFT folder "
                      "(adapter_config.json) nor a model folder (config.json)")
