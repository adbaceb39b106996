"""DeepFusion without its KD terms: the CE-only row of the DeepFusion tables."""
from .deepfusion import DeepFusion


class CEOnly(DeepFusion):
    """The same pipeline with alpha = beta = 0: the students learn from the public data's CE
    alone (teachers unused), so each KD term's gain over it is visible."""
    name = "deepfusion-ce"
    feature = "none"
    variant = dict(alpha=0.0, beta=0.0)
