"""The daemon's reconcile loop: desired state (the config) in, observed state (ledger, files,
children, disks) in, one idempotent step out, every tick.

    observe  each stage reports its facts (statemachine/stages.Facts)
    derive   the stage follows from the facts alone (statemachine/stages.derive)
    step     every stage takes its one step for that decision (daemon/*_stage.py)
    publish  state.toml, sd_notify STATUS and the watchdog ping

Nothing here is remembered that the facts on disk cannot tell again, except what is deliberately
short-lived (rates, backoff timers): a restart continues exactly where the files say it is.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from typing import Any

from eagle3d.daemon import control, requests
from eagle3d.daemon import pipeline
from eagle3d.daemon.children import end_orphans
from eagle3d.daemon.engine import start_engine
from eagle3d.daemon.extract_stage import EngineFactory
from eagle3d.daemon.ingest import remove_dataset_debris
from eagle3d.daemon.notify import Notifier
from eagle3d.daemon.snapshot import snapshot
from eagle3d.statemachine import entry, layout, pointer, stages
from eagle3d.statemachine.atomic import remove_dead_temps
from eagle3d.statemachine.config import (STOP_BUDGET_S, Config, ConfigError, daemon_problem,
                                          load_config, reload_problem, write_in_force)
from eagle3d.statemachine.ledger import Ledger
from eagle3d.statemachine.stages import Decision, Facts, Seen, Stage
from eagle3d.statemachine.statefile import write_state

log = logging.getLogger("eagle3d")

TICK = 0.25
STATE_EVERY = 1.0


def prepare_dirs(cfg: Config) -> None:
    """Create the folders with no world access, and refuse ones that others can write: a
    group or world member could plant a dump, a pid file or a control request."""
    state = cfg.paths.state_dir
    for path, mode in ((state, 0o750), (layout.children_dir(state), 0o700),
                       (layout.control_dir(state), 0o700), (cfg.paths.spool_dir, 0o700),
                       (cfg.paths.dataset_dir, 0o750), (cfg.paths.train_dir, 0o750)):
        path.mkdir(parents=True, exist_ok=True, mode=mode)
        st = path.lstat()
        if path.is_symlink():
            raise ConfigError(f"{path} is a symlink; eagle3d does not follow links in its folders")
        if st.st_mode & 0o022:
            raise ConfigError(f"{path} is writable by its group or by everyone; run "
                              f"chmod go-w {path}")
        if st.st_uid not in (os.geteuid(), 0):
            raise ConfigError(f"{path} belongs to uid {st.st_uid}, not the daemon's user")


class Daemon:
    def __init__(self, cfg: Config, until: str | None = None,
                 engine_factory: EngineFactory = start_engine) -> None:
        problem = daemon_problem(cfg)
        if problem:
            raise ConfigError(problem)
        self.cfg = cfg
        self.until = until
        prepare_dirs(cfg)
        write_in_force(cfg)  # before any child: children start from it, never from cfg.path
        pointer.write(cfg.path, cfg.paths.state_dir)  # eagle3ctl finds this daemon by cfg.path
        pid_dir = layout.children_dir(cfg.paths.state_dir)
        self.ledger = Ledger(layout.ledger(cfg.paths.state_dir))
        self.notifier = Notifier.from_env()
        self.started = time.time()
        self.stopping = False
        self.reload_requested = False
        self.config_problem: str | None = None
        self.config_problem_since: float | None = None
        self.decision: Decision | None = None
        self.stage_since = time.time()
        self.stages, self.verified_fingerprint = pipeline.build(
            cfg, self.ledger, pid_dir, engine_factory, heartbeat=self.publish)
        self._last_state = 0.0
        self._last_ping = 0.0

    # ---- life cycle ---------------------------------------------------------------------------

    def run(self) -> int:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._on_stop)
        signal.signal(signal.SIGHUP, self._on_hup)
        self.recover()
        self.notifier.ready()
        code = 0
        try:
            while not self.stopping:
                self.tick()
                if self.until_met():
                    assert self.decision is not None
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

    def recover(self) -> None:
        """Facts first: end the previous life's children, return in-flight samples, clean up."""
        ended = end_orphans(layout.children_dir(self.cfg.paths.state_dir))
        if ended:
            log.warning("ended children of a previous daemon: %s", ", ".join(ended))
            self.ledger.event("orphans_ended", ", ".join(ended))
        n = self.ledger.requeue_inflight("daemon (re)started")
        if n:
            log.info("returned %d in-flight samples to pending", n)
        for name in remove_dead_temps(self.cfg.paths.state_dir) + remove_dead_temps(
                self.cfg.paths.train_dir):
            log.info("removed %s: its writer is gone", name)
        removed = remove_dataset_debris(self.cfg.paths.dataset_dir, self.ledger)
        if removed:
            log.info("removed %d dataset files left by an interrupted ingest", len(removed))
        self.ledger.event("daemon_started", f"pid {os.getpid()}")

    def shutdown(self) -> None:
        """Stop dispatch, let the engine finish what it holds, return the rest to pending,
        checkpoint the trainer, and leave a last honest state file: all within STOP_BUDGET_S."""
        deadline = time.monotonic() + STOP_BUDGET_S
        self.notifier.stopping()
        log.info("stopping (within %.0f s)", STOP_BUDGET_S)
        self.stopping = True
        # Last stage first: the trainer's checkpoint is never squeezed by the ingest's wait.
        for stage in reversed(self.stages):
            stage.stop(deadline)
        self.ledger.requeue_inflight("daemon stopped")
        self.ledger.event("daemon_stopped", f"pid {os.getpid()}")
        self.publish(final=True)
        pointer.remove(self.cfg.path)

    # ---- the tick -----------------------------------------------------------------------------

    def tick(self) -> None:
        control.apply_all(self.cfg.paths.state_dir,
                          lambda request: requests.handle(request, self.ledger, self.unblock))
        if self.reload_requested:
            self.reload_requested = False
            self.reload()
        decision = stages.derive(self.observe())
        if self.decision is None or decision.stage != self.decision.stage:
            self.stage_since = time.time()
            log.info("stage %s: %s", decision.stage.value, decision.reason)
            self.ledger.event("stage", f"{decision.stage.value}: {decision.reason}")
            self._last_state = 0.0
        self.decision = decision
        if not self.until_met():  # `--until train` must not start the trainer it will not wait for
            for stage in self.stages:
                stage.step(decision)
        self.publish()

    def observe(self) -> Facts:
        counts = self.ledger.counts()
        # The verified set's fingerprint costs a pass over it: only worth it once the gate is
        # open, when it changes rarely (per-sample cost must stay flat at a million samples).
        seen = Seen(counts, self.verified_fingerprint() if stages.gate(counts).open else None)
        facts: dict[str, Any] = {}
        blocked = []
        for stage in self.stages:
            part = stage.observe(seen)
            blocked.append(part.pop("blocked", None))
            facts.update(part)
        return Facts(counts=counts, operator_pause=self.ledger.meta("pause"),
                     blocked=next((b for b in blocked if b), None), **facts)

    def unblock(self, all_failed: bool) -> None:
        """An operator's retry: the stages try again what had stopped them."""
        for stage in self.stages:
            stage.unblock(all_failed)

    def reload(self) -> None:
        """SIGHUP: take a new config if it validates and keeps the dataset's contract."""
        self.notifier.reloading()
        try:
            new = load_config(self.cfg.path)
            plan = next(s for s in self.stages if s.name == Stage.PLAN.value)
            problem = reload_problem(self.cfg, new, plan.conflict() is None)
        except ConfigError as exc:
            problem = f"the new config does not validate: {exc}"
        if problem:
            self.config_problem = f"reload refused, the old config stays in force: {problem}"
            self.config_problem_since = time.time()
            log.error("%s", self.config_problem)
            self.ledger.event("reload_refused", problem)
        else:
            write_in_force(new)
            self.cfg = new
            self.config_problem = None
            for stage in self.stages:
                stage.reconfigure(new)
            log.info("config reloaded from %s", new.path)
            self.ledger.event("reloaded", str(new.path))
        self.notifier.ready()

    # ---- publishing ---------------------------------------------------------------------------

    def publish(self, final: bool = False) -> None:
        now = time.time()
        ping = self.notifier.watchdog_interval()
        if ping is not None and now - self._last_ping >= ping:
            self.notifier.watchdog()
            self._last_ping = now
        if not final and now - self._last_state < STATE_EVERY:
            return
        self._last_state = now
        state = snapshot(self, final)
        write_state(self.cfg.paths.state_dir, state)
        s = state["samples"]
        self.notifier.status(f"{state['stage']}: {s['verified'] + s['extracted']}/{s['total']} "
                             f"samples, {state['tokens']['done']}/{state['tokens']['total']} "
                             f"tokens; {state['reason']}")


def run(config_path: str, until: str | None) -> int:
    try:
        daemon = Daemon(load_config(config_path), until)
    except ConfigError as exc:
        log.error("%s", exc)
        return entry.REFUSED
    return daemon.run()
