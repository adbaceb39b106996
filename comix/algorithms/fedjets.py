"""FedJETS-style federated MoE training (Dun et al. 2023; DeepFusion's baseline, Sec. V-A): a
global MoE (upcycled from K copies of the dense base, like DeepFusion's) trained over several
rounds by devices that each hold a *compact* MoE pruned from it: every non-expert weight, the
gate rows and FFN experts of ``local_experts`` of the K experts. Homogeneous: every device runs
the same compact architecture, which is what makes its on-device memory the comparison of
DeepFusion's Fig. 7.

Round: the server sends each device the non-expert weights, its experts (by global id) and the
full gate; the device trains everything it holds (next-token CE + Mixtral's load balance) and
uploads it with its *expert preference*: the full gate's mean routing probability over the K
experts on its training batches. The server averages non-expert weights over all uploaders and
each expert (and its gate row) over the devices that trained it (an expert nobody held keeps its
value), then gives every device the ``local_experts`` experts it prefers most for the next round
(FedJETS selects each client's experts by gating scores on its data; its anchor clients and
expert-selection network are left out). Round 1's experts are drawn at random from the seed. The
server scores the global MoE on its test data by domain, like DeepFusion.
"""
from __future__ import annotations

import random

import torch
from torch import nn

from ..models.base import tokenizer_source
from ..models.upcycle import moe_config, upcycle
from ..runtime import to_cpu
from .base import Algorithm, ClientContext, ClientState, Tensors
from .training import batch_generator, expert_lr, make_optimizer
from .global_moe import moe_step, public_tuning, save_moe, score_on_server


def _layer(name: str) -> int:
    return int(name.split(".layers.")[1].split(".")[0])


