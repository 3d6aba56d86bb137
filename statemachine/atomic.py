"""Atomic file replacement: the only way eagle3d writes a file that someone else reads whole."""

from __future__ import annotations

import os
from pathlib import Path


def atomic_write_bytes(path: str | os.PathLike, data: bytes, mode: int = 0o640) -> None:
    """Temp file in the same folder, fsync, rename over the target, fsync the folder: a reader
    sees the old file or the new one, never a mix, even across a crash or power cut."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, mode)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        os.fsync(fd)
    except BaseException:
        os.close(fd)
        os.unlink(tmp)
        raise
    os.close(fd)
    os.rename(tmp, path)
    fsync_dir(path.parent)


def fsync_dir(folder: str | os.PathLike) -> None:
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
