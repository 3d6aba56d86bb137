"""The loop's condition: an error raised in a tick never ends the daemon (controller-runtime's
contract). It is recorded (a ledger event where the ledger works, the log once per distinct
error with its traceback), shown by `eagle3ctl status` with its reason and since when, and the
tick is tried again after a backoff of 1, 2, 4 … s (at most a minute), while the loop keeps
pinging the watchdog and publishing its heartbeat. The condition clears by itself at the first
tick that goes through.
"""

from __future__ import annotations

import errno
import logging
import sqlite3
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from eagle3d.statemachine import entry, ledger as ledger_file
from eagle3d.statemachine.config_validation import ConfigError

log = logging.getLogger("eagle3d")

BACKOFF_FIRST_S = 1.0
BACKOFF_MAX_S = 60.0
_DISK_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EIO)


def describe(where: str, exc: BaseException, ledger: Path) -> str:
    """One line for status: what failed, where, and in words an operator can act on."""
    text = str(exc) or type(exc).__name__
    if isinstance(exc, sqlite3.OperationalError) and "locked" in text:
        return f"ledger locked (another process holds {ledger}; while {where})"
    if isinstance(exc, sqlite3.OperationalError) and "disk is full" in text:
        return f"state folder's disk full ({ledger.parent}; while {where})"
    if isinstance(exc, OSError) and exc.errno in _DISK_ERRNOS:
        return f"{exc.strerror} ({exc.filename or ledger.parent}; while {where})"
    return f"{type(exc).__name__}: {text} (while {where})"


class StartFailed(Exception):
    """The daemon could not start: its one log line, and the exit code that tells systemd
    whether starting it again may help (docs/operations.md, "When it restarts by itself")."""

    def __init__(self, line: str, code: int) -> None:
        super().__init__(line)
        self.code = code


def start_failure(exc: Exception, ledger: Path) -> StartFailed:
    """An error that ended the daemon's start, as one line naming the file and what to do, and
    its exit code: REFUSED (the unit does not restart it) for what only the operator mends, a
    damaged ledger or a file the service may not write; RETRY for what may mend by itself.

    What may mend exits rather than waits: before READY=1 nothing but the journal could say what
    the daemon waits for, and systemd's start timeout would end a wait anyway. The unit starts it
    again after RestartSec (30 s), which outlasts a backup's lock or a remount, and gives up after
    its start limit (5 in 30 minutes), leaving the unit failed where an operator looks."""
    if isinstance(exc, (ConfigError, entry.Refusal, ledger_file.LedgerError)):
        return StartFailed(str(exc), entry.REFUSED)
    if isinstance(exc, sqlite3.Error):
        what, passing = ledger_file.problem(ledger, exc)
    elif isinstance(exc, OSError):
        # A rename's target, not its temporary file: the place the operator knows.
        what = f"{exc.filename2 or exc.filename or ledger.parent}: {exc.strerror}"
        passing = exc.errno in _DISK_ERRNOS
    else:  # a bug: where it happened, for its report (the rest of the traceback is noise here)
        where = traceback.extract_tb(exc.__traceback__)[-1]
        return StartFailed(f"cannot start: {type(exc).__name__}: {exc} (at {where.filename}:"
                           f"{where.lineno}); please report it", 1)
    if passing:
        return StartFailed(f"cannot start for now: {what}; exit {entry.RETRY}, to be started "
                           "again (the unit restarts it after 30 s)", entry.RETRY)
    return StartFailed(f"cannot start: {what}; exit {entry.REFUSED}: fix it, then start the "
                       "daemon again", entry.REFUSED)


@dataclass
class Condition:
    reason: str
    since: float     # wall clock, shown to people: when this reason first failed a tick
    retries: int     # ticks that failed in a row, whatever their reasons (the backoff's count)
    retry_at: float  # monotonic

    def as_state(self) -> dict[str, Any]:
        return {"reason": self.reason, "since": self.since, "retries": self.retries,
                "retry_in_s": round(max(0.0, self.retry_at - time.monotonic()), 1)}


class Conditions:
    """The one condition in force, if any; `failed` and `cleared` move it."""

    def __init__(self) -> None:
        self.current: Condition | None = None

    def waiting(self) -> bool:
        """Whether the next tick must wait out the backoff."""
        return self.current is not None and time.monotonic() < self.current.retry_at

    def failed(self, reason: str, exc: BaseException) -> bool:
        """Record a failed tick; True when the reason is new (the caller records it once)."""
        new = self.current is None or self.current.reason != reason
        if new:
            log.error("the loop goes on, retrying with backoff: %s", reason, exc_info=exc)
        retries = 1 if self.current is None else self.current.retries + 1
        delay = min(BACKOFF_MAX_S, BACKOFF_FIRST_S * 2.0 ** (retries - 1))
        since = time.time() if new or self.current is None else self.current.since
        self.current = Condition(reason, since, retries, time.monotonic() + delay)
        return new

    def cleared(self) -> Condition | None:
        """The tick went through: the condition that was in force, now gone."""
        was, self.current = self.current, None
        if was is not None:
            log.info("recovered after %d failed ticks: %s", was.retries, was.reason)
        return was
