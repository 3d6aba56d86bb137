"""The EAGLE-3 training loss: the target's next-token distribution as the teacher, and a soft
cross-entropy that keeps no float32 [rows, V] tensor for the backward.

The teacher is kept as the target's logits over the draft vocabulary, only at the indices that
count (loss-masked next tokens), computed once per batch and shared by every TTT step; each
step picks the rows it learns and turns them into probabilities in the forward and again in the
backward: inside fused kernels on CUDA, chunk by chunk on CPU. A plain
`-(p * log_softmax(z)).sum()` keeps two float32 [rows, V] tensors alive per step for the
backward, which at T = 4096 and V = 32,000 is 1 GB per step."""

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
    logits: Tensor     # [N, V_draft]: the target's logits at the N counted indices
    top: Tensor        # [N]: their argmax, for the accuracy figure
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
    return Teacher(logits, logits.argmax(-1), [Pick(*p.view(3, -1)) for p in per_step], counts)


def _rows_per_chunk(logits: Tensor) -> int:
    # Compiled (CUDA), the kernels keep no float32 temporaries: all rows at once.
    if logits.is_cuda:
        return max(1, logits.shape[0])
    return max(1, CHUNK_ELEMENTS // logits.shape[-1])


@fused_on_cuda
def _row_losses(z: Tensor, teacher_logits: Tensor, rows: Tensor) -> Tensor:
    z = z.float()
    p = torch.softmax(teacher_logits[rows].float(), dim=-1)
    return torch.logsumexp(z, dim=-1) - (p * z).sum(-1)


@fused_on_cuda
def _row_grads(z: Tensor, teacher_logits: Tensor, rows: Tensor, grad: Tensor) -> Tensor:
    p = torch.softmax(teacher_logits[rows].float(), dim=-1)
    return ((torch.softmax(z.float(), dim=-1) - p) * grad).to(z.dtype)


class _SoftCrossEntropy(torch.autograd.Function):
    """sum over rows of -sum_v p_v log softmax(z)_v = logsumexp(z) - p.z, with p =
    softmax(teacher logits); the gradient is softmax(z) - p."""

    @staticmethod
    def forward(ctx, logits: Tensor, teacher_logits: Tensor, rows: Tensor) -> Tensor:
        step = _rows_per_chunk(logits)
        total = sum(_row_losses(logits[i:i + step], teacher_logits, rows[i:i + step]).sum()
                    for i in range(0, logits.shape[0], step))
        ctx.save_for_backward(logits, teacher_logits, rows)
        return torch.as_tensor(total, dtype=torch.float32, device=logits.device)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None, None]:
        logits, teacher_logits, rows = ctx.saved_tensors
        out = torch.empty_like(logits)
        step = _rows_per_chunk(logits)
        for i in range(0, logits.shape[0], step):
            out[i:i + step] = _row_grads(logits[i:i + step], teacher_logits, rows[i:i + step],
                                         grad)
        return out, None, None


def soft_cross_entropy(logits: Tensor, teacher_logits: Tensor, rows: Tensor) -> Tensor:
    """The summed cross-entropy of `logits` [n, V] against the teacher's rows `rows` [n]."""
    return _SoftCrossEntropy.apply(logits, teacher_logits, rows)
