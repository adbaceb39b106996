"""``export_personal(..., format="executorch" | "gguf")``: a user's model in the file a device
runtime loads, with its tokenizer and a manifest (base, method, user, round, precision, sizes).

Every refusal is one line before the model is rebuilt (``device_refusal``): ExecuTorch not
installed, a precision the format has not, a model with no form in the format (a mixture in GGUF,
soft prompts, a server-side global model).
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

from .run_folder import MANIFEST, ExportError

FORMATS = ("comix", "executorch", "gguf")


def precisions(fmt: str) -> tuple[str, ...]:
    from .device import PRECISIONS as EXECUTORCH
    from .gguf_file import PRECISIONS as GGUF
    return {"executorch": EXECUTORCH, "gguf": GGUF}.get(fmt, ())


def device_refusal(fmt: str, precision: str | None, roles: set[str], kind: str | None, architecture: str) -> str | None:
    """Why ``fmt`` cannot hold this model, in one line (None: it can). ``kind``: export.py's kind of
    the user's adapters (None: the run's model is the server's global MoE)."""
    from .device import executorch_missing
    from .gguf_file import gguf_refusal
    if fmt not in FORMATS:
        return f"--format {fmt!r}: one of {', '.join(FORMATS)}"
    if precision is not None and precision not in precisions(fmt):
        return f"--precision {precision!r}: --format {fmt} has {', '.join(precisions(fmt)) or 'no --precision'}"
    if fmt == "executorch" and executorch_missing():
        return executorch_missing()
    if kind is None:
        return (f"--format {fmt}: the run's model is the server's global MoE (a Mixtral folder), which comix does not "
                "export for devices; --format comix gives it as a transformers folder")
    if "prompt" in roles:
        return (f"--format {fmt}: soft prompts are prepended as virtual tokens inside PEFT's prompt model, which "
                "has no device form here; --format comix rebuilds it with comix.load_personal")
    if fmt == "gguf" and kind != "lora":
        return ("--format gguf needs one plain checkpoint, and this is a "
                f"{'mixture of LoRA experts' if kind == 'mixture' else kind + ' model'} whose routers weigh experts "
                "per token: --format executorch runs it whole, routers included")
    if fmt == "gguf":
        return gguf_refusal(architecture)
    return None


def _merged(model, tok, base_spec: str, tmp: Path):
    """The plain-LoRA user model merged into its base (its PEFT folder, written to ``tmp`` and
    removed, merged as ``--merged`` merges it)."""
    from .peft_forms import _lora_modules, merged_model, write_peft_lora
    write_peft_lora(_lora_modules(model), tmp, base_spec)
    merged = merged_model(tmp, base_spec)
    shutil.rmtree(tmp)
    return merged


def write_device(tmp: Path, fmt: str, precision: str | None, model, tok, manifest: dict, cfg,
                 max_len: int | None = None) -> None:
    """Write the user's ``model`` in ``fmt`` into ``tmp`` (renamed by the caller) with its tokenizer
    and ``manifest`` completed."""
    from ..models.base import OFFLINE, model_config, offline_gguf
    precision = precision or precisions(fmt)[0]
    n_params = sum(p.numel() for p in model.parameters())
    if fmt == "executorch":
        from .device import PTE, default_max_len, write_pte
        info = write_pte(model, tmp / PTE, precision, max_len or default_max_len(model_config(cfg.model)))
        run = f"comix generate {{out}} \"Hello\" (ExecuTorch's Python runtime; on a phone: its LLM runner and {PTE})"
    else:
        from .gguf_file import write_gguf
        merged = _merged(model, tok, cfg.model, tmp / ".peft")
        source = offline_gguf(cfg.model) if cfg.model in OFFLINE else None
        info = write_gguf(merged, tok, tmp / "model.gguf", precision, name=f"comix {manifest['method']} {manifest['user']}",
                          tokenizer_gguf=source)
        run = "llama-cli -m {out}/model.gguf -p \"Hello\" -n 40 --temp 0; Ollama: FROM ./model.gguf in a Modelfile"
    tok.save_pretrained(str(tmp))
    manifest.update(format="comix-device/1", kind=fmt, round=cfg.train.rounds, precision=precision, file=info,
                    sizes={"file_bytes": info["bytes"], "parameters": n_params}, run=run)
    (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1))


def is_device_export(folder: Path) -> bool:
    file = Path(folder) / MANIFEST
    return file.exists() and json.loads(file.read_text()).get("format") == "comix-device/1"


def load_device(folder: Path):
    """(model, tokenizer, manifest) of a device export that comix runs itself: the ExecuTorch
    program (``PteModel``) or the GGUF file read back by transformers' GGUF loader."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    folder = Path(folder)
    man = json.loads((folder / MANIFEST).read_text())
    tok = AutoTokenizer.from_pretrained(str(folder))
    if man["kind"] == "executorch":
        from .device import PteModel, executorch_missing
        if executorch_missing():
            raise ExportError(executorch_missing())
        return PteModel(folder / man["file"]["pte"], man["file"]["max_len"]), tok, man
    import functools

    from transformers import modeling_gguf_pytorch_utils as reader
    from transformers.utils import logging as hf_logging
    bar = reader.tqdm  # transformers' GGUF reader draws a plain tqdm bar over the tensors: not on one small file
    reader.tqdm = functools.partial(bar, disable=True)
    hf_logging.disable_progress_bar()  # and its "Loading weights" bar
    try:
        model = AutoModelForCausalLM.from_pretrained(str(folder), gguf_file=man["file"]["gguf"]).eval()
    finally:
        reader.tqdm = bar
        hf_logging.enable_progress_bar()
    return model, tok, man

