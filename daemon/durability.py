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

A failed write-back usually leaves its pages in the page cache, clean, still holding the good
bytes: a re-read after the next (successful) syncfs would see them and vouch for a file the disk
does not hold. So when the ledger gives reason to doubt the cache, verify evicts each file's pages
before reading it, and the checksum is computed over what the disk holds. The reasons: a failed
syncfs, or a daemon life that ended without a clean stop (its handles may have heard of an error
it never recorded, and handles opened later are not told of an error someone already saw).
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
TRUSTED_UPTO = "verify.cache_trusted_upto"  # meta: the last event weighed by a finished pass
LIFE_EVENTS = ("daemon_started", "daemon_stopped")  # written by reconcile.py

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


def page_cache_doubt(ledger: Ledger) -> tuple[str | None, int]:
    """Why verify must read from the disk this pass (None: the page cache can be trusted), and
    the last ledger event weighed, to hand to `doubt_settled` once the pass has read every file.

    Only events since the last settled pass are weighed, by their sequence number (the primary
    key): the events table grows with every sample, and this runs at every pass."""
    since = int(ledger.meta(TRUSTED_UPTO) or 0)
    upto = ledger.last_event_seq()
    rows = ledger.events_of(("syncfs_failed", *LIFE_EVENTS), since, upto)
    failed = [detail for _, kind, detail in rows if kind == "syncfs_failed"]
    if failed:
        return (f"{len(failed)} dataset sync(s) failed since the last pass that read from the "
                f"disk (last: {failed[-1]})"), upto
    crashed = _unclean_stop(ledger, [row for row in rows if row[1] in LIFE_EVENTS])
    if crashed:
        return (f"the daemon life that started with {crashed} ended without a clean stop, so "
                "a write-back error it met may never have been reported"), upto
    return None, upto


def _unclean_stop(ledger: Ledger, lives: list[tuple[int, str, str]]) -> str | None:
    """The detail ("pid N") of a daemon start followed by another start with no stop between;
    `lives` are the life events to weigh, in order."""
    if not any(kind == "daemon_started" for _, kind, _ in lives):
        return None
    # The life before the first start weighed: its stop, when clean, is just before that start.
    before = ledger.last_event_of(LIFE_EVENTS, lives[0][0])
    chain = ([before] if before else []) + lives
    for (_, kind, detail), (_, then, _) in zip(chain, chain[1:]):
        if kind == then == "daemon_started":
            return detail
    return None


def doubt_settled(ledger: Ledger, upto: int) -> None:
    """A verify pass read every file it listed from the disk (or had no doubt): the events up to
    `upto` need not be weighed again."""
    ledger.set_meta(TRUSTED_UPTO, str(upto))
