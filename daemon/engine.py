"""The daemon's handle on the engine child: the configured engine's spec
(capture/engines/<name>/spec.py) starts it as a child of the daemon. Every engine looks the same
to the reconcile loop (engines.CaptureEngine): submit batches, read events, stop. Events are
hints; the dumps in the spool are the results.
"""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

from eagle3d.capture import engines
from eagle3d.daemon.children import Child
from eagle3d.statemachine.config_schema import Config
from eagle3d.statemachine.ledger import token_ids


def start_engine(cfg: Config, pid_dir: Path, contract: dict[str, Any]) -> engines.CaptureEngine:
    """The extract stage's engine, started; engines.EngineUnavailable where it cannot be."""
    def spawn(argv: list[str], env: dict[str, str] | None, pipes: bool) -> Child:
        pipe = subprocess.PIPE if pipes else None
        return Child("engine", argv, pid_dir, env=env, stdin=pipe, stdout=pipe)
    return engines.get(cfg.target.engine).capture_engine(cfg, contract, spawn)


def plan_batch_item(sid: str, ids: bytes, mask: bytes) -> dict[str, Any]:
    """A sample as the engine protocol carries it, from the ledger's planned tokens."""
    return {"id": sid, "input_ids": token_ids(ids), "loss_mask": list(mask)}
