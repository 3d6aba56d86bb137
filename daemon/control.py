"""Control without a socket: `eagle3ctl` drops a request file into `<state_dir>/control/`, the
daemon applies it at its next tick, records an event and writes an acknowledgement beside it.

A request is accepted only from a file owned by the daemon's user or root, in a folder nobody
else can write: no network listener, and nobody else on the box can steer the pipeline.
"""

from __future__ import annotations

import json
import os
import stat
import time
from pathlib import Path
from typing import Any, Callable, NamedTuple

from eagle3d.statemachine import layout
from eagle3d.statemachine.atomic import atomic_write_bytes

VERBS = ("pause", "resume", "retry", "exclude", "verify-full")


class Request(NamedTuple):
    name: str
    verb: str
    args: dict[str, Any]


def submit(state_dir: Path, verb: str, args: dict[str, Any]) -> str:
    """Drop a request for the daemon; returns its name, for `wait_ack`."""
    name = f"{time.time_ns()}-{os.urandom(4).hex()}"
    atomic_write_bytes(layout.control_dir(state_dir) / f"{name}.request.json",
                       json.dumps({"verb": verb, "args": args, "pid": os.getpid()}).encode(), 0o600)
    return name


def wait_ack(state_dir: Path, name: str, timeout: float) -> dict[str, Any] | None:
    """The daemon's acknowledgement of a request; None (and the request withdrawn, so that a
    daemon starting later does not act on a request nobody waits for) when none came in time."""
    ctl = layout.control_dir(state_dir)
    ack = ctl / f"{name}.ack.json"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if ack.exists():
            try:
                reply = json.loads(ack.read_text())
            except ValueError:
                time.sleep(0.02)
                continue
            ack.unlink(missing_ok=True)
            return reply
        time.sleep(0.05)
    (ctl / f"{name}.request.json").unlink(missing_ok=True)
    return None


def send(state_dir: Path, verb: str, args: dict[str, Any], timeout: float) -> dict[str, Any] | None:
    return wait_ack(state_dir, submit(state_dir, verb, args), timeout)


def pending(state_dir: Path) -> list[Request | tuple[str, str]]:
    """Requests waiting, oldest first; a malformed or foreign one comes back as (name, problem)."""
    out: list[Request | tuple[str, str]] = []
    ctl = layout.control_dir(state_dir)
    try:
        names = sorted(p.name for p in ctl.iterdir() if p.name.endswith(".request.json"))
    except FileNotFoundError:
        return out
    me = os.geteuid()
    for fname in names:
        name = fname[:-len(".request.json")]
        path = ctl / fname
        try:
            st = os.lstat(path)
            if not stat.S_ISREG(st.st_mode) or st.st_uid not in (me, 0):
                raise ValueError(f"refused: owned by uid {st.st_uid}, not the daemon's user")
            raw = json.loads(path.read_text())
            verb, args = raw.get("verb"), raw.get("args", {})
            if verb not in VERBS:
                raise ValueError(f"unknown verb {verb!r} (known: {', '.join(VERBS)})")
            if not isinstance(args, dict):
                raise ValueError("args must be an object")
            out.append(Request(name, verb, args))
        except (OSError, ValueError, AttributeError) as exc:
            out.append((name, str(exc)))
    return out


def acknowledge(state_dir: Path, name: str, ok: bool, message: str) -> None:
    ctl = layout.control_dir(state_dir)
    atomic_write_bytes(ctl / f"{name}.ack.json", json.dumps({"ok": ok, "message": message}).encode(),
                       0o600)
    (ctl / f"{name}.request.json").unlink(missing_ok=True)


def refuse_all(state_dir: Path, why: str) -> None:
    """Answer every waiting request with `why`, nothing done: a request eagle3ctl dropped into
    a run's folder that the daemon no longer applies requests from (a switch sets it aside)."""
    for req in pending(state_dir):
        acknowledge(state_dir, req[0], False, why if isinstance(req, Request) else req[1])


def apply_all(state_dir: Path, handler: Callable[[Request], str]) -> None:
    """Apply each waiting request through `handler` (returns the message; raises ValueError for
    a request it refuses) and acknowledge it."""
    for req in pending(state_dir):
        if not isinstance(req, Request):
            acknowledge(state_dir, req[0], False, req[1])
            continue
        try:
            acknowledge(state_dir, req.name, True, handler(req))
        except ValueError as exc:
            acknowledge(state_dir, req.name, False, str(exc))
