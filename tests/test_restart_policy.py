"""One restart policy (daemon/children.Supervisor) for every stage's child: the same table of
exits gives the same answers for the planner, the generator, the engine and the trainer, each
with its own limit from the config. The children are small real processes that exit with the
table's codes (the engine: the in-process fake of test_extract_stage)."""

from __future__ import annotations

import sys
import time
from typing import Any, Callable

import pytest

from eagle3d.daemon.stages.extract import ExtractStage
from eagle3d.daemon.stages.generate import GenerateStage
from eagle3d.daemon.stages.plan import PlanStage
from eagle3d.daemon.stages.train import TrainStage
from eagle3d.statemachine import entry, layout
from eagle3d.statemachine.config_schema import Config
from eagle3d.statemachine.config_validation import load_config
from eagle3d.statemachine.ledger import Ledger
from eagle3d.statemachine.stages import Decision, Stage
from tests.pipeline import wait_for
from tests.test_extract_stage import FakeEngine, plan

LIMITS = {"data": {"planner_max_restarts": 1}, "generate": {"max_restarts": 1},
          "extract": {"engine_max_restarts": 1}, "train": {"max_restarts": 1},
          "verify": {"spot_checks": 0}}


def exits_with(code: int) -> list[str]:
    return [sys.executable, "-c", f"import sys; sys.exit({code})"]


class Case:
    """A stage whose next child exits with a given code: `crash(code)` starts it and steps the
    stage until the exit is seen."""

    def __init__(self, stage: Any, stage_of: Stage, limit_key: str,
                 exit_next: Callable[[int], None], child: Callable[[], Any]) -> None:
        self.stage, self.decision, self.limit_key = stage, Decision(stage_of, "t", stage_of), \
            limit_key
        self.exit_next, self.child = exit_next, child

    def crash(self, code: int) -> None:
        self.exit_next(code)
        self.stage.supervisor.retry_at = 0  # the backoff, elapsed
        self.stage.step(self.decision)
        assert self.child() is not None, "the stage did not start its child"
        wait_for(lambda: self.stage.step(self.decision) or self.child() is None, 30,
                 "the child's exit")


def child_case(monkeypatch, argv_path: str, stage: Any, stage_of: Stage, limit_key: str) -> Case:
    def exit_next(code: int) -> None:
        monkeypatch.setattr(argv_path, lambda *args: exits_with(code))
    return Case(stage, stage_of, limit_key, exit_next, lambda: stage.child)


def planner(cfg: Config, ledger: Ledger, monkeypatch) -> Case:
    return child_case(monkeypatch, "eagle3d.daemon.stages.plan.planner_argv",
                      PlanStage(cfg, ledger, cfg.paths.state_dir), Stage.PLAN,
                      "[data] planner_max_restarts")


def generator(cfg: Config, ledger: Ledger, monkeypatch) -> Case:
    return child_case(monkeypatch, "eagle3d.daemon.stages.generate.generator_argv",
                      GenerateStage(cfg, ledger, cfg.paths.state_dir), Stage.GENERATE,
                      "[generate] max_restarts")


def trainer(cfg: Config, ledger: Ledger, monkeypatch) -> Case:
    return child_case(monkeypatch, "eagle3d.daemon.stages.train.trainer_argv",
                      TrainStage(cfg, ledger, cfg.paths.state_dir, lambda: "f" * 32),
                      Stage.TRAIN, "[train] max_restarts")


def engine(cfg: Config, ledger: Ledger, monkeypatch) -> Case:
    plan(cfg, 2)
    engines: list[FakeEngine] = []
    codes: list[int] = []

    def factory(cfg: Config, pid_dir: Any, doc: dict[str, Any]) -> FakeEngine:
        engines.append(FakeEngine(doc["fingerprint"], ledger))
        engines[-1].exit_code = codes[-1]
        return engines[-1]
    stage = ExtractStage(cfg, ledger, cfg.paths.state_dir, factory)
    return Case(stage, Stage.EXTRACT, "[extract] engine_max_restarts", codes.append,
                lambda: stage.engine)


STAGES = {"plan": planner, "generate": generator, "extract": engine, "train": trainer}

# (what happens, the exit codes in turn, an operator's retry after them, the answer:
#  restarts counted, the supervisor's state, whether a reason blocks the stage)
TABLE = [
    ("a crash backs off", [1], False, 1, "backoff", False),
    ("a crash past the limit is final", [1, 1], False, 2, "fatal", True),
    ("a killed child counts like a crash", [-9, -9], False, 2, "fatal", True),
    ("a refusal is final at once", [entry.REFUSED], False, 1, "fatal", True),
    ("a contract mismatch is final at once", [entry.CONTRACT_MISMATCH], False, 1, "fatal", True),
    ("an operator's retry starts afresh", [1, 1], True, 0, "stopped", False),
]


