"""Will the dataset's disk keep the GPUs fed? A projection at the door (check-config, the train
stage's start), before hours of training find out.

The GPUs consume the dataset's bytes per token (from the capture contract: hidden size and dump
precision) times the tokens/s they train. That pace is projected from the hidden size through
measured points; the disk's is a short read probe of the dataset's own files, evicted from the
page cache before and after (a file read moments ago would report the memory's speed). Every
epoch reads the whole dataset again, and one far larger than memory comes from the disk each
time. No torch: the daemon and eagle3ctl run this.
"""

from __future__ import annotations

import math
import os
import time
from pathlib import Path
from typing import Any, Iterator

from eagle3d.dataset import contract as contract_mod
from eagle3d.dataset.dumpformat import SUFFIX, bytes_per_token
from eagle3d.statemachine import layout
from eagle3d.statemachine.config_schema import FP8

# (target hidden size, tokens/s one H200 trains its drafter at): SmolLM2-135M's full pipeline
# (README, 2026-12-04), the 8B- and Kimi-K2.5-sized drafts of bench/gpu_train.py at T=4096
# (2026-12-04). Between them, and beyond, the pace is interpolated on log-log axes.
GPU_TOKENS_PER_S = ((576, 240_000.0), (4096, 30_500.0), (7168, 12_800.0))
PROBE_BYTES = 256 << 20
PROBE_S = 0.5
CHUNK = 16 << 20


def gpu_tokens_per_s(hidden_size: int) -> float:
    """The tokens/s one GPU is expected to train at for a target of this hidden size."""
    points = [(math.log(h), math.log(t)) for h, t in GPU_TOKENS_PER_S]
    x = math.log(hidden_size)
    (x0, y0), (x1, y1) = next(((a, b) for a, b in zip(points, points[1:]) if x <= b[0]),
                              (points[-2], points[-1]))
    return math.exp(y0 + (y1 - y0) * (x - x0) / (x1 - x0))


def dumps(dataset_dir: Path) -> Iterator[Path]:
    return (dump for folder in layout.sample_folders(dataset_dir)
            for dump in folder.glob(f"*{SUFFIX}"))


def probe(files: Iterator[Path], max_bytes: int = PROBE_BYTES,
          max_s: float = PROBE_S) -> float | None:
    """Bytes/s of plain large reads of `files`, uncached, for at most `max_bytes` or `max_s`;
    None without a file to read."""
    buffer = memoryview(bytearray(CHUNK))
    total, start = 0, time.perf_counter()
    for path in files:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            while total < max_bytes and (got := os.readv(fd, [buffer])):
                total += got
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
        if total >= max_bytes or time.perf_counter() - start >= max_s:
            break
    return total / (time.perf_counter() - start) if total else None


def shortfall(contract: dict[str, Any], gpus: int, read_rate: float) -> str | None:
    """Why `gpus` GPUs would wait for a disk reading `read_rate` bytes/s, or None."""
    hidden, stored = int(contract["hidden_size"]), contract_mod.dump_dtype(contract)
    per_token = bytes_per_token(hidden, stored)
    per_gpu = gpu_tokens_per_s(hidden)
    needed = gpus * per_gpu * per_token
    if read_rate >= needed:
        return None
    return (f"the dataset's disk reads {read_rate / 1e6:,.0f} MB/s (a short probe), below the "
            f"{needed / 1e6:,.0f} MB/s that {gpus} GPU{'s' if gpus > 1 else ''} would consume "
            f"({per_gpu:,.0f} tokens/s each expected at hidden size {hidden}, {per_token:,} "
            f"bytes per token): training would wait for the disk, at about "
            f"{read_rate / needed:.0%} of the GPUs' pace. A faster disk (local NVMe)"
            + ("" if stored == FP8 else ", fp8 dumps ([extract] dump_dtype, half the bytes)")
            + " or fewer GPUs would close the gap")


def check(dataset_dir: Path, gpus: int) -> str | None:
    """The warning for this dataset and GPU count, or None when the disk keeps up or there is
    no dataset to probe yet."""
    contract = contract_mod.read(dataset_dir)
    if not contract or "hidden_size" not in contract:
        return None
    rate = probe(dumps(dataset_dir))
    return None if rate is None else shortfall(contract, gpus, rate)
