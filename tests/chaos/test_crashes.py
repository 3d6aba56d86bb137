"""kill -9 at seeded random moments through plan, extract, verify and train, with the engine and
a trainer rank killed and every disk filled on the way: at the end nothing is lost or doubled,
every file verifies, nothing is left behind, and training resumed from its checkpoints.

One campaign over one dataset, because each daemon life in extract pays a model load: the
faults are episodes of the same run, each named in the failure it causes.
"""

from __future__ import annotations

import os
import random
import re
import signal
import time
from pathlib import Path

import pytest

from eagle3d.daemon import control
from eagle3d.statemachine.config import load_config
from eagle3d.statemachine.ledger import Ledger
from tests.chaos.conftest import SCALE, SEED
from tests.chaos.harness import (audit, chaos_config, counts, describe, end, kill9,
                                 orphans_after_kill, progress, rank_processes, state, until)
from tests.pipeline import DaemonProcess, fill_file_system

pytestmark = [pytest.mark.slow, pytest.mark.chaos]




class Campaign:
    def __init__(self, config: Path, rng: random.Random, figures) -> None:
        self.config = config
        self.cfg = load_config(config)
        self.rng = rng
        self.figures = figures
        self.lives: list[DaemonProcess] = []
        self.orphans: list[str] = []
        self.faults = 0

    def start(self, *args: str) -> DaemonProcess:
        d = DaemonProcess(self.config, *args)
        self.lives.append(d)
        return d

    def kill(self, d: DaemonProcess, moment: str) -> None:
        kill9(d)
        self.figures.crashes += 1
        self.faults += 1
        left = orphans_after_kill(self.config)
        if left:
            self.orphans.append(f"after kill -9 of the daemon in {moment}: {describe(left)}")
            end(left)

    def done(self) -> int:
        c = counts(self.cfg)
        return c.get("extracted", 0) + c.get("verified", 0)

    # ---- the episodes -------------------------------------------------------------------------

    def kill_in_plan(self) -> None:
        d = self.start()
        until(d, lambda: (self.cfg.paths.state_dir / "children" / "planner.json").exists()
              or counts(self.cfg).get("pending"), 60, "the planner")
        time.sleep(self.rng.uniform(0.0, 1.5))
        self.kill(d, "plan")

    def kill_in_extract(self, data_fs: Path, faults: bool) -> None:
        d = self.start()
        base = self.done()
        until(d, lambda: self.done() > base, 300, "extraction to start")
        if faults:
            self.dataset_full(d, data_fs)
            self.engine_killed(d)
        mark = self.done()
        until(d, lambda: self.done() > mark or not counts(self.cfg).get("pending"), 300,
              "more extraction")
        time.sleep(self.rng.uniform(0.0, 0.5))
        self.kill(d, "extract")

    def engine_killed(self, d: DaemonProcess) -> None:
        pid = until(d, lambda: state(self.cfg).get("engine", {}).get("pid"), 60, "the engine pid")
        os.killpg(pid, signal.SIGKILL)
        self.figures.crashes += 1
        self.faults += 1
        mark = self.done()
        until(d, lambda: self.done() > mark, 300, "extraction after the engine was killed")

    def dataset_full(self, d: DaemonProcess, data_fs: Path) -> None:
        ballast = fill_file_system(data_fs)
        until(d, lambda: state(self.cfg).get("stage") == "paused", 60,
              "a pause for the full dataset disk")
        ballast.unlink()
        self.faults += 1
        until(d, lambda: state(self.cfg).get("stage") == "extract", 60, "the end of the pause")

    def kill_in_verify(self) -> None:
        """A verify pass over a few small files lasts well under a second: the life before
        stops at the door of verify (`--until verify`), or the operator asks for a full pass,
        so that this life starts inside it."""
        c = counts(self.cfg)
        if c.get("pending") or c.get("inflight"):
            d = self.start("--until", "verify")
            assert d.wait(600) == 0, d.output()[-4000:]
        elif not c.get("extracted"):
            control.submit(self.cfg.paths.state_dir, "verify-full", {})
        d = self.start()
        until(d, lambda: counts(self.cfg).get("extracted") and not counts(self.cfg).get("pending")
              and not counts(self.cfg).get("inflight"), 60, "the verify stage")
        time.sleep(self.rng.uniform(0.0, 0.3))
        self.kill(d, "verify")

    def kill_in_train(self, k: int) -> None:
        d = self.start()
        every = self.cfg.train.checkpoint_every
        until(d, lambda: progress(self.cfg).get("step", 0) > every * (k + 1), 300,
              f"training past step {every * (k + 1)}")
        time.sleep(self.rng.uniform(0.0, 0.3))
        self.kill(d, "train")

    def finish(self, train_fs: Path) -> DaemonProcess:
        """The last life: a trainer rank and the checkpoint disk fail under it, then it runs
        to the end."""
        d = self.start("--until", "done")
        # state.toml and progress.json of the previous life are still there: wait for this one's.
        until(d, lambda: (lambda st: st.get("daemon", {}).get("pid") == d.proc.pid and
                          st.get("trainer", {}).get("pid"))(state(self.cfg)), 300, "the trainer")
        self.rank_killed(d)
        self.checkpoint_disk_full(d, train_fs)
        code = d.wait(900)
        assert code == 0, f"the last life failed:\n{d.output()[-4000:]}"
        with Ledger(self.cfg.paths.state_dir / "ledger.sqlite", readonly=True) as ledger:
            kinds = [kind for _, kind, _, _ in ledger.recent_events(100_000)]
        # The operator's history (`eagle3ctl events`) tells of both trainer failures and the end.
        assert kinds.count("train_restart") >= 2 and "drafter_done" in kinds, kinds[-20:]
        return d

    def rank_killed(self, d: DaemonProcess) -> None:
        trainer = until(d, lambda: (lambda st: st.get("daemon", {}).get("pid") == d.proc.pid and
                                    st.get("trainer", {}).get("pid"))(state(self.cfg)), 60,
                        "the trainer")
        ranks = until(d, lambda: rank_processes(trainer), 60, "the trainer ranks")
        step = progress(self.cfg).get("step", 0)
        ranks[-1].send_signal(signal.SIGKILL)
        self.figures.crashes += 1
        self.faults += 1
        until(d, lambda: state(self.cfg).get("trainer", {}).get("restarts", 0) >= 1, 120,
              "the trainer restart after a rank was killed")
        until(d, lambda: progress(self.cfg).get("step", 0) > step, 300,
              "training to go on after a rank was killed")

    def checkpoint_disk_full(self, d: DaemonProcess, train_fs: Path) -> None:
        restarts = state(self.cfg).get("trainer", {}).get("restarts", 0)
        ballast = fill_file_system(train_fs)
        until(d, lambda: state(self.cfg).get("trainer", {}).get("restarts", 0) > restarts, 300,
              "the trainer to stop on a full checkpoint disk")
        ballast.unlink()
        self.faults += 1
        step = progress(self.cfg).get("step", 0)
        until(d, lambda: progress(self.cfg).get("step", 0) > step, 300,
              "training to go on after the checkpoint disk was freed")


