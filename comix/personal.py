"""A user's personalised model outside comix (issue F1 part 2).

``export_personal(method_dir, user, out)`` writes, into a temporary folder renamed at the end:
  * every user model: ``manifest.json`` (method spec, the user's client index, the run's config,
    each expert's id and role, top-k, scaling, which modules; the base model's spec and a SHA-256
    of its weights) and ``comix_adapters.safetensors`` (the user's adapters as comix names them,
    routers included), from which ``load_personal`` rebuilds the exact model;
  * plain-LoRA users (FedAvg, Local, FedIT, FFA-/FedSA-LoRA, FDLoRA's fused pair, ...): a standard
    PEFT LoRA folder at the top (``adapter_config.json``, ``adapter_model.safetensors``) that
    ``PeftModel.from_pretrained(base, out)`` loads with comix's logits; ``merged=True`` adds
    ``merged/``, the base with the LoRA merged, for ``AutoModelForCausalLM.from_pretrained``;
  * mixture users (CoMiGS, pFedMoE, ...): ``experts/<j>/`` one PEFT LoRA folder per expert (the
    attention LoRA plus expert j's LoRA on every MLP projection: the model the router would give
    if it always picked expert j) and ``routers.safetensors``; ``static=True`` adds ``static/``,
    one PEFT adapter of the experts combined with the user's mean routing weights by PEFT's
    ``add_weighted_adapter(..., combination_type="cat")`` (an approximation: routing is per token
    and the MLP is not linear; the manifest says so), for servers that take one LoRA per request.
  * other layers (FedAMoLE's AMoLE, soft prompts; kind ``comix``): the adapters and the manifest
    only, which ``load_personal`` rebuilds (no PEFT form exists for them); FedAMoLE adds
    ``experts/<id>/``, per held global expert the PEFT LoRA of "routers always pick it";
  * a method whose model is the server's (DeepFusion, FedJETS; kind ``global-moe``): the run's
    Mixtral folder as ``model/``, one model for every user.
Not PEFT's X-LoRA format: in peft 0.21.2 its save drops the classifier's weights and its single
classifier cannot express CoMiGS's per-layer token routers (issue F1).
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

import torch
from torch import nn

MANIFEST = "manifest.json"
ADAPTERS = "comix_adapters.safetensors"
GLOBAL = "global-moe"   # where a run saves a server-side global model (algorithms/global_moe.save_moe)


class ExportError(ValueError):
    pass


def weights_sha256(model: nn.Module) -> str:
    """SHA-256 over the base model's tensors (sorted names, fp32 bytes): what a reload checks."""
    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(t.detach().to("cpu", torch.float32).contiguous().numpy().tobytes())
    return h.hexdigest()


# -- reading a run ------------------------------------------------------------------------------
def run_config(method_dir: Path) -> Path:
    """The config.yaml of the run a method folder belongs to (``<run>/<method>`` or, in a compare
    grid, ``<run>/seed<S>/<method>``)."""
    method_dir = Path(method_dir)
    for folder in (method_dir.parent, method_dir.parent.parent):
        if (folder / "config.yaml").exists():
            return folder / "config.yaml"
    raise ExportError(f"{method_dir} belongs to no comix run (no config.yaml above it)")


def _exportable(method_dir: Path) -> bool:
    """A finished method folder with per-user adapters or a global model (DeepFusion, FedJETS)."""
    return (method_dir / "results.json").exists() and \
        ((method_dir / "adapters").is_dir() or (method_dir / GLOBAL / "config.json").exists())


def method_dirs(run_dir: Path) -> list[Path]:
    return sorted(p.parent for p in Path(run_dir).glob("*/results.json") if _exportable(p.parent))


def resolve_method_dir(path: Path, method: str | None = None) -> Path:
    """The method folder of ``path`` (itself, or the one ``method`` names in a run folder)."""
    path = Path(path)
    if _exportable(path):
        return path
    if not (path / "config.yaml").exists() and not (path.parent / "config.yaml").exists():
        raise ExportError(f"{path} is not a comix run (no config.yaml) nor a method folder of one")
    found = method_dirs(path)
    if method:
        from .specs import spec_dirname
        match = [d for d in found if d.name == spec_dirname(method)]
        if not match:
            raise ExportError(f"{path} has no finished method {method!r} (it has: {', '.join(d.name for d in found)})")
        return match[0]
    if len(found) != 1:
        raise ExportError(f"{path} holds {len(found)} methods ({', '.join(d.name for d in found)}): name one with --method")
    return found[0]


