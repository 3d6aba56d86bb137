"""Durability of the dataset by groups of files, not file by file.

Ingest does not fsync each dump: that made it wait for the disk on every file, at half of `cp`
speed. Instead the whole dataset file system is flushed with syncfs(2): at the start of every
verify pass, so a sample is marked verified only once its file is on disk (a file lost to a power
cut before that fails verify's re-read and is extracted again; its tmpfs spool copy would have
been lost by the same power cut anyway); every GiB or 30 s of ingest, so dirty data never piles
up; and at a clean shutdown.

The kernel reports a write-back error once to each open handle on the file system, at that
handle's next syncfs, including an error its own flusher met first. So each user keeps one handle
open from the daemon's start, before anything is written: a handle opened per call would miss
those errors.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
import time
from pathlib import Path

from eagle3d.statemachine.ledger import Ledger

log = logging.getLogger("eagle3d")

EVERY_BYTES = 1 << 30
EVERY_S = 30.0

_libc = ctypes.CDLL(None, use_errno=True)  # Python's os module has no syncfs


class SyncFs:
    """A syncfs(2) handle on the file system holding `folder` (which must exist)."""

    fd = -1

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)

    def __del__(self) -> None:  # like a file object: closed with its last reference
        if self.fd >= 0:
            os.close(self.fd)

    def sync(self, ledger: Ledger) -> bool:
        """Write every dirty page of the file system to disk; False, logged loudly and recorded
        as a ledger event, when some write-back since the last call failed (EIO, ENOSPC)."""
        if _libc.syncfs(self.fd) == 0:
            return True
        err = ctypes.get_errno()
        log.error("DATASET NOT ON DISK: syncfs of %s: %s; files written since the last good "
                  "sync may be lost (verify re-reads them before they count)",
                  self.folder, os.strerror(err))
        ledger.event("syncfs_failed", f"{self.folder}: {os.strerror(err)}")
        return False


class GroupSync:
    """Shared by the ingest threads: after every ingested file, the thread that crosses
    `every_bytes` since the last sync, or `every_s`, runs one syncfs. Only that thread waits for
    the disk; the others go on copying."""

    def __init__(self, folder: Path, every_bytes: int = EVERY_BYTES,
                 every_s: float = EVERY_S) -> None:
        self.handle = SyncFs(folder)
        self.every_bytes, self.every_s = every_bytes, every_s
        self.unsynced = 0
        self.last = time.monotonic()
        self.syncs = 0
        self._counts = threading.Lock()
        self._syncing = threading.Lock()

    def ingested(self, nbytes: int, ledger: Ledger) -> None:
        with self._counts:
            self.unsynced += nbytes
            due = self.unsynced >= self.every_bytes or \
                time.monotonic() - self.last >= self.every_s
        # A sync already running covers most of what this thread wrote: no queue of syncs.
        if due and self._syncing.acquire(blocking=False):
            try:
                self.flush(ledger)
            finally:
                self._syncing.release()

    def flush(self, ledger: Ledger) -> bool:
        """Sync now (also at shutdown); True when it succeeded."""
        with self._counts:
            self.unsynced, self.last = 0, time.monotonic()
            self.syncs += 1
        return self.handle.sync(ledger)