def test_kill_9_at_random_moments_and_full_disks_lose_nothing(config_factory, tmp_path, tmpfs,
                                                              figures):
    rng = random.Random(SEED)
    n = 16 * SCALE
    data_fs, train_fs = tmpfs("data", f"{24 * SCALE}m"), tmpfs("train", "512m")
    config = chaos_config(
        config_factory, tmp_path, n,
        data={"max_tokens": 256},
        paths={"dataset_dir": str(data_fs / "dataset"),
               "train_dir": str(train_fs / "train")},
        budget={"reserve": "1MiB", "spool_max": "64MiB"},
        extract={"batch_tokens": 128, "max_inflight_tokens": 256, "max_attempts": 3},
        # Two ranks make the rank kill a real partial failure, but each trainer start costs
        # them twice the imports on two cores: CI size runs one rank.
        train={"nproc": 2 if SCALE > 1 else 1, "epochs": 1000.0,
               "max_steps": 3 * SCALE + 80})
    c = Campaign(config, rng, figures)
    try:
        for _ in range(SCALE):
            c.kill_in_plan()
        for i in range(SCALE):
            c.kill_in_extract(data_fs, faults=i == 0)
        for _ in range(SCALE):
            c.kill_in_verify()
        for k in range(SCALE):
            c.kill_in_train(k)
        c.finish(train_fs)
    finally:
        for d in c.lives:
            if d.proc.poll() is None:
                d.proc.kill()
                d.proc.wait()
    logs = "\n".join(d.output() for d in c.lives)
    resumed = [int(s) for s in re.findall(r"resuming at step (\d+)", logs)]
    assert len(resumed) >= SCALE and min(resumed) >= c.cfg.train.checkpoint_every, \
        f"training did not resume from its checkpoints: {resumed}"
    final = counts(c.cfg)
    assert final.get("failed", 0) == 0, f"samples failed on the way: {final}"
    lost = audit(config, n, trained=True)
    figures.lost += lost
    assert lost == 0
    assert not c.orphans, "orphan processes:\n  " + "\n  ".join(c.orphans)
    figures.faults += c.faults
