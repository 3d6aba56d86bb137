"""Training checkpoints: `checkpoints/step-NNNNNNNN/state.pt`, written into a temp folder and
renamed, so a kill at any moment leaves only whole checkpoints. The last KEEP are kept."""

from __future__ import annotations

import os
import logging
import re
import shutil
from pathlib import Path
from typing import Any

import torch

from eagle3d.statemachine.atomic import fsync_dir

log = logging.getLogger("eagle3d.trainer")

KEEP = 2
_NAME = re.compile(r"step-(\d{8})")


def save(folder: Path, step: int, state: dict[str, Any]) -> Path:
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    final = folder / f"step-{step:08d}"
    for stale in folder.glob(".step-*.tmp"):  # left by a killed run; one trainer writes here
        shutil.rmtree(stale, ignore_errors=True)
    tmp = folder / f".step-{step:08d}.{os.getpid()}.tmp"
    tmp.mkdir()
    with open(tmp / "state.pt", "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    shutil.rmtree(final, ignore_errors=True)
    os.rename(tmp, final)
    fsync_dir(folder)
    for old in _complete(folder)[:-KEEP]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def _complete(folder: Path) -> list[Path]:
    found = [p for p in folder.iterdir() if _NAME.fullmatch(p.name) and (p / "state.pt").exists()]
    return sorted(found, key=lambda p: p.name)


def latest(folder: Path, fingerprint: str, draft_config: dict[str, Any],
           model_state: dict[str, torch.Tensor]) -> dict[str, Any] | None:
    """The newest checkpoint made from this manifest for a drafter of this shape, holding the
    weights `model_state` names, at its sizes (the model's own layout), or None. A checkpoint of
    another manifest or shape (the [train] keys that size the drafter changed) or made by a
    version of eagle3d that laid the weights out otherwise is not resumed: training starts
    over, and says so."""
    folder = Path(folder)
    complete = _complete(folder) if folder.is_dir() else []
    if not complete:
        return None
    path = complete[-1]
    state = torch.load(path / "state.pt", map_location="cpu", weights_only=False)
    if state.get("manifest_fingerprint") != fingerprint:
        log.warning("checkpoint %s was made from another dataset manifest (%s, now %s); "
                    "starting over", path, state.get("manifest_fingerprint"), fingerprint)
        return None
    if state.get("draft_config") != draft_config:
        log.warning("checkpoint %s holds a drafter of another shape (%s, now %s); starting "
                    "over", path, state.get("draft_config"), draft_config)
        return None
    held, weights = ({name: t.shape for name, t in tensors.items()}
                     for tensors in (state["model"], model_state))
    if held != weights:
        log.warning("checkpoint %s lays the drafter's weights out otherwise (an earlier "
                    "eagle3d: %s, now %s); starting over", path, sorted(set(held) - set(weights)),
                    sorted(set(weights) - set(held)))
        return None
    return state
