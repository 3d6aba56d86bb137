"""Disk budgets: keep the configured reserve free on the dataset file system and cap the spool.

A budget that is hit stops dispatch with the reason and the figures; nothing is dropped, and
dispatch resumes by itself when space comes back.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import psutil

from eagle3d.statemachine.config import Config, human_bytes
from eagle3d.statemachine.runs import Run


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
