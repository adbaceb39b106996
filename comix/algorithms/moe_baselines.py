"""The routing ablations of CoMiGS Table 5 (groups II and III): a 2-expert mixture of LoRA
experts on every MLP with either nothing shared (Local-MoE) or every expert shared (FedAvg-MoE:
FedAvg applied to a MoE model). As in the authors' Table 5 runs (epfml/CoMiGS
collab_runscripts/table4/baseline_fedavg_moe*.sh: ``-as experts``, whose strategy keeps the
router client-specific), FedAvg-MoE's routers stay on the device; ``fedavg-moe:share_router=true``
averages them too (the authors' ``all`` strategy).

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
    variant = dict(experts=2, generalists=2, router_update="joint")


class LocalMoETr(CoMiGS):
    name = "local-moe-tr"
    variant = dict(experts=2, generalists=0, router_update="train")


class FedAvgMoETr(CoMiGS):
    name = "fedavg-moe-tr"
    variant = dict(experts=2, generalists=2, router_update="train")
