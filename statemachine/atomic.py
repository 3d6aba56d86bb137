"""Atomic file replacement: the only way eagle3d writes a file that someone else reads whole."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Iterable


# This host, as a temp file's name carries it: a pid means something on its own host only, and
# a shared folder (the shards' dataset root, the train folder) is written from several hosts.
# Dots would split the name's parts; a host name has none other than its domain's.
HOST = os.uname().nodename.replace(".", "_")  # gethostname without importing socket


def temp_path(path: Path) -> Path:
    """Where a file is written before its rename: `.<name>.<writer's host>.<writer's pid>.tmp`
    beside it, so that what a killed writer left can be told from a live writer's work."""
    return path.with_name(f".{path.name}.{HOST}.{os.getpid()}.tmp")


def writer(name: str) -> tuple[str, int] | None:
    """(host, pid) of the writer of a temp file, from its name, or None for any other name."""
    parts = name.split(".")
    if len(parts) >= 5 and parts[0] == "" and parts[-1] == "tmp" and parts[-2].isdigit() \
            and parts[-3]:
        return parts[-3], int(parts[-2])
    return None


def remove_dead_temps(folder: str | os.PathLike) -> list[str]:
    """Remove the temp files whose writer is gone (killed between its write and its rename:
    nothing else would ever remove them); returns their names."""
    folder = Path(folder)
    removed = []
    for name in dead_temps(p.name for p in folder.glob(".*.tmp")):
        try:
            (folder / name).unlink()
            removed.append(name)
        except FileNotFoundError:
            pass
    return removed


def dead_temps(names: Iterable[str]) -> list[str]:
    """The temp files among `names` whose writer is gone. Only this host's: another host's pid
    cannot be judged here."""
    return [name for name in names
            if (who := writer(name)) is not None and who[0] == HOST and not _alive(who[1])]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: alive
        pass
    return True


def atomic_write_bytes(path: str | os.PathLike, data: bytes, mode: int = 0o640,
                       durable: bool = True) -> None:
    """Temp file in the same folder, fsync, rename over the target, fsync the folder: a reader
    sees the old file or the new one, never a mix, even across a crash or power cut.
    `durable` False leaves out the two fsyncs: still never a mix for a reader, but a power cut
    may keep the old file, for what is rewritten every second anyway."""
    path = Path(path)
    tmp = temp_path(path)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, mode)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        if durable:
            os.fsync(fd)
    except BaseException:
        os.close(fd)
        os.unlink(tmp)
        raise
    os.close(fd)
    os.rename(tmp, path)
    if durable:
        fsync_dir(path.parent)


def fsync_dir(folder: str | os.PathLike) -> None:
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def process_umask() -> int:
    """The process's umask, read without setting it (os.umask sets it, for every thread at
    once); the most private one where the kernel does not say (Linux before 4.7)."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    return 0o077


def share_with_group(path: str | os.PathLike) -> None:
    """Give what a library wrote for its owner alone (safetensors' files, mkdtemp's folders) the
    modes of eagle3d's own files, 0640 and folders 0750, under the umask: the unit's UMask=0027
    lets the service's group read them, as the docs promise, and nobody else."""
    path = Path(path)
    mask = process_umask()
    for p in [path, *path.rglob("*")] if path.is_dir() else [path]:
        if not p.is_symlink():
            os.chmod(p, (0o750 if p.is_dir() else 0o640) & ~mask)
