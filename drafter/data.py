"""Training data: the manifest's samples, read lazily, in token-bucketed batches.

Each epoch's order is a pure function of (seed, epoch), so a resumed run finds the batch it
stopped at by its position alone. Batches are formed from windows of similar-length samples
(little padding) and the batch order is shuffled again; every rank gets the same number of
batches, so DDP's collectives always pair up.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from eagle3d.dataset import precision
from eagle3d.dataset.dumpformat import INPUT_IDS, LOSS_MASK

WINDOW = 64  # samples sorted together: larger pads less, smaller shuffles more


@dataclass(frozen=True)
class Batch:
    input_ids: torch.Tensor  # [B, T] int64
    aux: torch.Tensor        # [B, T, 3H]
    last: torch.Tensor       # [B, T, H]
    targets: torch.Tensor    # [B, T] bool: the next token is loss-masked
    tokens: int              # real (unpadded) tokens


def sample_paths(manifest: dict[str, Any], dataset_dir: Path) -> list[Path]:
    return [Path(dataset_dir) / s["path"] for s in manifest["samples"]]


def plan_epoch(lengths: list[int], batch_tokens: int, seed: int, epoch: int,
               world: int) -> list[list[list[int]]]:
    """Per rank, the epoch's batches (lists of sample indices). A batch holds as many samples
    as fit in `batch_tokens` once padded to its longest; a longer sample goes alone."""
    gen = torch.Generator().manual_seed(seed * 100_003 + epoch)
    order = torch.randperm(len(lengths), generator=gen).tolist()
    batches: list[list[int]] = []
    for w in range(0, len(order), WINDOW):
        window = sorted(order[w:w + WINDOW], key=lambda i: lengths[i])
        current: list[int] = []
        for i in window:
            longest = max([lengths[j] for j in current] + [lengths[i]])
            if current and longest * (len(current) + 1) > batch_tokens:
                batches.append(current)
                current = []
            current.append(i)
        if current:
            batches.append(current)
    shuffled = [batches[i] for i in torch.randperm(len(batches), generator=gen).tolist()]
    per_rank = len(shuffled) // world
    if per_rank == 0:
        raise ValueError(f"{len(shuffled)} batches cannot feed {world} ranks; lower "
                         "[train] batch_tokens or nproc, or extract more samples")
    return [shuffled[r * per_rank:(r + 1) * per_rank] for r in range(world)]


def load_batch(paths: list[Path], indices: list[int], device: torch.device) -> Batch:
    """Read the batch's samples (lazily, only their bytes) and pad them to a common length.
    The hidden states go to the device as stored (fp8 with its scales: half the bytes of bf16)
    and are dequantized there."""
    rows = []
    for i in indices:
        with safe_open(str(paths[i]), framework="pt") as f:
            rows.append({k: f.get_tensor(k) for k in f.keys()})
    T = max(r[INPUT_IDS].shape[0] for r in rows)
    B = len(rows)
    state_names = [k for k in rows[0] if k not in (INPUT_IDS, LOSS_MASK)]
    # Padding rows stay zero; with fp8 their scales are zero too, so they dequantize to zero.
    stored = {k: torch.zeros(B, T, *rows[0][k].shape[1:], dtype=rows[0][k].dtype)
              for k in state_names}
    input_ids = torch.zeros(B, T, dtype=torch.int64)
    targets = torch.zeros(B, T, dtype=torch.bool)
    for b, r in enumerate(rows):
        n = r[INPUT_IDS].shape[0]
        input_ids[b, :n] = r[INPUT_IDS]
        for k in state_names:
            stored[k][b, :n] = r[k]
        # Index t's teacher predicts token t+1: it counts when that token is loss-masked.
        targets[b, :n - 1] = r[LOSS_MASK][1:].bool()
    aux, last = precision.decode_states({k: t.to(device) for k, t in stored.items()})
    return Batch(input_ids.to(device), aux, last, targets.to(device),
                 sum(r[INPUT_IDS].shape[0] for r in rows))

