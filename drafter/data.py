"""Training data: the manifest's samples, read lazily, in token-bucketed batches.

Each epoch's order is a pure function of (seed, epoch), so a resumed run finds the batch it
stopped at by its position alone. Batches are formed from windows of similar-length samples
(little padding) and the batch order is shuffled again, then dealt to the ranks in turn: step s
of the job trains batches s·world … s·world + world - 1 of that order, so every sample is
trained once per epoch whatever the world size. Every rank gets the same number of batches, so
DDP's collectives always pair up; a rank left without one in the epoch's last round trains a
filler that counts for nothing.

The batches are read by drafter/reader.py, ahead of the step, into reused host buffers. The
hidden states travel as stored (fp8 with its scales: half the bytes) and are dequantized on the
device.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import torch

from eagle3d.dataset import precision

WINDOW = 64  # samples sorted together: larger pads less, smaller shuffles more


def sent(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`t`, made on the host, on `device` without waiting: a copy from pageable memory to a GPU
    first waits for everything queued there (the training step before), one from pinned memory
    with non_blocking does not."""
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


@dataclass(frozen=True)
class Planned:
    """One batch of an epoch's plan: its samples, and whether the loss counts them. A filler
    (`trained=False`) keeps a rank in step with the others without training on anything."""
    indices: tuple[int, ...]
    trained: bool = True


@dataclass(frozen=True)
class Batch:
    input_ids: torch.Tensor  # [B, T] int64
    aux: torch.Tensor        # [B, T, 3H]
    last: torch.Tensor       # [B, T, H]
    targets: torch.Tensor    # [B, T] bool, on the host: the next token is loss-masked
    tokens: int              # real (unpadded) tokens trained on


@dataclass(frozen=True)
class StoredBatch:
    """A batch as read from the dumps, in host memory: the token ids and the hidden states as
    stored (fp8 with their scales: half the bytes of bf16 to copy), the rest as in Batch."""
    input_ids: torch.Tensor  # [B, T] int32 or int64
    states: dict[str, torch.Tensor]  # by dump name
    targets: torch.Tensor
    tokens: int

    def to(self, device: torch.device) -> Batch:
        """A copy on `device` (on the CPU too: the host buffer is reused for the next batch),
        fp8 states dequantized there; from pinned memory the copies do not block the host. The
        targets stay on the host, where loss.teacher reads them."""
        aux, last = precision.decode_states({
            name: t.to(device, non_blocking=True, copy=True) for name, t in self.states.items()})
        ids = self.input_ids.to(device, non_blocking=True, copy=True).long()
        return Batch(ids, aux, last, self.targets, self.tokens)


def sample_paths(manifest: dict[str, Any], dataset_dir: Path) -> list[Path]:
    return [Path(dataset_dir) / s["path"] for s in manifest["samples"]]


def plan_epoch(lengths: list[int], batch_tokens: int, seed: int, epoch: int,
               world: int) -> list[list[Planned]]:
    """Per rank, the epoch's batches. A batch holds as many samples as fit in `batch_tokens`
    once padded to its longest; a longer sample goes alone."""
    gen = torch.Generator().manual_seed(seed * 100_003 + epoch)
    order = torch.randperm(len(lengths), generator=gen).tolist()
    batches: list[Planned] = []
    for w in range(0, len(order), WINDOW):
        window = sorted(order[w:w + WINDOW], key=lambda i: lengths[i])
        current: list[int] = []
        for i in window:
            # The window is sorted by length: the sample joining is the batch's longest.
            if current and lengths[i] * (len(current) + 1) > batch_tokens:
                batches.append(Planned(tuple(current)))
                current = []
            current.append(i)
        if current:
            batches.append(Planned(tuple(current)))
    shuffled = [batches[i] for i in torch.randperm(len(batches), generator=gen).tolist()]
    # The shortest sample makes the cheapest filler.
    filler = Planned((min(range(len(lengths)), key=lengths.__getitem__),), trained=False)
    shuffled += [filler] * (-len(shuffled) % world)
    return [shuffled[rank::world] for rank in range(world)]


def position(plans: list[list[Planned]], step: int) -> tuple[int, int]:
    """(epoch, batch within it) where step `step` of the epochs' plans stands; (epochs, 0) past
    the last. A run keeps its step alone: this is where it stands in the data."""
    for epoch, plan in enumerate(plans):
        if step < len(plan):
            return epoch, step
        step -= len(plan)
    return len(plans), 0


def remaining(plans: list[list[Planned]], step: int, count: int) -> Iterator[Planned]:
    """`count` batches of the epochs' plans from step `step` on. The batches before are skipped
    by their position: a resumed run reads none of them."""
    return itertools.islice(itertools.chain.from_iterable(plans), step, step + count)
