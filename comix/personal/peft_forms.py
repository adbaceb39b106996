"""PEFT forms of a user's model: LoRA folders (exact for plain LoRA, one per expert for a
mixture), the static approximation of a mixture, the merged model and the base model itself."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from torch import nn

from .run_folder import ExportError


def _lora_modules(model: nn.Module, expert: int | None = None) -> dict[str, tuple[torch.Tensor, torch.Tensor, float, bool]]:
    """module path -> (A, B, scaling, fan_in_fan_out) of every plain LoRA of ``model`` (an FDLoRA
    pair fused into one by concatenating ranks, w_0 B | w_1 B_local); with ``expert`` also that
    expert's LoRA on each mixture MLP projection."""
    from transformers.pytorch_utils import Conv1D

    from ..models.lora import LoRALinear
    from ..models.mixture import MixtureOfLoRAMLP
    out = {}
    for name, m in model.named_modules():
        if isinstance(m, LoRALinear):
            conv = isinstance(m.base, Conv1D)
            a, b = m.lora.lora_A.detach(), m.lora.lora_B.detach()
            if m.lora_local is not None:
                w = m.lora_fusion.detach()
                a = torch.cat([a, m.lora_local.lora_A.detach()])
                b = torch.cat([w[0] * b, w[1] * m.lora_local.lora_B.detach()], 1)
            out[name + ".base"] = (a, b, m.scaling, conv)
        elif isinstance(m, MixtureOfLoRAMLP) and expert is not None:
            for proj, w in m.experts[expert].items():
                conv = isinstance(getattr(m.base, proj), Conv1D)
                out[f"{name}.base.{proj}"] = (w.lora_A.detach(), w.lora_B.detach(), m.scaling, conv)
    return out


def _amole_modules(model: nn.Module, expert_id: int) -> dict[str, tuple[torch.Tensor, torch.Tensor, float, bool]]:
    """module path -> (A, B, scaling, fan_in_fan_out) of the model whose AMoLE routers always give
    global expert ``expert_id`` weight 1: on every AMoLE module the shared expert, concatenated in
    rank with ``expert_id``'s LoRA where this client holds it (shared + expert, exactly), plus the
    model's plain LoRA modules."""
    from transformers.pytorch_utils import Conv1D

    out = dict(_lora_modules(model))
    for name, m in _amole_layers(model):
        ids = m.slot_ids[:m.n_active].tolist()
        parts = [(m.shared.lora_A.detach(), m.shared.lora_B.detach())] if m.shared is not None else []
        if expert_id in ids:
            slot = ids.index(expert_id)
            parts.append((m.expert_A[slot].detach(), m.expert_B[slot].detach()))
        if parts:
            out[name + ".base"] = (torch.cat([a for a, _ in parts]), torch.cat([b for _, b in parts], 1), m.scaling,
                                   isinstance(m.base, Conv1D))
    return out


def _peft_prefix(path: str) -> str:
    return f"base_model.model.{path}"


def write_peft_lora(modules: dict, out: Path, base_name: str) -> None:
    """A PEFT LoRA folder equal to ``modules``: each module's rank and scaling are exact through
    ``rank_pattern`` / ``alpha_pattern`` (PEFT's scaling is lora_alpha / r, so alpha = scaling x r)."""
    from peft import LoraConfig
    from safetensors.torch import save_file

    tensors, ranks, alphas, fan_in = {}, {}, {}, set()
    for path, (a, b, scaling, conv) in modules.items():
        target = path.removesuffix(".base").replace(".base.", ".")
        tensors[_peft_prefix(target) + ".lora_A.weight"] = a.float().contiguous().clone()
        tensors[_peft_prefix(target) + ".lora_B.weight"] = b.float().contiguous().clone()
        ranks[target], alphas[target] = a.shape[0], scaling * a.shape[0]
        if conv:
            fan_in.add(target)
    if not tensors:
        raise ExportError("no LoRA modules to export")
    first = next(iter(ranks))
    config = LoraConfig(r=ranks[first], lora_alpha=alphas[first], target_modules=sorted(ranks), lora_dropout=0.0,
                        bias="none", task_type="CAUSAL_LM", fan_in_fan_out=bool(fan_in),
                        rank_pattern={k: v for k, v in ranks.items() if v != ranks[first]},
                        alpha_pattern={k: v for k, v in alphas.items() if v != alphas[first]},
                        base_model_name_or_path=base_name)
    out.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(str(out))
    save_file(tensors, str(out / "adapter_model.safetensors"))