def _users_in_order(method_dir: Path) -> list[str]:
    """The run's users in client order (metrics.jsonl writes each round's rows in that order)."""
    users = []
    for line in (method_dir / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        if row.get("evaluated_by") == "server" or row["round"] != 1:
            continue
        users.append(row["user"])
    return users


def rebuild(method_dir: Path, user: str):
    """(model, tokenizer, info) of ``user`` as the run left it; ``info`` holds the algorithm, the
    client index, the number of clients, the adapters, the run's config, the method spec and the
    base weights' SHA-256."""
    from safetensors.torch import load_file

    from .config import load_config
    from .models import inject_adapters, load_base_model
    from .specs import build_algorithm

    method_dir = Path(method_dir)
    cfg = load_config(str(run_config(method_dir)))
    spec = json.loads((method_dir / "results.json").read_text())["method"]
    users = _users_in_order(method_dir)
    file = method_dir / "adapters" / f"{user}.safetensors"
    if user not in users and not file.exists():
        raise ExportError(f"--user {user!r} is not a user of {method_dir} (users: {', '.join(users) or 'none'})")
    if not file.exists():
        raise ExportError(f"{method_dir} has no adapters for user {user!r} ({file.name} is missing)")
    adapters = load_file(str(file))
    if not adapters:
        raise ExportError(f"{file} holds no adapters: {spec} keeps no per-user adapters to export")
    algo = build_algorithm(cfg, spec, len(users))
    if algo.device_spec(0) is not None or algo.pooled:
        raise ExportError(f"{spec} has no per-user adapter model to export (its model is the server's)")
    client = 0 if algo.pooled else users.index(user)
    base, tok = load_base_model(cfg.model, dropout=0.0)
    base_sha = weights_sha256(base)  # before the adapters wrap its linears
    model = inject_adapters(base, algo.adapter_config(client))
    algo.load_state(model, adapters)
    info = {"algorithm": algo, "client": client, "n_clients": len(users), "adapters": adapters, "config": cfg,
            "spec": spec, "base_sha256": base_sha}
    return model.eval(), tok, info


# -- PEFT folders -------------------------------------------------------------------------------
def _lora_modules(model: nn.Module, expert: int | None = None) -> dict[str, tuple[torch.Tensor, torch.Tensor, float, bool]]:
    """module path -> (A, B, scaling, fan_in_fan_out) of every plain LoRA of ``model`` (an FDLoRA
    pair fused into one by concatenating ranks, w_0 B | w_1 B_local); with ``expert`` also that
    expert's LoRA on each mixture MLP projection."""
    from transformers.pytorch_utils import Conv1D

    from .models.lora import LoRALinear
    from .models.mixture import MixtureOfLoRAMLP
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


# -- export ---------------------------------------------------------------------------------------
def _roles(adapters: dict) -> set[str]:
    from .models import param_role
    return {param_role(n) for n in adapters}


PLAIN = {"attention_lora", "mlp_lora", "personal_lora", "fusion"}
MIXTURE = {"attention_lora", "generalist", "specialist", "router"}


def _scored_on_server(method_dir: Path) -> bool:
    """Whether the method's model is the server's global MoE (its class scores a model of the
    server's, ``Algorithm.server_evaluate``: DeepFusion and its baselines, FedJETS, central-moe)."""
    from .algorithms import REGISTRY, Algorithm
    from .specs import split_spec
    spec = json.loads((method_dir / "results.json").read_text())["method"]
    cls = REGISTRY[split_spec(spec)[0]][0]
    return cls.server_evaluate is not Algorithm.server_evaluate and (method_dir / GLOBAL / "config.json").exists()


def _into(out: Path, write) -> Path:
    """``write(tmp)`` into a temporary sibling of ``out``, renamed to ``out`` at the end: a failed
    export leaves nothing behind."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}-"))
    try:
        write(tmp)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def _export_global(method_dir: Path, out: Path) -> Path:
    """A method whose model is the server's (DeepFusion's, FedJETS' global MoE, a Mixtral folder
    with its tokenizer): the folder as ``model/`` with a manifest; it serves every user."""
    from .config import load_config
    spec = json.loads((method_dir / "results.json").read_text())["method"]
    cfg = run_config(method_dir)

    def write(tmp: Path):
        shutil.copytree(method_dir / GLOBAL, tmp / "model")
        manifest = {"format": "comix-personal/1", "method": spec, "kind": "global-moe", "model": "model",
                    "base": {"spec": load_config(str(cfg)).model}, "config": cfg.read_text(),
                    "note": "the server's global model: one model for every user, loads with "
                            "AutoModelForCausalLM.from_pretrained(<out>/model)"}
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1))
    return _into(out, write)


def export_personal(path: Path, user: str | None, out: Path, method: str | None = None, merged: bool = False,
                    static: bool = False) -> Path:
    """Write ``user``'s model of the run at ``path`` to ``out`` (see the module docstring);
    everything goes to a temporary sibling first and is renamed at the end. Returns ``out``."""
    from safetensors.torch import save_file

    out = Path(out)
    if out.exists():
        raise ExportError(f"--out {out} exists: choose a new folder (nothing is overwritten)")
    method_dir = resolve_method_dir(path, method)
    if _scored_on_server(method_dir):
        return _export_global(method_dir, out)
    if not user:
        raise ExportError(f"--user is needed: {method_dir.name} keeps a model per user "
                          f"(users: {', '.join(_users_in_order(method_dir))})")
    model, tok, info = rebuild(method_dir, user)
    algo, adapters, cfg, spec = info["algorithm"], info["adapters"], info["config"], info["spec"]
    roles = _roles(adapters)
    # plain LoRA and CoMiGS-style mixtures have PEFT forms; other layers (FedAMoLE's AMoLE with
    # its token projection, soft prompts) only comix's own form, which load_personal rebuilds
    kind = "lora" if roles <= PLAIN else "mixture" if roles <= MIXTURE else "comix"
    from .models import mixtures, param_role
    from .models.mixture import MixtureOfLoRAMLP
    manifest = {"format": "comix-personal/1", "method": spec, "user": user, "client": info["client"],
                "n_clients": info["n_clients"], "kind": kind, "base": {"spec": cfg.model, "sha256": info["base_sha256"]},
                "config": run_config(method_dir).read_text(),
                "adapters": ADAPTERS}
    if kind == "comix":
        manifest["peft"] = None
        manifest["note"] = (f"{', '.join(sorted(roles - PLAIN - MIXTURE))} have no PEFT form: comix.load_personal "
                            "rebuilds the model, lm-eval scores it as --model comix (comix/harness.py)")

    def write(tmp: Path):
        save_file({n: t.contiguous() for n, t in adapters.items()}, str(tmp / ADAPTERS))
        if kind == "lora":
            write_peft_lora(_lora_modules(model), tmp, cfg.model)
            manifest["peft"] = "."
            if merged:
                _write_merged(model, tok, tmp / "merged", cfg.model)
                manifest["merged"] = "merged"
        elif kind == "comix" and _amole_layers(model):
            # FedAMoLE: one PEFT folder per global expert this client holds, "the model whose
            # routers always pick it" (with the shared expert; where a module lacks it, the shared
            # expert alone); the personal model itself is the comix form
            holds = {name: m.slot_ids[:m.n_active].tolist() for name, m in _amole_layers(model)}
            held = sorted({i for ids in holds.values() for i in ids})
            for j in held:
                write_peft_lora(_amole_modules(model, j), tmp / "experts" / str(j), cfg.model)
            manifest["experts"] = [{"id": j, "peft": f"experts/{j}", "modules": [n for n, ids in holds.items() if j in ids],
                                    "approximation": "shared expert + expert j at weight 1 where held; the personal "
                                                     "model routes each token"} for j in held]
        elif kind == "mixture":
            layers = [m for m in mixtures(model) if isinstance(m, MixtureOfLoRAMLP)]
            n = layers[0].n_experts
            for j in range(n):
                write_peft_lora(_lora_modules(model, expert=j), tmp / "experts" / str(j), cfg.model)
            save_file({k: t.contiguous() for k, t in adapters.items() if param_role(k) == "router"},
                      str(tmp / "routers.safetensors"))
            manifest["experts"] = [{"id": j, "role": "generalist" if algo.is_shared(_expert_param(model, j))
                                    else "specialist", "peft": f"experts/{j}"} for j in range(n)]
            manifest.update(top_k=layers[0].top_k, scaling=layers[0].scaling, rank=layers[0].rank,
                            mlp_modules=list(layers[0].layout.projections), routers="routers.safetensors",
                            router_layers=[name for name, m in model.named_modules() if isinstance(m, MixtureOfLoRAMLP)])
            if static:
                weights = mean_routing(method_dir, user, n)
                _write_static(tmp, cfg.model, n, weights)
                manifest["static"] = {"peft": "static", "weights": weights, "approximation":
                                      "experts combined by the user's mean gate (PEFT cat); the mixture routes each "
                                      "token and its MLP is not linear, so this is not the personal model"}
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1))
    return _into(out, write)


def _amole_layers(model: nn.Module) -> list:
    """(path, module) of every AMoLE layer of ``model`` (FedAMoLE)."""
    from .models.amole import AMoLELinear
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

    from .models import load_base_model
    base, _ = load_base_model(base_name)
    peft = PeftModel.from_pretrained(base, str(folder / "experts" / "0"), adapter_name="e0")
    for j in range(1, n):
        peft.load_adapter(str(folder / "experts" / str(j)), adapter_name=f"e{j}")
    peft.add_weighted_adapter([f"e{j}" for j in range(n)], weights, "static", combination_type="cat")
    peft.save_pretrained(str(folder / "static-tmp"), selected_adapters=["static"])
    shutil.move(str(folder / "static-tmp" / "static"), str(folder / "static"))
    shutil.rmtree(folder / "static-tmp")


def _write_merged(model: nn.Module, tok, out: Path, base_name: str) -> None:
    from peft import PeftModel

    from .models import load_base_model
    base, _ = load_base_model(base_name)
    merged = PeftModel.from_pretrained(base, str(out.parent)).merge_and_unload()
    if hasattr(merged.config, "comix_tokenizer"):
        del merged.config.comix_tokenizer
    merged.save_pretrained(str(out))
    tok.save_pretrained(str(out))


# -- load ----------------------------------------------------------------------------------------
def load_personal(folder: str | Path, base: nn.Module | None = None):
    """(model, tokenizer) of an exported user model, rebuilt exactly as the run left it: the base
    (``base``, or the manifest's spec) is checked against the manifest's weight hash first."""
    from safetensors.torch import load_file

    from .config import load_config
    from .models import inject_adapters, load_base_model
    from .specs import build_algorithm

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
