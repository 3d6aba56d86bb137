"""One log format for the daemon and every child it starts: one line per event on stderr, which
systemd hands to the journal. Under journald (JOURNAL_STREAM set) the journal adds the time and
takes the priority from a <N> prefix; elsewhere each line carries its own date and time (a
SLURM or Kubernetes log of several days needs the date), or, with EAGLE3D_LOG_FORMAT=json, is
one JSON object for a log collector. Children inherit the variable, so one setting covers all."""

from __future__ import annotations

import json
import logging
import os
import sys
import warnings

_PRIORITY = {"DEBUG": 7, "INFO": 6, "WARNING": 4, "ERROR": 3, "CRITICAL": 2}


LOG_FORMAT_ENV = "EAGLE3D_LOG_FORMAT"  # "text" (the default) or "json"
ISO_TIME = "%Y-%m-%dT%H:%M:%S%z"


class _Journal(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        return f"<{_PRIORITY.get(record.levelname, 6)}>{super().format(record)}"


class _Json(logging.Formatter):
    """{"time": ISO 8601 with the zone, "level", "process", "pid", "message"}: what Kubernetes
    log collectors index without a parsing rule."""

    def __init__(self, process: str) -> None:
        super().__init__(datefmt=ISO_TIME)
        self.process = process

    def format(self, record: logging.LogRecord) -> str:
        out = {"time": self.formatTime(record, self.datefmt), "level": record.levelname.lower(),
               "process": self.process, "pid": record.process, "message": record.getMessage()}
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        return json.dumps(out, ensure_ascii=False)


def setup_logging(process: str) -> None:
    """`process` names the line's source: daemon, planner, engine, trainer, evaluate."""
    handler = logging.StreamHandler(sys.stderr)
    if os.environ.get(LOG_FORMAT_ENV) == "json":
        handler.setFormatter(_Json(process))
    elif os.environ.get("JOURNAL_STREAM"):
        handler.setFormatter(_Journal(f"{process}: %(message)s"))
    else:
        handler.setFormatter(logging.Formatter(f"%(asctime)s %(levelname)-7s {process}: %(message)s",
                                               datefmt=ISO_TIME))
    logging.basicConfig(level=logging.INFO, handlers=[handler], force=True)
    # A warning (ours, as the trainer's dense-attention fallback, or a library's) is then a line
    # of this process at warning priority, not two bare lines the journal files as information.
    warnings.formatwarning = _one_line
    logging.captureWarnings(True)


def _one_line(message: Warning | str, category: type[Warning], filename: str, lineno: int,
              line: str | None = None) -> str:
    return f"{filename}:{lineno}: {category.__name__}: {message}"
