"""FedAMoLE (Zhang et al., journal version Sec. IV): AMoLE modules on q and v of every attention
block, domain experts assigned to clients each round by reverse selection (RSEA).

Client (one round): take the payload (shared expert, token projection, and the domain experts
the server assigned it, by global id), train them with the backbone frozen on
NLL + beta * load balance (eq. 18-20, summed over modules), then compute on its *embedding set*
(the last ``embed_frac`` of its training tokens, never trained on; Sec. IV-A "separated from
the local training set") the mean token embedding W_t h of each module (eq. 23) and the mean
expert embedding A_j h of each assigned expert (eq. 25), and upload: shared expert, token
projection, its assigned experts and those embeddings. Nothing else leaves it.

Server: shared expert and token projection averaged over every uploader, each domain expert
over the clients that trained it (eq. 22; an expert nobody trained keeps its value); expert
embeddings averaged over their holders (eq. 24); then per module relevance, softmax over
clients and the MILP of Definition IV.1 (``rsea.py``) give each client its experts for the next
round. Round 1 is a random assignment drawn from the run's seed.

Which model is scored, and when: each client's model after its local training, before the
server aggregates (the authors' main.py: train_experts, then eval and test, then aggregate),
so ``evaluate_local``; MTAL is the last round's (journal eq. 29). The optimiser is a fresh Adam
every round (node.py Client.train_experts builds it inside the round): here always, whatever
``train.optimizer_state`` says, because the moments of a slot would otherwise pass to whichever
expert the next round puts there.

Variants (journal Table III names; arXiv Table 3 names as aliases, algorithms/__init__.py):
``assignment``: ``rsea`` (FedAMoLE), ``random`` (a new random assignment every round:
"FedAMoLE (random)" = FedAMoLE-R), ``fixed`` (round 1's random assignment kept: FedMoLE);
``router="vanilla"``: "FedAMoLE (vanilla router)" = FedAMoLE-A (RSEA kept: arXiv Sec. 5.5 replaces
only the module), and with ``assignment="random"`` "(vanilla router, random)"; ``shared=False`` FedAMoLE-S (models/amole.py);
``homogeneous=True`` FedAMoLE-H (every client E * k_c / N experts per module; in neither
paper's tables: the authors' ``--homo_arch``, optimize.py). A vanilla router has no token or
expert embeddings, and the papers do not say what RSEA scores with it; here a client uploads
its mean router logits over the embedding set (E numbers per module, the vanilla counterpart
of eq. 26's mean token-expert score) and s_ij is client i's mean logit of expert j.

Where the paper is silent, the reference code (zyc140345/FedAMoLE) decides: LoRA scaling
alpha / r (PEFT), the embedding set held out of the training data (5 %, at most 200 examples:
data/data_loader.py), the relevance divided by the layer's own score scale (node.py
dispatch_experts divides by sqrt(r), as its layer does). ``embed_noise`` adds Gaussian noise
of that standard deviation to the uploaded embeddings (the privacy knob the reference
exposes); off by default.
"""
from __future__ import annotations

import re
import time

import torch
from torch import nn

from ..data import sample_batch
from ..models import AdapterConfig, mixtures
from ..models.amole import AMoLEConfig, AMoLELinear, layer_load_balance
from ..models.cohort import unstack
from ..runtime import at_least_fp32, to_cpu
from .base import Algorithm, ClientContext, ClientState, Tensors
from ..data.partition import held_out
from .training import FEDAMOLE_OPTIMIZER, FEDAMOLE_OPTIMIZER_SOURCE, adapter_tensors, load_adapters
from .rsea import assign, assign_by_relevance, check_feasible, random_assignment

_EXPERT = re.compile(r"^(?P<module>.+)\.experts\.(?P<id>\d+)\.lora_(?P<ab>[AB])$")


def expert_name(module: str, gid: int, ab: str) -> str:
    return f"{module}.experts.{gid}.lora_{ab}"


def amole_modules(model: nn.Module) -> dict[str, AMoLELinear]:
    return {n: m for n, m in model.named_modules() if isinstance(m, AMoLELinear)}


