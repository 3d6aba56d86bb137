"""state.toml: where the pipeline is, for humans and for `eagle3ctl status`.

The ledger is the truth about samples; this file carries what only the daemon knows (stage
reason, rates, children, disk figures, heartbeat). It is replaced atomically, so a reader sees a
whole file or the previous whole file.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

from eagle3d.statemachine import layout
from eagle3d.statemachine.atomic import atomic_write_bytes



def _clean(value: Any) -> Any:
    """TOML has no null: drop None values, recursively."""
    if isinstance(value, dict):
        return {str(k): _clean(v) for k, v in value.items() if v is not None}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value if v is not None]
    return value


# The last table of the file: a reader that finds it knows the file is whole (a torn copy, say
# from a restore or a copy tool, can still parse, with its last tables missing).
_END = "end"


def write_state(state_dir: Path, state: dict[str, Any], path: Path | None = None) -> None:
    """`path`: another copy than the state folder's (a shard's published state)."""
    import tomli_w  # here, not at the top: eagle3ctl only reads, and must start in a blink
    doc = {**_clean(state), _END: {"whole": True}}
    atomic_write_bytes(path or layout.state_file(state_dir), tomli_w.dumps(doc).encode())


def read_state(state_dir: Path, path: Path | None = None
               ) -> tuple[dict[str, Any] | None, str | None]:
    """(state, problem): a missing or damaged file is reported, never raised. `path`: another
    copy than the state folder's."""
    path = path or layout.state_file(state_dir)
    try:
        state = tomllib.loads(path.read_bytes().decode("utf-8"))
        if "stage" not in state or _END not in state:
            return None, f"{path} is incomplete; the daemon rewrites it every few seconds"
        del state[_END]
        return state, None
    except FileNotFoundError:
        return None, f"no {path.name} yet (the daemon has not run with this config)"
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        return None, f"{path} is unreadable ({exc}); the daemon rewrites it every few seconds"
