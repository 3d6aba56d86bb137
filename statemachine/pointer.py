"""The running daemon's pointer: which daemon runs for an editable config, with which config in
force and state folder. Written by the daemon at start, removed at its stop; read by
`eagle3ctl`, so that an edit to the file's [paths] (refused until a restart) never makes the
running daemon look gone; and, while the state disk cannot be written, the daemon's heartbeat
(say_stale). The file's place is layout.daemon_pointer's."""

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


def write(config: Path, state_dir: Path, roots: dict[str, Path]) -> Path | None:
    """Say that this process is the daemon of `config`, holding its config in force in
    `state_dir`, and the configured [paths] `roots` its runs live under (check-config judges an
    edit against them, as a reload does); returns the pointer's path, None where it cannot be
    written (the daemon runs on: eagle3ctl then finds it through the file's own [paths], as
    before pointers)."""
    import tomli_w  # only the daemon writes it; eagle3ctl must start in a blink
    path = layout.daemon_pointer(config)
    doc = {"pid": os.getpid(), "config": str(Path(config).resolve()),
           "state_dir": str(state_dir), "in_force": str(layout.config_in_force(state_dir)),
           "roots": {key: str(root) for key, root in roots.items()}}
    try:
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        if not _trusted(path.parent):
            raise PermissionError(0, "the folder is not the daemon's own")
        atomic_write_bytes(path, tomli_w.dumps(doc).encode())
    except OSError as exc:
        import logging  # the daemon's, here: eagle3ctl, which only reads, must start in a blink
        logging.getLogger("eagle3d").warning(
            "cannot write the daemon's pointer %s (%s): eagle3ctl finds this daemon only while "
            "the config's [paths] are the ones it runs with", path, exc.strerror)
        return None
    return path


def _trusted(folder: Path) -> bool:
    """A pointer says which config eagle3ctl shows and sends requests for: only from a folder
    that no one else could have filled (a fallback under /tmp may be another user's)."""
    st = folder.lstat()
    return not st.st_mode & 0o022 and (st.st_uid in (os.getuid(), 0) or
                                       folder.parent == Path("/run"))


def read(config: Path) -> dict[str, Any] | None:
    """The pointer of the daemon running for `config`, or None (none, or its process is gone)."""
    path = layout.daemon_pointer(config)
    try:
        if not _trusted(path.parent):
            return None
        doc = tomllib.loads(path.read_text())
        pid = int(doc["pid"])
    except (OSError, ValueError, KeyError, TypeError, tomllib.TOMLDecodeError):
        return None
    try:
        os.kill(pid, 0)
    except PermissionError:  # another user's process: alive
        return doc
    except OSError:
        return None
    return doc


def say_stale(config: Path, stale: dict[str, Any] | None) -> None:
    """While the state file cannot be written (its disk read-only or full), the daemon's
    heartbeat and why, in its pointer: the runtime folder lies off the state disk, so that
    status shows a live daemon with a stale state rather than a dead one (a hung daemon's
    heartbeat here ages as its state file's would). None: the state file is written again.
    Raises OSError where the pointer cannot be rewritten; a pointer not this process's is left."""
    import tomli_w
    path = layout.daemon_pointer(config)
    doc = tomllib.loads(path.read_text())
    if doc.get("pid") != os.getpid():
        return
    doc.pop("stale_state", None)
    if stale is not None:
        doc["stale_state"] = stale
    atomic_write_bytes(path, tomli_w.dumps(doc).encode(), durable=False)  # rewritten each second


def remove(config: Path) -> None:
    """At the daemon's stop: its pointer only (a newer daemon may have written its own)."""
    path = layout.daemon_pointer(config)
    try:
        if tomllib.loads(path.read_text()).get("pid") == os.getpid():
            path.unlink()
    except (OSError, tomllib.TOMLDecodeError):
        pass
