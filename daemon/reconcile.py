"""The daemon's reconcile loop: desired state (the config) in, observed state (ledger, files,
children, disks) in, one idempotent step out, every tick.

Nothing here is remembered that the facts on disk cannot tell again, except what is deliberately
short-lived (rates, backoff timers): a restart continues exactly where the files say it is.
"""

from __future__ import annotations

import collections
import logging
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

from eagle3d.capture import contract as capture_contract
from eagle3d.daemon import budgets, control
from eagle3d.daemon.children import Child, end_orphans
from eagle3d.daemon.durability import GroupSync, SyncFs
from eagle3d.daemon.engine import EngineUnavailable, start_engine
from eagle3d.daemon.ingest import DiskFull, Ingestor, remove_dataset_debris
from eagle3d.daemon.notify import Notifier
from eagle3d.daemon.spool import Spool
from eagle3d.daemon.train_stage import Training
from eagle3d.daemon.verify_stage import SpotCheck, VerifyRunner, plan_batch_item, write_manifest
from eagle3d.statemachine import manifest, stages
from eagle3d.statemachine.config import Config, ConfigError, load_config
from eagle3d.statemachine.ledger import Ledger
from eagle3d.statemachine.stages import Facts, Stage
from eagle3d.statemachine.statefile import write_state

log = logging.getLogger("eagle3d")

TICK = 0.25
STATE_EVERY = 1.0
ENGINE_STOP_GRACE = 30.0
TRAINER_STOP_GRACE = 60.0
LEDGER = "ledger.sqlite"


def prepare_dirs(cfg: Config) -> None:
    """Create the folders with no world access, and refuse ones that others can write."""
    for path, mode in ((cfg.paths.state_dir, 0o750), (cfg.paths.state_dir / "children", 0o700),
                       (control.folder(cfg.paths.state_dir), 0o700), (cfg.paths.spool_dir, 0o700),
                       (cfg.paths.dataset_dir, 0o750), (cfg.paths.train_dir, 0o750)):
        path.mkdir(parents=True, exist_ok=True, mode=mode)
        st = path.lstat()
        if path.is_symlink():
            raise ConfigError(f"{path} is a symlink; eagle3d does not follow links in its folders")
        if st.st_mode & 0o002:
            raise ConfigError(f"{path} is world-writable; run chmod o-w {path}")
        if st.st_uid not in (os.geteuid(), 0):
            raise ConfigError(f"{path} belongs to uid {st.st_uid}, not the daemon's user")


