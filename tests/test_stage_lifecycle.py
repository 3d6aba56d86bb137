"""The daemon's whole loop with the operator's requests during training: the in-process engine
of test_extract_stage (counting its starts and the grace of each stop) and small real processes
standing in for the trainer and the evaluation, which write the files the real ones write."""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from eagle3d.daemon import control
from eagle3d.daemon.notify import Notifier
from eagle3d.daemon.reconcile import Daemon
from eagle3d.daemon.stages import train
from eagle3d.statemachine import layout, manifest, stages, train_files
from eagle3d.statemachine.config_schema import Config
from eagle3d.statemachine.config_validation import load_config
from eagle3d.statemachine.ledger import Ledger
from eagle3d.statemachine.stages import Stage
from eagle3d.statemachine.statefile import read_state
from tests.pipeline import ctl, edit_config, switch, wait_for
from tests.test_extract_stage import FakeEngine, plan

GRACE = 7.0

# The trainer: trains for the manifest in force (progress.json names it), exports, and either
# exits or (RUN) keeps going until SIGTERM, when it checkpoints and exits, as drafter/train.py.
TRAINER = """
import pathlib, signal, sys, time
from eagle3d.statemachine import layout, manifest, stages, train_files
dataset, train, log, run = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2]), sys.argv[3], \\
    sys.argv[4] == "run"
note = lambda what: open(log, "a").write(what + "\\n")
def checkpoint(*_):
    time.sleep(float(sys.argv[5]))  # a checkpoint takes its time
    note("checkpoint")
    sys.exit(0)
signal.signal(signal.SIGTERM, checkpoint)
fingerprint = manifest.read(dataset)["fingerprint"]
note("train " + fingerprint)
while run:
    time.sleep(0.05)
layout.export_dir(train).mkdir(parents=True, exist_ok=True)
(layout.export_dir(train) / "config.json").write_text("{}")
train_files.ProgressWriter(train, fingerprint).write(train_files.DONE)
"""

# The evaluation: measures once `go` exists (so the test decides when it ends).
EVALUATE = """
import pathlib, sys, time
from eagle3d.statemachine import layout, train_files
train, log, go = pathlib.Path(sys.argv[1]), sys.argv[2], pathlib.Path(sys.argv[3])
open(log, "a").write("evaluate\\n")
while not go.exists():
    time.sleep(0.05)
train_files.write_eval(layout.eval_file(train), {"acceptance_length": 1.5,
                                                 "identical_to_greedy": True})
"""


class CountingEngine(FakeEngine):
    def __init__(self, *args: Any, stops: list[float]) -> None:
        super().__init__(*args)
        self.stops = stops

    def stop(self, grace: float) -> int:
        self.stops.append(grace)
        return super().stop(grace)


@pytest.fixture
def pipeline(config_factory, tmp_path, monkeypatch):
    cfg = load_config(config_factory({
        "extract": {"max_inflight_samples": 4, "engine_stop_grace_s": GRACE},
        "verify": {"spot_checks": 2}}))
    for folder in (cfg.paths.state_dir, cfg.paths.dataset_dir, cfg.paths.spool_dir):
        folder.mkdir(parents=True, exist_ok=True)
    plan(cfg, 6)
    ledger = Ledger(layout.ledger(cfg.paths.state_dir))
    engines: list[CountingEngine] = []
    stops: list[float] = []
    log = tmp_path / "children.log"

    def factory(cfg: Config, pid_dir: Path, doc: dict[str, Any]) -> CountingEngine:
        engines.append(CountingEngine(doc["fingerprint"], ledger, stops=stops))
        with open(log, "a") as f:
            f.write("engine\n")
        return engines[-1]
    go = tmp_path / "go"

    def children(trainer_runs: bool, checkpoint_s: float = 1.0) -> None:
        monkeypatch.setattr(train, "trainer_argv", lambda cfg, path: [
            sys.executable, "-c", TRAINER, str(cfg.paths.dataset_dir), str(cfg.paths.train_dir),
            str(log), "run" if trainer_runs else "exit", str(checkpoint_s)])
        monkeypatch.setattr(train, "eval_argv", lambda cfg: [
            sys.executable, "-c", EVALUATE, str(cfg.paths.train_dir), str(log), str(go)])
    daemon = Daemon(cfg, engine_factory=factory)
    daemon.recover()
    seen: list[Stage] = []

    def tick_until(predicate, what: str) -> None:
        def once() -> bool:
            daemon.tick()
            seen.append(daemon.decision.stage)
            return predicate()
        wait_for(once, 120, what, poll=0.05)
    lines = lambda: log.read_text().split("\n")[:-1] if log.exists() else []  # noqa: E731
    yield cfg, daemon, engines, stops, children, tick_until, lines, seen, go
    daemon.shutdown()
    ledger.close()


