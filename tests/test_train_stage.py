"""The train stage without torchrun: its children are small real processes that exit as a
trainer or an evaluation would, and the stage's answers to each exit are checked."""

from __future__ import annotations

import sys
import time

import pytest

from eagle3d.daemon import train_stage
from eagle3d.daemon.train_stage import TrainStage
from eagle3d.statemachine import entry, layout, train_files
from eagle3d.statemachine.config import load_config
from eagle3d.statemachine.ledger import Ledger
from eagle3d.statemachine.stages import Decision, Stage
from tests.pipeline import wait_for

TRAIN = Decision(Stage.TRAIN, "test", Stage.TRAIN)
FINGERPRINT = "f" * 32


def exits_with(code: int, then: str = "") -> list[str]:
    return [sys.executable, "-c", f"{then}\nimport sys; sys.exit({code})"]


@pytest.fixture
def stage(config_factory, monkeypatch):
    cfg = load_config(config_factory({"train": {"max_restarts": 1}}))
    cfg.paths.state_dir.mkdir(parents=True)
    ledger = Ledger(layout.ledger(cfg.paths.state_dir))
    stage = TrainStage(cfg, ledger, cfg.paths.state_dir, lambda: FINGERPRINT)
    yield stage, cfg, monkeypatch
    stage.stop(time.monotonic() + 5)
    ledger.close()


def step_until_idle(stage: TrainStage) -> None:
    stage.step(TRAIN)
    wait_for(lambda: stage.step(TRAIN) or stage.child is None, 30, "the child's exit")


def test_a_trainer_that_keeps_failing_is_restarted_then_fails_the_stage(stage):
    stage, cfg, monkeypatch = stage
    monkeypatch.setattr(train_stage, "trainer_argv", lambda cfg: exits_with(1))
    step_until_idle(stage)
    assert stage.restarts == 1 and stage.failure is None and stage.retry_at > time.time()
    stage.retry_at = 0  # the backoff, elapsed
    step_until_idle(stage)
    assert "[train] max_restarts = 1" in stage.observe(FINGERPRINT)["train_failed"]
    assert stage.status()["status"] == "failed"


def test_a_target_that_is_not_the_datasets_fails_at_once(stage):
    stage, cfg, monkeypatch = stage
    monkeypatch.setattr(train_stage, "trainer_argv",
                        lambda cfg: exits_with(entry.CONTRACT_MISMATCH))
    step_until_idle(stage)
    assert stage.restarts == 1 and "not the dataset's model" in stage.failure


def test_a_finished_training_is_evaluated_and_marked_done(stage):
    stage, cfg, monkeypatch = stage
    train_dir = cfg.paths.train_dir
    train_dir.mkdir(parents=True)
    (layout.export_dir(train_dir)).mkdir()
    (layout.export_dir(train_dir) / "config.json").write_text("{}")
    train_files.ProgressWriter(train_dir, FINGERPRINT).write(train_files.DONE)
    report = {"acceptance_length": 1.7, "identical_to_greedy": False}
    write = (f"from eagle3d.statemachine.train_files import write_eval\n"
             f"write_eval({str(layout.eval_file(train_dir))!r}, {report!r})")
    monkeypatch.setattr(train_stage, "eval_argv", lambda cfg: exits_with(entry.DIVERGED, write))
    step_until_idle(stage)
    assert stage.observe(FINGERPRINT)["train_done"]
    assert stage.status()["acceptance_length"] == 1.7
    assert [kind for _, kind, _ in stage.ledger.events_of(("eval_not_greedy", "drafter_done"))] \
        == ["eval_not_greedy", "drafter_done"]
