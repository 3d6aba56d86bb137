"""The files through which training talks to the daemon, both ends of each: `progress.json`
(the trainer writes, the daemon and eagle3ctl read), `refusal.json` (a refusing trainer rank
writes, the daemon reads), `eval.json` (the evaluation writes, the daemon reads) and
`done.json` (the daemon's marker tying the drafter to its manifest).

Every file is replaced atomically, so a reader sees a whole file or none; a missing or damaged
one reads as None, never as an exception.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from eagle3d.statemachine import digests, layout
from eagle3d.statemachine.atomic import atomic_write_bytes

# progress.json's `status`, in the order a run goes through them. "starting" is the wait for
# the first step's figures: on CUDA, torch.compile building the fused kernels (a minute or more
# from an empty compile cache), which would otherwise read as a trainer stuck at step 0.
LOADING, STARTING, TRAINING, EXPORTING, DONE = "loading", "starting", "training", "exporting", \
    "done"
TRAINS = (LOADING, STARTING, TRAINING)  # before the export

# progress.json's `data_wait`: the share of the trainer's recent time spent waiting for batches
# from the dataset. Past this share the reader, not the GPU, sets the pace: the trainer's log
# says so once and `eagle3ctl status` shows it.
READER_LIMIT = 0.10


def _read(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_bytes())
        return data if isinstance(data, dict) else None
    except (OSError, ValueError):
        return None


def _write(path: Path, doc: dict[str, Any]) -> None:
    atomic_write_bytes(path, json.dumps(doc).encode())


class ProgressWriter:
    """The trainer's end of `progress.json`, rewritten at most once a second (and at every
    change of status); `since` is the wall-clock time the status began; `started_over` why
    the training began at step 0 beside a checkpoint it could not resume, or None."""

    def __init__(self, train_dir: Path, fingerprint: str, total_steps: int = 0) -> None:
        self.path, self.fingerprint, self.total_steps = layout.progress_file(train_dir), \
            fingerprint, total_steps
        self.last_write, self.status, self.since = 0.0, "", 0.0
        self.started_over: str | None = None

    def write(self, status: str, force: bool = True, **fields: Any) -> None:
        now = time.monotonic()
        if status != self.status:
            self.status, self.since, force = status, time.time(), True
        if not force and now - self.last_write < 1.0:
            return
        self.last_write = now
        _write(self.path, {"status": status, "since": self.since, "step": 0,
                           "total_steps": self.total_steps, "epoch": 0, "loss": None, "acc": [],
                           "tokens_per_s": 0.0, "eta_s": None,
                           "manifest_fingerprint": self.fingerprint,
                           "started_over": self.started_over, **fields})


def read_progress(train_dir: Path) -> dict[str, Any]:
    """The daemon's end: the last progress written, or {} before the first."""
    return _read(layout.progress_file(train_dir)) or {}


def trained_for(train_dir: Path, fingerprint: str) -> bool:
    """Training of this manifest finished and its export is complete."""
    progress = read_progress(train_dir)
    return (progress.get("status") == DONE and progress.get("manifest_fingerprint") == fingerprint
            and (layout.export_dir(train_dir) / "config.json").exists())


@dataclass(frozen=True)
class Refused:
    """A trainer's refusal: its exit code (statemachine/entry.py), the reason it logged and the
    samples it names (entry.DATASET_CHANGED: their files are not what verify passed)."""
    code: int
    reason: str
    samples: tuple[str, ...] = ()


# torchrun exits 1 whatever code its workers exit with, so a refusal cannot reach the daemon
# through the exit code: the refusing rank writes it down here, in the one folder that the
# daemon and node 0's ranks share, and the daemon clears it before each start.
def write_refusal(train_dir: Path, refused: Refused) -> None:
    """The trainer's end (every rank that refuses: which one does depends on the check)."""
    Path(train_dir).mkdir(parents=True, exist_ok=True)
    _write(layout.refusal_file(train_dir), {"code": refused.code, "reason": refused.reason,
                                            "samples": list(refused.samples)})


def read_refusal(train_dir: Path) -> Refused | None:
    """The daemon's end, once the trainer has exited: its refusal, or None."""
    doc = _read(layout.refusal_file(train_dir))
    if doc is None or not isinstance(doc.get("code"), int):
        return None
    samples = doc.get("samples")
    return Refused(doc["code"], str(doc.get("reason", "")),
                   tuple(s for s in samples if isinstance(s, str))
                   if isinstance(samples, list) else ())


