"""Training checkpoints: `checkpoints/step-NNNNNNNN/state.pt`, written into a temp folder and
renamed, so a kill at any moment leaves only whole checkpoints. The last KEEP are kept."""

from __future__ import annotations

import logging
import os
import pickle
import re
import shutil
from pathlib import Path
from typing import Any

import torch

from eagle3d.statemachine.atomic import fsync_dir
from eagle3d.statemachine.config_schema import TrainConfig

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
    """The whole checkpoints, oldest written first: by when, not by step, since a training that
    starts over (a grown manifest) writes low steps beside the old manifest's higher ones."""
    found = [p for p in folder.iterdir() if _NAME.fullmatch(p.name) and (p / "state.pt").exists()]
    return sorted(found, key=lambda p: ((p / "state.pt").stat().st_mtime_ns, p.name))


def schedule(train: TrainConfig) -> dict[str, Any]:
    """The [train] settings a checkpoint's step and batch position count in: the epochs'
    batches (batch_tokens, seed, epochs) and what each step unrolls (ttt_steps). Resumed under
    others, samples would be trained twice or not at all. Saved in each checkpoint."""
    return {k: getattr(train, k) for k in ("batch_tokens", "epochs", "seed", "ttt_steps")}


def latest(folder: Path, fingerprint: str, samples: int, draft_config: dict[str, Any],
           model_state: dict[str, torch.Tensor],
           train: TrainConfig) -> tuple[dict[str, Any] | None, str | None]:
    """The newest checkpoint made from this manifest (`fingerprint`, of `samples` samples) for a
    drafter of this shape, under `train`'s schedule, holding the weights `model_state` names, at
    its sizes (the model's own layout), and None; or None and why training starts over from
    step 0 where there is a checkpoint it cannot resume (None where there is none). A checkpoint
    of another manifest, shape (the [train] keys that size the drafter changed) or schedule, or
    made by a version of eagle3d that laid the weights out otherwise or recorded no schedule,
    is not resumed: training starts over, and says so."""
    folder = Path(folder)
    complete = _complete(folder) if folder.is_dir() else []
    if not complete:
        return None, None
    path = complete[-1]
    try:
        # Tensors and plain values only: a full unpickle would run whatever code the file names,
        # as the trainer's user.
        state = torch.load(path / "state.pt", map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        return _starting_over(path, "the checkpoint holds more than tensors and plain values, "
                              f"so it is not loaded ({str(exc).splitlines()[0]})")
    if state.get("manifest_fingerprint") != fingerprint:
        return _starting_over(path, _manifest_change(state.get("samples"), samples))
    for key, what, now in (("draft_config", "for a drafter of another shape", draft_config),
                           ("schedule", "under other [train] settings", schedule(train))):
        if state.get(key) != now:
            return _starting_over(path, f"the checkpoint was made {what} ({state.get(key)}, "
                                  f"now {now})")
    held, weights = ({name: t.shape for name, t in tensors.items()}
                     for tensors in (state["model"], model_state))
    if held != weights:
        return _starting_over(path, "the checkpoint lays the drafter's weights out otherwise "
                              f"(an earlier eagle3d: {sorted(set(held) - set(weights))}, now "
                              f"{sorted(set(weights) - set(held))})")
    return state, None


def _manifest_change(held: int | None, now: int) -> str:
    """Why a checkpoint of another manifest is not resumed, in the operator's terms: the
    draft vocabulary and the batches are the new manifest's."""
    if held is None:  # a checkpoint of an eagle3d that did not record its manifest's size
        return "the checkpoint was made from another dataset manifest"
    if now > held:
        return f"the manifest grew from {held} to {now} samples (a raised [data] limit)"
    return f"the dataset's manifest changed ({held} samples, now {now})"


def _starting_over(path: Path, why: str) -> tuple[None, str]:
    log.warning("checkpoint %s: %s; starting over", path, why)
    return None, why
