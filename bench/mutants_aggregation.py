"""The server's optimisers and robust rules, FedProx and SCAFFOLD (comix/aggregation.py,
algorithms/fedprox.py, algorithms/scaffold.py): the edits a port of Flower's strategies or of the
papers' update rules gets wrong, each caught by tests that compare with Flower's own strategies
(tests/test_aggregation.py) or with the rule's equation (tests/test_scaffold.py)."""
from __future__ import annotations

from mutant import _m

AGGREGATION = ("tests/test_aggregation.py",)
SCAFFOLD = ("tests/test_scaffold.py",)

AGGREGATION_MUTANTS = [
    _m("aggregation", "fedadam-v-from-delta", "comix/aggregation.py",
       "v = self.cfg.beta2 * v + (1 - self.cfg.beta2) * d2", "v = self.cfg.beta2 * v + (1 - self.cfg.beta2) * delta.abs()",
       "FedAdam's second moment from |delta| instead of delta^2", AGGREGATION),
    _m("aggregation", "fedyogi-sign-inverted", "comix/aggregation.py",
       "v = v - (1 - self.cfg.beta2) * d2 * torch.sign(v - d2)", "v = v + (1 - self.cfg.beta2) * d2 * torch.sign(v - d2)",
       "FedYogi's second moment moves away from delta^2", AGGREGATION),
    _m("aggregation", "fedadam-no-eta-norm", "comix/aggregation.py",
       "lr = self.lr * (1 - self.cfg.beta2 ** (t + 1)) ** 0.5 / (1 - self.beta1 ** (t + 1))", "lr = self.lr",
       "FedAdam's step without Flower's bias-corrected rate", AGGREGATION),
    _m("aggregation", "fedavgm-momentum-dropped", "comix/aggregation.py",
       "m = self.m[n] = self.cfg.momentum * self.m[n] + delta if n in self.m else delta",
       "m = self.m[n] = delta", "FedAvgM steps without its momentum", AGGREGATION),
    _m("aggregation", "server-tau-inside-sqrt", "comix/aggregation.py",
       "out[n] = (x + lr * m / (v.sqrt() + self.cfg.tau)).to(new.dtype)",
       "out[n] = (x + lr * m / (v + self.cfg.tau).sqrt()).to(new.dtype)",
       "the adaptive servers' tau added under the square root", AGGREGATION),
    _m("aggregation", "median-lower-middle", "comix/aggregation.py",
       "value = torch.quantile(stack.reshape(len(ts), -1), 0.5, dim=0).reshape(stack.shape[1:])",
       "value = stack.median(0).values", "the median of an even count is the lower middle value, not numpy's mean of the two",
       AGGREGATION),
    _m("aggregation", "trimmed-mean-one-end", "comix/aggregation.py",
       "value = stack.sort(0).values[cut:len(ts) - cut].mean(0)", "value = stack.sort(0).values[cut:].mean(0)",
       "the trimmed mean cuts the lowest values only", AGGREGATION),
    _m("aggregation", "krum-counts-itself", "comix/aggregation.py",
       "dist[i, dist[i].argsort(stable=True)[1:closest + 1]].sum()", "dist[i, dist[i].argsort(stable=True)[:closest]].sum()",
       "Krum's score counts an upload's zero distance to itself", AGGREGATION),
    _m("aggregation", "krum-one-neighbour-more", "comix/aggregation.py",
       "closest = max(1, len(clients) - f - 2)", "closest = max(1, len(clients) - f - 1)",
       "Krum scores n - f - 1 neighbours, not n - f - 2", AGGREGATION),
    _m("aggregation", "prox-full-square", "comix/algorithms/fedprox.py",
       "    return mu / 2 * sum((at_least_fp32(p) - a).pow(2).sum() for p, a in anchor)",
       "    return mu * sum((at_least_fp32(p) - a).pow(2).sum() for p, a in anchor)",
       "FedProx's term mu ||w - w^t||^2 instead of mu / 2 of it", AGGREGATION),
    _m("aggregation", "scaffold-correction-sign", "comix/algorithms/scaffold.py",
       "        p.sub_(corr.to(p.device, p.dtype), alpha=lr)", "        p.add_(corr.to(p.device, p.dtype), alpha=lr)",
       "SCAFFOLD's local step corrected by c_i - c", SCAFFOLD),
    _m("aggregation", "scaffold-variate-sign", "comix/algorithms/scaffold.py",
       "new[n] = c_i - c + (at_least_fp32(start[n]) - at_least_fp32(trained[n])) / rnd[\"lr_sum\"]",
       "new[n] = c_i - c + (at_least_fp32(trained[n]) - at_least_fp32(start[n])) / rnd[\"lr_sum\"]",
       "option II's new c_i from y - x instead of x - y", SCAFFOLD),
    _m("aggregation", "scaffold-server-over-sampled", "comix/algorithms/base.py",
       "mean.update(server_controls(self.round_start, control_delta_sum(uploads), self.n_clients))",
       "mean.update(server_controls(self.round_start, control_delta_sum(uploads), len(uploads)))",
       "the server moves c by the mean over the sampled clients, not the sum over all N", SCAFFOLD),
    _m("aggregation", "scaffold-uploads-c-i", "comix/algorithms/scaffold.py",
       "    return with_controls({}, delta)", "    return with_controls({}, new)",
       "a client uploads its c_i itself, not Delta c_i", SCAFFOLD),
]
