"""OFA-KD: DeepFusion's pipeline with OFA-KD's branches and loss in place of VAA and the KL."""
from .deepfusion import DeepFusion


class OFAKD(DeepFusion):
    """OFA-KD baseline (Hao et al. 2023): every intermediate student stage projected into the
    vocabulary by a branch with its own head (``OFABranches``), each branch and the final logits
    trained with the OFA loss against the teacher's logits, in place of VAA and the KL."""
    name = "ofa-kd"
    feature = "ofa"
