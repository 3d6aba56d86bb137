"""The extract stage and the daemon's loop without child processes: an in-process engine writes
real dumps into a real tmpfs spool, and the real ingest, ledger, verify and manifest do the rest.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from eagle3d.dataset import contract, dumpformat
from eagle3d.daemon.reconcile import Daemon
from eagle3d.daemon.stages.extract import ExtractStage
from eagle3d.statemachine import layout, plan_meta
from eagle3d.statemachine.config_schema import Config
from eagle3d.statemachine.config_validation import load_config
from eagle3d.statemachine.ledger import Ledger, PlannedSample
from eagle3d.statemachine.stages import Decision, Seen, Stage
from tests.conftest import smollm_contract
from tests.pipeline import wait_for
from tests.test_ingest import H, sample_ids, write

EXTRACT = Decision(Stage.EXTRACT, "test", Stage.EXTRACT)


def seen(ledger: Ledger) -> Seen:
    """What the loop reads for the stages at each tick (reconcile.observe)."""
    return Seen(ledger.counts(), None, plan_meta.read(ledger))


def tick(stage: ExtractStage, ledger: Ledger, decision: Decision = EXTRACT) -> None:
    """One tick of the loop for this stage: observe, then one step."""
    stage.observe(seen(ledger))
    stage.step(decision)


class FakeEngine:
    """An engine in the test's process: it writes each dump as it is submitted, or fails."""

    kind = "fake"
    device = "cpu"

    def __init__(self, contract_fingerprint: str, ledger: Ledger) -> None:
        self.fingerprint = contract_fingerprint
        self.ledger = ledger
        self.ready = False
        self.pid = 0
        self.exit_code: int | None = None
        self.submitted: list[str] = []
        self.fail_with: dict[str, Any] | None = None  # an error event for every batch
        self.hold = False  # take batches and write nothing, like an engine about to crash
        self._events: list[dict] = [{"event": "ready"}]

    def submit(self, batch: list[dict[str, Any]], out: Path) -> None:
        ids = [item["id"] for item in batch]
        self.submitted += ids
        if self.hold:
            return
        if self.fail_with is not None:
            self._events.append({"event": "error", "ids": ids, **self.fail_with})
            return
        planned = self.ledger.plan_tokens(ids)
        for sid in ids:
            write(out, sid, planned[sid][0], contract=self.fingerprint)
        self._events.append({"event": "done", "ids": ids})

    def events(self) -> list[dict]:
        out, self._events = self._events, []
        self.ready = self.ready or any(e["event"] == "ready" for e in out)
        return out

    def poll(self) -> int | None:
        return self.exit_code

    def stop(self, grace: float) -> int:
        return self.exit_code or 0


def plan(cfg: Config, n: int) -> dict[str, Any]:
    """A planned ledger and its contract, as the planner would leave them."""
    doc = contract.write(cfg.paths.dataset_dir, smollm_contract(cfg, hidden_size=H))
    with Ledger(layout.ledger(cfg.paths.state_dir)) as ledger:
        samples = []
        for i in range(n):
            ids = sample_ids(i, 8 + i)
            samples.append(PlannedSample(f"{i:032x}", i, 8 + i, 8 + i, dumpformat.ids_hash(ids),
                                         ids, b"\1" * (8 + i)))
        ledger.add_planned(samples, [], {
            "plan.source": cfg.data.source, "plan.first": str(cfg.data.first),
            "plan.max_tokens": str(cfg.data.max_tokens), "plan.through": str(n - 1),
            "plan.exhausted": "1", "plan.bytes_per_token": str(dumpformat.bytes_per_token(
                H, "bfloat16"))})
    return doc