class FedJETS(Algorithm):
    name = "fedjets"
    section = "fedjets"
    needs_server_data = True  # the global MoE is scored on the server's test data
    quant_refusal_reason = ("its devices train every weight of a compact MoE that the server rewrites each round "
                            "(new experts, averaged attention): no frozen base stays on a device to quantise")

    def __init__(self, lora, train, n_clients, experts: int = 4, local_experts: int = 2, top_k: int = 2,
                 aux_loss_coef: float = 0.001, router_std: float = 0.02, public_steps: int = 100,
                 public_batch: int = 4, public_lr: float = 1e-4):
        super().__init__(lora, train, n_clients)
        if public_steps < 0 or public_batch < 1 or public_lr <= 0:
            raise ValueError("fedjets: public_steps >= 0, public_batch >= 1 and public_lr > 0")
        # after the last round the server trains the global MoE on its public data for as many
        # batches as DeepFusion's server uses (K x kd_steps + tune_steps; the recipes set them equal)
        self.public_steps, self.public_batch, self.public_lr = public_steps, public_batch, public_lr
        if not 1 <= local_experts <= experts:
            raise ValueError(f"fedjets.local_experts = {local_experts} must lie in [1, experts = {experts}]")
        if not 1 <= top_k <= local_experts:
            raise ValueError(f"fedjets.top_k = {top_k} must lie in [1, local_experts = {local_experts}]")
        self.k, self.m, self.top_k = experts, local_experts, top_k
        self.aux_loss_coef, self.router_std = aux_loss_coef, router_std
        self.moe = None

    # -- devices ---------------------------------------------------------------------------------
    def device_spec(self, client: int) -> str:
        return f"compact-moe:{self.m}"

    def build_device_model(self, spec: str, base: nn.Module, quant: str = "none") -> nn.Module:
        from transformers import MixtralForCausalLM
        return MixtralForCausalLM(moe_config(base.config, self.m, self.top_k, self.aux_loss_coef)).float().train()

    def declared_upload(self, model: nn.Module, adapters: Tensors) -> Tensors:
        return {}  # per round by assignment: ``expected_upload``

    def _load(self, model: nn.Module, payload: Tensors) -> dict[int, list[int]]:
        """Put the payload into the compact model: experts of each layer in global-id order."""
        held = self._ids(payload)
        params = dict(model.named_parameters())
        with torch.no_grad():
            for n, t in payload.items():
                if n.startswith("w."):
                    params[n[2:]].copy_(t)
            for layer, ids in held.items():
                mlp = model.model.layers[layer].mlp
                for slot, gid in enumerate(ids):
                    mlp.experts.gate_up_proj[slot].copy_(payload[f"e.{layer}.{gid}.gate_up"])
                    mlp.experts.down_proj[slot].copy_(payload[f"e.{layer}.{gid}.down"])
                    mlp.gate.weight[slot].copy_(payload[f"g.{layer}.{gid}"])
        return held

    @staticmethod
    def _ids(tensors: Tensors) -> dict[int, list[int]]:
        held: dict[int, set[int]] = {}
        for n in tensors:
            if n.startswith("e."):
                _, layer, gid, _ = n.split(".")
                held.setdefault(int(layer), set()).add(int(gid))
        return {layer: sorted(ids) for layer, ids in held.items()}

    def client_round(self, ctx: ClientContext, state: ClientState, payload: Tensors):
        model = ctx.model
        held = self._load(model, payload)
        routers = {int(n.split(".")[1]): t.to(ctx.runtime.device) for n, t in payload.items() if n.startswith("router.")}
        pref = {layer: torch.zeros(self.k, device=ctx.runtime.device) for layer in routers}

        def record(layer):  # the full gate's routing probabilities on this device's tokens
            def hook(_module, args):
                with torch.no_grad():
                    h = args[0].reshape(-1, args[0].shape[-1]).float()
                    pref[layer] += torch.softmax(h @ routers[layer].float().t(), -1).mean(0)
            return hook
        hooks = [model.model.layers[i].mlp.register_forward_pre_hook(record(i)) for i in routers]
        gen = batch_generator(state)
        model.train()
        params = list(model.parameters())
        # a fresh optimizer every round: the weights it would carry moments for are new
        opt = make_optimizer(list(model.named_parameters()), ClientState(adapters={}), "moe", self.train)
        total = self.train.rounds * self.train.local_steps
        scaler, losses = ctx.runtime.grad_scaler(), []
        try:
            for _ in range(self.train.local_steps):
                for g in opt.param_groups:
                    g["lr"] = expert_lr(state.step, total, self.train)
                x, y = self.train_batch(ctx, gen)
                losses.append(moe_step(model, x, y, params, opt, self.aux_loss_coef, self.train, ctx.runtime, scaler))
                state.step += 1
        finally:
            for h in hooks:
                h.remove()
        state.rng = gen.get_state()
        upload = {f"w.{n}": p.detach().to("cpu", copy=True) for n, p in model.named_parameters()
                  if ".mlp.experts." not in n and ".mlp.gate." not in n}
        for layer, ids in held.items():
            mlp = model.model.layers[layer].mlp
            for slot, gid in enumerate(ids):
                upload[f"e.{layer}.{gid}.gate_up"] = mlp.experts.gate_up_proj[slot].detach().to("cpu", copy=True)
                upload[f"e.{layer}.{gid}.down"] = mlp.experts.down_proj[slot].detach().to("cpu", copy=True)
                upload[f"g.{layer}.{gid}"] = mlp.gate.weight[slot].detach().to("cpu", copy=True)
        for layer, p in pref.items():
            upload[f"pref.{layer}"] = to_cpu(p / max(1, self.train.local_steps))
        return state, upload, {"train_loss": torch.stack(losses).mean().item(), "device_model": f"compact-moe:{self.m}",
                               "device_params": sum(p.numel() for p in params)}

    def client_finish(self, ctx: ClientContext, state: ClientState, payload: Tensors) -> ClientState:
        return state  # the global MoE lives on the server; a device keeps nothing of it

    # -- server ----------------------------------------------------------------------------------
    def server_init(self, initial):
        moe = upcycle([self.server.base] * self.k, top_k=self.top_k, router_std=self.router_std,
                      seed=self.server.seed, aux_loss_coef=self.aux_loss_coef)  # fp32 copies on the CPU
        sd = {n: t.detach() for n, t in moe.named_parameters()}  # tied weights once (embeddings = head)
        rng = random.Random(self.server.seed)
        state = {"weights": sd, "assignment": {c: sorted(rng.sample(range(self.k), self.m))
                                                for c in range(self.n_clients)}, "round": 0}
        return state, self._payloads(state)

    def _payloads(self, state) -> dict[int, Tensors]:
        sd = state["weights"]
        common = {f"w.{n}": t for n, t in sd.items() if ".mlp.experts." not in n and ".mlp.gate." not in n}
        layers = sorted({_layer(n) for n in sd if ".mlp.gate." in n})
        routers = {f"router.{i}": sd[f"model.layers.{i}.mlp.gate.weight"] for i in layers}
        out = {}
        for c, ids in state["assignment"].items():
            own = {}
            for i in layers:
                for gid in ids:
                    own[f"e.{i}.{gid}.gate_up"] = sd[f"model.layers.{i}.mlp.experts.gate_up_proj"][gid]
                    own[f"e.{i}.{gid}.down"] = sd[f"model.layers.{i}.mlp.experts.down_proj"][gid]
                    own[f"g.{i}.{gid}"] = sd[f"model.layers.{i}.mlp.gate.weight"][gid]
            out[c] = {**common, **routers, **own}
        return out

    def expected_upload(self, server_state, client: int, reference: Tensors) -> Tensors:
        """Everything the device was sent but the full gate, and a preference per layer."""
        payload = self._payloads({**server_state, "assignment": {client: server_state["assignment"][client]}})[client]
        shapes = {n: torch.empty(t.shape, device="meta") for n, t in payload.items() if not n.startswith("router.")}
        return {**shapes, **{f"pref.{n[7:]}": torch.empty(self.k, device="meta") for n in payload
                             if n.startswith("router.")}}

    def server_round(self, server_state, uploads: dict[int, Tensors]):
        sd = dict(server_state["weights"])
        names = {n for up in uploads.values() for n in up if n.startswith("w.")}
        for n in names:  # non-expert weights: mean over every uploader
            sd[n[2:]] = torch.stack([up[n].float() for up in uploads.values()]).mean(0)
        cloned = set()
        for key in ("e", "g"):
            held: dict[tuple, list[torch.Tensor]] = {}
            for up in uploads.values():
                for n, t in up.items():
                    if n.startswith(f"{key}."):
                        held.setdefault(tuple(n.split(".")[1:]), []).append(t.float())
            for parts, ts in held.items():  # each expert / gate row: mean over its holders only
                layer, gid = int(parts[0]), int(parts[1])
                if key == "g":
                    target = f"model.layers.{layer}.mlp.gate.weight"
                else:
                    target = f"model.layers.{layer}.mlp.experts.{'gate_up_proj' if parts[2] == 'gate_up' else 'down_proj'}"
                if target not in cloned:  # the previous round's tensor may still be referenced
                    sd[target], _ = sd[target].clone(), cloned.add(target)
                sd[target][gid] = torch.stack(ts).mean(0)
        assignment = dict(server_state["assignment"])
        for c, up in uploads.items():  # next round: the experts this device's data prefers
            pref = torch.stack([t for n, t in up.items() if n.startswith("pref.")]).mean(0)
            assignment[c] = sorted(pref.topk(self.m).indices.tolist())
        state = {"weights": sd, "assignment": assignment, "round": server_state["round"] + 1}
        self.moe = None
        if state["round"] == self.train.rounds:
            moe = self._global(state)
            public = torch.cat(list(self.server.data.public.values()))
            state["public"] = public_tuning(moe, public, self.public_steps, self.public_batch, self.public_lr,
                                            self.aux_loss_coef, self.train, self.server.runtime, self.server.seed)
            state["weights"] = {n: t.detach().to("cpu", copy=True) for n, t in moe.named_parameters()}
            save_moe(moe, self.server.out_dir / "global-moe", tokenizer_source(self.server.base))
        return state, self._payloads(state)

    def _global(self, state) -> nn.Module:
        if self.moe is None:
            from transformers import MixtralForCausalLM
            moe = MixtralForCausalLM(moe_config(self.server.base.config, self.k, self.top_k, self.aux_loss_coef))
            missing = moe.load_state_dict(state["weights"], strict=False).missing_keys
            assert set(missing) <= {"lm_head.weight"}, missing  # tied to the embeddings
            moe.tie_weights()
            self.moe = moe.to(self.server.runtime.device).eval()
        return self.moe

    def server_report(self, server_state) -> dict:
        return {"assignment": {str(c): ids for c, ids in server_state["assignment"].items()},
                **({"public": server_state["public"]} if "public" in server_state else {})}

    def server_evaluate(self, server_state) -> dict[str, dict]:
        return score_on_server(self._global(server_state), self.server, self.train)
