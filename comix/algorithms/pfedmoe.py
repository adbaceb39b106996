"""pFedMoE (Yi et al. 2024) as CoMiGS Sec. 4.2 applies it to language: the CoMiGS-1G1S
architecture (a shared generalist + a local expert + a local token-level router on every MLP;
attention LoRA shared), but router and experts are updated *simultaneously* on the training loss
(plus load balance); no validation data is used. CoMiGS's Sec. 4.2 attributes pFedMoE's gap to
exactly this: a router fit on training data cannot adapt to the target distribution."""
from .comigs import CoMiGS


class PFedMoE(CoMiGS):
    name = "pfedmoe"
    variant = dict(experts=2, generalists=1, router_update="joint")