class Daemon:
    def __init__(self, cfg: Config, until: str | None = None) -> None:
        self.cfg = cfg
        self.until = until
        prepare_dirs(cfg)
        self.state_dir = cfg.paths.state_dir
        self.pid_dir = self.state_dir / "children"
        self.ledger = Ledger(self.state_dir / LEDGER)
        self.notifier = Notifier.from_env()
        self.started = time.time()
        self.stopping = False
        self.reload_requested = False
        self.config_problem: str | None = None
        self.blocked: str | None = None
        self.decision: stages.Decision | None = None
        self.stage_since = time.time()
        self.planner: Child | None = None
        self.planner_failures = 0
        self.engine: Any = None
        self.engine_restarts = 0
        self.engine_retry_at = 0.0
        self.engine_problem: str | None = None
        self.contract: dict[str, Any] | None = None
        self.spool: Spool | None = None
        self.ingest_threads: list[threading.Thread] = []
        self.ingested: collections.deque[tuple[float, int, int]] = collections.deque()
        self.ingest_lock = threading.Lock()
        # Opened before anything is written, to hear of every write-back error (durability.py).
        self.group_sync = GroupSync(cfg.paths.dataset_dir)
        self.verify_sync = SyncFs(cfg.paths.dataset_dir)
        self.disk_full_until = 0.0
        self.verify: VerifyRunner | None = None
        self.spot = SpotCheck(cfg, self.ledger)
        self.training = Training(cfg, self.pid_dir, self.ledger)
        self._fp_cache: tuple[int, str] = (-1, "")
        self._manifest_cache: tuple[int, str | None] = (-1, None)
        self._last_state = 0.0
        self._last_ping = 0.0

    # ---- life cycle ---------------------------------------------------------------------------

    def run(self) -> int:
        signal.signal(signal.SIGTERM, self._on_stop)
        signal.signal(signal.SIGINT, self._on_stop)
        signal.signal(signal.SIGHUP, self._on_hup)
        self._recover()
        self.notifier.ready()
        code = 0
        try:
            while not self.stopping:
                self.tick()
                if self.until_met():
                    if self.decision.stage == Stage.FAILED:
                        log.error("pipeline failed: %s", self.decision.reason)
                        code = 1
                    else:
                        log.info("reached stage %s", self.until)
                    break
                time.sleep(TICK)
        finally:
            self.shutdown()
        return code

    def until_met(self) -> bool:
        """`--until`: the stage is reached (not merely paused on the way), or the run failed."""
        d = self.decision
        if not self.until or d is None:
            return False
        return d.stage == Stage.FAILED or (d.stage != Stage.PAUSED and
                                           stages.reached(d.underlying, self.until))

    def _on_stop(self, signum: int, frame: Any) -> None:
        self.stopping = True

    def _on_hup(self, signum: int, frame: Any) -> None:
        self.reload_requested = True

    def _recover(self) -> None:
        """Facts first: end the previous life's children, return in-flight samples, clean up."""
        ended = end_orphans(self.pid_dir)
        if ended:
            log.warning("ended children of a previous daemon: %s", ", ".join(ended))
            self.ledger.event("orphans_ended", ", ".join(ended))
        n = self.ledger.requeue_inflight("daemon (re)started")
        if n:
            log.info("returned %d in-flight samples to pending", n)
        removed = remove_dataset_debris(self.cfg.paths.dataset_dir, self.ledger)
        if removed:
            log.info("removed %d dataset files left by an interrupted ingest", len(removed))
        self.contract = capture_contract.read(self.cfg.paths.dataset_dir)
        self.ledger.event("daemon_started", f"pid {os.getpid()}")

    def shutdown(self) -> None:
        """Stop dispatch, let the engine finish what it holds (bounded), return the rest to
        pending, checkpoint the trainer, and leave a last honest state file."""
        self.notifier.stopping()
        log.info("stopping")
        if self.planner is not None:
            self.planner.stop(10)
        if self.engine is not None:
            self._drain_engine(ENGINE_STOP_GRACE)
            self.engine.stop(10)
            self.engine = None
        self.training.stop(TRAINER_STOP_GRACE)
        if self.spool is not None:
            self.spool.rescan(force=True)
            self.stopping = True
            for t in self.ingest_threads:
                t.join(timeout=30)
            self.spool.stop()
            self.group_sync.flush(self.ledger)
        self.ledger.requeue_inflight("daemon stopped")
        self.ledger.event("daemon_stopped", f"pid {os.getpid()}")
        self._publish(final=True)

    def _drain_engine(self, grace: float) -> None:
        deadline = time.time() + grace
        while time.time() < deadline and self.ledger.counts().get("inflight"):
            if self.engine.poll() is not None:
                break
            self._engine_events()
            if self.spool is not None:
                self.spool.rescan(force=True)
            self._publish()
            time.sleep(0.2)

    # ---- the tick -----------------------------------------------------------------------------

    def tick(self) -> None:
        control.apply_all(self.state_dir, self._handle_request)
        if self.reload_requested:
            self.reload_requested = False
            self.reload()
        facts = self.observe()
        decision = stages.derive(facts)
        if self.decision is None or decision.stage != self.decision.stage:
            self.stage_since = time.time()
            log.info("stage %s: %s", decision.stage.value, decision.reason)
            self.ledger.event("stage", f"{decision.stage.value}: {decision.reason}")
            self._last_state = 0.0
        self.decision = decision
        if not self.until_met():  # `--until train` must not start the trainer it will not wait for
            self.act(decision)
        self._publish()

    def observe(self) -> Facts:
        counts = self.ledger.counts()
        # The verified set's fingerprint costs a pass over it: only worth it once the gate is
        # open, when it changes rarely (per-sample cost must stay flat at a million samples).
        fp = self.verified_fingerprint() if stages.gate(counts).open else None
        spot = self.spot.result(fp) if fp else None
        return Facts(
            counts=counts,
            plan_complete=self.plan_complete(),
            blocked=self.blocked or self.engine_problem or self.plan_conflict(),
            operator_pause=self.ledger.meta("pause"),
            budget_pause=self.budget_pause(counts),
            verify_complete=bool(fp and self.manifest_fingerprint() == fp and spot and spot[0]),
            train_done=self.training.done_for(fp),
            train_failed=self.training.failure,
            spot_check_failed=spot[1] if spot and not spot[0] else None)

    def manifest_fingerprint(self) -> str | None:
        """The manifest's fingerprint, re-read only when the file changes (it lists every
        sample: parsing it at every tick would cost more than the tick)."""
        path = self.cfg.paths.dataset_dir / manifest.FILE
        try:
            mtime = path.stat().st_mtime_ns
        except FileNotFoundError:
            return None
        if self._manifest_cache[0] != mtime:
            doc = manifest.read(self.cfg.paths.dataset_dir)
            self._manifest_cache = (mtime, doc.get("fingerprint") if doc else None)
        return self._manifest_cache[1]

    def act(self, d: stages.Decision) -> None:
        working = d.stage == d.underlying
        self._step_plan(d.underlying == Stage.PLAN and working)
        if self.contract is None:
            self.contract = capture_contract.read(self.cfg.paths.dataset_dir)
        self._ensure_ingest()
        self._engine_events()
        # A pause holds dispatch back, not the loaded model: resuming must not pay its load again.
        # A re-plan (a larger limit) keeps it too: extraction resumes right after.
        needed = d.underlying == Stage.EXTRACT or (d.underlying == Stage.VERIFY
                                                   and self.cfg.verify.spot_checks > 0)
        if needed and d.stage != Stage.FAILED:
            self._ensure_engine()
        elif self.engine is not None and (d.underlying in (Stage.TRAIN, Stage.DONE)
                                          or d.stage == Stage.FAILED):
            log.info("stopping the engine: stage %s needs no target model", d.stage.value)
            # One still loading holds nothing worth waiting for.
            self.engine.stop(ENGINE_STOP_GRACE if self.engine.ready else 0)
            self.engine = None
        if d.underlying == Stage.EXTRACT:
            self._expire_inflight()
            if working:
                self._dispatch()
        if d.underlying == Stage.VERIFY and working:
            self._step_verify()
        if d.underlying == Stage.TRAIN and working:
            self.training.step(self.verified_fingerprint())

    # ---- plan ---------------------------------------------------------------------------------

    def plan_complete(self) -> bool:
        m = self.ledger.meta
        through = m("plan.through")
        if m("plan.source") != self.cfg.data.source or through is None:
            return False
        if m("plan.first") != str(self.cfg.data.first) or \
                m("plan.max_tokens") != str(self.cfg.data.max_tokens):
            return False
        return int(through) >= self.cfg.data.first + self.cfg.data.limit - 1 or \
            m("plan.exhausted") == "1"

    def plan_conflict(self) -> str | None:
        """A config whose data slice no longer matches what this ledger was planned from."""
        m = self.ledger.meta
        if m("plan.source") is None:
            return None
        changed = [k for k, v in (("source", self.cfg.data.source), ("first", str(self.cfg.data.first)),
                                  ("max_tokens", str(self.cfg.data.max_tokens)))
                   if m(f"plan.{k}") != v]
        if not changed:
            return None
        return (f"[data] {', '.join(changed)} changed since this dataset was planned "
                f"(was {', '.join(str(m('plan.' + k)) for k in changed)}); point [paths] "
                "state_dir and dataset_dir at new folders to start a new dataset")

    def _step_plan(self, wanted: bool) -> None:
        """Start the planner when the plan is wanted; reap it whenever it exits (the stage may
        move on, from the ledger's plan.* keys, before its exit is seen)."""
        if self.planner is None:
            if wanted:
                self.planner = Child("planner", [sys.executable, "-m", "eagle3d.capture.planner",
                                                 "-c", str(self.cfg.path)], self.pid_dir)
            return
        code = self.planner.poll()
        if code is None:
            return
        self.planner = None
        if code == 0:
            self.planner_failures = 0
            return
        if code == 3:
            self.blocked = ("the config does not match this dataset's capture contract; see the "
                            "log for the differences, and point [paths] dataset_dir and "
                            "state_dir at new folders to start a new dataset")
            return
        self.planner_failures += 1
        if self.planner_failures >= 3:
            self.blocked = f"the planner failed {self.planner_failures} times (exit {code}); see the log"

    # ---- extract ------------------------------------------------------------------------------

    def _ensure_ingest(self) -> None:
        if self.spool is not None or self.contract is None:
            return
        self.spool = Spool(self.cfg.paths.spool_dir, self.cfg.extract.rescan_interval_s)
        for i in range(self.cfg.extract.ingest_threads):
            t = threading.Thread(target=self._ingest_loop, name=f"ingest-{i}", daemon=True)
            t.start()
            self.ingest_threads.append(t)

    def _ingest_loop(self) -> None:
        assert self.spool is not None and self.contract is not None
        ledger = Ledger(self.state_dir / LEDGER)
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
                            self.ingested.append((time.time(), outcome.tokens, outcome.nbytes))
                except DiskFull as exc:
                    log.warning("%s: waiting for space", exc.strerror)
                    ledger.event("disk_full", str(exc.strerror))
                    self.disk_full_until = time.time() + 5.0
                    time.sleep(1.0)
                except Exception:
                    log.exception("ingest of %s failed; it stays in the spool", name)
                    time.sleep(1.0)
                finally:
                    self.spool.done(name)
        finally:
            ledger.close()

    def _ensure_engine(self) -> None:
        if self.engine is not None:
            code = self.engine.poll()
            if code is None:
                return
            held = self.ledger.expired_inflight(float("inf"))
            for sid in held:
                self.ledger.mark_retry(sid, f"the engine exited with code {code}",
                                       self.cfg.extract.max_attempts)
            n = len(held)
            self.spot.abandon()
            self.engine = None
            self.engine_restarts += 1
            self.ledger.event("engine_exit", f"code {code}, {n} in-flight samples returned")
            log.warning("the engine exited with code %s; %d in-flight samples returned", code, n)
            if self.engine_restarts > self.cfg.extract.engine_max_restarts:
                self.engine_problem = (f"the engine exited {self.engine_restarts} times "
                                       f"([extract] engine_max_restarts = "
                                       f"{self.cfg.extract.engine_max_restarts}); see the log")
                return
            self.engine_retry_at = time.time() + min(60.0, 2.0 ** self.engine_restarts)
        if time.time() < self.engine_retry_at or self.contract is None or self.engine_problem:
            return
        try:
            self.engine = start_engine(self.cfg, self.pid_dir, self.contract)
        except EngineUnavailable as exc:
            self.engine_problem = str(exc)
            log.error("cannot start the engine: %s", exc)
            self.ledger.event("engine_unavailable", str(exc))

    def _engine_events(self) -> None:
        if self.engine is None:
            return
        for ev in self.engine.events():
            if ev.get("event") == "error" and ev.get("kind") == "disk_full":
                self.ledger.release(ev.get("ids", []), f"spool full: {ev.get('error')}")
                self.disk_full_until = time.time() + 5.0
            elif ev.get("event") == "error":
                for sid in ev.get("ids", []):
                    self.ledger.mark_retry(sid, f"engine: {ev.get('error', 'unknown error')}",
                                           self.cfg.extract.max_attempts)
            elif ev.get("event") == "done" and self.spool is not None:
                self.spool.rescan(force=True)  # the dumps are there now: do not wait for hints
        if self.spot.waiting:
            self.spot.poll()

    def _expire_inflight(self) -> None:
        cutoff = time.time() - self.cfg.extract.inflight_timeout_s
        for sid in self.ledger.expired_inflight(cutoff):
            self.ledger.mark_retry(sid, f"no dump within {self.cfg.extract.inflight_timeout_s:.0f} s",
                                   self.cfg.extract.max_attempts)

    def _dispatch(self) -> None:
        if self.engine is None or not self.engine.ready or time.time() < self.disk_full_until:
            return
        x = self.cfg.extract
        counts = self.ledger.counts()
        room_samples = x.max_inflight_samples - counts.get("inflight")
        room_tokens = x.max_inflight_tokens - counts.tokens.get("inflight", 0)
        while room_samples > 0 and room_tokens > 0:
            claimed = self.ledger.claim(room_samples, min(room_tokens, x.batch_tokens))
            if not claimed:
                return
            tokens = self.ledger.plan_tokens([s.id for s in claimed])
            self.engine.submit([plan_batch_item(s.id, *tokens[s.id]) for s in claimed],
                               self.cfg.paths.spool_dir)
            room_samples -= len(claimed)
            room_tokens -= sum(s.tokens for s in claimed)

    def budget_pause(self, counts: Any) -> str | None:
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

    # ---- verify -------------------------------------------------------------------------------

    def verified_fingerprint(self) -> str:
        """The fingerprint of the verified set, recomputed only after ledger events (cheap)."""
        seq = self.ledger.db.execute("SELECT max(seq) FROM events").fetchone()[0] or 0
        if seq != self._fp_cache[0]:
            self._fp_cache = (seq, manifest.ledger_fingerprint(self.ledger))
        return self._fp_cache[1]

    def _step_verify(self) -> None:
        assert self.contract is not None
        if self.verify is None:
            self.verify = VerifyRunner(self.cfg, self.state_dir / LEDGER, self.contract,
                                       self.verify_sync)
        counts = self.ledger.counts()
        if counts.get("extracted"):
            self.verify.start()
            return
        if self.verify.running or not stages.gate(counts).open:
            return
        fp = self.verified_fingerprint()
        if self.spot.result(fp) is None:
            if not self.spot.waiting:
                if self.engine is None or not self.engine.ready:
                    return
                self.spot.start(fp, self.engine)
            return
        write_manifest(self.cfg, self.ledger, self.contract)

    # ---- control and reload -------------------------------------------------------------------

    def _handle_request(self, req: control.Request) -> str:
        a = req.args
        if req.verb == "pause":
            reason = str(a.get("reason") or "no reason given")
            self.ledger.set_meta("pause", f"{reason} (since {time.strftime('%Y-%m-%d %H:%M:%S')})")
            self.ledger.event("paused", reason)
            return "paused: no new work is dispatched; in-flight work finishes"
        if req.verb == "resume":
            self.ledger.db.execute("DELETE FROM meta WHERE key = 'pause'")
            self.ledger.event("resumed")
            return "resumed"
        if req.verb == "retry":
            ids = None if a.get("failed") else _ids(a)
            unknown = [i for i in ids or [] if self.ledger.sample(i) is None]
            if unknown:
                raise ValueError(f"unknown sample ids: {', '.join(unknown[:5])}")
            self.training.failure = None if ids is None else self.training.failure
            self.engine_problem = None
            self.blocked = None
            return f"{self.ledger.retry(ids)} samples back to pending"
        if req.verb == "exclude":
            ids = _ids(a)
            reason = str(a.get("reason") or "").strip()
            if not reason:
                raise ValueError("an exclusion needs --reason")
            unknown = [i for i in ids if self.ledger.sample(i) is None]
            if unknown:
                raise ValueError(f"unknown sample ids: {', '.join(unknown[:5])}")
            return f"{self.ledger.exclude(ids, reason)} samples excluded: {reason}"
        if req.verb == "verify-full":
            with self.ledger.transaction() as db:
                n = db.execute("UPDATE samples SET status = 'extracted', updated_at = ? WHERE "
                               "status = 'verified'", (time.time(),)).rowcount
                self.ledger.event("verify_full", f"{n} verified samples to verify again", None, db)
            return f"{n} verified samples will be verified again"
        raise ValueError(f"unknown verb {req.verb}")

    def reload(self) -> None:
        """SIGHUP: take a new config if it validates and keeps the dataset's contract."""
        self.notifier.reloading()
        try:
            new = load_config(self.cfg.path)
            problem = reload_problem(self.cfg, new)
        except ConfigError as exc:
            problem = f"the new config does not validate: {exc}"
        if problem:
            self.config_problem = f"reload refused, the old config stays in force: {problem}"
            log.error("%s", self.config_problem)
            self.ledger.event("reload_refused", problem)
        else:
            self.cfg = new
            self.config_problem = None
            for part in (self.training, self.spot, self.verify):
                if part is not None:
                    part.cfg = new
            self.blocked = None
            self.training.failure = None
            log.info("config reloaded from %s", new.path)
            self.ledger.event("reloaded", str(new.path))
        self.notifier.ready()

    # ---- publishing ---------------------------------------------------------------------------

    def _rates(self) -> tuple[float, float]:
        now = time.time()
        with self.ingest_lock:
            while self.ingested and self.ingested[0][0] < now - 60:
                self.ingested.popleft()
            if not self.ingested:
                return 0.0, 0.0
            span = max(now - self.ingested[0][0], 1.0)
            return len(self.ingested) / span, sum(t for _, t, _ in self.ingested) / span

    def _publish(self, final: bool = False) -> None:
        now = time.time()
        ping = self.notifier.watchdog_interval()
        if ping is not None and now - self._last_ping >= ping:
            self.notifier.watchdog()
            self._last_ping = now
        if not final and now - self._last_state < STATE_EVERY:
            return
        self._last_state = now
        state = self.snapshot(final)
        write_state(self.state_dir, state)
        s = state["samples"]
        self.notifier.status(f"{state['stage']}: {s['verified'] + s['extracted']}/{s['total']} "
                             f"samples, {state['tokens']['done']}/{state['tokens']['total']} "
                             f"tokens; {state['reason']}")

    def snapshot(self, final: bool = False) -> dict[str, Any]:
        counts = self.ledger.counts()
        d = self.decision
        samples_rate, tokens_rate = self._rates()
        done_tokens, total_tokens = counts.done_tokens, counts.wanted_tokens
        bpt = int(self.ledger.meta("plan.bytes_per_token", "0") or 0)
        eta = None
        stage = d.underlying.value if d else "plan"
        if stage == "extract" and tokens_rate > 0:
            eta = (total_tokens - done_tokens) / tokens_rate
        elif stage == "verify" and self.verify and self.verify.rate() > 0:
            eta = sum(counts.bytes.get(s, 0) for s in ("extracted",)) / self.verify.rate()
        trainer = self.training.progress()
        if stage == "train" and trainer.get("eta_s") is not None:
            eta = trainer["eta_s"]
        return {
            "stage": "stopped" if final else "stopping" if self.stopping else (
                d.stage.value if d else "plan"),
            "underlying": stage,
            "reason": ("daemon stopped; " + (d.reason if d else "")) if final else (d.reason if d else ""),
            "since": self.stage_since,
            "updated": time.time(),
            "config": {"path": str(self.cfg.path), "problem": self.config_problem},
            "samples": {**{k: counts.get(k) for k in ("pending", "inflight", "extracted",
                                                      "verified", "failed", "excluded")},
                        "total": counts.total, "skipped": self.ledger.skipped_count()},
            "tokens": {"done": done_tokens, "total": total_tokens},
            "rate": {"samples_per_s": round(samples_rate, 3), "tokens_per_s": round(tokens_rate, 1)},
            "eta_s": None if eta is None else round(eta, 1),
            "bytes": {"written": sum(counts.bytes.values()), "projected": bpt * total_tokens,
                      "spool": self.spool.bytes_waiting if self.spool else 0},
            "disk": [{"role": x.role, "path": x.path, "free": x.free, "total": x.total}
                     for x in budgets.disks(self.cfg)],
            "engine": self._engine_state(),
            "trainer": trainer,
            "verify": ({"done": self.verify.done, "total": self.verify.total,
                        "running": self.verify.running, "failures": self.verify.failures}
                       if self.verify else None),
            "gate": {"open": stages.gate(counts).open, "describe": stages.gate(counts).describe()},
            "daemon": {"pid": os.getpid(), "started": self.started, "heartbeat": time.time(),
                       "alive": not final},
        }

    def _engine_state(self) -> dict[str, Any]:
        if self.engine is None:
            return {"status": "stopped", "restarts": self.engine_restarts,
                    "kind": self.cfg.target.engine, "problem": self.engine_problem}
        return {"status": "ready" if self.engine.ready else "starting", "pid": self.engine.pid,
                "restarts": self.engine_restarts, "kind": self.engine.kind,
                "device": self.engine.device}


def reload_problem(old: Config, new: Config) -> str | None:
    """Why a new config cannot be taken on the fly, or None."""
    if new.paths != old.paths:
        return ("[paths] changed: restart the daemon to switch to other folders "
                "(systemctl restart eagle3d)")
    a, b = old.contract_keys(), new.contract_keys()
    changed = [k for k in a if a[k] != b[k]]
    if changed:
        return (f"{', '.join(changed)} would break the dataset's capture contract; point "
                "[paths] dataset_dir and state_dir at new folders for a new dataset")
    if new.target.engine != old.target.engine:
        return "[target] engine changed: restart the daemon to switch engines"
    return None


def _ids(args: dict[str, Any]) -> list[str]:
    ids = args.get("ids")
    if not isinstance(ids, list) or not ids or not all(isinstance(i, str) for i in ids):
        raise ValueError("give one or more sample ids")
    return ids


def run(config_path: str, until: str | None) -> int:
    try:
        cfg = load_config(config_path)
        daemon = Daemon(cfg, until)
    except ConfigError as exc:
        log.error("%s", exc)
        return 2
    return daemon.run()