class FedAMoLE(Algorithm):
    name = "fedamole"
    train_defaults, train_defaults_source = FEDAMOLE_OPTIMIZER, FEDAMOLE_OPTIMIZER_SOURCE
    # DP: shared tensors and each expert are means through ``aggregate`` (noise on every sum); the
    # RSEA embeddings are per-client statistics, outside the clip and the epsilon (privacy.md says
    # so); the authors' --apply_dp --dp_eta noise on them is ``embed_noise``, not accounted.
    dp_aggregate = True
    server_combines = True  # the shared tensors and each expert over its holders (eq. 22), by name
    section = "fedamole"
    evaluate_local = True  # scored after local training, before aggregation (main.py)
    fresh_optimizer_each_round = "zyc140345/FedAMoLE node.py (Client.train_experts builds Adam inside the round)"

    def __init__(self, lora, train, n_clients, targets: list[str] | None = None, pool: int = 30, slots: int = 8,
                 top_k: int = 2, k_c: int = 2, shared: bool = True, router: str = "amole", score_scale: str = "d",
                 renormalize: bool = False, dropout: float = 0.05, beta: float = 1e-3, assignment: str = "rsea",
                 solver: str = "scip", embed_frac: float = 0.05, embed_examples: int = 200, embed_noise: float = 0.0,
                 homogeneous: bool = False):
        super().__init__(lora, train, n_clients)
        self.cfg = AMoLEConfig(targets=list(targets or ["q_proj", "v_proj"]), r=lora.r, alpha=lora.alpha,
                               dropout=dropout, pool=pool, slots=slots, top_k=top_k, shared=shared, router=router,
                               score_scale=score_scale, renormalize=renormalize)
        if assignment not in ("rsea", "random", "fixed"):
            raise ValueError(f"fedamole.assignment must be rsea, random or fixed, got {assignment!r}")
        if not 0 < embed_frac < 1 or embed_examples < 1 or embed_noise < 0:
            raise ValueError("fedamole: embed_frac in (0, 1), embed_examples >= 1, embed_noise >= 0")
        # FedAMoLE-H: every client the same number of experts, E * k_c / N
        per = pool * k_c // n_clients
        if homogeneous and (pool * k_c % n_clients or not top_k <= per <= slots):
            raise ValueError(f"fedamole-h: E * k_c / N = {pool} * {k_c} / {n_clients} must be a whole number in "
                             f"[k_e, b] = [{top_k}, {slots}]")
        self.bounds = (per, per) if homogeneous else (top_k, slots)
        check_feasible(pool, n_clients, k_c, *self.bounds)  # one line naming the numbers, before training
        self.k_c, self.beta, self.assignment, self.solver = k_c, beta, assignment, solver
        self.embed_frac, self.embed_examples, self.embed_noise = embed_frac, embed_examples, embed_noise

    def adapter_config(self, client: int) -> AdapterConfig:
        return AdapterConfig(attention=False, mlp="none", amole=self.cfg)

    def scale_dim(self, d_in: int) -> int:
        """The relevance's scale is the layer's own (eq. 10 and 26 share sqrt(d); sqrt(r) in the
        authors' layer.py and node.py alike)."""
        return d_in if self.cfg.score_scale == "d" else self.cfg.r

    def dp_exempt(self, name: str) -> bool:
        return name.startswith("rsea.")  # per-client embeddings, not part of any mean (see dp_aggregate)

    def is_shared(self, name: str) -> bool:
        return name.startswith("rsea.") or ".shared.lora_" in name or name.endswith(".token_proj") \
            or ".vanilla_router." in name or bool(_EXPERT.match(name) and ".mlp." not in name)

    # -- naming: model slots <-> global expert ids -------------------------------------------------
    def adapters_of(self, model_tensors: Tensors) -> Tensors:
        """A fresh model's adapters as the state names them: slot s becomes expert s (only its
        shapes matter: the server's pool and the round-1 payload replace them)."""
        out = {n: t for n, t in model_tensors.items() if not n.endswith((".expert_A", ".expert_B"))}
        for n, t in model_tensors.items():
            if n.endswith(".expert_A"):
                module = n[:-len(".expert_A")]
                for slot in range(self.cfg.slots):
                    out[expert_name(module, slot, "A")] = t[slot].clone()
                    out[expert_name(module, slot, "B")] = model_tensors[module + ".expert_B"][slot].clone()
        return out

    def save_state(self, model: nn.Module, state: ClientState) -> ClientState:
        """Slot tensors go back under the global ids of the experts in the slots."""
        ids = {name: m.slot_ids[:m.n_active].tolist() for name, m in amole_modules(model).items()}
        state.adapters = self._by_id(adapter_tensors(model), ids)
        return state

    @staticmethod
    def _by_id(tensors: Tensors, ids: dict[str, list[int]]) -> Tensors:
        """The model's tensors as a state names them: each module's slot s under the global id ids[module][s]."""
        out = {n: t for n, t in tensors.items() if not n.endswith((".expert_A", ".expert_B"))}
        for name, held in ids.items():
            for slot, gid in enumerate(held):
                for ab in "AB":
                    out[expert_name(name, gid, ab)] = tensors[f"{name}.expert_{ab}"][slot].clone()
        return out

    def _slots(self, model: nn.Module, adapters: Tensors) -> tuple[Tensors, dict[str, list[int]]]:
        """A client's adapters as the model names them (its held experts in the first slots by
        ascending id, the other slots zero) and each module's held ids."""
        modules = amole_modules(model)
        held: dict[str, dict[int, dict[str, torch.Tensor]]] = {m: {} for m in modules}
        out = {}
        for n, t in adapters.items():
            m = _EXPERT.match(n)
            if m and m["module"] in held:
                held[m["module"]].setdefault(int(m["id"]), {})[m["ab"]] = t
            else:
                out[n] = t
        for name, module in modules.items():
            ids = sorted(held[name])
            for ab in "AB":
                factors = torch.stack([held[name][g][ab] for g in ids])
                empty = factors.new_zeros(self.cfg.slots - len(ids), *factors.shape[1:])
                out[f"{name}.expert_{ab}"] = torch.cat([factors, empty])
        return out, {name: sorted(h) for name, h in held.items()}

    def load_state(self, model: nn.Module, adapters: Tensors) -> None:
        """Shared expert and router by name; the held experts into the first slots, by id."""
        tensors, ids = self._slots(model, adapters)
        for name, module in amole_modules(model).items():
            module.assign(ids[name])
        params = dict(model.named_parameters())
        load_adapters(model, {n: t for n, t in tensors.items() if n in params})

    def load_cohort(self, model: nn.Module, adapters: list[Tensors]) -> list[str]:
        """``load_state`` of each client of a cohort: its held experts into its own first slots."""
        slots = [self._slots(model, a) for a in adapters]
        for name, module in amole_modules(model).items():
            module.assign_clients([ids[name] for _, ids in slots])
        return super().load_cohort(model, [tensors for tensors, _ in slots])

    def cohort_adapters(self, model: nn.Module, names: list[str]) -> list[Tensors]:
        """``save_state`` of each client of a cohort: its slots back under the ids of its experts."""
        modules = amole_modules(model)
        return [self._by_id(tensors, {name: m.slot_ids[c, :m.experts_of(c)].tolist() for name, m in modules.items()})
                for c, tensors in enumerate(unstack(model, names))]

    # -- client ------------------------------------------------------------------------------------
    def apply_payload(self, state: ClientState, payload: Tensors) -> ClientState:
        """The server's tensors replace this client's; its assigned experts are exactly the
        payload's (an expert moved elsewhere leaves the device's state)."""
        if any(_EXPERT.match(n) for n in payload):
            state.adapters = {n: t for n, t in state.adapters.items() if not _EXPERT.match(n)}
        for n, t in payload.items():
            if not self.is_shared(n) or n.startswith("rsea."):
                raise ValueError(f"payload tensor {n!r} is not a shared parameter of this client")
            state.adapters[n] = at_least_fp32(t.detach().clone())
        return state

    def split(self, data):
        """(training data, embedding set): the embedding set is the last embed_frac of the
        instruction examples (at most ``embed_examples``) or of the tokens, never trained on."""
        return held_out(data, self.embed_frac, self.train.seq_len, self.embed_examples)

    def embedding_inputs(self, aux) -> list[torch.Tensor]:
        """The forwards over the embedding set: every instruction example one at a time (no
        padding enters the means; the authors' batch size is 1), or up to ``embed_examples``
        windows of seq_len tokens, 8 to a batch."""
        if hasattr(aux, "subset"):
            return [aux.ids[i][None] for i in range(len(aux))]
        L = self.train.seq_len
        windows = aux[:min(self.embed_examples, (len(aux) - 1) // L) * L].long().reshape(-1, L)
        return list(windows.split(8))

    def train_batch(self, ctx: ClientContext, gen: torch.Generator):
        return sample_batch(self.split(ctx.data.train)[0], self.train.batch_size, self.train.seq_len, gen)

    def forward_loss(self, model: nn.Module, own: torch.Tensor | None = None) -> torch.Tensor:
        """beta * sum over modules of eq. 19's load balance (from the last forward); in a cohort one
        per client, over its own tokens and experts (``layer_load_balance``)."""
        terms = [layer_load_balance(m, own) for m in mixtures(model)
                 if isinstance(m, AMoLELinear) and m.last_routing is not None]
        return self.beta * torch.stack(terms).sum(0) if terms else super().forward_loss(model, own)

    def embeddings(self, ctx: ClientContext) -> Tensors:
        """Eq. 23 and 25 on the embedding set: per module the mean token embedding and the mean
        expert embedding of each assigned expert; with a vanilla router, the mean router logits
        over the pool instead (the module docstring says why)."""
        _, aux = self.split(ctx.data.train)
        sums: dict[str, dict] = {}  # module -> {"n": tokens, "token": (r), "expert": (n, r) | "router": (E)}

        def hook(name):
            def record(module: AMoLELinear, args, _out):
                h = at_least_fp32(args[0].reshape(-1, args[0].shape[-1]))
                n, r = module.n_active, module.cfg.r
                # in fp32 under a bf16 run too: the upload's tensors are fp32 (check_upload), and a
                # mean over thousands of tokens would lose its small differences to bf16's mantissa
                with torch.autocast(h.device.type, enabled=False):
                    if module.token_proj is not None:
                        got = {"token": (h @ module.token_proj.t().to(h.dtype)).sum(0),
                               "expert": (h @ module.expert_A[:n].reshape(n * r, -1).t().to(h.dtype)).reshape(-1, n, r).sum(0)}
                    else:
                        got = {"router": (h @ module.vanilla_router.weight.t().to(h.dtype)).sum(0)}
                prev = sums.setdefault(name, {"n": 0})
                prev["n"] += len(h)
                for k, v in got.items():
                    prev[k] = prev[k] + v if k in prev else v
            return record
        modules = amole_modules(ctx.model)
        handles = [m.register_forward_hook(hook(n)) for n, m in modules.items()]
        ids = {n: m.slot_ids[:m.n_active].tolist() for n, m in modules.items()}
        device = ctx.model.get_input_embeddings().weight.device
        try:
            with torch.inference_mode():
                ctx.model.eval()
                for x in self.embedding_inputs(aux):
                    ctx.model(input_ids=x.to(device))
                ctx.model.train()
        finally:
            for h in handles:
                h.remove()
        gen = torch.Generator().manual_seed(ctx.client)
        noise = (lambda t: t + self.embed_noise * torch.randn(t.shape, generator=gen)) if self.embed_noise \
            else (lambda t: t)
        out = {}
        for name, got in sums.items():
            mean = {k: to_cpu(v / got["n"]) for k, v in got.items() if k != "n"}
            if "router" in mean:
                out[f"rsea.{name}.router"] = noise(mean["router"])
                continue
            out[f"rsea.{name}.token"] = noise(mean["token"])
            for slot, gid in enumerate(ids[name]):
                out[f"rsea.{name}.expert.{gid}"] = noise(mean["expert"][slot])
        return out

    def after_training(self, ctx: ClientContext, state: ClientState) -> tuple[Tensors, dict]:
        """RSEA's embeddings (eq. 23, 25) of the model that holds this round's trained experts, beside
        the upload; the mean number of experts a module holds."""
        modules = amole_modules(ctx.model).values()
        experts = sum(m.n_active for m in modules) / max(1, len(modules))
        return self.embeddings(ctx) if self.assignment == "rsea" else {}, {"experts": experts}

    # -- server ------------------------------------------------------------------------------------
    @staticmethod
    def _pool_shapes(tensors: Tensors) -> dict[str, tuple[int, int]]:
        """module -> (d_in, d_out), read from a client's initial expert tensors."""
        out = {}
        for n, t in tensors.items():
            m = _EXPERT.match(n)
            if m and m["ab"] == "A":
                out[m["module"]] = (t.shape[1], tensors[n[:-1] + "B"].shape[0])
        return out

    def server_init(self, initial: dict[int, Tensors]):
        """The pool of E experts per module (A kaiming, B zero, from the run's generator), a
        random first assignment, the common start of the shared tensors."""
        modules = self._pool_shapes(initial[0])
        common = {n: t for n, t in initial[0].items() if not _EXPERT.match(n)}
        # the pool, round 1's assignment and the random ablations draw from the run's seed, so
        # the std over seeds includes that randomness
        gen = torch.Generator().manual_seed(self.server.seed if self.server is not None else 0)
        pool = {}
        for m, (d_in, d_out) in modules.items():
            for gid in range(self.cfg.pool):
                a = torch.empty(self.cfg.r, d_in)
                nn.init.kaiming_uniform_(a, a=5 ** 0.5, generator=gen)
                pool[expert_name(m, gid, "A")], pool[expert_name(m, gid, "B")] = a, torch.zeros(d_out, self.cfg.r)
        assignment = {m: random_assignment(self.n_clients, self.cfg.pool, self.k_c, *self.bounds, gen,
                                           self.solver) for m in modules}
        state = {"shared": common, "pool": pool, "assignment": assignment, "gen": gen, "token_emb": {},
                 "expert_emb": {}, "report": {}}
        return state, self._payloads(state)

    def _payloads(self, state) -> dict[int, Tensors]:
        out = {}
        for c in range(self.n_clients):
            p = dict(state["shared"])
            for m, d in state["assignment"].items():
                for gid in d[c].nonzero().flatten().tolist():
                    for ab in "AB":
                        p[expert_name(m, gid, ab)] = state["pool"][expert_name(m, gid, ab)]
            out[c] = p
        return out

    def expected_upload(self, server_state, client: int, reference: Tensors) -> Tensors:
        expected = {n: t for n, t in reference.items() if not _EXPERT.match(n)}
        rsea, amole = self.assignment == "rsea", self.cfg.router == "amole"
        for m, d in server_state["assignment"].items():
            for gid in d[client].nonzero().flatten().tolist():
                for ab in "AB":
                    t = server_state["pool"][expert_name(m, gid, ab)]
                    expected[expert_name(m, gid, ab)] = torch.empty(t.shape, device="meta")
                if rsea and amole:
                    expected[f"rsea.{m}.expert.{gid}"] = torch.empty(self.cfg.r, device="meta")
            if rsea:
                expected[f"rsea.{m}.token" if amole else f"rsea.{m}.router"] = \
                    torch.empty(self.cfg.r if amole else self.cfg.pool, device="meta")
        return expected

    def server_round(self, server_state, uploads: dict[int, Tensors]):
        st = server_state
        shared_names = set(st["shared"])
        st["shared"] = {**st["shared"], **self.aggregate({c: {n: t for n, t in up.items() if n in shared_names}
                                                   for c, up in uploads.items()})}
        experts = self.aggregate({c: {n: t for n, t in up.items() if _EXPERT.match(n)} for c, up in uploads.items()})
        st["pool"].update(experts)  # eq. 22 by id: holders only; experts nobody trained keep their value
        t0 = time.perf_counter()
        report = {"solve_s": 0.0, "experts_per_client": {}}
        for m, d in st["assignment"].items():
            if self.assignment == "random":
                st["assignment"][m] = random_assignment(self.n_clients, self.cfg.pool, self.k_c, *self.bounds,
                                                        st["gen"], self.solver)
            elif self.assignment == "rsea":
                # a client that did not train this round keeps its last embedding
                for c, up in uploads.items():
                    for kind in ("token", "router"):
                        if f"rsea.{m}.{kind}" in up:
                            st["token_emb"][(m, c)] = up[f"rsea.{m}.{kind}"].double()
                if self.cfg.router == "amole":
                    for gid in range(self.cfg.pool):
                        held = [up[f"rsea.{m}.expert.{gid}"].double() for up in uploads.values()
                                if f"rsea.{m}.expert.{gid}" in up]
                        if held:
                            st["expert_emb"][(m, gid)] = torch.stack(held).mean(0)  # eq. 24
                    zero = torch.zeros(self.cfg.r, dtype=torch.float64)
                    clients = torch.stack([st["token_emb"].get((m, c), zero) for c in range(self.n_clients)])
                    experts_e = torch.stack([st["expert_emb"].get((m, g), zero) for g in range(self.cfg.pool)])
                    d_in = st["pool"][expert_name(m, 0, "A")].shape[1]
                    st["assignment"][m], info = assign(clients, experts_e, self.scale_dim(d_in), self.k_c,
                                                       *self.bounds, self.solver)
                else:  # vanilla router: s_ij = client i's mean router logit of expert j
                    zero = torch.zeros(self.cfg.pool, dtype=torch.float64)
                    s_v = torch.stack([st["token_emb"].get((m, c), zero) for c in range(self.n_clients)])
                    st["assignment"][m], info = assign_by_relevance(s_v, self.k_c, *self.bounds, self.solver)
                report["solve_s"] += info["solve_s"]
                # how far the selection probabilities are from uniform (1 / N): near 0, the MILP's
                # choice rests on tiny differences
                dev = float((info["probs"] - 1 / self.n_clients).abs().max())
                if dev >= report.get("p_max_dev", -1.0):  # Fig. 8: the module whose choice is least arbitrary
                    report["p_max_dev"] = dev
                    report["relevance"] = {"module": m, "s": info["relevance"].tolist(),
                                           "p": info["probs"].tolist()}
            report["experts_per_client"][m] = st["assignment"][m].sum(1).tolist()
        report["rsea_s"] = time.perf_counter() - t0
        st["report"] = report
        return st, self._payloads(st)

    def server_report(self, server_state) -> dict:
        return server_state.get("report", {})
