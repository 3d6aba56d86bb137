"""The operator's requests (eagle3ctl pause, resume, retry, exclude, verify --full), answered
through daemon/control.py's request files. Each handler returns the answer for the operator or
raises ValueError with what was wrong with the request.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Callable

from eagle3d.daemon import control
from eagle3d.daemon.stages.verify import forget_failed_spot_check
from eagle3d.statemachine import layout
from eagle3d.statemachine.atomic import atomic_write_bytes
from eagle3d.statemachine.ledger import Ledger

# verify --full's reason, on the `unverified` event of each sample it sends back to verify.
VERIFY_FULL = "eagle3ctl verify --full"


def _ids(args: dict[str, Any]) -> list[str]:
    ids = args.get("ids")
    if not isinstance(ids, list) or not ids or not all(isinstance(i, str) for i in ids):
        raise ValueError("give one or more sample ids")
    return ids


def _known(ledger: Ledger, ids: list[str]) -> list[str]:
    unknown = [i for i in ids if ledger.sample(i) is None]
    if unknown:
        raise ValueError(f"unknown sample ids: {', '.join(unknown[:5])}")
    return ids


def operator_pause(state_root: Path) -> str | None:
    """The operator's pause, its reason and since when, or None. It pauses the daemon, not a
    run: kept in the state root (layout.operator_pause), it holds across run switches."""
    try:
        return layout.operator_pause(state_root).read_text().strip() or None
    except FileNotFoundError:
        return None


def _pause(state_root: Path, why: str) -> None:
    atomic_write_bytes(layout.operator_pause(state_root), f"{why}\n".encode())


def adopt_ledger_pause(ledger: Ledger, state_root: Path) -> None:
    """A pause of a daemon from before pauses outlived runs sits in its run's ledger: moved to
    the state root at start, so that an upgrade does not resume a paused daemon."""
    earlier = ledger.meta("pause")
    if earlier:
        if operator_pause(state_root) is None:
            _pause(state_root, earlier)
        ledger.clear_meta("pause")


def handle(request: control.Request, ledger: Ledger, unblock: Callable[[bool], None],
           state_root: Path) -> str:
    """Apply one request. `unblock(all_failed)` clears what a retry should clear in the stages
    (a trainer's failure only when every failed sample is retried); `state_root`: the configured
    state folder, where a pause lives whatever run is current."""
    args = request.args
    if request.verb == "pause":
        reason = str(args.get("reason") or "no reason given")
        _pause(state_root, f"{reason} (since {time.strftime('%Y-%m-%d %H:%M:%S')})")
        ledger.event("paused", reason)
        return ("paused: no new work is dispatched; in-flight work finishes; the pause holds "
                "across run switches until eagle3ctl resume")
    if request.verb == "resume":
        layout.operator_pause(state_root).unlink(missing_ok=True)
        ledger.event("resumed")
        return "resumed"
    if request.verb == "retry":
        ids = None if args.get("failed") else _known(ledger, _ids(args))
        unblock(ids is None)
        return f"{ledger.retry(ids)} samples back to pending"
    if request.verb == "exclude":
        ids = _ids(args)
        reason = str(args.get("reason") or "").strip()
        if not reason:
            raise ValueError("an exclusion needs --reason")
        _known(ledger, ids)
        return f"{ledger.exclude(ids, reason)} samples excluded: {reason}"
    if request.verb == "verify-full":
        n = ledger.unverify_all(VERIFY_FULL)
        forget_failed_spot_check(ledger)
        ledger.event("verify_full", f"{n} verified samples to verify again")
        return f"{n} verified samples will be verified again"
    raise ValueError(f"unknown verb {request.verb}")
