"""The spool watcher: which dumps are waiting to be ingested.

inotify (through watchdog) is only a hint to act sooner. Its queue overflows under a flood of
renames (measured here: 20,000 renames delivered as few as 3,600 events, silently), and a rename
from outside the folder arrives as *created*, not *moved*. So every event kind counts, and a
periodic full rescan is the truth that catches whatever the events missed.

The spool lies in a folder every local user may write to (/dev/shm). It is opened once and held
(safepath.HeldDir): the rescan, the removal of dead temps and ingest act through the handle, and
an event gives a name only. If the path comes to name anything else, `replaced()` says so and
the extract stage stops there; the daemon never follows the path to what is there now.
"""

from __future__ import annotations

import logging
import os
import stat
import threading
import time
from pathlib import Path

from watchdog.events import FileSystemEvent, FileSystemEventHandler
from watchdog.observers import Observer

from eagle3d.daemon.ages import Ages
from eagle3d.dataset import dumpformat
from eagle3d.statemachine import layout
from eagle3d.statemachine.atomic import dead_temps, writer
from eagle3d.statemachine.safepath import HeldDir, Unsafe

log = logging.getLogger("eagle3d")


class _StopRace(logging.Filter):
    """watchdog's inotify thread logs an error when a last event arrives as the observer stops:
    a race inside the library, harmless, and a false error in `journalctl -p err`."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "called when the thread is inactive" not in record.getMessage()


logging.getLogger("watchdog.observers.inotify").addFilter(_StopRace())

# A dot-named file that is not a dump writer's temp file is nobody's dump: an editor's swap file,
# an operator's note, the temp file of a copy that died. Once nothing has written to it for this
# long it goes to rejected/ with its reason, like any other file that is not a dump: kept for
# the operator (rejected/ keeps the first few whole, then only reasons), never deleted unseen,
# and no longer a silent weight on [budget] spool_max that nothing reports. Untouched by the
# monotonic clock (daemon/ages.py): a step of the wall clock makes no live writer's file old.
STRAY_AGE_S = 600.0


class _Hint(FileSystemEventHandler):
    def __init__(self, spool: "Spool") -> None:
        self.spool = spool

    def on_any_event(self, event: FileSystemEvent) -> None:
        for p in (event.src_path, getattr(event, "dest_path", "")):
            name = os.path.basename(os.fsdecode(p)) if p else ""
            if name.endswith(dumpformat.SUFFIX) and not name.startswith("."):
                self.spool.offer(name)


class Spool:
    """A queue of dump names, fed by inotify hints and by rescans, each name at most once
    until it has been handled."""

    def __init__(self, folder: Path, rescan_interval: float) -> None:
        """Raises safepath.Unsafe where `folder` is not the daemon's to hold."""
        self.dir = HeldDir.open(folder)
        self.rescan_interval = rescan_interval
        self._cv = threading.Condition()
        self._queue: list[str] = []
        self._known: set[str] = set()  # queued or being handled
        self._next_rescan = 0.0
        self._strays = Ages()  # how long each dot-named file that is no writer's temp is untouched
        self.bytes_waiting = 0
        self.observer = Observer()
        # By path: after a swap its events may name another folder's files, which is harmless
        # while they are names only, looked up again in the folder held.
        self.observer.schedule(_Hint(self), str(folder), recursive=False)
        self.observer.daemon = True
        self.observer.start()

    def offer(self, name: str) -> None:
        with self._cv:
            if name not in self._known:
                self._known.add(name)
                self._queue.append(name)
                self._cv.notify()

    def take(self, timeout: float) -> str | None:
        self.rescan()  # the periodic one: hints get lost, and a paused engine reports nothing
        with self._cv:
            if not self._queue:
                self._cv.wait(timeout)
            return self._queue.pop(0) if self._queue else None

    @property
    def idle(self) -> bool:
        with self._cv:
            return not self._queue

    def done(self, name: str) -> None:
        with self._cv:
            self._known.discard(name)

    def rescan(self, force: bool = False) -> None:
        """List the spool: offer every dump, measure what it holds, and remove temp files whose
        writer is dead (a killed engine leaves them behind)."""
        now = time.monotonic()
        with self._cv:  # every ingest thread calls this: one of them rescans
            if not force and now < self._next_rescan:
                return
            self._next_rescan = now + self.rescan_interval
        entries = self.dir.entries()
        total = 0
        strays = {}
        for name, st in entries:
            total += st.st_size
            if name.startswith("."):
                if writer(name) is None:  # a writer's is removed below once its writer is gone
                    strays[name] = ((st.st_ino, st.st_size, st.st_mtime_ns), st.st_mtime)
            elif stat.S_ISDIR(st.st_mode):
                if name == layout.rejected_dir(self.dir.path).name:
                    total += self._rejected_bytes(name)
            else:
                self.offer(name)
        for name, age in self._strays.update(strays).items():
            if age > STRAY_AGE_S:
                self.offer(name)  # ingest rejects it, with its reason
        for name in dead_temps(name for name, _ in entries):
            try:
                self.dir.unlink(name)
                log.info("removed %s: its writer is gone", name)
            except FileNotFoundError:
                pass
        self.bytes_waiting = total

    def _rejected_bytes(self, name: str) -> int:
        try:
            rejected = self.dir.subdir(name, 0o700)
        except Unsafe as exc:  # not ours: nothing in it is counted, nor read
            log.warning("%s", exc)
            return 0
        try:
            return sum(st.st_size for _, st in rejected.entries())
        finally:
            rejected.close()

    def replaced(self) -> str | None:
        """Why the spool's path no longer names the folder held, or None. Another user in the
        spool's world-writable parent may have put a link or a folder of theirs there: the
        engine, which writes by path, would write into it, so the extract stage stops."""
        if self.dir.where() != "replaced":
            return None  # a spool removed outright is made again (or waited for) elsewhere
        return (f"the spool {self.dir.path} was replaced under the daemon: another local user "
                "may have put a link or a folder of theirs in its place. eagle3d neither reads "
                "nor writes there; extraction stops until the path names the daemon's own "
                "spool again (remove what is there now and restart the service)")

    def stop(self) -> None:
        self.observer.stop()
        self.observer.join(timeout=5)
        self.dir.close()


