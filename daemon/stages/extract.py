"""The extract stage: the engine child (started, restarted with backoff, stopped when no stage
needs the target), dispatch of pending samples within the in-flight bounds, the ingest threads
that turn spooled dumps into dataset files, in-flight expiry, the rates and the disk budgets.

The engine is also lent to the verify stage for its spot check. An engine loads its model for
minutes, so it is started only when a sample needs it (one to extract, or a spot check due) and,
once up, kept through verify while spot checks are on and through a pause: it is never started
only to be stopped, and every stop gives it [extract] engine_stop_grace_s before SIGKILL.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from pathlib import Path
from typing import Any, Callable, Protocol

from eagle3d.capture.engines import CaptureEngine as Engine, EngineUnavailable
from eagle3d.dataset import contract as capture_contract
from eagle3d.daemon import budgets
from eagle3d.daemon.ages import Ages
from eagle3d.daemon.children import Silence, Supervisor, remaining, stage_failed
from eagle3d.daemon.durability import GroupSync
from eagle3d.daemon.engine import plan_batch_item, start_engine
from eagle3d.daemon.ingest import DiskUnwritable, Ingestor
from eagle3d.daemon.stages.extract_spool import Spool
from eagle3d.statemachine import layout, safepath
from eagle3d.statemachine.config_schema import Config
from eagle3d.statemachine.ledger import Counts, Ledger
from eagle3d.statemachine.safepath import Unsafe
from eagle3d.statemachine.stages import Decision, ExtractFacts, Seen, Stage

log = logging.getLogger("eagle3d")

DISK_FULL_BACKOFF_S = 5.0
RATE_WINDOW_S = 60.0


EngineFactory = Callable[[Config, Path, dict[str, Any]], Engine]


class EngineBorrower(Protocol):
    """A stage the engine is lent to (verify's spot check)."""

    def needs_engine(self) -> bool: ...
    def engine_exited(self) -> None: ...


class _NoBorrower:
    def needs_engine(self) -> bool:
        return False

    def engine_exited(self) -> None:
        pass


class ExtractStage:
    name = Stage.EXTRACT.value
    state_key = "engine"
    ingests = True

    def __init__(self, cfg: Config, ledger: Ledger, pid_dir: Path,
                 engine_factory: EngineFactory = start_engine,
                 heartbeat: Callable[[], None] = lambda: None) -> None:
        self.cfg = cfg
        self.ledger = ledger
        self.pid_dir = pid_dir
        self.start_engine = engine_factory
        self.heartbeat = heartbeat  # publishes the state while a stop drains the engine
        self.engine: Engine | None = None
        self.supervisor = Supervisor("[extract] engine_max_restarts",
                                     cfg.extract.engine_max_restarts,
                                     stage_failed(ledger, "extract_failed",
                                                  "the extract stage stopped: %s"))
        # Progress of a ready engine with samples in flight: its events (children.Silence).
        self.silence = Silence("engine", cfg.extract.engine_silence_s)
        self.seen: Seen | None = None
        self.budget_held: str | None = None  # the disk budget's pause, at the last observe
        self.contract: dict[str, Any] | None = None
        # Opened before anything is written, to hear of every write-back error (durability.py).
        self.group_sync = GroupSync(cfg.paths.dataset_dir)
        self.spool: Spool | None = None
        self.spool_refused: str | None = None  # why the spool could not be held, tried each tick
        self.ingest_threads: list[threading.Thread] = []
        self.ingested: collections.deque[tuple[float, int]] = collections.deque()
        self.ingest_lock = threading.Lock()
        # How long each sample has been in flight on the monotonic clock: the ledger's
        # dispatched_at is wall-clock time, which NTP may step by hours (issue 59 rule 4).
        self.inflight_ages = Ages()
        self.disk_full_until = 0.0
        self.disk_full_why = ""  # what the last disk event said, for the budget's reason
        self.stopping = False
        self.borrower: EngineBorrower = _NoBorrower()
        # Whether another stage's child still holds the GPUs (a trainer writing its checkpoint
        # after the pipeline left train): an engine beside it would run out of memory.
        self.gpus_taken: Callable[[], bool] = lambda: False

    def lend_engine_to(self, borrower: EngineBorrower) -> None:
        """`borrower` says when it needs the engine, and hears when it exits (a spot check in
        flight starts over with the next)."""
        self.borrower = borrower

    # ---- the stage's facts ----------------------------------------------------------------

    def observe(self, seen: Seen) -> ExtractFacts:
        self.seen = seen
        self.budget_held = self.budget_pause(seen)
        return ExtractFacts(budget_pause=self.budget_held,
                            blocked=self.supervisor.fatal or self.spool_problem())

    def spool_problem(self) -> str | None:
        """Why the spool cannot be held, or was replaced under the daemon: extraction stops
        (the engine writes by path) and status says why until the operator mends it."""
        if self.spool is None:
            return self.spool_refused
        return self.spool.replaced()

    def budget_pause(self, seen: Seen) -> str | None:
        """The disk budgets' pause, from the counts and the plan the loop read this tick."""
        counts, bpt = seen.counts, seen.plan.bytes_per_token
        dataset_disk, spool_disk = budgets.disks(self.cfg)[:2]
        free = dataset_disk.free
        remaining = bpt * (counts.tokens.get("pending", 0) + counts.tokens.get("inflight", 0))
        spooled = self.spool.bytes_waiting if self.spool else 0
        inflight = bpt * counts.tokens.get("inflight", 0)
        return (self._spool_gone()
                or budgets.projection_pause(self.cfg, free, remaining)
                or budgets.dataset_pause(self.cfg, free, inflight + spooled)
                or budgets.spool_pause(self.cfg, spooled + inflight, spool_disk.free,
                                       bpt * self.cfg.extract.batch_tokens)
                or (f"disk budget: {self.disk_full_why}; dispatch waits for it"
                    if time.monotonic() < self.disk_full_until else None))

    def _spool_gone(self) -> str | None:
        """A spool folder removed under the daemon (an rm -rf of /dev/shm/eagle3d) is made
        again, with the checks of the start; why dispatch must wait where it cannot be. The
        in-flight samples' dumps went with it: they go back without an attempt (a dump still
        written for one is ingested all the same)."""
        spool = self.cfg.paths.spool_dir
        if spool.is_dir() and not spool.is_symlink():
            return None
        problem = safepath.folder_problem(spool, 0o700)
        if problem is not None:
            return f"spool: {spool} was removed and cannot be made again: {problem}"
        self._let_go_of_spool()  # it holds the removed folder: the next step holds the new one
        held = list(self.ledger.inflight())
        self.ledger.release(held, f"the spool {spool} was removed under the daemon")
        log.warning("the spool %s was removed under the daemon: made again, %d in-flight "
                    "samples returned without an attempt", spool, len(held))
        self.ledger.event("spool_recreated", f"{spool}: {len(held)} in-flight samples returned")
        return None

    # ---- one step ---------------------------------------------------------------------------

    def step(self, decision: Decision) -> None:
        if self.contract is None:  # the planner writes it
            self.contract = capture_contract.read(self.cfg.paths.dataset_dir)
        self._ensure_ingest()
        if self.spool is None and self.contract is not None:
            return  # no spool held: no engine, which writes into the spool by path
        self._engine_events()
        wanted = self._engine_wanted(decision)
        if wanted != "stop":
            self._ensure_engine(start=wanted == "start")
        elif self.engine is not None:
            log.info("stopping the engine: stage %s needs no target model", decision.stage.value)
            self.engine.stop(self.cfg.extract.engine_stop_grace_s)
            self.engine = None
        if decision.underlying == Stage.EXTRACT:
            self._expire_inflight()
            if decision.stage == Stage.EXTRACT:
                self._dispatch()

    def _engine_wanted(self, decision: Decision) -> str:
        """"start": a sample needs the engine now; "keep": one that is up may be needed soon (a
        spot check once verify is through); "stop": no stage needs the target."""
        if decision.stage == Stage.FAILED:
            return "stop"
        if decision.stage == Stage.PAUSED and self.budget_held:
            return "keep"  # a budget waits for a person or for space: no model loaded only to wait
        if decision.underlying == Stage.EXTRACT or (decision.underlying == Stage.VERIFY and
                                                    self.borrower.needs_engine()):
            return "start"
        if decision.underlying == Stage.VERIFY and self.cfg.verify.spot_checks > 0:
            return "keep"
        return "stop"

    @property
    def ready_engine(self) -> Engine | None:
        return self.engine if self.engine is not None and self.engine.ready else None

    def _ensure_engine(self, start: bool) -> None:
        """Reap an engine that exited or hung; start one (backoff allowing) only where `start`."""
        self._end_silent_engine()
        if self.engine is not None:
            code = self.engine.poll()
            if code is None:
                return
            self._engine_exited(code)
        if not start or not self.supervisor.may_start or self.contract is None or \
                self.gpus_taken():
            return
        try:
            self.engine = self.start_engine(self.cfg, self.pid_dir, self.contract)
            self.silence.reset()
        except EngineUnavailable as exc:
            log.error("cannot start the engine: %s", exc)
            self.ledger.event("engine_unavailable", str(exc))
            self.supervisor.terminal(str(exc))

    def _end_silent_engine(self) -> None:
        """A ready engine that holds samples and shows nothing past [extract] engine_silence_s
        has not exited but is hung (SIGSTOP, a read the kernel never answers): it is killed and
        restarted, the restart counted against the engine's limit. Its samples go back to
        pending without an attempt: they never had one."""
        engine = self.ready_engine
        if engine is None:
            return
        if not self.ledger.counts().get("inflight"):
            self.silence.sign()  # an idle engine has nothing to show
            return
        why = self.silence.overdue()
        if why is None:
            return
        log.error("%s: killing it", why)
        engine.stop(0.0)  # SIGKILL: a stopped or stuck process never answers SIGTERM
        self.engine = None
        held = list(self.ledger.inflight())
        self.ledger.release(held, why)
        self.borrower.engine_exited()
        self.ledger.event("engine_silent", f"{why}; {len(held)} in-flight samples returned "
                          "without an attempt")
        self.supervisor.exited(None, why)

    def _engine_exited(self, code: int) -> None:
        # An engine that knew why it could not become ready (an SGLang server whose capture
        # plugin never answered) would fail the same way again: no restart, the reason shown.
        refused = getattr(self.engine, "problem", None)
        held = list(self.ledger.inflight())
        for sid in held:
            self.ledger.mark_retry(sid, f"the engine exited with code {code}",
                                   self.cfg.extract.max_attempts)
        self.borrower.engine_exited()
        self.engine = None
        self.ledger.event("engine_exit", f"code {code}, {len(held)} in-flight samples returned")
        log.warning("the engine exited with code %s; %d in-flight samples returned", code,
                    len(held))
        self.supervisor.exited(code, f"the engine cannot capture: {refused}" if refused
                               else f"the engine exited with code {code}", final=bool(refused))

    def _engine_events(self) -> None:
        if self.engine is None:
            return
        for ev in self.engine.events():
            self.silence.sign()
            if ev.get("event") == "error" and ev.get("kind") in ("disk_full", "write_failed"):
                # The spool's fault, never the sample's: back without an attempt, and dispatch
                # waits a moment for the disk.
                self.ledger.release(ev.get("ids", []), f"spool: {ev.get('error')}")
                self.disk_full_why = "the spool's file system filled up"
                self.disk_full_until = time.monotonic() + DISK_FULL_BACKOFF_S
            elif ev.get("event") == "error":
                for sid in ev.get("ids", []):
                    self.ledger.mark_retry(sid, f"engine: {ev.get('error', 'unknown error')}",
                                           self.cfg.extract.max_attempts)
            elif ev.get("event") == "done" and self.spool is not None:
                self.spool.rescan(force=True)  # the dumps are there now: do not wait for hints

    def _expire_inflight(self) -> None:
        timeout = self.cfg.extract.inflight_timeout_s
        if self.silence.silent_for() >= timeout:
            return  # a late sample is its own fault only while the engine works on others
        inflight = self.ledger.inflight()
        ages = self.inflight_ages.update({sid: (at, at) for sid, at in inflight.items()})
        for sid in (sid for sid, age in ages.items() if age >= timeout):
            self.ledger.mark_retry(sid, f"no dump within {timeout:.0f} s",
                                   self.cfg.extract.max_attempts)

    def _dispatch(self) -> None:
        engine = self.ready_engine
        if engine is None or time.monotonic() < self.disk_full_until:
            return
        bounds = self.cfg.extract
        counts = self.ledger.counts()
        room_samples = bounds.max_inflight_samples - counts.get("inflight")
        room_tokens = min(bounds.max_inflight_tokens - counts.tokens.get("inflight", 0),
                          self._spool_room(counts))
        while room_samples > 0 and room_tokens > 0:
            claimed = self.ledger.claim(room_samples, min(room_tokens, bounds.batch_tokens))
            if not claimed:
                return
            tokens = self.ledger.plan_tokens([s.id for s in claimed])
            engine.submit([plan_batch_item(s.id, *tokens[s.id]) for s in claimed],
                          self.cfg.paths.spool_dir)
            room_samples -= len(claimed)
            room_tokens -= sum(s.tokens for s in claimed)

    def _spool_room(self, counts: Counts) -> int:
        """Tokens whose dumps the spool still has room for: [budget] spool_max and its file
        system's free space, less what waits there and every dump in flight, written or not
        (the spool is empty at nearly every dispatch, and one dispatch must not take more than
        the budget). A claim may go one sample past it, so that no long sample starves."""
        assert self.seen is not None  # observed before every step
        bpt = self.seen.plan.bytes_per_token
        spooled = self.spool.bytes_waiting if self.spool else 0
        room = min(self.cfg.budget.spool_max - spooled, budgets.disks(self.cfg)[1].free)
        return (room - bpt * counts.tokens.get("inflight", 0)) // bpt

    # ---- ingest ---------------------------------------------------------------------------

    def _let_go_of_spool(self) -> None:
        """End the ingest threads and the watch of a spool folder that is gone."""
        if self.spool is None:
            return
        self.stopping = True
        for thread in self.ingest_threads:
            thread.join(timeout=5.0)
        self.spool.stop()
        self.spool, self.ingest_threads, self.stopping = None, [], False

    def _ensure_ingest(self) -> None:
        if self.spool is not None or self.contract is None:
            return
        try:
            self.spool = Spool(self.cfg.paths.spool_dir, self.cfg.extract.rescan_interval_s)
        except Unsafe as exc:
            if str(exc) != self.spool_refused:
                log.error("%s", exc)
            self.spool_refused = str(exc)
            return
        self.spool_refused = None
        for i in range(self.cfg.extract.ingest_threads):
            thread = threading.Thread(target=self._ingest_loop, args=(self.spool,),
                                      name=f"ingest-{i}", daemon=True)
            thread.start()
            self.ingest_threads.append(thread)

    def _ingest_loop(self, spool: Spool) -> None:
        """Ingest what `spool` is given, until the stage stops or lets go of this spool."""
        assert self.contract is not None
        ledger = Ledger(layout.ledger(self.cfg.paths.state_dir))
        ingestor = Ingestor(ledger, spool.dir, self.cfg.paths.dataset_dir,
                            self.contract, self.cfg.extract.max_attempts, self.group_sync)
        try:
            while self.spool is spool and not (self.stopping and spool.idle):
                name = spool.take(0.2)
                if name is None:
                    continue
                try:
                    outcome = ingestor.ingest(name)
                    if outcome.kind == "ingested":
                        with self.ingest_lock:
                            self.ingested.append((time.monotonic(), outcome.tokens))
                except DiskUnwritable as exc:
                    log.warning("%s: waiting for it", exc.strerror)
                    ledger.event("disk_full", str(exc.strerror))
                    self.disk_full_why = exc.strerror
                    self.disk_full_until = time.monotonic() + DISK_FULL_BACKOFF_S
                    time.sleep(1.0)
                except Exception:
                    log.exception("ingest of %s failed; it stays in the spool", name)
                    time.sleep(1.0)
                finally:
                    spool.done(name)
        finally:
            ledger.close()

    def rates(self) -> tuple[float, float]:
        """Samples and tokens ingested per second over the last minute."""
        now = time.monotonic()
        with self.ingest_lock:
            while self.ingested and self.ingested[0][0] < now - RATE_WINDOW_S:
                self.ingested.popleft()
            if not self.ingested:
                return 0.0, 0.0
            span = max(now - self.ingested[0][0], 1.0)
            return len(self.ingested) / span, sum(t for _, t in self.ingested) / span

    # ---- status and stop ------------------------------------------------------------------

    def eta(self) -> float | None:
        _, tokens_rate = self.rates()
        if self.seen is None or tokens_rate <= 0:
            return None
        return (self.seen.counts.wanted_tokens - self.seen.counts.done_tokens) / tokens_rate

    def status(self) -> dict[str, Any]:
        engine = self.engine
        samples_rate, tokens_rate = self.rates()
        out: dict[str, Any] = {
            "restarts": self.supervisor.restarts, "restarts_total": self.supervisor.exits_total,
            "eta_s": self.eta(),
            "blocked": self.supervisor.fatal,
            "rate": {"samples_per_s": round(samples_rate, 3),
                     "tokens_per_s": round(tokens_rate, 1)},
            "spool_bytes": self.spool.bytes_waiting if self.spool else 0}
        if engine is None:
            return {**out, "status": self.supervisor.state, "kind": self.cfg.target.engine}
        if engine.ready:
            out.update(self.silence.status())
        return {**out, "status": "ready" if engine.ready else "starting", "pid": engine.pid,
                "kind": engine.kind, "device": engine.device,
                "model": getattr(engine, "model", "") or self.cfg.target.model}

    def unblock(self, all_failed: bool) -> None:
        self.supervisor.clear()

    def reconfigure(self, cfg: Config) -> None:
        self.cfg = cfg
        self.silence.bound_s = cfg.extract.engine_silence_s
        # An engine that keeps dying stays stopped: its failures are the machine's (GPU, SGLang),
        # which no reload mends (`eagle3ctl retry` does).
        self.supervisor.reconfigure(cfg.extract.engine_max_restarts, mended=False)

    def stop(self, deadline: float) -> None:
        """Let the engine finish what it holds (for up to its grace), stop it (its grace again),
        and ingest what it wrote: nothing in flight is lost, and what is left goes back to
        pending."""
        if self.engine is not None:
            self._drain(deadline)
            self.engine.stop(remaining(deadline, self.cfg.extract.engine_stop_grace_s))
            self.engine = None
        if self.spool is not None:
            self.spool.rescan(force=True)
            self.stopping = True
            for thread in self.ingest_threads:
                thread.join(timeout=remaining(deadline, 30.0))
            self.spool.stop()
            self.group_sync.flush(self.ledger)

    def _drain(self, deadline: float) -> None:
        assert self.engine is not None
        grace = self.cfg.extract.engine_stop_grace_s
        drain_until = time.monotonic() + remaining(deadline - grace, grace)
        while time.monotonic() < drain_until and self.ledger.counts().get("inflight"):
            if self.engine.poll() is not None:
                return
            self._engine_events()
            if self.spool is not None:
                self.spool.rescan(force=True)
            self.heartbeat()
            time.sleep(0.2)
