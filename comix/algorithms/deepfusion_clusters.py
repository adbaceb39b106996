"""DeepFusion's server steps 2-3 (Li et al., Sec. IV-B, Fig. 4): the devices' uploaded models
rebuilt, devices clustered into K domains by their data embeddings, and one proxy teacher per
domain and architecture, the weight average of the cluster's models of that architecture
(``algorithms/deepfusion.py`` uses them)."""
from __future__ import annotations

import copy
import warnings

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ..data import calibration_docs
from ..models.devices import build_device_model


def uploaded_models(uploads: dict[int, dict[str, torch.Tensor]], spec_of: list[str], base: nn.Module) -> dict[int, nn.Module]:
    """Each device's model (spec ``spec_of[c]``) with the weights it uploaded, frozen; one line
    when an upload does not fit its spec (only tied weights may be absent from it)."""
    out = {}
    for c, up in uploads.items():
        model = build_device_model(spec_of[c], base, calibration_docs())
        missing = model.load_state_dict({n[8:]: t for n, t in up.items() if n.startswith("weights.")}, strict=False)
        if missing.missing_keys or missing.unexpected_keys:
            tied = {n for n, _ in model.named_parameters(remove_duplicate=False)} - dict(model.named_parameters()).keys()
            if set(missing.missing_keys) - tied or missing.unexpected_keys:
                raise ValueError(f"device {c}'s upload does not fit {spec_of[c]!r}")
        out[c] = model.eval().requires_grad_(False)
    return out


def cluster_devices(embeddings: torch.Tensor, k: int, seed: int = 0) -> list[int]:
    """Each device's domain in [0, K): KMeans on the L2-normalised embeddings, which is KMeans
    on cosine similarity (||a - b||^2 = 2 - 2 cos(a, b) for unit vectors; eq. 6)."""
    from sklearn.cluster import KMeans

    n = embeddings.shape[0]
    if not 1 <= k <= n:
        raise ValueError(f"deepfusion.experts = K = {k} must lie in [1, N = {n}] (the number of devices)")
    x = F.normalize(embeddings.double(), dim=-1).numpy()
    if len(np.unique(x.round(12), axis=0)) < k:
        raise ValueError(f"deepfusion.experts = K = {k} exceeds the {len(np.unique(x.round(12), axis=0))} distinct "
                         "device embeddings: some domains would be empty")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        labels = KMeans(n_clusters=k, n_init=10, random_state=seed).fit_predict(x)
    return [int(c) for c in labels]


def embedding_map(embeddings: torch.Tensor) -> list[list[float]]:
    """The devices' unit-normalised data embeddings on their first two principal components (the
    report's view of the clustering; what the server holds anyway)."""
    x = F.normalize(embeddings.double(), dim=-1)
    x = x - x.mean(0)
    if len(x) < 2:
        return [[0.0, 0.0] for _ in x]
    _, _, v = torch.linalg.svd(x, full_matrices=False)
    pts = x @ v[:2].T
    pts = torch.cat([pts, pts.new_zeros(len(pts), 2 - pts.shape[1])], 1) if pts.shape[1] < 2 else pts
    return [[round(a, 4), round(b, 4)] for a, b in pts.tolist()]


def architecture_of(model: nn.Module) -> str:
    """What must match for two models' weights to be averaged: class and every shape."""
    c = model.config
    keys = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "n_embd", "n_layer", "n_head", "n_inner")
    return type(model).__name__ + "(" + ",".join(f"{k}={getattr(c, k)}" for k in keys if hasattr(c, k)) + ")"


@torch.no_grad()
def average_models(models: list[nn.Module]) -> nn.Module:
    """The element-wise mean of same-architecture models (a proxy teacher, Fig. 4), a new model."""
    arch = {architecture_of(m) for m in models}
    if len(arch) != 1:
        raise ValueError(f"cannot average models of different architectures: {sorted(arch)}")
    proxy = copy.deepcopy(models[0])
    states = [m.state_dict() for m in models]
    proxy.load_state_dict({n: torch.stack([s[n].float() for s in states]).mean(0).to(t.dtype)
                           for n, t in states[0].items()})
    return proxy.eval()


def proxy_teachers(models: list[nn.Module], labels: list[int], k: int) -> list[list[tuple[nn.Module, float]]]:
    """Per domain, [(proxy teacher, loss weight)]: one proxy per architecture among the domain's
    devices (their weight average), weighted by that architecture's share of the domain."""
    out = []
    for c in range(k):
        members = [m for m, lab in zip(models, labels) if lab == c]
        by_arch: dict[str, list[nn.Module]] = {}
        for m in members:
            by_arch.setdefault(architecture_of(m), []).append(m)
        out.append([(average_models(ms), len(ms) / len(members)) for _, ms in sorted(by_arch.items())])
    return out
