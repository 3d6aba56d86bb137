"""The EAGLE-3 training loss: the target's next-token distribution as the teacher, and a soft
cross-entropy that keeps no float32 [rows, V] tensor for the backward.

The teacher is kept as the target's log-probabilities over the draft vocabulary, only at the
indices that count (loss-masked next tokens), computed once per batch and shared by every TTT
step; each step picks the rows it learns. Its loss reads them and the drafter's logits once,
in one fused kernel on CUDA (chunk by chunk on CPU), which also keeps the logits' log-sum-exp
for the backward and counts the rows whose argmax agrees with the teacher's: the backward is
then one more read. A plain `-(p * log_softmax(z)).sum()` keeps two float32 [rows, V] tensors
alive per step for the backward, which at T = 4096 and V = 32,000 is 1 GB per step. Kept as
logits, the teacher was normalised again in every step's forward and backward and an argmax read
the logits once more: at the 8B shape, T = 8192, on an H200 the step's kernels took 286.3 ms,
279.7 ms with the teacher kept normalised (`bench/gpu_train.py --profile`, one run of each).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from eagle3d.drafter.data import sent
from eagle3d.drafter.fusion import fused_on_cuda

CHUNK_ELEMENTS = 1 << 25  # float32 temporaries per chunk on CPU: 128 MB


class Pick(NamedTuple):
    """What one TTT step learns: teacher rows, and the (batch, index) of the drafter outputs
    that learn them."""
    rows: Tensor
    batch: Tensor
    index: Tensor


class Teacher(NamedTuple):
    log_probs: Tensor  # [N, V_draft]: the target's, at the N counted indices, in the head's dtype
    picks: list[Pick]  # per TTT step
    counts: Tensor     # [steps]: rows per step


@torch.no_grad()
def teacher(last: Tensor, targets: Tensor, head: Tensor, steps: int) -> Teacher:
    """`last` [B, T, H]: the target's final hidden states; `targets` [B, T] bool, on the host:
    index t counts when token t+1 is loss-masked; `head`: the target lm_head's
    draft-vocabulary rows.

    Step k at index t learns the teacher of index t+1+k, so it learns every counted index
    u >= 1+k, from its output at u-1-k. The picks are found on the host and sent in one copy
    that does not wait (data.sent): reading `targets` back from the GPU, or copying from
    pageable memory, would make every training step wait for the GPU to drain the step before
    (11.0k against 9.2k tokens/s at the Kimi-K2.5-sized draft, T = 4096, on an H200)."""
    if targets.device.type != "cpu":
        raise ValueError("teacher reads the targets on the host (data.StoredBatch.to keeps "
                         "them there): a copy back would wait for the GPU")
    b, u = targets.nonzero(as_tuple=True)
    rows = [(u >= 1 + k).nonzero().squeeze(1) for k in range(steps)]
    flat = torch.cat([b, u, *(torch.cat([r, b[r], u[r] - 1 - k]) for k, r in enumerate(rows)),
                      torch.tensor([len(r) for r in rows])])
    flat = sent(flat, last.device)
    b, u, *per_step, counts = flat.split([len(b), len(u), *(3 * len(r) for r in rows), steps])
    logits = last[b, u].to(head.dtype) @ head.T
    # Rounded to the head's dtype, a log-probability is no further off than the logit it came
    # from was, where it matters: |log p| is small for the tokens with any weight.
    log_probs = torch.log_softmax(logits.float(), dim=-1).to(logits.dtype)
    return Teacher(log_probs, [Pick(*p.view(3, -1)) for p in per_step], counts)


def _rows_per_chunk(logits: Tensor) -> int:
    # Compiled (CUDA), the kernels keep no float32 temporaries: all rows at once.
    if logits.is_cuda:
        return max(1, logits.shape[0])
    return max(1, CHUNK_ELEMENTS // logits.shape[-1])


@fused_on_cuda
def _row_losses(z: Tensor, teacher_log_probs: Tensor,
                rows: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Per row: the loss, the logits' log-sum-exp, and whether the argmaxes agree."""
    t = teacher_log_probs[rows]
    z32 = z.float()
    lse = torch.logsumexp(z32, dim=-1)
    return (lse - (torch.exp(t.float()) * z32).sum(-1), lse,
            z.argmax(-1) == t.argmax(-1))


@fused_on_cuda
def _row_grads(z: Tensor, lse: Tensor, teacher_log_probs: Tensor, rows: Tensor,
               grad: Tensor) -> Tensor:
    p = torch.exp(teacher_log_probs[rows].float())
    return ((torch.exp(z.float() - lse[:, None]) - p) * grad).to(z.dtype)


class _SoftCrossEntropy(torch.autograd.Function):
    """sum over rows of -sum_v p_v log softmax(z)_v = logsumexp(z) - p.z, with p the teacher's
    probabilities; the gradient is softmax(z) - p. Also returns the count of rows whose argmax
    is the teacher's (no gradient)."""

    @staticmethod
    def forward(ctx, logits: Tensor, teacher_log_probs: Tensor,
                rows: Tensor) -> tuple[Tensor, Tensor]:
        step = _rows_per_chunk(logits)
        loss = logits.new_zeros((), dtype=torch.float32)
        hits = logits.new_zeros((), dtype=torch.int64)
        lses = [logits.new_zeros(0, dtype=torch.float32)]  # all an empty batch keeps
        for i in range(0, logits.shape[0], step):
            rows_loss, lse, agree = _row_losses(logits[i:i + step], teacher_log_probs,
                                                rows[i:i + step])
            loss, hits = loss + rows_loss.sum(), hits + agree.sum()
            lses.append(lse)
        ctx.save_for_backward(logits, torch.cat(lses), teacher_log_probs, rows)
        ctx.mark_non_differentiable(hits)
        return loss, hits

    @staticmethod
    def backward(ctx, grad: Tensor, _hits: Tensor | None) -> tuple[Tensor, None, None]:
        logits, lse, teacher_log_probs, rows = ctx.saved_tensors
        out = torch.empty_like(logits)
        step = _rows_per_chunk(logits)
        for i in range(0, logits.shape[0], step):
            out[i:i + step] = _row_grads(logits[i:i + step], lse[i:i + step],
                                         teacher_log_probs, rows[i:i + step], grad)
        return out, None, None


def soft_cross_entropy(logits: Tensor, teacher_log_probs: Tensor,
                       rows: Tensor) -> tuple[Tensor, Tensor]:
    """The summed cross-entropy of `logits` [n, V] against the teacher's rows `rows` [n], and
    how many of those n rows have the teacher's argmax."""
    return _SoftCrossEntropy.apply(logits, teacher_log_probs, rows)
