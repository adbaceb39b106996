"""The routing ablations of CoMiGS Table 5 (groups II and III): a 2-expert mixture of LoRA
experts on every MLP with either nothing shared (Local-MoE) or everything shared, the routers
included (FedAvg-MoE: FedAvg applied to a MoE model).

  * ``local-moe`` / ``fedavg-moe``: router and experts updated together on the training loss;
  * ``local-moe-tr`` / ``fedavg-moe-tr``: alternating updates as in Alg. 1, but the router steps
    use freshly sampled *training* batches (no validation set), like ``comigs-tr``.
"""
from .comigs import CoMiGS


class LocalMoE(CoMiGS):
    name = "local-moe"
    variant = dict(experts=2, generalists=0, router_update="joint")


class FedAvgMoE(CoMiGS):
    name = "fedavg-moe"
    variant = dict(experts=2, generalists=2, share_router=True, router_update="joint")


class LocalMoETr(CoMiGS):
    name = "local-moe-tr"
    variant = dict(experts=2, generalists=0, router_update="train")


class FedAvgMoETr(CoMiGS):
    name = "fedavg-moe-tr"
    variant = dict(experts=2, generalists=2, share_router=True, router_update="train")
