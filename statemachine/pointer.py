"""The running daemon's pointer: which daemon runs for an editable config, with which config in
force and state folder. Written by the daemon at start, removed at its stop; read by
`eagle3ctl`, so that an edit to the file's [paths] (refused until a restart) never makes the
running daemon look gone. The file's place is layout.daemon_pointer's."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

from eagle3d.statemachine import layout
from eagle3d.statemachine.atomic import atomic_write_bytes


def write(config: Path, state_dir: Path) -> Path:
    """Say that this process is the daemon of `config`, holding its config in force in
    `state_dir`; returns the pointer's path."""
    import tomli_w  # only the daemon writes it; eagle3ctl must start in a blink
    path = layout.daemon_pointer(config)
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    doc = {"pid": os.getpid(), "config": str(Path(config).resolve()),
           "state_dir": str(state_dir), "in_force": str(layout.config_in_force(state_dir))}
    atomic_write_bytes(path, tomli_w.dumps(doc).encode())
    return path


def read(config: Path) -> dict[str, Any] | None:
    """The pointer of the daemon running for `config`, or None (none, or its process is gone)."""
    try:
        doc = tomllib.loads(layout.daemon_pointer(config).read_text())
        os.kill(int(doc["pid"]), 0)
    except PermissionError:
        return doc
    except (OSError, ValueError, KeyError, tomllib.TOMLDecodeError):
        return None
    return doc


def remove(config: Path) -> None:
    """At the daemon's stop: its pointer only (a newer daemon may have written its own)."""
    path = layout.daemon_pointer(config)
    try:
        if tomllib.loads(path.read_text()).get("pid") == os.getpid():
            path.unlink()
    except (OSError, tomllib.TOMLDecodeError):
        pass