def test_verify_full_during_train_stops_the_trainer_and_starts_no_engine(pipeline):
    """The H200's flap: `eagle3ctl verify --full` during training took the pipeline back to
    verify, which started an SGLang server beside the trainer and killed it a second later, with
    0 s of grace. Now the trainer checkpoints and stops while verify runs, no engine starts (the
    verified set's spot check is on record already), and the trainer resumes after."""
    cfg, daemon, engines, stops, children, tick_until, lines, seen, _ = pipeline
    children(trainer_runs=True)
    tick_until(lambda: any(line.startswith("train") for line in lines()), "the trainer at work")
    assert len(engines) == 1 and stops == [GRACE]  # extract's engine, stopped with its grace

    control.submit(cfg.paths.state_dir, "verify-full", {})
    seen.clear()
    tick_until(lambda: [line.split()[0] for line in lines()] == ["engine", "train", "checkpoint",
                                                                  "train"],
               "the trainer stopped at a checkpoint and started again")
    assert Stage.VERIFY in seen and seen[-1] == Stage.TRAIN
    assert len(engines) == 1, "an engine was started that no sample needed"


def test_an_exclude_during_the_evaluation_trains_again_before_done(pipeline):
    """done.json names the manifest the drafter was trained on: an exclude while the evaluation
    runs must not end in done with the excluded sample trained in."""
    cfg, daemon, engines, stops, children, tick_until, lines, seen, go = pipeline
    children(trainer_runs=False)
    tick_until(lambda: "evaluate" in lines(), "the evaluation")
    before = manifest.read(cfg.paths.dataset_dir)["fingerprint"]
    excluded = manifest.read(cfg.paths.dataset_dir)["samples"][0]["id"]
    control.submit(cfg.paths.state_dir, "exclude", {"ids": [excluded], "reason": "test"})
    daemon.tick()
    go.touch()  # the evaluation ends as the exclude is taken in
    tick_until(lambda: daemon.decision.stage == Stage.DONE, "done")
    after = manifest.read(cfg.paths.dataset_dir)["fingerprint"]
    assert after != before and excluded not in json.dumps(manifest.read(cfg.paths.dataset_dir))
    assert [line for line in lines() if line.startswith("train")] == \
        [f"train {before}", f"train {after}"]
    assert train_files.done_for(cfg.paths.train_dir, after, train_files.eval_key(cfg))


def test_the_spot_checks_engine_waits_for_the_trainers_checkpoint(pipeline):
    """An exclude during training changes the verified set, whose spot check the engine must
    then run: it starts once the trainer has written its checkpoint and left the GPUs, never
    beside it (SGLang at mem_fraction 0.85 beside a trainer ran out of memory)."""
    cfg, daemon, engines, stops, children, tick_until, lines, seen, _ = pipeline
    children(trainer_runs=True)
    tick_until(lambda: any(line.startswith("train") for line in lines()), "the trainer at work")
    excluded = manifest.read(cfg.paths.dataset_dir)["samples"][0]["id"]
    control.submit(cfg.paths.state_dir, "exclude", {"ids": [excluded], "reason": "test"})
    tick_until(lambda: len([line for line in lines() if line.startswith("train")]) == 2,
               "training again on the new manifest")
    assert [line.split()[0] for line in lines()] == ["engine", "train", "checkpoint", "engine",
                                                     "train"]
    assert stops == [GRACE, GRACE]  # each engine stopped with its grace when train came


def test_a_target_switch_during_training_checkpoints_and_switching_back_resumes(pipeline):
    """A reload of another contract while the trainer runs: the trainer stops at a checkpoint,
    the new run starts in its own folders, and the reload back resumes training in the first
    run's train folder, on the same verified set."""
    cfg, daemon, engines, stops, children, tick_until, lines, seen, _ = pipeline
    children(trainer_runs=True)
    tick_until(lambda: any(line.startswith("train") for line in lines()), "the trainer at work")
    first = daemon.current
    edit_config(cfg.path, "target", dtype="bfloat16")
    switch(daemon)
    assert lines()[-1] == "checkpoint" and daemon.current.id != first.id
    assert daemon.cfg.paths.train_dir == cfg.paths.train_dir / "runs" / daemon.current.id
    assert daemon.switched == f"{first.id} set aside, {daemon.current.id} started"
    edit_config(cfg.path, "target", dtype="float32")
    switch(daemon)
    assert daemon.current.id == first.id and daemon.cfg.paths == cfg.paths
    tick_until(lambda: [line.split()[0] for line in lines()] == ["engine", "train", "checkpoint",
                                                                  "train"],
               "the trainer started again in the first run")
    trained = [line for line in lines() if line.startswith("train")]
    assert trained[0] == trained[1]  # the same verified set: nothing was redone
    assert len(engines) == 1  # no sample of the first run was extracted again


