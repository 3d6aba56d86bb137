"""Where training waits, told to the operator: the trainer records the share of its time spent
waiting for batches in progress.json, names the reader in its log once when the reader sets
the pace, the train stage publishes the share and `eagle3ctl status` shows it."""

from __future__ import annotations

import logging
import os
import time

import torch

from eagle3d.daemon.stages.train import TrainStage
from eagle3d.drafter.reporting import Reporter, StepFigures
from eagle3d.statemachine import layout, train_files
from eagle3d.statemachine.config_validation import load_config
from eagle3d.statemachine.ledger import Ledger
from eagle3d.statemachine.statefile import write_state
from tests.test_ctl import ctl


def train_steps(reporter: Reporter, progress: train_files.ProgressWriter, steps: int,
                step_s: float, waited_s: float) -> dict:
    one = torch.ones(1)
    for step in range(1, steps + 1):
        started = time.monotonic()
        time.sleep(step_s)
        reporter.report(StepFigures.send(torch.device("cpu"), 1, step, step / 100, 1e-3,
                                         started, one, one, one, 1000, False, waited_s))
        progress.last_write = 0.0  # the writer's once-a-second limit: every step read here
    return train_files.read_progress(progress.path.parent)


def test_a_trainer_waiting_for_its_reader_records_the_share_and_names_the_reader_once(
        tmp_path, caplog):
    progress = train_files.ProgressWriter(tmp_path, "fp", total_steps=100)
    reporter = Reporter(1, 100, 0, tmp_path / "metrics.jsonl", progress, bytes_per_token=28_693)
    reporter.recent.window_s = 0.3  # the 10 s window, shortened for the test
    with caplog.at_level(logging.WARNING, logger="eagle3d.trainer"):
        fed = train_steps(reporter, progress, 10, 0.04, 0.0)
        assert fed["data_wait"] == 0.0 and not caplog.records
        starved = train_steps(reporter, progress, 20, 0.04, 0.03)
    reporter.close()
    assert starved["data_wait"] >= train_files.READER_LIMIT  # ~0.75, less on a loaded host
    named = [r.getMessage() for r in caplog.records]
    assert len(named) == 1, named
    assert "reader is the limit" in named[0] and "MB/s of dumps" in named[0]


def test_the_train_stage_publishes_the_wait_and_status_shows_it(config_factory):
    config = config_factory()
    cfg = load_config(config)
    cfg.paths.state_dir.mkdir(parents=True)
    progress = train_files.ProgressWriter(cfg.paths.train_dir, "fp", total_steps=900)
    cfg.paths.train_dir.mkdir(parents=True)
    progress.write(train_files.TRAINING, step=5, data_wait=0.03)
    with Ledger(layout.ledger(cfg.paths.state_dir)) as ledger:
        published = TrainStage(cfg, ledger, cfg.paths.state_dir, lambda: "f" * 32).status()
    assert published["data_wait"] == 0.03
    state_dir = cfg.paths.state_dir
    for wait, said in ((0.03, "data wait 3% of step time\n"),
                       (0.4, "data wait 40% of step time (waiting for the reader")):
        write_state(state_dir, {"stage": "train", "reason": "training", "trainer": {
            **published, "status": "training", "pid": os.getpid(), "data_wait": wait}})
        shown = ctl(config, "status").stdout
        assert said in shown, shown
        assert ("waiting for the reader" in shown) == (wait >= train_files.READER_LIMIT)
