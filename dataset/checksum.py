"""The dataset checksum: xxh3-128, fast enough that ingest and verify run near raw copy and read
speed, and the trainer's reader checks every file it reads at no cost it can measure (a
cryptographic hash would be the bottleneck; integrity against accidents is the goal, the threat
model does not include an attacker who can write the dataset)."""

from __future__ import annotations

import os

import xxhash

PREFIX = "xxh3-128:"
CHUNK = 8 << 20


def hasher() -> "xxhash.xxh3_128":
    return xxhash.xxh3_128()


def digest(h: "xxhash.xxh3_128") -> str:
    return PREFIX + h.hexdigest()


def file_checksum(path: str | os.PathLike) -> str:
    fd = os.open(path, os.O_RDONLY)
    try:
        return fd_checksum(fd)
    finally:
        os.close(fd)


def fd_checksum(fd: int) -> str:
    """The checksum of the whole file open at `fd`, read by offset (the fd's own is left)."""
    h = hasher()
    buf = bytearray(CHUNK)
    view = memoryview(buf)
    offset = 0
    while n := os.preadv(fd, [buf], offset):
        h.update(view[:n])
        offset += n
    return digest(h)
