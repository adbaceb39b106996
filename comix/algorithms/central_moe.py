"""The centralized upper bound of DeepFusion's Fig. 9: the same global MoE trained on pooled data."""
from __future__ import annotations

import copy

import torch
from torch import nn

from ..data import sample_batch
from ..models.base import tokenizer_source
from ..models.upcycle import upcycle
from .base import ClientContext, ClientState, Tensors
from .training import batch_generator, expert_lr, keep_optimizer, make_optimizer
from .deepfusion import DeepFusion
from .global_moe import moe_step, public_tuning, save_moe


class CentralMoE(DeepFusion):
    """The upper bound of Fig. 9 (the paper's DeepSpeed baseline): the *same* global MoE
    (upcycled from K copies of the dense base, Sec. II) trained centrally, every weight, on all
    devices' training data pooled; scored on the server's test data like DeepFusion. Its step
    budget is the devices' total (N x ``train.local_steps`` batches of ``train.batch_size``, the
    batches cycling through the users), so it sees as many training tokens as the devices did.
    Nothing is uploaded (the data is central).

    ``train.rounds`` > 1 cuts the same run into pieces the engine checkpoints (a multi-hour CPU run
    resumes after its last finished piece): R rounds of ``train.local_steps`` train exactly as one
    round of R x ``train.local_steps`` -- the MoE, its AdamW moments, the batch generator, the
    learning-rate schedule and the cycle through the users all continue -- and the public tuning
    runs once, after the last round."""
    name = "central-moe"
    dp_refusal_reason = "it trains one model on every user's pooled data: there is no client upload to protect"
    pooled = True
    quant_refusal_reason = "the centralized reference trains every weight of the global MoE on the server"
    one_shot = False  # one central run: rounds only checkpoint it

    def device_spec(self, client: int) -> str:
        return "central-moe"

    def build_device_model(self, spec: str, base: nn.Module, quant: str = "none") -> nn.Module:
        dense = copy.deepcopy(base).float()
        moe = upcycle([dense] * self.k, top_k=self.top_k, seed=0, aux_loss_coef=self.aux_loss_coef)
        self._initial[spec] = {n: t.detach().to("cpu", copy=True) for n, t in moe.state_dict().items()}
        return moe.requires_grad_(True).train()

    def declared_upload(self, model: nn.Module, adapters: Tensors) -> Tensors:
        return {}

    def client_round(self, ctx: ClientContext, state: ClientState, payload: Tensors):
        model = ctx.model
        # the MoE being trained waits between rounds in the trainer's private state (checkpointed
        # by the engine, never uploaded); the first round starts from the upcycled base
        model.load_state_dict(state.extra.get("moe", self._initial["central-moe"]))
        gen = batch_generator(state)
        model.train()
        params = list(model.parameters())
        opt = make_optimizer(list(model.named_parameters()), state, "moe", self.train)
        scaler = ctx.runtime.grad_scaler()
        steps = len(ctx.data) * self.train.local_steps  # the devices' total budget, per round
        total = self.train.rounds * steps
        losses = []
        for _ in range(steps):
            for g in opt.param_groups:
                g["lr"] = expert_lr(state.step, total, self.train)
            user = ctx.data[state.step % len(ctx.data)]  # batches cycle through the users
            x, y = sample_batch(user.train, self.train.batch_size, self.train.seq_len, gen)
            losses.append(moe_step(model, x, y, params, opt, self.aux_loss_coef, self.train, ctx.runtime, scaler))
            state.step += 1
        state.rng = gen.get_state()
        if state.step < total:  # more rounds to come: the weights and their moments go on with them
            state.extra["moe"] = {n: t.detach().to("cpu", copy=True) for n, t in model.state_dict().items()}
            keep_optimizer(state, "moe", opt, self.train)
        else:  # trained: nothing to carry (a copy of the MoE and its moments is GBs at the paper's scale)
            state.extra.pop("moe", None)
            state.optimizers.pop("moe", None)
        self.moe = model.eval()
        return state, {}, {"train_loss": torch.stack(losses).mean().item(), "device_model": "central-moe",
                           "device_params": sum(p.numel() for p in params), "train_steps": steps}

    def server_init(self, initial):
        return {"round": 0}, {c: {} for c in range(self.n_clients)}

    def server_round(self, server_state, uploads: dict[int, Tensors]):
        if self.server is None or self.server.data is None:
            raise ValueError(f"{self.name} is scored on the server's test data: set data.public_frac > 0")
        server_state = {**server_state, "round": server_state["round"] + 1}
        if server_state["round"] < self.train.rounds:  # the central run goes on: tuning comes after it
            return server_state, {c: {} for c in range(self.n_clients)}
        public = torch.cat(list(self.server.data.public.values()))
        report = public_tuning(self.moe, public, self.k * self.kd_steps + self.tune_steps, self.kd_batch, self.tune_lr,
                               self.aux_loss_coef, self.train, self.server.runtime, self.server.seed)
        save_moe(self.moe, self.server.out_dir / "global-moe", tokenizer_source(self.server.base))
        return {**server_state, "public": report}, {c: {} for c in range(self.n_clients)}

    def server_report(self, server_state) -> dict:
        return {"public": server_state["public"]} if "public" in server_state else {}
