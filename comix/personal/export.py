"""``export_personal``: a user's model of a finished run written to a new folder (the package
docstring lists what each kind of method gets), through a temporary sibling renamed at the end."""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

from .peft_forms import (_amole_layers, _amole_modules, _expert_param, _lora_modules, _write_merged, _write_static,
                         mean_routing, point_adapters_at, write_base, write_peft_lora)
from .run_folder import ADAPTERS, GLOBAL, MANIFEST, ExportError, _users_in_order, rebuild, resolve_method_dir, run_config


def _roles(adapters: dict) -> set[str]:
    from ..models import param_role
    return {param_role(n) for n in adapters}


PLAIN = {"attention_lora", "mlp_lora", "personal_lora", "fusion"}
MIXTURE = {"attention_lora", "generalist", "specialist", "router"}


def _scored_on_server(method_dir: Path) -> bool:
    """Whether the method's model is the server's global MoE (its class scores a model of the
    server's, ``Algorithm.server_evaluate``: DeepFusion and its baselines, FedJETS, central-moe)."""
    from ..algorithms import REGISTRY, Algorithm
    from ..specs import split_spec
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
    from ..config import load_config
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


def _kind(roles: set[str]) -> str:
    """Plain LoRA and CoMiGS-style mixtures have PEFT forms; other layers (FedAMoLE's AMoLE with its
    token projection, soft prompts) only comix's own form, which load_personal rebuilds."""
    return "lora" if roles <= PLAIN else "mixture" if roles <= MIXTURE else "comix"


def _adapter_roles(method_dir: Path, user: str) -> set[str]:
    """The roles of ``user``'s stored adapters, read from the file's names (no tensor loaded)."""
    from safetensors import safe_open

    from ..models import param_role
    file = method_dir / "adapters" / f"{user}.safetensors"
    if not file.exists():
        return set()  # rebuild names the missing user
    with safe_open(str(file), "pt") as f:
        return {param_role(n) for n in f.keys()}


def _check_merged(method_dir: Path, user: str) -> None:
    """--merged needs one linear adapter to fold into the base: refused in one line, before the
    model is rebuilt, for a mixture (its routers pick experts per token) or comix's own layers."""
    roles = _adapter_roles(method_dir, user)
    kind = _kind(roles)
    if roles and kind != "lora":  # no roles: no file, and rebuild names the missing user
        raise ExportError(f"--merged: {method_dir.name} is a {'mixture of LoRA experts' if kind == 'mixture' else kind} "
                          "model whose routers weigh experts per token, so no single merged model equals it; use "
                          "--static for one approximate adapter, or comix.load_personal for the exact model")


def _export_device(method_dir: Path, user: str | None, out: Path, fmt: str, precision: str | None,
                   max_len: int | None) -> Path:
    """``user``'s model as an ExecuTorch program or a GGUF file (comix/personal/formats.py); every
    refusal is one line before the model is rebuilt."""
    from ..config import load_config
    from ..models.base import model_config
    from .formats import device_refusal, write_device
    cfg = load_config(str(run_config(method_dir)))
    config = model_config(cfg.model)
    architecture = (config.architectures or [type(config).__name__.replace("Config", "ForCausalLM")])[0]
    global_model = _scored_on_server(method_dir)
    roles = set() if global_model or not user else _adapter_roles(method_dir, user)
    why = device_refusal(fmt, precision, roles, None if global_model else _kind(roles), architecture)
    if why:
        raise ExportError(why)
    if not user:
        raise ExportError(f"--user is needed: {method_dir.name} keeps a model per user "
                          f"(users: {', '.join(_users_in_order(method_dir))})")
    model, tok, info = rebuild(method_dir, user)
    manifest = {"method": info["spec"], "user": user, "client": info["client"], "n_clients": info["n_clients"],
                "base": {"spec": cfg.model, "sha256": info["base_sha256"]}}
    if info["algorithm"].export_caveat:
        manifest["caveat"] = info["algorithm"].export_caveat
    return _into(out, lambda tmp: write_device(tmp, fmt, precision, model, tok, manifest, cfg, max_len))


def export_personal(path: Path, user: str | None, out: Path, method: str | None = None, merged: bool = False,
                    static: bool = False, with_base: bool | None = None, format: str = "comix",
                    precision: str | None = None, max_len: int | None = None) -> Path:
    """Write ``user``'s model of the run at ``path`` to ``out`` (see the package docstring);
    everything goes to a temporary sibling first and is renamed at the end. Returns ``out``.
    ``with_base`` (default: for the models comix builds itself, whose names no hub resolves) adds
    ``base/``, the base model as a transformers folder, and points every PEFT folder's
    ``base_model_name_or_path`` at it, so ``AutoPeftModelForCausalLM.from_pretrained`` loads an
    export offline. ``format`` "executorch" | "gguf": the file a device runtime loads instead
    (comix/personal/formats.py) at ``precision`` (fp32 | int8; f16 | q8_0), ExecuTorch's KV cache
    ``max_len`` positions long."""
    from safetensors.torch import save_file

    from ..models.base import TINY

    out = Path(out)
    if out.exists():
        raise ExportError(f"--out {out} exists: choose a new folder (nothing is overwritten)")
    method_dir = resolve_method_dir(path, method)
    if format != "comix":
        return _export_device(method_dir, user, out, format, precision, max_len)
    if precision is not None or max_len is not None:
        raise ExportError("--precision and --max-len are for --format executorch | gguf")
    if _scored_on_server(method_dir):
        return _export_global(method_dir, out)
    if not user:
        raise ExportError(f"--user is needed: {method_dir.name} keeps a model per user "
                          f"(users: {', '.join(_users_in_order(method_dir))})")
    if merged:
        _check_merged(method_dir, user)
    model, tok, info = rebuild(method_dir, user)
    algo, adapters, cfg, spec = info["algorithm"], info["adapters"], info["config"], info["spec"]
    roles = _roles(adapters)
    kind = _kind(roles)
    with_base = cfg.model in TINY if with_base is None else with_base
    from ..models import mixtures, param_role
    from ..models.mixture import MixtureOfLoRAMLP
    manifest = {"format": "comix-personal/1", "method": spec, "user": user, "client": info["client"],
                "n_clients": info["n_clients"], "kind": kind, "base": {"spec": cfg.model, "sha256": info["base_sha256"]},
                "config": run_config(method_dir).read_text(),
                "adapters": ADAPTERS}
    if algo.export_caveat:
        manifest["caveat"] = algo.export_caveat
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
        if with_base:  # the base as a transformers folder; every PEFT folder names it
            write_base(cfg.model, tmp / "base")
            point_adapters_at(tmp, str((out / "base").resolve()))
            manifest["base"]["folder"] = "base"
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1))
    return _into(out, write)
