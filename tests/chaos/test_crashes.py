"""kill -9 at seeded random moments through plan, extract, verify, train, export and evaluation,
with the engine and a trainer rank killed, every disk filled and the config edited under load on
the way: at the end nothing is lost or doubled, every file verifies, nothing is left behind, and
every life of training resumed from the checkpoints of the one before.

One campaign over one dataset, because each daemon life in extract pays a model load: the
faults are episodes of the same run, each named in the failure it causes. Every wait is on a fact
of the life at hand (its pid, its children, its trainer's writes): a killed life leaves its
state.toml, pid files and progress.json behind, and waiting on those kills the next life before
it has done anything.
"""

from __future__ import annotations

import collections
import os
import random
import re
import signal
import time
from pathlib import Path

import pytest

from eagle3d.daemon import control
from eagle3d.statemachine.config_validation import load_config
from eagle3d.statemachine.ledger import Ledger
from tests.chaos.figures import SCALE, SEED
from tests.chaos.harness import (audit, chaos_config, counts, describe, end, events_after, kill9,
                                  last_event, life_child, life_state, orphans_after_kill,
                                  rank_processes, trainer_progress, until)
from tests.pipeline import DaemonProcess, edit_config, fill_file_system

# A guard against a hang only (every wait has its own limit and message): the campaign's lives
# grow with SCALE, and one life costs a model load, which on a busy 2-core machine is minutes.
pytestmark = [pytest.mark.slow, pytest.mark.chaos, pytest.mark.timeout(2400 * SCALE)]

RESUMED = re.compile(r"resuming at step (\d+)")


