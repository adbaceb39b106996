"""Reading a finished run: its method folders, users and config, and a user's model rebuilt
exactly as the run left it."""
from __future__ import annotations

import hashlib
import json
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
        from ..specs import spec_dirname
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

    from ..config import load_config
    from ..models import inject_adapters, load_base_model
    from ..specs import build_algorithm

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
