"""One daemon per state folder: an exclusive lock on the folder's lock file, held for the
daemon's whole life (PostgreSQL's postmaster.pid, by flock). A second daemon on the same folder
would end the first one's engine as an orphan and dispatch from the same ledger; it is refused
instead, naming the holder. The kernel drops the lock with the holder's last descriptor, so a
killed daemon never leaves a stale lock behind; its children never inherit the descriptor
(Python opens it close-on-exec), so an orphaned engine does not keep its daemon's lock."""

from __future__ import annotations

import fcntl
import os
import time
from pathlib import Path
from typing import IO

from eagle3d.statemachine import layout
from eagle3d.statemachine.entry import Refusal


class Held(Refusal):
    """Another daemon holds the state folder (exit 2: a restart would meet the same holder)."""


def hold(state_root: Path) -> IO[str]:
    """Take the state folder's lock for this process, or raise Held naming the holder. Keep the
    returned file open for as long as the daemon runs; closing it releases the lock."""
    path = layout.daemon_lock(state_root)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    lock = os.fdopen(fd, "r+")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = lock.read().strip() or "a process that has not yet written its name"
        lock.close()
        raise Held(f"another eagle3d daemon holds {state_root} ({holder}); stop it first, or "
                   f"give this config another [paths] state_dir") from None
    # Only the holder writes: the name a refused daemon shows.
    lock.truncate(0)
    lock.write(f"pid {os.getpid()} on {os.uname().nodename}, since "
               f"{time.strftime('%Y-%m-%d %H:%M:%S')}\n")
    lock.flush()
    return lock
