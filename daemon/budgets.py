"""Disk budgets: keep the configured reserve free on the dataset file system, cap the spool,
and hold a reserve of the daemon's own on the state folder's disk.

A budget that is hit stops dispatch with the reason and the figures; nothing is dropped, and
dispatch resumes by itself when space comes back.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path

import psutil

from eagle3d.statemachine import layout
from eagle3d.statemachine.config_schema import Config, human_bytes
from eagle3d.statemachine.runs import Run

log = logging.getLogger("eagle3d")

# What the ledger and the state file need to go on for a while, and to say why they wait.
STATE_RESERVE = 32 * 1024**2


@dataclass(frozen=True)
class Disk:
    role: str
    path: str
    free: int
    total: int


def disks(cfg: Config) -> list[Disk]:
    out = []
    for role in ("dataset_dir", "spool_dir", "train_dir", "state_dir"):
        path = getattr(cfg.paths, role)
        anchor = Path(path)
        while not anchor.exists():
            anchor = anchor.parent
        usage = psutil.disk_usage(str(anchor))
        out.append(Disk(role, str(path), usage.free, usage.total))
    return out


def dataset_pause(cfg: Config, free: int, committed: int) -> str | None:
    """Why dispatch must wait for the dataset disk; `committed` is what in-flight and spooled
    samples will still write there."""
    if free - committed < cfg.budget.reserve:
        return (f"disk budget: the dataset file system has {human_bytes(free)} free, "
                f"{human_bytes(committed)} is on its way, and {human_bytes(cfg.budget.reserve)} must stay "
                "free ([budget] reserve); dispatch resumes when space is freed")
    return None


def projection_pause(cfg: Config, free: int, remaining: int) -> str | None:
    """Refuse to start (or go on) when the rest of the dataset cannot fit."""
    if remaining > free - cfg.budget.reserve:
        return (f"the rest of the dataset is projected at {human_bytes(remaining)}, but the dataset "
                f"file system has {human_bytes(free)} free and {human_bytes(cfg.budget.reserve)} must stay "
                "free ([budget] reserve); free space, lower [budget] reserve or [data] limit, or "
                "point [paths] dataset_dir elsewhere")
    return None


def spool_pause(cfg: Config, spooled: int, free: int, one_batch: int) -> str | None:
    """The spool's own cap, and its file system's free space (a tmpfs shared with others).
    `spooled` counts what waits there and what the engine is writing: checked before each
    dispatch, the spool alone is nearly always empty (ingest drains it within a tick)."""
    if cfg.budget.spool_max < one_batch:
        return (f"spool budget: [budget] spool_max ({human_bytes(cfg.budget.spool_max)}) is "
                f"smaller than one batch of dumps ({human_bytes(one_batch)}); raise spool_max or "
                "lower [extract] batch_tokens")
    if spooled >= cfg.budget.spool_max:
        return (f"spool budget: {human_bytes(spooled)} waits in {cfg.paths.spool_dir}, the cap is "
                f"{human_bytes(cfg.budget.spool_max)} ([budget] spool_max)")
    if free < one_batch:
        return (f"spool budget: the spool's file system has {human_bytes(free)} free, less than "
                f"one batch of dumps ({human_bytes(one_batch)}); dispatch resumes when space "
                "is freed")
    return None


class StateReserve:
    """The state folder's reserve of its own: a file of STATE_RESERVE bytes on its disk. When
    less than that is free besides it (another tenant of the disk filled it, or the ledger
    grew), the daemon gives the reserve up and pauses every stage: the ledger and the state file
    still have room to say why. It takes the reserve back, and goes on, once twice as much is
    free."""

    def __init__(self, state_root: Path) -> None:
        self.state_root = state_root
        self.path = layout.state_reserve(state_root)

    @property
    def held(self) -> bool:
        try:
            return self.path.stat().st_size == STATE_RESERVE
        except FileNotFoundError:
            return False

    def pause(self) -> str | None:
        """Why every stage must wait for the state folder's disk, after giving the reserve up or
        taking it back as its free space says; None while the reserve is held."""
        free = psutil.disk_usage(str(self.state_root)).free
        if self.held:
            if free >= STATE_RESERVE:
                return None
            self.path.unlink()
            log.warning("the state folder's disk has %s free: its reserve of %s given up, "
                        "every stage pauses", human_bytes(free), human_bytes(STATE_RESERVE))
        elif free >= 2 * STATE_RESERVE and self._take():
            return None
        free = psutil.disk_usage(str(self.state_root)).free
        return (f"state disk full: the state folder's file system ({self.state_root}) has "
                f"{human_bytes(free)} free besides the ledger and state file's reserve; the "
                f"pipeline goes on once {human_bytes(2 * STATE_RESERVE)} are free")

    def _take(self) -> bool:
        try:
            fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW, 0o600)
            try:
                os.posix_fallocate(fd, 0, STATE_RESERVE)
            finally:
                os.close(fd)
        except OSError as exc:  # another tenant took the space meanwhile: paused still
            self.path.unlink(missing_ok=True)
            log.warning("cannot take the state folder's reserve back: %s", exc.strerror)
            return False
        return True


def reclaimable(set_aside: list[tuple[Run, int]]) -> str:
    """What a budget's reason adds where runs were set aside: their sizes and the command that
    frees them."""
    listed = ", ".join(f"{run.id} ({human_bytes(size)})" for run, size in set_aside)
    return (f"; runs set aside hold {human_bytes(sum(size for _, size in set_aside))} on it, "
            f"reclaimable with eagle3ctl forget RUN --reason TEXT: {listed}")


def never_met(cfg: Config) -> str | None:
    """A budget no freed space can satisfy: a reserve as large as its file system. A start, a
    reload and `eagle3ctl check-config` all refuse it, where the daemon would pause for good."""
    dataset = disks(cfg)[0]
    if cfg.budget.reserve >= dataset.total:
        return (f"{cfg.path}: [budget] reserve ({human_bytes(cfg.budget.reserve)}) can never stay "
                f"free: the dataset's file system ({dataset.path}) holds "
                f"{human_bytes(dataset.total)} in all")
    return None