@pytest.fixture
def setup(config_factory, tmp_path):
    cfg = load_config(config_factory({"extract": {"max_inflight_samples": 4,
                                                  "engine_max_restarts": 1},
                                      "verify": {"spot_checks": 0}}))
    for folder in (cfg.paths.state_dir, cfg.paths.dataset_dir, cfg.paths.spool_dir):
        folder.mkdir(parents=True, exist_ok=True)
    doc = plan(cfg, 10)
    ledger = Ledger(layout.ledger(cfg.paths.state_dir))
    engines: list[FakeEngine] = []

    def factory(cfg: Config, pid_dir: Path, doc: dict[str, Any]) -> FakeEngine:
        engines.append(FakeEngine(doc["fingerprint"], ledger))
        return engines[-1]
    yield cfg, ledger, factory, engines, doc
    ledger.close()


def test_dispatch_stays_within_bounds_and_every_dump_is_ingested(setup):
    cfg, ledger, factory, engines, _ = setup
    stage = ExtractStage(cfg, ledger, cfg.paths.state_dir, factory)
    try:
        tick(stage, ledger)  # starts the engine; nothing is dispatched before it is ready
        assert engines and not engines[0].submitted
        tick(stage, ledger)
        assert len(engines[0].submitted) == 4  # [extract] max_inflight_samples
        wait_for(lambda: tick(stage, ledger) or ledger.counts().get("extracted") == 10, 60,
                 "all ten ingested")
        assert sorted(engines[0].submitted) == sorted(s.id for s in ledger.samples())
        assert stage.rates()[0] > 0
    finally:
        stage.stop(time.monotonic() + 10)


def test_an_engine_that_dies_returns_its_samples_and_is_restarted_then_given_up(setup):
    cfg, ledger, factory, engines, _ = setup
    stage = ExtractStage(cfg, ledger, cfg.paths.state_dir, factory)
    try:
        tick(stage, ledger)
        engines[0].hold = True
        tick(stage, ledger)
        assert ledger.counts().get("inflight") == 4
        engines[0].exit_code = -9
        tick(stage, ledger)
        assert ledger.counts().get("inflight") == 0 and ledger.counts().get("pending") == 10
        assert sorted(s.id for s in ledger.samples() if s.attempts == 1) == \
            sorted(engines[0].submitted)
        assert [kind for _, kind, _ in ledger.events_of(("engine_exit",))] == ["engine_exit"]
        stage.supervisor.retry_at = 0  # the backoff, elapsed
        tick(stage, ledger)
        assert len(engines) == 2
        engines[1].exit_code = 1
        tick(stage, ledger)
        assert "engine_max_restarts = 1" in stage.observe(seen(ledger)).blocked
    finally:
        stage.stop(time.monotonic() + 10)


def test_a_full_spool_returns_samples_without_an_attempt_and_pauses(setup):
    cfg, ledger, factory, engines, _ = setup
    stage = ExtractStage(cfg, ledger, cfg.paths.state_dir, factory)
    try:
        tick(stage, ledger)
        engines[0].fail_with = {"kind": "disk_full", "error": "No space left on device"}
        tick(stage, ledger)
        tick(stage, ledger)
        assert ledger.counts().get("pending") == 10
        assert all(s.attempts == 0 for s in ledger.samples())
        assert "filled up" in stage.observe(seen(ledger)).budget_pause
    finally:
        stage.stop(time.monotonic() + 10)


def test_the_loop_reaches_train_with_every_sample_verified(setup):
    cfg, ledger, factory, engines, _ = setup
    daemon = Daemon(cfg, until="train", engine_factory=factory)
    daemon.recover()
    try:
        wait_for(lambda: daemon.tick() or daemon.until_met(), 120, "the train stage")
    finally:
        daemon.shutdown()
    assert daemon.decision.stage == Stage.TRAIN
    assert ledger.counts().get("verified") == 10
    assert layout.manifest_file(cfg.paths.dataset_dir).exists()
    assert layout.config_in_force(cfg.paths.state_dir).exists()