class Campaign:
    def __init__(self, config: Path, rng: random.Random, figures) -> None:
        self.config = config
        self.cfg = load_config(config)
        self.rng = rng
        self.figures = figures
        self.lives: list[DaemonProcess] = []
        self.train_lives: list[DaemonProcess] = []  # lives that ran a trainer, in order
        self.orphans: list[str] = []
        self.faults = 0
        self.done_kinds: collections.Counter[str] = collections.Counter()
        self.lost: int | None = None  # measured by the audit, once it has run

    def start(self, *args: str) -> DaemonProcess:
        d = DaemonProcess(self.config, *args)
        self.lives.append(d)
        return d

    def kill(self, d: DaemonProcess, moment: str) -> None:
        kill9(d)
        self.injected(f"daemon killed in {moment}")
        left = orphans_after_kill(self.config)
        if left:
            self.orphans.append(f"after kill -9 of the daemon in {moment}: {describe(left)}")
            end(left)

    def injected(self, what: str, crash: bool = True) -> None:
        self.done_kinds[what] += 1
        self.faults += 1
        self.figures.crashes += crash

    def done(self) -> int:
        c = counts(self.cfg)
        return c.get("extracted", 0) + c.get("verified", 0)

    def training_step(self, d: DaemonProcess) -> int:
        """The step this life's running trainer has reached (0: none is training yet)."""
        p = trainer_progress(self.cfg, d)
        return p.get("step", 0) if p.get("status") == "training" else 0

    def stage_in(self, d: DaemonProcess, *stages: str) -> str | None:
        """This life's stage (underneath a pause), when it is one of `stages`."""
        stage = life_state(self.cfg, d).get("underlying")
        return stage if stage in stages else None

    def resumes(self) -> list[list[int]]:
        """Per life that trained, the steps its trainers resumed at."""
        return [[int(s) for s in RESUMED.findall(d.output())] for d in self.train_lives]

    def summary(self) -> str:
        """What the campaign did, for the figures: printed whether it passed or not."""
        did = ", ".join(f"{n} x {what}" for what, n in self.done_kinds.items())
        audit = "its audit did not run" if self.lost is None else \
            f"its audit: {self.lost} samples lost"
        return f"campaign: {did or 'nothing'}; training resumed at {self.resumes()}; {audit}"

    # ---- the episodes -------------------------------------------------------------------------

    def kill_in_plan(self) -> None:
        """The planner's model load is most of its life (the plan of a few hundred tiny
        conversations takes well under a second): the kill lands in either."""
        d = self.start()
        until(d, lambda: life_child(self.cfg, d, "planner")
              or self.stage_in(d, "extract", "verify", "train", "done"),
              120, "this life's planner")
        time.sleep(self.rng.uniform(0.0, 1.5))
        self.kill(d, "plan")

    def kill_in_extract(self, data_fs: Path, faults: bool) -> None:
        d = self.start()
        base = self.done()
        until(d, lambda: self.done() > base, 300, "extraction to start")
        if faults:
            self.dataset_full(d, data_fs)
            self.engine_killed(d)
            self.config_edited(d, "extract", "batch_tokens", 192)
        mark = self.done()
        until(d, lambda: self.done() > mark or not counts(self.cfg).get("pending"), 300,
              "more extraction")
        time.sleep(self.rng.uniform(0.0, 0.5))
        self.kill(d, "extract")

    def engine_killed(self, d: DaemonProcess) -> None:
        engine = until(d, lambda: life_child(self.cfg, d, "engine"), 120, "this life's engine")
        os.killpg(engine.pid, signal.SIGKILL)
        self.injected("engine killed mid-batch")
        mark = self.done()
        until(d, lambda: self.done() > mark, 300, "extraction after the engine was killed")

    def dataset_full(self, d: DaemonProcess, data_fs: Path) -> None:
        ballast = fill_file_system(data_fs)
        until(d, lambda: life_state(self.cfg, d).get("stage") == "paused", 60,
              "a pause for the full dataset disk")
        ballast.unlink()
        self.injected("dataset disk filled in ingest", crash=False)
        until(d, lambda: life_state(self.cfg, d).get("stage") == "extract", 60,
              "the end of the pause")

    def config_edited(self, d: DaemonProcess, section: str, key: str, value: object) -> None:
        """An accepted edit and SIGHUP (`systemctl reload`) while the stage is busy."""
        mark = last_event(self.cfg)
        edit_config(self.config, section, **{key: value})
        d.proc.send_signal(signal.SIGHUP)
        said = until(d, lambda: [k for _, k, _ in events_after(self.cfg, mark)
                                 if k.startswith("reload")], 60, "the reload")
        assert said == ["reloaded"], f"[{section}] {key} = {value!r} was not taken: {said}"
        self.injected(f"config edited under load ([{section}] {key})", crash=False)

    def kill_in_verify(self) -> None:
        """A verify pass over a few small files lasts well under a second: the life before
        stops at the door of verify (`--until verify`), or the operator asks for a full pass,
        so that this life starts inside it."""
        c = counts(self.cfg)
        if c.get("pending") or c.get("inflight"):
            # The rest of extraction: a busy 2-core machine took 6 s a sample at scale 10.
            d = self.start("--until", "verify")
            left = c.get("pending") + c.get("inflight")
            assert d.wait(300 + 15 * left) == 0, d.output()[-4000:]
        elif not c.get("extracted"):
            control.submit(self.cfg.paths.state_dir, "verify-full", {})
        d = self.start()
        # The ledger already says "extracted" before this life has read a line: its own
        # state.toml says when it is in verify (or past it, when the pass was quicker).
        stage = until(d, lambda: self.stage_in(d, "verify", "train", "done"), 120,
                      "this life's verify stage", poll=0.02)
        if stage == "verify":
            time.sleep(self.rng.uniform(0.0, 0.3))
        self.kill(d, stage)

    def kill_in_train(self) -> None:
        """Killed once this life's trainer has passed a checkpoint of its own, so that the
        next life has something new to resume from."""
        d = self.start()
        self.train_lives.append(d)
        first = until(d, lambda: self.training_step(d), 300, "this life's trainer to train")
        every = self.cfg.train.checkpoint_every
        until(d, lambda: self.training_step(d) >= first + every, 300,
              f"this life's trainer past step {first + every - 1}")
        time.sleep(self.rng.uniform(0.0, 0.3))
        self.kill(d, "train")

    def trainer_faults(self, train_fs: Path) -> DaemonProcess:
        """A life whose trainer loses a rank, then its checkpoint disk, and goes on; the life
        is killed in the export that ends training."""
        d = self.start()
        self.train_lives.append(d)
        until(d, lambda: self.training_step(d), 300, "this life's trainer to train")
        self.config_edited(d, "train", "max_restarts", 12)
        self.rank_killed(d)
        self.checkpoint_disk_full(d, train_fs)
        # The export lasts a second or two; a poll this fast lands in it, and the kill is
        # named after where it did land.
        moment = until(d, lambda: self.export_moment(d), 900, "the export", poll=0.02)
        self.kill(d, moment)
        return d

    def export_moment(self, d: DaemonProcess) -> str | None:
        status = trainer_progress(self.cfg, d).get("status")
        if status in ("exporting", "done"):
            return f"export (trainer {status})"
        return "evaluation" if life_child(self.cfg, d, "evaluate") else None

    def rank_killed(self, d: DaemonProcess) -> None:
        trainer = life_child(self.cfg, d, "trainer")
        ranks = until(d, lambda: rank_processes(trainer.pid), 60, "the trainer ranks")
        ranks[-1].send_signal(signal.SIGKILL)
        self.injected("trainer rank killed mid-step")
        until(d, lambda: life_state(self.cfg, d).get("trainer", {}).get("restarts", 0) >= 1, 120,
              "the trainer restart after a rank was killed")
        until(d, lambda: self.training_step(d), 300, "training to go on after a rank was killed")

    def checkpoint_disk_full(self, d: DaemonProcess, train_fs: Path) -> None:
        restarts = life_state(self.cfg, d).get("trainer", {}).get("restarts", 0)
        ballast = fill_file_system(train_fs)
        until(d, lambda: life_state(self.cfg, d).get("trainer", {}).get("restarts", 0)
              > restarts, 300, "the trainer to stop on a full checkpoint disk")
        ballast.unlink()
        self.injected("checkpoint disk filled", crash=False)
        until(d, lambda: self.training_step(d), 300,
              "training to go on after the checkpoint disk was freed")

    def kill_in_evaluation(self) -> None:
        d = self.start()
        until(d, lambda: life_child(self.cfg, d, "evaluate"), 600, "this life's evaluation")
        time.sleep(self.rng.uniform(0.0, 5.0))
        self.kill(d, "evaluation")

    def run(self, data_fs: Path, train_fs: Path) -> None:
        for _ in range(SCALE):
            self.kill_in_plan()
        for i in range(SCALE):
            self.kill_in_extract(data_fs, faults=i == 0)
        for _ in range(SCALE):
            self.kill_in_verify()
        for _ in range(SCALE):
            self.kill_in_train()
        self.trainer_faults(train_fs)
        self.kill_in_evaluation()
        self.finish()

    def check(self) -> None:
        resumes = self.resumes()
        flat = [s for life in resumes for s in life]
        # Every life after the first resumed, never from before a checkpoint the one before made.
        assert all(resumes[1:]) and flat == sorted(flat) and \
            min(flat) >= self.cfg.train.checkpoint_every, \
            f"training did not resume from its checkpoints: {resumes}"
        final = counts(self.cfg)
        assert final.get("failed", 0) == 0, f"samples failed on the way: {final}"

    def finish(self) -> None:
        d = self.start("--until", "done")
        code = d.wait(900)
        assert code == 0, f"the last life failed:\n{d.output()[-4000:]}"
        with Ledger(self.cfg.paths.state_dir / "ledger.sqlite", readonly=True) as ledger:
            events = [(kind, detail) for _, kind, _, detail in ledger.recent_events(100_000)]
        restarts = [detail for kind, detail in events if kind == "train_restart"]
        # The operator's history (`eagle3ctl events`) tells of both trainer failures, counted
        # against the limit the reload set, and of the end.
        assert len(restarts) >= 2 and all("of 12)" in r for r in restarts), restarts
        assert ("drafter_done" in [kind for kind, _ in events]), events[-20:]


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
        # Two ranks make the rank kill a real partial failure and every resume a DDP resume.
        # Steps: each train life is killed a checkpoint and a step or two past where it resumed
        # (10 is ample), and the life that loses a rank and its checkpoint disk resumes twice
        # from its last checkpoint before it trains to the end (20 is ample); a step past those
        # is training that nothing waits for.
        train={"nproc": 2, "epochs": 1000.0, "max_steps": 10 * SCALE + 20})
    c = Campaign(config, rng, figures)
    try:
        c.run(data_fs, train_fs)
        c.check()
        c.lost = figures.audited(audit(config, n, trained=True))
        assert c.lost == 0
        assert not c.orphans, "orphan processes:\n  " + "\n  ".join(c.orphans)
        figures.faults += c.faults
    finally:
        for d in c.lives:
            if d.proc.poll() is None:
                d.proc.kill()
                d.proc.wait()
        figures.notes.append(c.summary())