def _amole_layers(model: nn.Module) -> list:
    """(path, module) of every AMoLE layer of ``model`` (FedAMoLE)."""
    from ..models.amole import AMoLELinear
    return [(name, m) for name, m in model.named_modules() if isinstance(m, AMoLELinear)]


def _expert_param(model: nn.Module, j: int) -> str:
    return next(n for n, _ in model.named_parameters() if f".mlp.experts.{j}." in n)


def mean_routing(method_dir: Path, user: str, n: int) -> list[float]:
    """The user's mean gate per expert (over layers) in the last evaluation's ``gates``."""
    rows = [json.loads(x) for x in (method_dir / "metrics.jsonl").read_text().splitlines()]
    gates = [r["gates"] for r in rows if r.get("user") == user and "gates" in r]
    if not gates:
        return [1.0 / n] * n
    last = torch.tensor(gates[-1], dtype=torch.float64)
    return [round(v, 6) for v in last.mean(0).tolist()]


def _write_static(folder: Path, base_name: str, n: int, weights: list[float]) -> None:
    from peft import PeftModel

    from ..models import load_base_model
    base, _ = load_base_model(base_name)
    peft = PeftModel.from_pretrained(base, str(folder / "experts" / "0"), adapter_name="e0")
    for j in range(1, n):
        peft.load_adapter(str(folder / "experts" / str(j)), adapter_name=f"e{j}")
    peft.add_weighted_adapter([f"e{j}" for j in range(n)], weights, "static", combination_type="cat")
    # no vocabulary was resized: PEFT need not look the base up (on a hub) to decide whether to save embeddings
    peft.save_pretrained(str(folder / "static-tmp"), selected_adapters=["static"], save_embedding_layers=False)
    shutil.move(str(folder / "static-tmp" / "static"), str(folder / "static"))
    shutil.rmtree(folder / "static-tmp")


def merged_model(peft_dir: Path, base_name: str) -> nn.Module:
    """The base with the PEFT LoRA folder ``peft_dir`` merged into it (PEFT's merge_and_unload)."""
    from peft import PeftModel

    from ..models import load_base_model
    base, _ = load_base_model(base_name)
    return PeftModel.from_pretrained(base, str(peft_dir)).merge_and_unload().eval()


def _write_merged(model: nn.Module, tok, out: Path, base_name: str) -> None:
    merged = merged_model(out.parent, base_name)
    if hasattr(merged.config, "comix_tokenizer"):
        del merged.config.comix_tokenizer
    merged.save_pretrained(str(out))
    tok.save_pretrained(str(out))


def write_base(spec: str, out: Path) -> None:
    """The base model comix trained on (``spec``: a built-in name or a hub id) with its tokenizer, as
    a plain transformers folder: what ``base_model_name_or_path`` can name offline."""
    from ..models import load_base_model
    base, tok = load_base_model(spec, dropout=0.0)
    if hasattr(base.config, "comix_tokenizer"):
        del base.config.comix_tokenizer
    from transformers.utils import logging as hf_logging
    hf_logging.disable_progress_bar()  # one small folder: no "Writing model shards" bar in the export's output
    try:
        base.save_pretrained(str(out))
    finally:
        hf_logging.enable_progress_bar()
    tok.save_pretrained(str(out))


def point_adapters_at(folder: Path, base: str) -> None:
    """Every PEFT folder under ``folder`` names ``base`` as its base model (adapter_config.json)."""
    for cfg in folder.rglob("adapter_config.json"):
        data = json.loads(cfg.read_text())
        data["base_model_name_or_path"] = base
        cfg.write_text(json.dumps(data, indent=2))
