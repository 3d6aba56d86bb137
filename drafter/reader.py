"""Reading the planned batches from the dumps at the disk's pace, ahead of the training step.

Each file of a batch is read whole with one vectored read (os.preadv) that scatters its tensors
straight into their rows of the batch: no mmap, no per-tensor Python, no copy but the kernel's
from the page cache (or the disk) into the batch. The batch lives in a Slot, a host buffer
allocated once (pinned on CUDA) and reused for batch after batch, so host memory is the slots'
however large the dataset is. Padding is zeroed, so a batch is exactly what reading each dump
and padding it would give (with fp8 the padding's scales are zero too: it decodes to zero).

Every file read is checked against the checksum verify recorded for it, over the bytes just
read (the header's and the tensors', the whole file): a file changed since verify passed it (a
bit flipped on the disk) stops the trainer with DatasetChanged, naming it, before any of its
batch is trained on. xxh3 hashes ~20 GB/s on one core without the GIL: beside the read, it
costs nothing bench/data_path.py can measure.
"""

from __future__ import annotations

import collections
import os
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Iterable, Iterator, Sequence

import torch

from eagle3d.dataset import checksum, dumpformat
from eagle3d.dataset.dumpformat import (DTYPE_NAMES, DTYPE_SIZES, INPUT_IDS, LOSS_MASK, DumpError,
                                        DumpHeader)
from eagle3d.drafter.data import Batch, Planned, StoredBatch
from eagle3d.statemachine.entry import DatasetChanged

ALIGN = 64  # every tensor of a slot starts at a multiple of this: any dtype may view it
# The dump format's dtypes as torch's: dumpformat names each by its torch name.
TORCH_DTYPES = {stored: getattr(torch, name) for name, stored in DTYPE_NAMES.items()}
# Batches held on the host at once, and threads reading them. One H200 trains the Kimi-K2.5
# shape at ~13k tokens/s, ~370 MB/s of fp8 dumps: one 4096-token batch (117 MB) is ~0.3 s of
# step and as long a read from a ~0.4 GB/s share of a disk. Several in flight keep the device's
# queue fed and let the slower reads of a shared disk average out.
READ_AHEAD = 4
READERS = 4


def header_of(fd: int, path: Path) -> tuple[DumpHeader, bytes]:
    """The dump's header and its bytes (dumpformat.header_and_bytes), an error naming `path`."""
    try:
        return dumpformat.header_and_bytes(fd)
    except DumpError as exc:
        raise DumpError(f"{path}: {exc}") from None


def check_sum(path: Path, recorded: tuple[str, str], head: bytes,
              tensors: list[memoryview]) -> None:
    """The file's bytes as read (its header's, then its tensors' in file order) against the
    checksum verify recorded for sample `recorded[0]`."""
    h = checksum.hasher()
    h.update(head)
    for view in tensors:
        h.update(view)
    sid, want = recorded
    if checksum.digest(h) != want:
        raise DatasetChanged(f"refusing to train: {path} (sample {sid}) changed since verify "
                             f"passed it: its checksum is {checksum.digest(h)}, verify "
                             f"recorded {want}", [sid])


def read_fully(fd: int, buffers: list[memoryview], offset: int, path: Path) -> None:
    """Fill `buffers` from `offset` on, in as few preadv calls as the kernel allows (one, below
    2 GiB)."""
    while buffers:
        got = os.preadv(fd, buffers, offset)
        if got == 0:
            raise DumpError(f"{path}: the file ended before its tensors did")
        offset += got
        while buffers and got >= len(buffers[0]):
            got -= len(buffers[0])
            buffers.pop(0)
        if got:
            buffers[0] = buffers[0][got:]


