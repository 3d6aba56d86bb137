"""The extract stage: the engine child (started, restarted with backoff, stopped when no stage
needs the target), dispatch of pending samples within the in-flight bounds, the ingest threads
that turn spooled dumps into dataset files, in-flight expiry, the rates and the disk budgets.

The engine is also lent to the verify stage for its spot check, so it is kept through verify
when spot checks are on, and through a pause: resuming must not pay the model load again.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from pathlib import Path
from typing import Any, Callable, Protocol

from eagle3d.dataset import contract as capture_contract
from eagle3d.daemon import budgets
from eagle3d.daemon.children import remaining
from eagle3d.daemon.durability import GroupSync
from eagle3d.daemon.engine import EngineUnavailable, start_engine
from eagle3d.daemon.ingest import DiskFull, Ingestor
from eagle3d.daemon.spool import Spool
from eagle3d.daemon.verify_stage import plan_batch_item
from eagle3d.statemachine import layout
from eagle3d.statemachine.config import Config
from eagle3d.statemachine.ledger import Counts, Ledger
from eagle3d.statemachine.stages import Decision, Stage

log = logging.getLogger("eagle3d")

ENGINE_STOP_GRACE = 30.0
DISK_FULL_BACKOFF_S = 5.0
RATE_WINDOW_S = 60.0


class Engine(Protocol):
    """What the stage needs of an engine (daemon/engine.py has the two real ones)."""
    kind: str
    ready: bool
    device: str
    pid: int  # and, optionally, `problem`: why it will never become ready

    def submit(self, batch: list[dict[str, Any]], out: Path) -> None: ...
    def events(self) -> list[dict]: ...
    def poll(self) -> int | None: ...
    def stop(self, grace: float) -> int: ...


EngineFactory = Callable[[Config, Path, dict[str, Any]], Engine]


class ExtractStage:
    def __init__(self, cfg: Config, ledger: Ledger, pid_dir: Path,
                 engine_factory: EngineFactory = start_engine) -> None:
        self.cfg = cfg
        self.ledger = ledger
        self.pid_dir = pid_dir
        self.start_engine = engine_factory
        self.engine: Engine | None = None
        self.restarts = 0
        self.retry_at = 0.0
        self.problem: str | None = None
        self.contract: dict[str, Any] | None = None
        # Opened before anything is written, to hear of every write-back error (durability.py).
        self.group_sync = GroupSync(cfg.paths.dataset_dir)
        self.spool: Spool | None = None
        self.ingest_threads: list[threading.Thread] = []
        self.ingested: collections.deque[tuple[float, int]] = collections.deque()
        self.ingest_lock = threading.Lock()
        self.disk_full_until = 0.0
        self.stopping = False
        # Told when the engine exits, so that a spot check in flight starts over with the next.
        self.on_engine_exit: Callable[[], None] = lambda: None

    # ---- the stage's facts ----------------------------------------------------------------

    def observe(self, counts: Counts) -> dict[str, Any]:
        return {"blocked": self.problem, "budget_pause": self.budget_pause(counts)}

    def budget_pause(self, counts: Counts) -> str | None:
        bpt = int(self.ledger.meta("plan.bytes_per_token", "0") or 0)
        dataset_disk, spool_disk = budgets.disks(self.cfg)[:2]
        free = dataset_disk.free
        remaining = bpt * (counts.tokens.get("pending", 0) + counts.tokens.get("inflight", 0))
        spooled = self.spool.bytes_waiting if self.spool else 0
        inflight = bpt * counts.tokens.get("inflight", 0)
        return (budgets.projection_pause(self.cfg, free, remaining)
                or budgets.dataset_pause(self.cfg, free, inflight + spooled)
                or budgets.spool_pause(self.cfg, spooled, spool_disk.free,
                                       bpt * self.cfg.extract.batch_tokens)
                or ("disk budget: a file system filled up (dataset or spool); dispatch waits "
                    "for space" if time.time() < self.disk_full_until else None))

    # ---- one step ---------------------------------------------------------------------------

    def step(self, decision: Decision) -> None:
        if self.contract is None:  # the planner writes it
            self.contract = capture_contract.read(self.cfg.paths.dataset_dir)
        self._ensure_ingest()
        self._engine_events()
        needed = decision.underlying == Stage.EXTRACT or (decision.underlying == Stage.VERIFY
                                                          and self.cfg.verify.spot_checks > 0)
        if needed and decision.stage != Stage.FAILED:
            self._ensure_engine()
        elif self.engine is not None and (decision.underlying in (Stage.TRAIN, Stage.DONE)
                                          or decision.stage == Stage.FAILED):
            log.info("stopping the engine: stage %s needs no target model", decision.stage.value)
            # One still loading holds nothing worth waiting for.
            self.engine.stop(ENGINE_STOP_GRACE if self.engine.ready else 0)
            self.engine = None
        if decision.underlying == Stage.EXTRACT:
            self._expire_inflight()
            if decision.stage == Stage.EXTRACT:
                self._dispatch()

    @property
    def ready_engine(self) -> Engine | None:
        return self.engine if self.engine is not None and self.engine.ready else None

    def _ensure_engine(self) -> None:
        if self.engine is not None:
            code = self.engine.poll()
            if code is None:
                return
            self._engine_exited(code)
            if self.problem:
                return
        if time.time() < self.retry_at or self.contract is None or self.problem:
            return
        try:
            self.engine = self.start_engine(self.cfg, self.pid_dir, self.contract)
        except EngineUnavailable as exc:
            self.problem = str(exc)
            log.error("cannot start the engine: %s", exc)
            self.ledger.event("engine_unavailable", str(exc))

    def _engine_exited(self, code: int) -> None:
        # An engine that knew why it could not become ready (an SGLang server whose capture
        # plugin never answered) would fail the same way again: no restart, the reason shown.
        refused = getattr(self.engine, "problem", None)
        held = self.ledger.expired_inflight(float("inf"))
        for sid in held:
            self.ledger.mark_retry(sid, f"the engine exited with code {code}",
                                   self.cfg.extract.max_attempts)
        self.on_engine_exit()
        self.engine = None
        self.restarts += 1
        self.ledger.event("engine_exit", f"code {code}, {len(held)} in-flight samples returned")
        log.warning("the engine exited with code %s; %d in-flight samples returned", code,
                    len(held))
        limit = self.cfg.extract.engine_max_restarts
        if refused:
            self.problem = f"the engine cannot capture: {refused}"
            return
        if self.restarts > limit:
            self.problem = (f"the engine exited {self.restarts} times ([extract] "
                            f"engine_max_restarts = {limit}); see the log")
            return
        self.retry_at = time.time() + min(60.0, 2.0 ** self.restarts)

    def _engine_events(self) -> None:
        if self.engine is None:
            return
        for ev in self.engine.events():
            if ev.get("event") == "error" and ev.get("kind") == "disk_full":
                self.ledger.release(ev.get("ids", []), f"spool full: {ev.get('error')}")
                self.disk_full_until = time.time() + DISK_FULL_BACKOFF_S
            elif ev.get("event") == "error":
                for sid in ev.get("ids", []):
                    self.ledger.mark_retry(sid, f"engine: {ev.get('error', 'unknown error')}",
                                           self.cfg.extract.max_attempts)
            elif ev.get("event") == "done" and self.spool is not None:
                self.spool.rescan(force=True)  # the dumps are there now: do not wait for hints

    def _expire_inflight(self) -> None:
        timeout = self.cfg.extract.inflight_timeout_s
        for sid in self.ledger.expired_inflight(time.time() - timeout):
            self.ledger.mark_retry(sid, f"no dump within {timeout:.0f} s",
                                   self.cfg.extract.max_attempts)

    def _dispatch(self) -> None:
        engine = self.ready_engine
        if engine is None or time.time() < self.disk_full_until:
            return
        bounds = self.cfg.extract
        counts = self.ledger.counts()
        room_samples = bounds.max_inflight_samples - counts.get("inflight")
        room_tokens = bounds.max_inflight_tokens - counts.tokens.get("inflight", 0)
        while room_samples > 0 and room_tokens > 0:
            claimed = self.ledger.claim(room_samples, min(room_tokens, bounds.batch_tokens))
            if not claimed:
                return
            tokens = self.ledger.plan_tokens([s.id for s in claimed])
            engine.submit([plan_batch_item(s.id, *tokens[s.id]) for s in claimed],
                          self.cfg.paths.spool_dir)
            room_samples -= len(claimed)
            room_tokens -= sum(s.tokens for s in claimed)

    # ---- ingest ---------------------------------------------------------------------------

    def _ensure_ingest(self) -> None:
        if self.spool is not None or self.contract is None:
            return
        self.spool = Spool(self.cfg.paths.spool_dir, self.cfg.extract.rescan_interval_s)
        for i in range(self.cfg.extract.ingest_threads):
            thread = threading.Thread(target=self._ingest_loop, name=f"ingest-{i}", daemon=True)
            thread.start()
            self.ingest_threads.append(thread)

    def _ingest_loop(self) -> None:
        assert self.spool is not None and self.contract is not None
        ledger = Ledger(layout.ledger(self.cfg.paths.state_dir))
        ingestor = Ingestor(ledger, self.cfg.paths.spool_dir, self.cfg.paths.dataset_dir,
                            self.contract, self.cfg.extract.max_attempts, self.group_sync)
        try:
            while not (self.stopping and self.spool.idle):
                name = self.spool.take(0.2)
                if name is None:
                    continue
                try:
                    outcome = ingestor.ingest(name)
                    if outcome.kind == "ingested":
                        with self.ingest_lock:
                            self.ingested.append((time.time(), outcome.tokens))
                except DiskFull as exc:
                    log.warning("%s: waiting for space", exc.strerror)
                    ledger.event("disk_full", str(exc.strerror))
                    self.disk_full_until = time.time() + DISK_FULL_BACKOFF_S
                    time.sleep(1.0)
                except Exception:
                    log.exception("ingest of %s failed; it stays in the spool", name)
                    time.sleep(1.0)
                finally:
                    self.spool.done(name)
        finally:
            ledger.close()

    def rates(self) -> tuple[float, float]:
        """Samples and tokens ingested per second over the last minute."""
        now = time.time()
        with self.ingest_lock:
            while self.ingested and self.ingested[0][0] < now - RATE_WINDOW_S:
                self.ingested.popleft()
            if not self.ingested:
                return 0.0, 0.0
            span = max(now - self.ingested[0][0], 1.0)
            return len(self.ingested) / span, sum(t for _, t in self.ingested) / span

    # ---- status and stop ------------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        engine = self.engine
        if engine is None:
            return {"status": "stopped", "restarts": self.restarts,
                    "kind": self.cfg.target.engine, "problem": self.problem}
        return {"status": "ready" if engine.ready else "starting", "pid": engine.pid,
                "restarts": self.restarts, "kind": engine.kind, "device": engine.device,
                "model": getattr(engine, "model", "") or self.cfg.target.model}

    def unblock(self) -> None:
        self.problem = None

    def stop(self, deadline: float, publish: Callable[[], None]) -> None:
        """Let the engine finish what it holds (until the deadline), stop it, and ingest what
        it wrote: nothing in flight is lost, and what is left goes back to pending."""
        if self.engine is not None:
            self._drain(deadline, publish)
            self.engine.stop(remaining(deadline, 10.0))
            self.engine = None
        if self.spool is not None:
            self.spool.rescan(force=True)
            self.stopping = True
            for thread in self.ingest_threads:
                thread.join(timeout=remaining(deadline, 30.0))
            self.spool.stop()
            self.group_sync.flush(self.ledger)

    def _drain(self, deadline: float, publish: Callable[[], None]) -> None:
        assert self.engine is not None
        drain_until = time.monotonic() + remaining(deadline - 10.0, ENGINE_STOP_GRACE)
        while time.monotonic() < drain_until and self.ledger.counts().get("inflight"):
            if self.engine.poll() is not None:
                return
            self._engine_events()
            if self.spool is not None:
                self.spool.rescan(force=True)
            publish()
            time.sleep(0.2)