def test_an_engine_that_knows_it_cannot_capture_is_not_restarted(setup):
    cfg, ledger, factory, engines, _ = setup
    stage = ExtractStage(cfg, ledger, cfg.paths.state_dir, factory)
    try:
        tick(stage, ledger)
        engines[0].problem = "the capture plugin wrote no ready file"
        engines[0].exit_code = 1
        tick(stage, ledger)
        stage.supervisor.retry_at = 0
        tick(stage, ledger)
        assert len(engines) == 1
        assert "no ready file" in stage.observe(seen(ledger)).blocked
    finally:
        stage.stop(time.monotonic() + 10)


def test_the_spool_budget_counts_every_dump_in_flight_before_it_is_written(config_factory):
    """A dispatch fills the spool only up to [budget] spool_max: the dumps the engine has yet to
    write count, not only those already in the spool (which is empty at every dispatch)."""
    bpt = dumpformat.bytes_per_token(H, "bfloat16")
    cfg = load_config(config_factory({
        "extract": {"max_inflight_samples": 100, "batch_tokens": 16},
        "budget": {"spool_max": 40 * bpt}, "verify": {"spot_checks": 0}}))
    for folder in (cfg.paths.state_dir, cfg.paths.dataset_dir, cfg.paths.spool_dir):
        folder.mkdir(parents=True, exist_ok=True)
    doc = plan(cfg, 10)
    with Ledger(layout.ledger(cfg.paths.state_dir)) as ledger:
        engine = FakeEngine(doc["fingerprint"], ledger)
        engine.hold = True  # busy: it writes nothing yet
        stage = ExtractStage(cfg, ledger, cfg.paths.state_dir, lambda *args: engine)
        try:
            for _ in range(3):  # the loop's ticks: a budget's pause dispatches nothing
                if stage.observe(seen(ledger)).budget_pause is None:
                    tick(stage, ledger)
            inflight = ledger.counts().tokens.get("inflight", 0)
            assert 0 < inflight * bpt <= cfg.budget.spool_max + 17 * bpt  # one sample past it
            assert ledger.counts().get("pending") > 0
        finally:
            stage.stop(time.monotonic() + 10)


def test_a_clock_step_expires_no_sample_in_flight_and_charges_no_attempt(setup):
    """NTP steps the wall clock by hours while four samples are in flight: stepped forward, the
    ledger's dispatch times lie hours in the past, and none of them is charged for it; stepped
    back, they lie in the future, and a sample with no dump still expires once
    [extract] inflight_timeout_s has really passed. (The machine's clock is never moved: the
    rows are written as a step leaves them.)"""
    cfg, ledger, factory, engines, _ = setup
    cfg = cfg._replace(extract=cfg.extract._replace(inflight_timeout_s=2.0))
    stage = ExtractStage(cfg, ledger, cfg.paths.state_dir, factory)

    def step_clock(by_s: float) -> None:
        with ledger.transaction() as db:
            db.execute("UPDATE samples SET dispatched_at = dispatched_at + ? "
                       "WHERE status = 'inflight'", (by_s,))

    def busy_tick() -> None:
        engines[0]._events.append({"event": "progress"})  # a busy engine, never a silent one
        tick(stage, ledger)

    def attempts() -> int:
        return sum(s.attempts for s in ledger.samples())

    try:
        tick(stage, ledger)
        engines[0].hold = True  # takes batches and writes nothing
        busy_tick()
        busy_tick()  # the samples in flight, seen
        assert ledger.counts().get("inflight") == 4 and attempts() == 4
        step_clock(-10 * 3600.0)  # the wall clock jumped 10 hours forward
        busy_tick()
        assert ledger.counts().get("inflight") == 4 and attempts() == 4
        step_clock(20 * 3600.0)  # and back, 10 hours behind the dispatch
        busy_tick()
        assert attempts() == 4
        time.sleep(2.2)
        busy_tick()
        assert len(engines[0].submitted) == 8 and attempts() == 8  # expired, dispatched again
    finally:
        stage.stop(time.monotonic() + 10)
