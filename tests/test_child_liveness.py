"""A child counts as alive only while it shows progress: a real SIGSTOP of the real engine and
of a trainer is shown in status, the child is restarted after its bound, the restart is charged
to the child and no sample is charged an attempt."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from eagle3d.daemon.stages import train
from eagle3d.daemon.stages.train import TrainStage
from eagle3d.statemachine import layout
from eagle3d.statemachine.config_validation import load_config
from eagle3d.statemachine.ledger import Ledger
from eagle3d.statemachine.stages import Decision, Stage
from tests.conftest import venv_bin
from tests.pipeline import DaemonProcess, ctl, status, wait_for


def _continue(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGCONT)
    except ProcessLookupError:
        pass


@pytest.mark.slow
def test_a_stopped_engine_is_shown_silent_restarted_and_no_sample_is_charged(config_factory):
    config = config_factory({"data": {"limit": 40, "max_tokens": 600},
                             "extract": {"batch_tokens": 1024, "max_inflight_tokens": 2048,
                                         "engine_silence_s": 8},
                             "verify": {"spot_checks": 0}})
    with DaemonProcess(config, "--until", "train") as d:
        st = d.status_until(lambda s: s["engine"].get("status") == "ready"
                            and s["samples"]["inflight"] > 0 and s["samples"]["extracted"] >= 1,
                            300, "the engine mid-extraction")
        stopped = st["engine"]["pid"]
        os.killpg(stopped, signal.SIGSTOP)  # alive, and silent: a wedged engine
        try:
            st = d.status_until(lambda s: s["engine"].get("silent"), 60, "the engine shown silent")
            assert st["engine"]["silent"]["child"] == "engine"
            assert time.time() - st["engine"]["silent"]["since"] < 60
            assert "SILENT since" in ctl(config, "status").stdout
            d.status_until(lambda s: s["engine"].get("pid") not in (None, stopped), 120,
                           "a new engine in place of the silent one")
        finally:
            _continue(stopped)
        assert d.wait(600) == 0, d.output()[-4000:]
    st = status(config)
    assert st["samples"]["verified"] == st["samples"]["total"] > 0
    assert st["samples"]["failed"] == 0 and st["engine"]["restarts"] >= 1
    cfg = load_config(config)
    with Ledger(layout.ledger(cfg.paths.state_dir), readonly=True) as ledger:
        assert {s.attempts for s in ledger.samples("verified")} == {1}
        assert not ledger.events_of(("attempt_failed", "failed"))
        assert ledger.events_of(("engine_silent",))


TRAINER = """
import sys, time
from eagle3d.statemachine import train_files
progress = train_files.ProgressWriter(sys.argv[1], "f" * 32, total_steps=10**6)
progress.write(train_files.LOADING)
step = 0
while True:
    step += 1
    progress.write(train_files.TRAINING, step=step)
    time.sleep(0.2)
"""


def test_a_stopped_trainer_is_shown_silent_then_restarted(config_factory, monkeypatch, caplog):
    """The journal says when the restart comes: within its backoff, on the monotonic clock the
    backoff runs on (it said "in -1796560000 s", the wall clock taken from a monotonic time)."""
    cfg = load_config(config_factory({"train": {"silence_s": 3, "max_restarts": 2,
                                                 "stop_grace_s": 2}}))
    cfg.paths.state_dir.mkdir(parents=True)
    monkeypatch.setattr(train, "trainer_argv",
                        lambda cfg, path: [sys.executable, "-c", TRAINER, str(cfg.paths.train_dir)])
    training = Decision(Stage.TRAIN, "test", Stage.TRAIN)
    with Ledger(layout.ledger(cfg.paths.state_dir)) as ledger:
        stage = TrainStage(cfg, ledger, cfg.paths.state_dir, lambda: "f" * 32)
        try:
            stage.step(training)
            first = stage.child.pid
            wait_for(lambda: stage.step(training) or stage.status().get("step", 0) >= 3, 60,
                     "the trainer's first steps")
            os.kill(first, signal.SIGSTOP)
            st = wait_for(lambda: stage.step(training) or stage.status().get("silent"), 30,
                          "the trainer shown silent", poll=0.2)
            assert st["child"] == "trainer" and st["bound_s"] == 3
            assert stage.status()["status"] == "training"
            wait_for(lambda: stage.step(training) or stage.child is None, 30, "the trainer stopped",
                     poll=0.2)
            assert stage.supervisor.restarts == 1 and stage.failure is None
            said = [r.getMessage() for r in caplog.records
                    if r.getMessage().startswith("restarting the trainer")]
            assert len(said) == 1 and 0 <= float(said[0].split(" in ")[-1].split()[0]) <= 2, said
            stage.supervisor.retry_at = 0  # the backoff, elapsed
            wait_for(lambda: stage.step(training) or stage.child is not None, 60,
                     "a new trainer", poll=0.2)
            assert stage.child.pid != first and stage.status()["status"] == "training"
            assert [kind for _, kind, _ in ledger.events_of(("train_silent",))] == ["train_silent"]
        finally:
            _continue(first)
            stage.stop(time.monotonic() + 10)


@pytest.mark.slow
def test_a_wall_clock_step_leaves_statuss_ages_true_after_one_tick(config_factory, tmp_path):
    """NTP steps the wall clock a day ahead while the engine is silent: after one tick,
    `eagle3ctl status` (under the same clock) says how long it has been silent, not a day
    more, and a copy's file being written in the spool is not taken for a stray."""
    from tests.chaos.operator_clock import Clock
    clock = Clock(tmp_path)
    if not clock.lib:
        pytest.skip(clock.why)
    config = config_factory({"data": {"limit": 40, "max_tokens": 600},
                             "extract": {"batch_tokens": 1024, "max_inflight_tokens": 2048,
                                         "engine_silence_s": 40},
                             "verify": {"spot_checks": 0}})
    cfg = load_config(config)
    with DaemonProcess(config, "--until", "train", env=clock.env()) as d:
        st = d.status_until(lambda s: s["engine"].get("status") == "ready"
                            and s["samples"]["inflight"] > 0, 300, "the engine mid-extraction")
        stopped = st["engine"]["pid"]
        copying = cfg.paths.spool_dir / ".a-copy.safetensors.XyZ123"  # rsync's kind of name
        copying.write_bytes(b"being written")
        os.killpg(stopped, signal.SIGSTOP)
        try:
            d.status_until(lambda s: s["engine"].get("silent"), 60, "the engine shown silent")
            clock.step(26 * 3600)
            time.sleep(cfg.extract.rescan_interval_s + 2)  # a tick, and a rescan of the spool
            shown = subprocess.run([venv_bin("eagle3ctl"), "-c", str(config), "status", "--json"],
                                   capture_output=True, text=True,
                                   env={**os.environ, **clock.env()})
            silent = json.loads(shown.stdout)["engine"].get("silent", {})
            text = subprocess.run([venv_bin("eagle3ctl"), "-c", str(config), "status"],
                                  capture_output=True, text=True,
                                  env={**os.environ, **clock.env()}).stdout
        finally:
            _continue(stopped)
        assert re.search(r"SILENT since \d\d:\d\d:\d\d \((\d+s|[0-4]m \d\ds);", text), text
        assert 0 <= silent["age_s"] < 300, silent
        assert copying.exists()
