"""Training data: the manifest's samples, read lazily, in token-bucketed batches.

Each epoch's order is a pure function of (seed, epoch), so a resumed run finds the batch it
stopped at by its position alone. Batches are formed from windows of similar-length samples
(little padding) and the batch order is shuffled again, then dealt to the ranks in turn: step s
of the job trains batches s·world … s·world + world - 1 of that order, so every sample is
trained once per epoch whatever the world size. Every rank gets the same number of batches, so
DDP's collectives always pair up; a rank left without one in the epoch's last round trains a
filler that counts for nothing.

On CUDA the next batches are read in a background thread into pinned memory while the GPU
trains, and copied without blocking; on CPU they are read when they are needed. The hidden
states travel as stored (fp8 with its scales: half the bytes) and are dequantized on the device.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Iterator

import torch
from safetensors import safe_open

from eagle3d.dataset import precision
from eagle3d.dataset.dumpformat import INPUT_IDS, LOSS_MASK

WINDOW = 64  # samples sorted together: larger pads less, smaller shuffles more
PREFETCH = 2  # batches read ahead on CUDA: one in flight while the next waits


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
    """A batch as read from the dumps, in host memory: the hidden states as stored (fp8 with
    their scales: half the bytes of bf16 to copy), the rest as in Batch."""
    input_ids: torch.Tensor
    states: dict[str, torch.Tensor]  # by dump name
    targets: torch.Tensor
    tokens: int

    def to(self, device: torch.device) -> Batch:
        """On `device`, fp8 states dequantized there; from pinned memory the copies do not
        block the host. The targets stay on the host, where loss.teacher reads them."""
        aux, last = precision.decode_states({name: t.to(device, non_blocking=True)
                                             for name, t in self.states.items()})
        return Batch(self.input_ids.to(device, non_blocking=True), aux, last, self.targets,
                     self.tokens)


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
            longest = max([lengths[j] for j in current] + [lengths[i]])
            if current and longest * (len(current) + 1) > batch_tokens:
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


def read_batch(paths: list[Path], planned: Planned, pin: bool = False,
               answers_only: bool = True) -> StoredBatch:
    """Read the batch's samples (lazily, only their bytes) and pad them to a common length, in
    host memory (pinned with `pin`). The loss counts where the next token is an answer's
    (loss-masked), or at every position but the last without `answers_only`."""
    rows = []
    for i in planned.indices:
        with safe_open(str(paths[i]), framework="pt") as f:
            rows.append({k: f.get_tensor(k) for k in f.keys()})
    T = max(r[INPUT_IDS].shape[0] for r in rows)
    B = len(rows)
    state_names = [k for k in rows[0] if k not in (INPUT_IDS, LOSS_MASK)]
    # Padding rows stay zero; with fp8 their scales are zero too, so they dequantize to zero.
    states = {k: torch.zeros(B, T, *rows[0][k].shape[1:], dtype=rows[0][k].dtype,
                             pin_memory=pin) for k in state_names}
    input_ids = torch.zeros(B, T, dtype=torch.int64, pin_memory=pin)
    targets = torch.zeros(B, T, dtype=torch.bool, pin_memory=pin)
    for b, r in enumerate(rows):
        n = r[INPUT_IDS].shape[0]
        input_ids[b, :n] = r[INPUT_IDS]
        for k in state_names:
            states[k][b, :n] = r[k]
        if planned.trained:
            # Index t's teacher predicts token t+1: it counts when that token is learned.
            targets[b, :n - 1] = r[LOSS_MASK][1:].bool() if answers_only else True
    tokens = sum(r[INPUT_IDS].shape[0] for r in rows) if planned.trained else 0
    return StoredBatch(input_ids, states, targets, tokens)


def batches(paths: list[Path], plan: Iterable[Planned], device: torch.device,
            prefetch: int | None = None, answers_only: bool = True) -> Iterator[Batch]:
    """The planned batches on `device`, in order (read_batch's), `prefetch` of them read ahead
    in a background thread (default: PREFETCH on CUDA, into pinned memory; none on CPU)."""
    cuda = device.type == "cuda"
    prefetch = (PREFETCH if cuda else 0) if prefetch is None else prefetch
    if prefetch == 0:
        for planned in plan:
            yield read_batch(paths, planned, cuda, answers_only).to(device)
        return
    # safetensors and torch's copies release the GIL: the reads overlap the GPU's work.
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="eagle3d-data") as pool:
        ahead: list[Future[Batch]] = []
        for planned in plan:
            ahead.append(pool.submit(read_batch, paths, planned, cuda, answers_only))
            if len(ahead) > prefetch:
                yield ahead.pop(0).result().to(device)
        for future in ahead:
            yield future.result().to(device)