def clear_refusal(train_dir: Path) -> None:
    """Before a trainer starts: only its own refusal may count."""
    layout.refusal_file(train_dir).unlink(missing_ok=True)


def write_eval(path: Path, report: dict[str, Any]) -> None:
    """The evaluation's end of `eval.json` (or of any `--out` file an operator names)."""
    atomic_write_bytes(path, json.dumps(report, indent=2).encode())


def read_eval(train_dir: Path) -> dict[str, Any] | None:
    """The evaluation's result, or None when there is none (or it holds no measurement)."""
    result = _read(layout.eval_file(train_dir))
    return result if result and "acceptance_length" in result else None


def write_done(train_dir: Path, fingerprint: str, result: dict[str, Any], train_key: str,
               eval_key: str) -> None:
    _write(layout.done_file(train_dir), {
        "manifest_fingerprint": fingerprint, "export": str(layout.export_dir(train_dir)),
        "train_key": train_key, "eval_key": eval_key,
        "acceptance_length": result.get("acceptance_length"),
        "identical_to_greedy": result.get("identical_to_greedy"), "finished": time.time()})


def read_done(train_dir: Path) -> dict[str, Any] | None:
    """The done marker: the drafter's export and its acceptance length, or None."""
    return _read(layout.done_file(train_dir))


def done_for(train_dir: Path, fingerprint: str | None, eval_key: str) -> bool:
    """The drafter of this manifest is trained, exported and evaluated with these [eval]
    settings (a marker written before they were recorded stands for any)."""
    done = read_done(train_dir)
    return bool(done and fingerprint and done.get("manifest_fingerprint") == fingerprint
                and done.get("eval_key", eval_key) == eval_key)


# ---- drafter versions: one per [train] settings key -----------------------------------------

# [train] settings that say where or how fast training runs, not what drafter it makes.
_RUNNING_ONLY = ("nproc", "nnodes", "node_rank", "rendezvous", "device", "checkpoint_every",
                 "max_restarts", "stop_grace_s", "silence_s", "threads", "report_to")


def _key(section: Any, skip: tuple[str, ...]) -> str:
    values = {k: v for k, v in section._asdict().items()
              if k not in skip and not isinstance(v, Path)}
    return digests.json_digest(values, digests.KEY_SIZE)


def train_key(cfg: Any) -> str:
    """The short key of the [train] settings that shape the drafter: a change trains another."""
    return _key(cfg.train, _RUNNING_ONLY)


def eval_key(cfg: Any) -> str:
    """The key of the [eval] settings that shape the measurement: a change evaluates again."""
    return _key(cfg.eval, ("batch_size",))


def _version_parts(train_dir: Path) -> list[Path]:
    """The train folder's files that belong to one drafter (the compile cache is shared)."""
    return [f(train_dir) for f in (layout.progress_file, layout.eval_file, layout.done_file,
                                   layout.refusal_file, layout.export_dir, layout.checkpoint_dir,
                                   layout.metrics_file, layout.metrics_plot, layout.tensorboard_dir,
                                   layout.vocab_file)]


def switch_version(train_dir: Path, held: str, wanted: str) -> bool:
    """Set the drafter of settings `held` aside in its version folder, never over anything, and
    bring back the one of `wanted` where there is one (True: it was there)."""
    import os
    aside = layout.versions_dir(train_dir) / held
    aside.mkdir(parents=True, exist_ok=True)
    for part in _version_parts(Path(train_dir)):
        if part.exists() and not (aside / part.name).exists():
            os.replace(part, aside / part.name)
    back = layout.versions_dir(train_dir) / wanted
    if not back.is_dir():
        return False
    for part in _version_parts(Path(train_dir)):
        if (back / part.name).exists():
            os.replace(back / part.name, part)
    back.rmdir()
    return True


def versions(train_dir: Path) -> list[dict[str, Any]]:
    """The drafters set aside: key, acceptance length (None where never evaluated), folder."""
    try:
        folders = sorted(layout.versions_dir(train_dir).iterdir())
    except OSError:
        return []
    return [{"key": f.name, "path": str(f),
             "acceptance_length": (read_eval(f) or {}).get("acceptance_length")}
            for f in folders if f.is_dir()]