@pytest.fixture
def made(config_factory, monkeypatch, request):
    cfg = load_config(config_factory(LIMITS))
    for folder in (cfg.paths.state_dir, cfg.paths.dataset_dir, cfg.paths.spool_dir):
        folder.mkdir(parents=True, exist_ok=True)
    ledger = Ledger(layout.ledger(cfg.paths.state_dir))
    case = STAGES[request.param](cfg, ledger, monkeypatch)
    yield case
    case.stage.stop(time.monotonic() + 10)
    ledger.close()


@pytest.mark.parametrize("made", list(STAGES), indirect=True)
@pytest.mark.parametrize("what,codes,retry,restarts,state,blocked", TABLE,
                         ids=[row[0] for row in TABLE])
def test_the_restart_policy_of_every_stage(made, what, codes, retry, restarts, state, blocked):
    case = made
    for code in codes:
        case.crash(code)
    if retry:
        case.stage.unblock(True)
    supervisor = case.stage.supervisor
    status = case.stage.status()
    assert (supervisor.restarts, supervisor.state) == (restarts, state), what
    assert status["restarts"] == restarts and bool(status["blocked"]) == blocked, status
    if state == "fatal":
        # Final means final: no backoff left to wait out, and no child started again.
        assert supervisor.retry_at == 0
        case.stage.step(case.decision)
        assert case.child() is None
    if len(codes) > 1 and blocked:
        assert f"{case.limit_key} = 1" in status["blocked"]


def test_every_stage_has_the_one_shape(config_factory):
    """The loop and the snapshot call every stage alike: the same methods, the same parameters,
    and a status that always names its ETA and its blocking reason."""
    import inspect

    from eagle3d.daemon import pipeline
    cfg = load_config(config_factory())
    for folder in (cfg.paths.state_dir, cfg.paths.dataset_dir):
        folder.mkdir(parents=True)
    with Ledger(layout.ledger(cfg.paths.state_dir)) as ledger:
        built = pipeline.build(cfg, ledger, cfg.paths.state_dir, lambda *a: None, lambda: None)
        names = [s.name for s in built.stages]
        assert names == [s.value for s in Stage][:len(names)]
        for stage in built.stages:
            for method in ("observe", "step", "status", "stop", "unblock", "reconfigure"):
                want = inspect.signature(getattr(pipeline.PipelineStage, method))
                got = inspect.signature(getattr(type(stage), method))
                assert list(got.parameters) == list(want.parameters), (stage.name, method)
            assert {"eta_s", "blocked"} <= set(stage.status()), stage.name


# The event a stage's FATAL leaves for the operator (the planner's contract check records its
# own), and whether a reload retries it: only where its failures come from its config.
FATAL = {"plan": (None, True), "generate": ("generate_failed", False),
         "extract": ("extract_failed", False), "train": ("train_failed", True)}


@pytest.mark.parametrize("made", list(STAGES), indirect=True)
def test_a_fatal_exit_is_recorded_once_and_a_reload_retries_what_a_config_mends(made, request):
    case = made
    case.crash(entry.REFUSED)
    event, retried = FATAL[request.node.callspec.params["made"]]
    recorded = case.stage.ledger.events_of([kind for kind, _ in FATAL.values() if kind])
    assert [(kind, detail) for _, kind, detail in recorded] == \
        ([] if event is None else [(event, case.stage.supervisor.fatal)])
    case.stage.reconfigure(case.stage.cfg)
    status = case.stage.status()
    assert (case.stage.supervisor.state, bool(status["blocked"])) == \
        (("stopped", False) if retried else ("fatal", True))


@pytest.mark.parametrize("made", list(STAGES), indirect=True)
def test_crashes_further_apart_than_the_window_never_use_up_the_limit(made):
    """A child that crashes now and then (days apart in a real install; a second apart here)
    is restarted every time: only the restarts within the window count against the limit, and a
    crash loop inside it still ends FATAL."""
    case = made
    case.stage.supervisor.window_s = 1.0
    for _ in range(3):  # the limit is 1
        case.crash(1)
        assert case.stage.supervisor.state == "backoff"
        assert case.stage.status()["restarts"] == 1 and not case.stage.status()["blocked"]
        time.sleep(1.1)
    case.crash(1)
    case.crash(1)
    assert case.stage.supervisor.state == "fatal"
    assert "2 times within" in case.stage.status()["blocked"]
    # What the window forgets, the metric's counter keeps (eagle3d_child_restarts_total).
    assert case.stage.status()["restarts_total"] == 5
