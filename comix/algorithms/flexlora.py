"""FlexLoRA (Bai et al. 2024): heterogeneous LoRA ranks aggregated in weight space (CoMiGS
Sec. 4.3). Each client uploads its factors; the server rebuilds every full update
dW_k = s_k B_k A_k (s_k = alpha / sqrt(r_k)), averages them (uniform weights, as every other
method here; FlexLoRA's own paper weights by data size) and gives client k the best rank-r_k
approximation of the mean by truncated SVD, dW = U S V^T:
    B_k = U[:, :r] sqrt(S[:r]) / sqrt(s_k),   A_k = sqrt(S[:r]) V[:, :r]^T / sqrt(s_k),
so s_k B_k A_k is exact whenever rank(mean dW) <= r_k (Eckart-Young otherwise). This applies to
the MLP LoRA (heterogeneous ranks); the attention LoRA, rank r for all, is averaged (FedAvg).

The mean is never formed: mean dW = B_cat A_cat with B_cat = [s_1 B_1, ..., s_K B_K] / K and
A_cat = [A_1; ...; A_K] (rank R = sum r_k), so two thin QRs and the SVD of an R x R matrix give
the same U, S, V as the SVD of the full out x in matrix, at a fraction of the cost."""
from __future__ import annotations

import torch

from .base import Tensors

from .training import average
from .hetero import HeteroRank, is_hetero, lora_pairs


class FlexLoRA(HeteroRank):
    name = "flexlora"
    section = "flexlora"

    def mean_update(self, uploads: dict[int, Tensors]) -> dict[str, tuple[torch.Tensor, ...]]:
        """Per LoRA: (U, S, V^T) of the mean update, computed from the factors."""
        pairs = lora_pairs(next(iter(uploads.values())))
        k = len(uploads)
        out = {}
        for prefix, (a, b) in pairs.items():
            b_cat = torch.cat([self.scaling(c) * up[b].double() / k for c, up in uploads.items()], 1)
            a_cat = torch.cat([up[a].double() for up in uploads.values()], 0)
            qb, rb = torch.linalg.qr(b_cat)
            qa, ra = torch.linalg.qr(a_cat.t())
            u, sv, vh = torch.linalg.svd(rb @ ra.t())
            out[prefix] = (qb @ u, sv, vh @ qa.t())
        return out

    def redistribute(self, delta: dict[str, tuple[torch.Tensor, ...]], client: int, dtype=torch.float32) -> Tensors:
        r, s = self.ranks[client], self.scaling(client)
        out: Tensors = {}
        for prefix, (u, sv, vh) in delta.items():
            root = sv[:r].sqrt() / s ** 0.5
            if root.numel() < r:  # fewer components than this client's rank: pad with zeros
                root = torch.cat([root, root.new_zeros(r - root.numel())])
                u = torch.nn.functional.pad(u, [0, r - u.shape[1]])
                vh = torch.nn.functional.pad(vh, [0, 0, 0, r - vh.shape[0]])
            out[prefix + "lora_B"] = (u[:, :r] * root).to(dtype)
            out[prefix + "lora_A"] = (root[:, None] * vh[:r]).to(dtype)
        return out

    def server_round(self, server_state, uploads: dict[int, Tensors]):
        delta = self.mean_update(uploads)
        attention = average({k: {n: t for n, t in up.items() if not is_hetero(n)} for k, up in uploads.items()})
        return server_state, {c: {**attention, **self.redistribute(delta, c)} for c in range(self.n_clients)}
