"""Which run settings a method refuses, and why, each in one line (a mixin of ``Algorithm``).

A method is offered client-level DP, SecAgg+, FedProx, a server optimiser or robust rule, or a
cohort when its round is the contract's own at the step the setting acts on; each answer compares
the method's class with the contract's (``Algorithm``, in base.py) and names the step it writes
itself. ``specs.build_algorithm`` and the in-process engine ask before any run directory exists.
"""
from __future__ import annotations

from ..aggregation import ServerConfig


def _contract(cls: type) -> type:
    """The contract class (``Algorithm``): the first class of ``cls``'s line that takes this mixin."""
    return next(k for k in cls.__mro__ if Refusals in k.__bases__)


class Refusals:
    # Client-level DP (comix/privacy.py): offered when the server's step is a mean of the uploads
    # through ``aggregate`` (the contract's server_round, or a subclass that says ``dp_aggregate``);
    # ``dp_refusal`` says why a method cannot offer it.
    dp_aggregate = False
    dp_refusal_reason: str | None = None
    # Offered where the server's step is one combination of the uploads per tensor followed by the
    # broadcast (the contract's ``server_round``, or a subclass that says ``server_combines``);
    # ``server_optimizer_reason`` names a method that already steps an optimiser of its own.
    server_combines = False
    server_optimizer_reason: str | None = None

    @classmethod
    def dp_refusal(cls) -> str | None:
        """Why this method cannot offer client-level DP (one line), or None when it can."""
        if cls.dp_refusal_reason:
            return cls.dp_refusal_reason
        if cls.pooled or not cls.trains:
            return "it uploads nothing (one pooled model or no training): there is no upload to protect"
        if not cls.dp_aggregate and cls.server_round is not _contract(cls).server_round:
            return "its server step is not a mean of the clients' uploads, so DP-FedAvg's noisy clipped sum " \
                   "gives it no guarantee"
        return None

    @classmethod
    def secure_aggregation_refusal(cls) -> str | None:
        """Why this method cannot run under secure aggregation (one line), or None. SecAgg+ gives
        the server only the *sum* of the sampled clients' uploads, so it serves the methods whose
        server step is that mean and nothing else (the contract's ``server_round``: FedAvg, FedIT,
        CoMiGS' generalists, FFA- and FedSA-LoRA): one fixed list of tensors per client, summed
        over every sampled client."""
        if cls.pooled or not cls.trains:
            return "it uploads nothing (one pooled model or no training)"
        if cls.is_shared is _contract(cls).is_shared:
            return "it shares nothing (every adapter stays on its device)"
        if cls.server_round is not _contract(cls).server_round:
            return "its server step needs more than the sum of the uploads (per-client tensors, ranks, holders " \
                   "or whole models), and SecAgg+ reveals only the sum"
        return None

    def cohort_refusal(self) -> str | None:
        """Why this method's clients cannot train together in a cohort (algorithms/cohort.py),
        one line, or None. A cohort runs the contract's default local round (``client_round``:
        payload, ``local_training`` with ``train_params``, ``train_batch``, ``forward_loss`` and the
        ``interleaved`` steps, upload, ``after_training``) on adapters made of plain LoRA factors,
        mixture routers and AMoLE layers; a method that writes any other part of its round itself
        keeps its own client step, one client at a time."""
        if self.pooled or not self.trains:
            return "it trains one pooled model or none: there is no cohort of clients"
        if self.device_spec(0) is not None:
            return "each device trains its own model, not adapters over the one shared base"
        cls = type(self)
        mine = lambda name: getattr(cls, name) is not getattr(_contract(cls), name)  # noqa: E731
        # the class of cls's line that writes ``name`` (its index in the MRO: lower is more derived)
        where = lambda name: next(i for i, k in enumerate(cls.__mro__) if name in k.__dict__)  # noqa: E731
        # a state loaded or saved its own way runs in a cohort where the same class (or a later one)
        # says how for a cohort too
        cohort_form = {"load_state": "load_cohort", "save_state": "cohort_adapters"}
        own = [name for name in ("client_round", "local_training", "regularizer", "after_expert_step", "load_state",
                                 "save_state", "personal_adapters", "scoring") if mine(name)
               and not (name in cohort_form and where(cohort_form[name]) <= where(name))]
        if own:
            return f"it writes its own {', '.join(own)}: that client step runs as written, one client at a time"
        for c in range(self.n_clients):
            cfg = self.adapter_config(c)
            kinds = [what for what, has in (("a personal LoRA pair", cfg.personal or cfg.attention_personal),
                                            ("a merged update", cfg.merged),
                                            ("FedLEASE's experts", cfg.lease is not None),
                                            ("a soft prompt", cfg.prompt is not None),
                                            ("unfused experts", cfg.mlp == "mixture" and not cfg.fused)) if has]
            if kinds:
                return f"its adapters hold {kinds[0]}, which the cohort's stacked layers do not carry"
        return None

    @classmethod
    def prox_refusal(cls) -> str | None:
        """Why ``train.prox_mu`` (FedProx) cannot apply to this method (one line), or None: it acts
        in the contract's own local training, on the parameters the method shares."""
        if cls.pooled or not cls.trains:
            return "it uploads nothing (one pooled model or no training): there is no round payload to stay near"
        if cls.is_shared is _contract(cls).is_shared:
            return "it shares nothing (every adapter stays on its device)"
        if cls.local_training is not _contract(cls).local_training:
            return "it writes its own local training, which the proximal term does not enter"
        return None

    @classmethod
    def scaffold_refusal(cls) -> str | None:
        """Why ``train.scaffold`` (algorithms/scaffold.py) cannot apply to this method (one line), or
        None: its variates ride on the contract's own round, from the payload to the upload and the
        server's mean."""
        if cls.pooled or not cls.trains:
            return "it uploads nothing (one pooled model or no training): there is no server model to correct towards"
        if cls.is_shared is _contract(cls).is_shared:
            return "it shares nothing (every adapter stays on its device)"
        own = [name for name in ("client_round", "local_training", "apply_payload", "upload_of", "declared_upload",
                                 "server_init", "server_round", "server_round_of_sum")
               if getattr(cls, name) is not getattr(_contract(cls), name)]
        if own:
            return f"it writes its own {', '.join(own)}, which SCAFFOLD's control variates do not enter"
        return None

    def executorch_refusal(self) -> str | None:
        """Why this method's local steps cannot run in ExecuTorch's training runtime
        (``train.client_runtime=executorch``: models/executorch_training.py), one line, or None.
        The exported program is the contract's step: the LM loss plus the load balance over the
        adapters (plain LoRA, or a mixture's experts and linear routers), the interleaved router
        steps (CoMiGS) run by the same program on their own batches."""
        if self.pooled or not self.trains or self.device_spec(0) is not None:
            return "its devices do not train adapters over the one shared base"
        own = [name for name in ("client_round", "local_training", "regularizer", "forward_loss", "after_expert_step",
                                 "train_batch")
               if getattr(type(self), name) is not getattr(_contract(type(self)), name)]
        if own:
            return f"it writes its own {', '.join(own)}, which the exported step does not run"
        for c in range(self.n_clients):
            cfg = self.adapter_config(c)
            if cfg.amole or cfg.lease or cfg.prompt or cfg.personal or cfg.merged or cfg.attention_personal:
                return "its adapters are not plain LoRA or a LoRA mixture, whose steps alone the exported program holds yet"
            if any(lora.dropout > 0 for lora in (cfg.lora, cfg.mlp_lora) if lora is not None):
                return "its LoRA dropout would draw masks inside the program, not from comix's seeded generator"
        return None

    @classmethod
    def server_refusal(cls, cfg: ServerConfig) -> str | None:
        """Why this method cannot run with ``cfg`` (a server optimiser or a robust rule), one line, or None."""
        if not cfg.steps and not cfg.robust:
            return None
        if cls.pooled or not cls.trains:
            return "it uploads nothing (one pooled model or no training): the server has nothing to combine"
        if cls.is_shared is _contract(cls).is_shared:
            return "it shares nothing (every adapter stays on its device)"
        if cls.server_optimizer_reason:
            return cls.server_optimizer_reason
        if not cls.server_combines and cls.server_round is not _contract(cls).server_round:
            return "its server step is not one combination of the uploads per tensor (per-client payloads, ranks, " \
                   "clusters or stacking), so there is no round update to step from"
        if cfg.aggregate == "krum" and cls.server_round is not _contract(cls).server_round:
            return "server.aggregate=krum compares whole uploads, and its clients upload different tensors"
        return None