class Slot:
    """A host buffer that one batch at a time is read into; it grows to the largest batch it
    has held. On CUDA it is pinned, and it is refilled only once the copy out of it to the
    device (`release`) has run."""

    def __init__(self, pin: bool) -> None:
        self.pin = pin
        self.buffer = torch.empty(0, dtype=torch.uint8)
        self.copied: torch.cuda.Event | None = None

    def release(self) -> None:
        """The batch has been copied out (queued on the current CUDA stream, or done on CPU)."""
        if self.pin:
            self.copied = torch.cuda.Event()
            self.copied.record()

    def carve(self, sizes: list[int]) -> list[torch.Tensor]:
        """Flat uint8 views of `sizes` bytes each, apart in the buffer."""
        if self.copied is not None:
            self.copied.synchronize()
        starts, end = [], 0
        for size in sizes:
            starts.append(end)
            end += -(-size // ALIGN) * ALIGN
        if self.buffer.numel() < end:
            self.buffer = torch.empty(0, dtype=torch.uint8)  # freed before the larger one
            self.buffer = torch.empty(end, dtype=torch.uint8, pin_memory=self.pin)
        return [self.buffer[s:s + size] for s, size in zip(starts, sizes)]

    def fill(self, paths: list[Path], planned: Planned, answers_only: bool, evict: bool,
             recorded: Sequence[tuple[str, str]] | None = None) -> StoredBatch:
        """Read the planned batch's dumps into this slot, right-padded to the longest.
        `evict` drops each file from the page cache once read (a dataset read once per epoch
        gains nothing from it staying there). `recorded`: see `batches`."""
        fds: list[int] = []
        try:
            for i in planned.indices:
                fds.append(dumpformat.open_dump(paths[i]))
                # The kernel reads ahead twice as far.
                os.posix_fadvise(fds[-1], 0, 0, os.POSIX_FADV_SEQUENTIAL)
            heads = [header_of(fd, paths[i]) for fd, i in zip(fds, planned.indices)]
            return self._read(fds, [paths[i] for i in planned.indices], heads,
                              planned.trained, answers_only, evict,
                              recorded and [recorded[i] for i in planned.indices])
        finally:
            for fd in fds:
                os.close(fd)

    def _read(self, fds: list[int], paths: list[Path], heads: list[tuple[DumpHeader, bytes]],
              trained: bool, answers_only: bool, evict: bool,
              recorded: list[tuple[str, str]] | None) -> StoredBatch:
        headers = [header for header, _ in heads]
        first = headers[0]
        names = list(first.tensors)
        row = {name: _row_bytes(first, name) for name in names}
        B, T = len(headers), max(h.tokens for h in headers)
        flat = dict(zip(names, self.carve([B * T * row[name] for name in names])))
        # numpy, not torch, for the bytes: torch's ops would hand each small fill to its
        # intra-op thread pool, which on a loaded host costs more than the fill.
        arrays = {name: flat[name].numpy() for name in names}
        for b, (fd, path, header) in enumerate(zip(fds, paths, headers)):
            if [(t.dtype, t.shape[1:]) for t in header.tensors.values()] != \
                    [(t.dtype, t.shape[1:]) for t in first.tensors.values()]:
                raise DumpError(f"{path}: its tensors' dtypes or widths differ from "
                                f"{paths[0]}'s in the same dataset")
            n, start = header.tokens, b * T
            for name in names:
                arrays[name][(start + n) * row[name]:(start + T) * row[name]] = 0
            # Each file's own order: the format lets a writer lay the tensors out in any order
            # (safetensors' own sorts them by dtype), and its header says which.
            in_file = sorted(names, key=lambda name: header.tensors[name].begin)
            views = [memoryview(arrays[name][start * row[name]:(start + n) * row[name]])
                     for name in in_file]
            read_fully(fd, list(views), header.tensors[in_file[0]].begin, path)
            if recorded:
                check_sum(path, recorded[b], heads[b][1], views)
            if evict:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        typed = {name: flat[name].view(TORCH_DTYPES[first.tensors[name].dtype]).view(
            B, T, *first.tensors[name].shape[1:]) for name in names}
        lengths = torch.tensor([h.tokens for h in headers])
        targets = torch.zeros(B, T, dtype=torch.bool)
        if trained:
            # Index t's teacher predicts token t+1: it counts when that token is learned.
            targets[:, :-1] = (typed[LOSS_MASK][:, 1:].bool() if answers_only else
                               torch.arange(T - 1) < (lengths - 1)[:, None])
        states = {name: t for name, t in typed.items() if name not in (INPUT_IDS, LOSS_MASK)}
        return StoredBatch(typed[INPUT_IDS], states, targets, int(lengths.sum()) if trained else 0)


def _row_bytes(header: DumpHeader, name: str) -> int:
    """Bytes per token of one tensor of a dump."""
    info = header.tensors[name]
    size = DTYPE_SIZES[info.dtype]
    for dim in info.shape[1:]:
        size *= dim
    return size


def batches(paths: list[Path], plan: Iterable[Planned], device: torch.device,
            ahead: int = READ_AHEAD, readers: int = READERS, answers_only: bool = True,
            evict: bool = False, recorded: Sequence[tuple[str, str]] | None = None
            ) -> Iterator[Batch]:
    """The planned batches on `device`, in order, padded to each batch's longest sample. The
    loss counts where the next token is an answer's (loss-masked), or at every position but a
    row's last without `answers_only`. `recorded`: (sample id, checksum) of each path, as
    verify recorded them; each file read is checked against it (DatasetChanged).

    `ahead` batches are held on the host at once (pinned on CUDA), read by up to `readers`
    threads while the device trains (preadv releases the GIL), each into a slot of its own that
    is reused once its batch is on the device: host memory stays at `ahead` of the largest
    batch. `evict` drops each file from the page cache once read (Slot.fill)."""
    cuda = device.type == "cuda"
    slots = [Slot(pin=cuda) for _ in range(max(1, ahead))]
    jobs = enumerate(plan)
    pending: collections.deque[tuple[Slot, Future[StoredBatch]]] = collections.deque()
    # A reader thread pins memory and waits on events of this rank's GPU: made current there,
    # it opens no CUDA context on GPU 0 (the default of a new thread).
    pool = ThreadPoolExecutor(max_workers=max(1, min(readers, len(slots))),
                              thread_name_prefix="eagle3d-data",
                              initializer=torch.cuda.set_device if cuda else None,
                              initargs=(device,) if cuda else ())

    def submit() -> None:
        # Slots are taken in the plan's order: the oldest batch's slot is always the next
        # freed, so a reader never waits for one that only a later batch would free.
        job = next(jobs, None)
        if job is not None:
            k, planned = job
            slot = slots[k % len(slots)]
            pending.append((slot, pool.submit(slot.fill, paths, planned, answers_only, evict,
                                              recorded)))
    try:
        for _ in slots:
            submit()
        while pending:
            slot, future = pending.popleft()
            batch = future.result().to(device)
            slot.release()
            submit()
            yield batch
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
