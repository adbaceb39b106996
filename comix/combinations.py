"""Run settings that are valid one by one but cannot run together, each refused in one line
naming the keys (``RunConfig.validate`` asks before any data or model loads)."""
from __future__ import annotations


def _on_gpu(device: str) -> bool:
    """Whether ``device`` (a config's string) puts the model on a GPU."""
    if device == "auto":
        import torch
        return torch.cuda.is_available()
    return device != "cpu"


def combination_problem(cfg) -> str | None:
    """Why ``cfg``'s (a RunConfig's) settings cannot run together, one line, or None."""
    privacy, server, train = cfg.privacy, cfg.server, cfg.train
    if server.robust and (privacy.secure_aggregation or privacy.noise_multiplier > 0 or privacy.target_epsilon > 0):
        hides = "SecAgg+ hides (the server sees only their sum)" if privacy.secure_aggregation else \
            "DP-FedAvg does not cover (its guarantee is for the noised mean of clipped updates)"
        return f"server.aggregate={server.aggregate} reads each upload, which {hides}: use server.aggregate=mean " \
               "with privacy.*"
    if train.scaffold:  # the variate deltas are a second upload, which neither bound covers
        clash = ("privacy.* (DP-FedAvg clips and noises the model update only)" if privacy.active else
                 "privacy.server_clip (it bounds the model update only)" if privacy.server_clip != float("inf") else
                 f"server.aggregate={server.aggregate} (a variate's update is a sum over clients, not a vote)"
                 if server.robust else None)
        if clash:
            return f"train.scaffold uploads each tensor's control-variate delta, which {clash} leaves unbounded: " \
                   "run SCAFFOLD without it"
    if not train.runtimes <= {"pytorch", "executorch"}:
        return f"train.client_runtime must be pytorch or executorch, or one of them per client, got {train.client_runtime!r}"
    if "executorch" in train.runtimes:  # the exported program: fp32 plain LoRA on the CPU, one step a batch
        clash = [f"{k}={v}" for k, v, ok in (("precision", cfg.precision, "fp32"), ("quant", cfg.quant, "none"),
                                             ("micro_batches", cfg.micro_batches, 1), ("train.cohort", train.cohort, 1),
                                             ("train.prox_mu", train.prox_mu, 0), ("train.scaffold", train.scaffold, False))
                 if v != ok] + ([f"device={cfg.device}"] if _on_gpu(cfg.device) else [])
        if clash:
            return f"train.client_runtime=executorch runs fp32 LoRA steps on the CPU, one client at a time, with " \
                   f"nothing added to the loss: {', '.join(clash)} cannot run so"
    return None
