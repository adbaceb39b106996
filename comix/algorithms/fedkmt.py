"""FedKMT: DeepFusion's pipeline with logit-only distillation (the paper's baseline)."""
from .deepfusion import DeepFusion


class FedKMT(DeepFusion):
    """The paper's "FedKMT" baseline (FedMKT-style, Fan et al. 2024): the same pipeline, but each
    proxy supervises its student through the final logits only (CE + beta * KL; no features)."""
    name = "fedkmt"
    feature = "none"