def test_a_switch_keeps_the_watchdog_and_status_going_while_the_trainer_checkpoints(
        pipeline, monkeypatch, tmp_path):
    """A reload of another contract while the trainer takes 12 s to checkpoint: the loop goes on
    ticking (no tick blocks for the stop), pings systemd's watchdog, and keeps the state file's
    heartbeat fresh, so that `eagle3ctl status` says "switching" and exits 0 throughout, never
    NOT RUNNING; then the new run is entered."""
    cfg, daemon, engines, stops, children, tick_until, lines, seen, _ = pipeline
    children(trainer_runs=True, checkpoint_s=12.0)
    tick_until(lambda: any(line.startswith("train") for line in lines()), "the trainer at work")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(tmp_path / "notify"))
    sock.setblocking(False)
    monkeypatch.setenv("NOTIFY_SOCKET", str(tmp_path / "notify"))
    monkeypatch.setenv("WATCHDOG_USEC", "2000000")  # a ping every second
    monkeypatch.setenv("WATCHDOG_PID", str(os.getpid()))
    daemon.notifier = Notifier.from_env()  # as systemd would have started it
    first = daemon.current
    edit_config(cfg.path, "target", dtype="bfloat16")
    pings: list[float] = []
    shown: list[tuple[int, str, float]] = []
    started = asked = time.monotonic()
    daemon.reload()
    while daemon.current.id == first.id:
        assert time.monotonic() - started < 60, "the switch never ended"
        began = time.monotonic()
        daemon.tick()
        assert time.monotonic() - began < 2.0, "a tick waited for the stop"
        while True:
            try:
                message = sock.recv(4096).decode()
            except BlockingIOError:
                break
            if "WATCHDOG=1" in message.split("\n"):
                pings.append(time.monotonic())
        if daemon.current.id == first.id and time.monotonic() - asked > 2:
            out = ctl(cfg.path, "status")
            state = read_state(first.state_dir)[0]
            shown.append((out.returncode, out.stdout + out.stderr, state["daemon"]["heartbeat"]))
            asked = time.monotonic()
        time.sleep(0.25)
    sock.close()
    assert time.monotonic() - started > 10 and lines()[-1] == "checkpoint"
    assert len(shown) >= 3, shown
    for code, text, _ in shown:
        assert code == 0 and "stage     switching" in text and "NOT RUNNING" not in text, text
    heartbeats = [beat for _, _, beat in shown]
    assert heartbeats == sorted(set(heartbeats)), "the heartbeat stood still"
    assert len(pings) >= 8 and max(b - a for a, b in zip(pings, pings[1:])) < 3, pings


def test_a_request_sent_as_the_runs_switch_is_answered_never_lost(pipeline):
    """eagle3ctl drops a request into the control folder of the run it found in force; a switch
    can set that run aside before the daemon reads it. Each such request is answered with a
    refusal that says why and that nothing was done: one sent while the switch stops the old
    run's stages, one that lands as the switch ends, and one that lands after it."""
    from eagle3d.daemon import requests
    cfg, daemon, engines, stops, children, tick_until, lines, seen, _ = pipeline
    children(trainer_runs=True, checkpoint_s=3.0)
    tick_until(lambda: any(line.startswith("train") for line in lines()), "the trainer at work")
    first = daemon.current
    edit_config(cfg.path, "target", dtype="bfloat16")
    daemon.reload()
    during = control.submit(first.state_dir, "pause", {"reason": "during"})
    daemon.tick()
    assert daemon.switching is not None and daemon.switching.stopper.is_alive()
    reply = control.wait_ack(first.state_dir, during, 5)
    assert reply is not None and not reply["ok"], reply
    assert "switching runs" in reply["message"] and "nothing was done" in reply["message"]
    daemon.switching.stopper.join()
    late = control.submit(first.state_dir, "pause", {"reason": "late"})
    daemon.tick()  # the switch ends
    assert daemon.current.id != first.id
    later = control.submit(first.state_dir, "retry", {"ids": [], "all_failed": True})
    tick_until(lambda: all((layout.control_dir(first.state_dir) / f"{name}.ack.json").exists()
                           for name in (late, later)), "the answers")
    for name in (late, later):
        reply = control.wait_ack(first.state_dir, name, 1)
        assert reply is not None and not reply["ok"], reply
        assert f"run {first.id} is set aside" in reply["message"], reply
        assert daemon.current.id in reply["message"] and "nothing was done" in reply["message"]
    assert requests.operator_pause(cfg.paths.state_dir) is None


def test_a_plan_finished_between_two_reads_of_one_tick_is_never_an_empty_plan(config_factory,
                                                                                monkeypatch):
    """The planner commits each batch with its plan.* keys in one transaction. A tick that read
    the counts just before the last batch landed and the plan's keys just after saw a finished
    plan of 0 samples and failed the pipeline: "the plan produced no usable samples", with 4
    planned (found by the randomized operator's walk). The interleaving is forced here: the
    planner's batch commits, through its own connection, right after the loop reads the counts."""
    cfg = load_config(config_factory())
    daemon = Daemon(cfg)
    try:
        read_counts = daemon.ledger.counts

        def counts_then_the_planners_last_batch():
            counts = read_counts()
            if not counts.total:
                plan(cfg, 4)
            return counts
        monkeypatch.setattr(daemon.ledger, "counts", counts_then_the_planners_last_batch)
        decision = stages.derive(daemon.observe())
        assert decision.stage in (Stage.PLAN, Stage.EXTRACT), decision
        assert stages.derive(daemon.observe()).stage == Stage.EXTRACT
    finally:
        daemon.ledger.close()
