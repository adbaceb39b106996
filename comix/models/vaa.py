"""View-Aligned Attention (DeepFusion, Sec. IV-C, Fig. 5, eq. 7-9): lets a student LM blend the
features of its J representation stages into a view that matches a teacher of another
architecture, so that feature matching across architectures makes sense.

  F_j^S  (B, T, C_S)   student hidden state at the end of stage j (J contiguous groups of layers)
  C_j    patchify F_j^S along the tokens into P_q / J patches (contiguous token windows) and
         project each to width d (a 1x1 Conv1d on the patch mean)
  F^S  = Concat_j C_j(F_j^S)                    (B, P_q, d)                        eq. 7
  F^S' = MultiHeadSelfAttention(F^S)            (B, P_q, d)                        eq. 8
  F_j^S' = Linear_j(split_j(F^S'))              (B, P_q / J, C_T_j)  teacher width of stage j
  L_FM = sum_j MSE(F_j^T, F_j^S')                                                  eq. 9

The paper leaves open what the teacher side of eq. 9 looks like for sequences; here (documented
choice) the teacher's stage-j hidden state is averaged over the *same token patches* (features
aligned by position: teacher and student read the same token ids, see ``deepfusion.py`` on
tokenizers), then normalised by a parameter-free LayerNorm so that no stage's scale dominates
the sum (LLM hidden states grow with depth). The student's patches are normalised the same way
before C_j (second documented choice): raw residual-stream features carry a few outlier
dimensions (SmolLM2's reach the hundreds), so without it L_FM started at 56-71 against CE ~ 3 and
its gradient, scaled by those outliers, dominated eq. 11 for a whole CPU-scale budget (measured,
docs/deepfusion.md); normalised, L_FM starts near J and VAA learns the mapping instead.
Defaults (paper silent): J = 4 stages, P_q = 64 queries, d = 256, 4 heads.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def stage_ends(n_layers: int, stages: int) -> list[int]:
    """Indices into ``output_hidden_states`` (0 = embeddings, i = after layer i) where each of
    ``stages`` contiguous, near-equal groups of ``n_layers`` layers ends."""
    if not 1 <= stages <= n_layers:
        raise ValueError(f"deepfusion.stages = {stages} must lie in [1, {n_layers}] (the model's layers)")
    return [round(n_layers * (j + 1) / stages) for j in range(stages)]


def stage_features(hidden_states: tuple[torch.Tensor, ...], stages: int) -> list[torch.Tensor]:
    """The J stage features of a model from its ``output_hidden_states`` tuple (L + 1 entries)."""
    return [hidden_states[i] for i in stage_ends(len(hidden_states) - 1, stages)]


def pool_patches(x: torch.Tensor, patches: int, mask: torch.Tensor | None = None) -> torch.Tensor:
    """(B, T, C) -> (B, patches, C): each sequence's real tokens (``mask`` = 1; padding on either
    side) cut into ``patches`` contiguous near-equal windows, and the mean of each window. Used
    for the student's patches and for the teacher side of eq. 9 alike, so both see the same
    token windows."""
    b, t, _ = x.shape
    m = torch.ones(b, t, device=x.device) if mask is None else mask.to(x.device).float()
    length = m.sum(1, keepdim=True).clamp_min(1)
    rank = (m.cumsum(1) - 1).clamp_min(0)                        # position among the real tokens
    window = (rank * patches / length).floor().long().clamp_max(patches - 1)
    weights = F.one_hot(window, patches).to(x.dtype) * m[..., None].to(x.dtype)  # (B, T, P)
    return weights.transpose(1, 2) @ x / weights.sum(1)[..., None].clamp_min(1)


class ViewAlignedAttention(nn.Module):
    def __init__(self, student_widths: list[int], teacher_widths: list[int], queries: int = 64, d: int = 256,
                 heads: int = 4):
        super().__init__()
        if len(student_widths) != len(teacher_widths):
            raise ValueError(f"VAA: {len(student_widths)} student stages but {len(teacher_widths)} teacher stages")
        self.stages = len(student_widths)
        if queries % self.stages:
            raise ValueError(f"deepfusion.queries = {queries} must be a multiple of the {self.stages} stages (P_q / J)")
        if d % heads:
            raise ValueError(f"deepfusion.vaa_dim = {d} must be a multiple of deepfusion.vaa_heads = {heads}")
        self.per_stage = queries // self.stages
        self.convs = nn.ModuleList(nn.Conv1d(c, d, kernel_size=1) for c in student_widths)
        self.attn = nn.MultiheadAttention(d, heads, batch_first=True)
        self.out = nn.ModuleList(nn.Linear(d, c) for c in teacher_widths)

    def _patchify(self, j: int, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """C_j(F_j^S): (B, T, C) -> (B, P_q / J, d): each token patch's mean, normalised, projected to width d
        (a 1x1 convolution; it commutes with the mean, so this is the patch embedding with
        weights shared across a patch's positions, and it accepts any sequence length)."""
        pooled = pool_patches(x.float(), self.per_stage, mask)
        pooled = F.layer_norm(pooled, pooled.shape[-1:]).to(self.convs[j].weight.dtype)  # scale-free input
        return self.convs[j](pooled.transpose(1, 2)).transpose(1, 2)

    def forward(self, student: list[torch.Tensor], mask: torch.Tensor | None = None) -> list[torch.Tensor]:
        """The student's stage features -> its view aligned to the teacher, one (B, P_q / J, C_T_j)
        tensor per stage; ``mask`` (B, T) marks real tokens (padding excluded from every patch)."""
        if len(student) != self.stages:
            raise ValueError(f"VAA built for {self.stages} stages, got {len(student)} student features")
        fs = torch.cat([self._patchify(j, f, mask) for j, f in enumerate(student)], dim=1)  # eq. 7
        blended, _ = self.attn(fs, fs, fs, need_weights=False)                          # eq. 8
        return [self.out[j](part) for j, part in enumerate(blended.split(self.per_stage, dim=1))]

    def loss(self, student: list[torch.Tensor], teacher: list[torch.Tensor],
             mask: torch.Tensor | None = None, teacher_mask: torch.Tensor | None = None) -> torch.Tensor:
        """L_FM (eq. 9): sum over stages of the MSE between the teacher's patch-pooled, normalised
        stage feature and the student's aligned view. A teacher that read the same text through
        its own tokenizer (other length, ``teacher_mask`` marking its real tokens) is pooled over
        its own tokens: patch p is the p-th of equal windows of each side's own tokens, so the two
        p-th windows cover about, not exactly, the same characters (two tokenizers cut a text
        differently)."""
        total = student[0].new_zeros((), dtype=torch.float32)
        for view, t in zip(self(student, mask), teacher):
            target = pool_patches(t.float(), self.per_stage, mask if teacher_mask is None else teacher_mask)
            target = F.layer_norm(target, target.shape[-1:])
            total = total + F.mse_loss(view.float(), target)
        return total
