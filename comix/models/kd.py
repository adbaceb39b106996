"""Distillation losses of DeepFusion and its KD baselines (the server's side of ``algorithms/deepfusion.py``):
eq. 11's CE + alpha * FM + beta * KL with View-Aligned Attention's feature term (``models/vaa.py``),
and OFA-KD's branches and loss (Hao et al., NeurIPS 2023)."""
from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

from .vaa import ViewAlignedAttention, stage_features


def check_same_vocabulary(teacher: nn.Module, student: nn.Module) -> None:
    """Logit KL and position-aligned features on the student's token ids need one token space; a
    teacher with a tokenizer of its own goes through ``models/token_align.py`` instead."""
    tv, sv = teacher.config.vocab_size, student.config.vocab_size
    if tv != sv:
        raise ValueError(f"deepfusion: a teacher ({type(teacher).__name__}) has vocab_size {tv}, the student {sv}, "
                         "and no tokenizer of its own to align through")


def hidden_width(model: nn.Module) -> int:
    c = model.config
    return getattr(c, "hidden_size", None) or c.n_embd


def kd_loss(student_out, teacher_out, targets: torch.Tensor, vaa: ViewAlignedAttention | None, stages: int,
            alpha: float, beta: float, temperature: float = 1.0, ofa: "OFABranches | None" = None,
            teacher_dist: torch.Tensor | None = None, teacher_mask: torch.Tensor | None = None) -> dict:
    """Eq. 11 for one teacher on a batch whose next tokens are ``targets`` (B, T), aligned with
    the logits: CE of the student, alpha * FM and beta * KL(teacher || student) of the next-token
    distributions (eq. 10) at ``temperature`` with the usual T^2 factor, averaged over tokens.
    FM is VAA's (eq. 9) with ``vaa``; none when alpha = 0 or no module is given (the logit-only
    baseline). With ``ofa`` (OFA-KD, Hao et al. 2023) the logit terms are OFA's own: FM is the sum
    over the student's intermediate-stage branches of the OFA loss of each branch's logits, and
    the final logits' term is the OFA loss in place of the KL. A teacher with another tokenizer
    (``models/token_align.py``) gives ``teacher_dist``, its next-token distribution already at
    ``temperature`` on the student's steps and vocabulary (B, T, V), in place of its logits, and
    ``teacher_mask`` (B, T'), its real tokens, for the feature term's patches. Returns the terms
    and their total."""
    logits = student_out.logits.float()
    ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
    if teacher_dist is None:
        log_t = F.log_softmax(teacher_out.logits.float() / temperature, -1)
        p_t, t_entropy = log_t.exp(), None
    else:  # a sparse distribution: 0 log 0 = 0
        p_t = teacher_dist.to(logits.device).float()
        t_entropy = torch.special.xlogy(p_t, p_t)

    def kl_to_teacher(student_logits: torch.Tensor) -> torch.Tensor:
        log_s = F.log_softmax(student_logits.float() / temperature, -1)
        if t_entropy is not None:
            return (t_entropy - p_t * log_s).sum(-1).mean() * temperature ** 2
        return (p_t * (log_t - log_s)).sum(-1).mean() * temperature ** 2

    fm = logits.new_zeros(())
    if ofa is not None:
        teacher = {"teacher_probs": p_t} if teacher_dist is not None else {"teacher_logits": teacher_out.logits}
        kl = ofa_loss(logits, targets=targets, eps=ofa.eps, temperature=ofa.temperature, **teacher)
        if alpha:
            fm = sum(ofa_loss(z, targets=targets, eps=ofa.eps, temperature=ofa.temperature, **teacher)
                     for z in ofa(stage_features(student_out.hidden_states, stages)[:-1]))
        return {"ce": ce, "fm": fm, "kl": kl, "total": ce + alpha * fm + beta * kl}
    kl = kl_to_teacher(logits)
    if alpha and vaa is not None:
        fm = vaa.loss(stage_features(student_out.hidden_states, stages),
                      stage_features(teacher_out.hidden_states, stages), teacher_mask=teacher_mask)
    return {"ce": ce, "fm": fm, "kl": kl, "total": ce + alpha * fm + beta * kl}


def ofa_loss(student_logits: torch.Tensor, teacher_logits: torch.Tensor | None = None,
             targets: torch.Tensor | None = None, eps: float = 1.0, temperature: float = 1.0,
             teacher_probs: torch.Tensor | None = None) -> torch.Tensor:
    """OFA-KD's loss (Hao et al., NeurIPS 2023; their distillers' ``ofa_loss``): the
    cross-entropy of the student against the teacher's distribution whose target-class
    probability is raised to (1 + p_t)^eps - 1 (eps = 1: plain cross-entropy to the teacher),
    averaged over the tokens that have a target (-100: none). The teacher's distribution is
    softmax(``teacher_logits`` / T), or ``teacher_probs`` as given (a teacher of another
    tokenizer, already carried onto the student's vocabulary)."""
    keep = targets.reshape(-1) != -100
    log_s = F.log_softmax(student_logits.float().reshape(-1, student_logits.shape[-1])[keep] / temperature, -1)
    if teacher_probs is not None:
        p_t = teacher_probs.float().reshape(-1, teacher_probs.shape[-1])[keep]
    else:
        p_t = F.softmax(teacher_logits.float().reshape(-1, teacher_logits.shape[-1])[keep] / temperature, -1)
    mask = F.one_hot(targets.reshape(-1)[keep], p_t.shape[-1]).float()
    return (-((p_t + mask) ** eps - mask) * log_s).sum(-1).mean()


class OFABranches(nn.Module):
    """OFA-KD's branches for an LM: every intermediate student stage gets a branch of its own, a
    projector (pre-norm residual MLP, the token-sequence counterpart of their ViT blocks) and its
    own norm and head into the vocabulary, initialised from the student's final norm and head but
    separate parameters (their branches end in classifier heads of their own; sharing the
    student's head would push every branch's loss into the student's output layer)."""

    def __init__(self, student: nn.Module, stages: int, eps: float = 1.0, temperature: float = 1.0):
        super().__init__()
        width = hidden_width(student)
        base = student.get_decoder() if hasattr(student, "get_decoder") else student.base_model
        norm = getattr(base, "norm", None) or getattr(base, "ln_f")
        head = student.get_output_embeddings()
        self.eps, self.temperature = eps, temperature
        self.projectors = nn.ModuleList(nn.Sequential(nn.LayerNorm(width), nn.Linear(width, width), nn.GELU(),
                                                      nn.Linear(width, width)) for _ in range(stages - 1))
        for p in self.projectors:
            nn.init.zeros_(p[-1].weight)  # a branch starts as the student's head on its stage
            nn.init.zeros_(p[-1].bias)
        self.norms = nn.ModuleList(copy.deepcopy(norm) for _ in range(stages - 1))
        self.heads = nn.ModuleList(nn.Linear(width, head.out_features, bias=False) for _ in range(stages - 1))
        with torch.no_grad():
            for h in self.heads:
                h.weight.copy_(head.weight)
        self.requires_grad_(True)

    def forward(self, features: list[torch.Tensor]) -> list[torch.Tensor]:
        return [h(n(f + p(f))) for p, n, h, f in zip(self.projectors, self.norms, self.heads, features)]
