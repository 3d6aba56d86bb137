"""One log format for the daemon and every child it starts: one line per event on stderr, which
systemd hands to the journal. Under journald (JOURNAL_STREAM set) the journal adds the time and
takes the priority from a <N> prefix; in a terminal each line carries its own time."""

from __future__ import annotations

import logging
import os
import sys
import warnings

_PRIORITY = {"DEBUG": 7, "INFO": 6, "WARNING": 4, "ERROR": 3, "CRITICAL": 2}


class _Journal(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        return f"<{_PRIORITY.get(record.levelname, 6)}>{super().format(record)}"


def setup_logging(process: str) -> None:
    """`process` names the line's source: daemon, planner, engine, trainer, evaluate."""
    handler = logging.StreamHandler(sys.stderr)
    if os.environ.get("JOURNAL_STREAM"):
        handler.setFormatter(_Journal(f"{process}: %(message)s"))
    else:
        handler.setFormatter(logging.Formatter(f"%(asctime)s %(levelname)-7s {process}: %(message)s",
                                               datefmt="%H:%M:%S"))
    logging.basicConfig(level=logging.INFO, handlers=[handler], force=True)
    # A warning (ours, as the trainer's dense-attention fallback, or a library's) is then a line
    # of this process at warning priority, not two bare lines the journal files as information.
    warnings.formatwarning = _one_line
    logging.captureWarnings(True)


def _one_line(message: Warning | str, category: type[Warning], filename: str, lineno: int,
              line: str | None = None) -> str:
    return f"{filename}:{lineno}: {category.__name__}: {message}"
