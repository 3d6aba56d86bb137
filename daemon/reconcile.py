"""The daemon's reconcile loop: desired state (the config) in, observed state (ledger, files,
children, disks) in, one idempotent step out, every tick.

    observe  each stage reports its facts (statemachine/stages.Facts)
    derive   the stage follows from the facts alone (statemachine/stages.derive)
    step     every stage takes its one step for that decision (daemon/stages/)
    publish  state.toml, sd_notify STATUS and the watchdog ping

Nothing here is remembered that the facts on disk cannot tell again, except what is deliberately
short-lived (rates, backoff timers): a restart continues exactly where the files say it is.

The loop never dies of a tick's error (daemon/condition.py): it becomes the loop's condition,
shown by status and retried with backoff while the watchdog pings and the heartbeat go on.
Only the documented terminal conditions end the process, with exit 2 (entry.REFUSED), which the
unit does not restart: a config invalid at start, another daemon holding the state folder.
Every interval runs on the monotonic clock: a clock step never silences the watchdog.

The daemon works on one run at a time (statemachine/runs.py): the run of the config's capture
contract. A reload that edits a contract key switches runs: the current run's stages stop within
their bounds, its state stays as it is, and the stages are built again for the run of the new
contract, resumed or new. The stop takes up to the sum of the graces (a trainer's checkpoint,
the engine's batch): it runs beside the loop, which meanwhile pings the watchdog and publishes
"switching", and takes no request until the new run's stages are there.
"""

from __future__ import annotations

import logging
import os
import signal
import sqlite3
import threading
import time
from pathlib import Path
from typing import Any, Callable, NamedTuple

from eagle3d.capture import engines
from eagle3d.daemon import budgets, control, metrics, pipeline, progress, requests, run_select
from eagle3d.daemon.children import end_orphans
from eagle3d.daemon.condition import Conditions, StartFailed, describe, start_failure
from eagle3d.daemon.engine import start_engine
from eagle3d.daemon.ingest import remove_dataset_debris
from eagle3d.daemon.notify import Notifier
from eagle3d.daemon.snapshot import snapshot
from eagle3d.daemon.stages.extract import EngineFactory
from eagle3d.statemachine import (daemon_lock, entry, layout, plan_meta, pointer, runs,
                                  safepath, stages)
from eagle3d.statemachine.atomic import remove_dead_temps
from eagle3d.statemachine.config_in_force import write_in_force
from eagle3d.statemachine.config_schema import STOP_BUDGET_S, Config
from eagle3d.statemachine.config_validation import ConfigError, load_config
from eagle3d.statemachine.reload_policy import NEEDS_RESTART, REFUSED, daemon_problem
from eagle3d.statemachine.ledger import Ledger
from eagle3d.statemachine.stages import Decision, Facts, Seen, Stage
from eagle3d.statemachine.statefile import write_state

log = logging.getLogger("eagle3d")

TICK = 0.25
STATE_EVERY = 1.0
# The longest a ledger statement of the loop waits for another process's lock: well under half
# the unit's watchdog (90 s), so a tick of a few statements never outlasts a ping. Past it the
# tick fails, and the loop shows "ledger locked" and retries.
LEDGER_BUSY_S = 2.0


class Switching(NamedTuple):
    """A run switch under way: the set-aside run's stages stop in `stopper`, the loop publishes
    `state` (their last snapshot) as "switching" meanwhile, and then goes on with `new`."""
    new: Config
    weights: str
    stopper: threading.Thread
    state: dict[str, Any]


def prepare_dirs(cfg: Config) -> None:
    """Create the folders with no world access, and refuse ones that others can write, or that
    lie in a folder another user could swap them in (a shard's or a run's folder is checked up
    through its root): a group or world member could plant a dump, a pid file or a control
    request, or have the daemon delete in a folder of their choosing."""
    state = cfg.paths.state_dir
    for path, mode in ((state, 0o750), (layout.children_dir(state), 0o700),
                       (layout.control_dir(state), 0o700), (cfg.paths.spool_dir, 0o700),
                       (cfg.paths.dataset_dir, 0o750), (cfg.paths.train_dir, 0o750)):
        problem = safepath.folder_problem(path, mode)
        if problem:
            raise ConfigError(problem)


class Daemon:
    def __init__(self, cfg: Config, until: str | None = None,
                 engine_factory: EngineFactory = start_engine) -> None:
        problem = daemon_problem(cfg) or budgets.never_met(cfg)
        if problem:
            raise ConfigError(problem)
        self.root_cfg = cfg  # the configured folders: the runs live under them
        self.cfg = cfg  # the current run's once entered: the ledger a failed start names
        self.until = until
        self.engine_factory = engine_factory
        try:
            prepare_dirs(cfg)
            # Before anything that acts on the folder: ending orphans, the config in force, the
            # ledger.
            self.lock = daemon_lock.hold(cfg.paths.state_dir)
        except Exception as exc:
            raise start_failure(exc, layout.ledger(cfg.paths.state_dir)) from None
        # Every run's children have their pid files here, so that a daemon restarted on another
        # run still ends the orphans of the run it crashed in.
        self.pid_dir = layout.children_dir(cfg.paths.state_dir)
        self.notifier = Notifier.from_env()
        self.started = time.time()
        self.stopping = False
        self.reload_requested = False
        self.config_problem: str | None = None
        self.config_problem_since: float | None = None
        self.switched: str | None = None  # which run was set aside for which, for status
        self.metrics_problem: str | None = None  # why the metrics textfile cannot be written
        self.switching: Switching | None = None
        self.set_aside: list[tuple[runs.Run, int]] = []  # the last sizes known
        self.aside: list[runs.Run] = []  # the set-aside runs, as the registry says now
        self._sizing: threading.Thread | None = None
        self._publishing = threading.Lock()  # a stop's heartbeat publishes from its thread
        self.conditions = Conditions()
        self.state_reserve = budgets.StateReserve(cfg.paths.state_dir)
        self.state_disk_pause: str | None = None
        self.phase = "starting"  # what the loop is doing, for a condition's reason
        self.publish_problems: dict[str, str | None] = {}  # of publishing's parts, by part
        self.stale_state: dict[str, Any] | None = None  # while the state file cannot be written
        self._last_snapshot: dict[str, Any] | None = None
        self._last_ping = float("-inf")  # monotonic, as every interval here
        self._last_progress = float("-inf")  # monotonic: a clock step never silences them
        try:
            self.enter(run_select.select(cfg))
        except Exception as exc:
            self.lock.close()  # nothing else is held yet: no child runs before the first tick
            raise start_failure(exc, layout.ledger(self.cfg.paths.state_dir)) from None

    def enter(self, selected: runs.Selected) -> None:
        """Work on `selected`'s run from now on: its folders, its ledger, its stages."""
        self.current = selected.run
        self.cfg = runs.run_config(self.root_cfg, selected.run)
        prepare_dirs(self.cfg)
        write_in_force(self.cfg)  # before any child: children start from it, never from cfg.path
        self.ledger = Ledger(layout.ledger(self.cfg.paths.state_dir), timeout=LEDGER_BUSY_S)
        self.decision: Decision | None = None
        self.stage_since = time.time()
        self.stages, self.verified_fingerprint = pipeline.build(
            self.cfg, self.ledger, self.pid_dir, self.engine_factory, heartbeat=self.publish)
        self._registry_seen = self._registry_sized = -1.0
        self.note_set_aside()
        log.info("run %s (%s) in %s", selected.run.id, "new" if selected.new else "resumed",
                 self.cfg.paths.dataset_dir)
        if selected.set_aside is not None:  # at a reload, or at a start with another contract
            self.switched = (f"{selected.set_aside.id} set aside, {selected.run.id} "
                             f"{'started' if selected.new else 'resumed'}")
            log.info("runs: %s", self.switched)
            self.ledger.event("run_current", self.switched)
        # eagle3ctl finds this daemon, and its run, by the editable file's path: only once the
        # run's first state file is there, else a status taken between the two would read a run
        # that 'has not started' while the daemon works on it.
        self._last_state = float("-inf")
        self.publish()
        pointer.write(self.cfg.path, self.cfg.paths.state_dir, self.root_cfg.paths._asdict())

    # ---- life cycle ---------------------------------------------------------------------------

    def run(self) -> int:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._on_stop)
        signal.signal(signal.SIGHUP, self._on_hup)
        code = 0
        try:
            while not self.stopping and not self.attempt(self.recover):
                time.sleep(TICK)
            self.notifier.ready()
            while not self.stopping:
                self.attempt(self.tick)
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

    def attempt(self, step: Callable[[], None]) -> bool:
        """One try of `step` (a tick, or the recovery before the first), unless a condition's
        backoff runs: then only the watchdog's ping and the heartbeat. An error becomes the
        loop's condition, recorded once per reason; True when `step` went through."""
        if self.conditions.waiting():
            self.publish()
            return False
        try:
            step()
        except Exception as exc:  # the loop's contract: no error of a tick ends the daemon
            reason = describe(self.phase, exc, layout.ledger(self.cfg.paths.state_dir))
            if self.conditions.failed(reason, exc):
                self.record("condition", reason)
            self._last_state = float("-inf")  # shown at once
            self.publish()
            return False
        was = self.conditions.cleared()
        if was is not None:
            self.record("condition_cleared", f"after {was.retries} failed ticks: {was.reason}")
            self._last_state = float("-inf")
            self.publish()
        return True

    def record(self, kind: str, detail: str) -> None:
        """A ledger event where the ledger takes it: the log has it anyway."""
        try:
            self.ledger.event(kind, detail)
        except sqlite3.Error as exc:
            log.warning("ledger event %s not recorded (%s): %s", kind, exc, detail)

    def _on_stop(self, signum: int, frame: Any) -> None:
        self.stopping = True

    def _on_hup(self, signum: int, frame: Any) -> None:
        self.reload_requested = True

    def note_set_aside(self) -> None:
        """The set-aside runs, read again whenever the registry changes (a run forgotten by
        eagle3ctl): a stat per tick, the registry read per change, so that a request in a
        set-aside run's folder is answered at the next tick. Their sizes: a walk of their
        folders per change, in a thread of its own (seconds per million dumps, longer than
        eagle3ctl waits for an answer); the last sizes known meanwhile."""
        root = self.root_cfg.paths.state_dir
        try:
            mtime = layout.runs_registry(root).stat().st_mtime
        except FileNotFoundError:
            mtime = 0.0
        if mtime != self._registry_seen:
            try:
                self.aside = runs.set_aside_runs(runs.read(root))
                self._registry_seen = mtime
            except ConfigError:
                pass  # edited by hand: the last runs known, read again at the next tick
        if mtime != self._registry_sized and not (self._sizing and self._sizing.is_alive()):
            self._registry_sized = mtime
            self._sizing = threading.Thread(target=self._size_set_aside, args=(root,),
                                            name="set-aside-sizes", daemon=True)
            self._sizing.start()

    def _size_set_aside(self, root: Path) -> None:
        self.set_aside = runs.set_aside(root)  # one assignment: the old list or the new, whole

    def recover(self) -> None:
        """Facts first: end the previous life's children, return in-flight samples, clean up."""
        self.phase = "recovering from the previous daemon's life"
        ended = end_orphans(self.pid_dir)
        if ended:
            log.warning("ended children of a previous daemon: %s", ", ".join(ended))
            self.ledger.event("orphans_ended", ", ".join(ended))
        self.recover_run("daemon (re)started")
        requests.adopt_ledger_pause(self.ledger, self.root_cfg.paths.state_dir)
        self.ledger.event("daemon_started", f"pid {os.getpid()}")

    def recover_run(self, why: str) -> None:
        """The run's own debris: in-flight samples back to pending, dead temp files, dataset
        files of an interrupted ingest."""
        n = self.ledger.requeue_inflight(why)
        if n:
            log.info("returned %d in-flight samples to pending", n)
        # The train folder is the training node's alone: the other shards share it, not its work.
        folders = (self.cfg.paths.state_dir, self.cfg.paths.dataset_dir,
                   *((self.cfg.paths.train_dir,) if self.cfg.shard.trains else ()))
        for name in (name for folder in folders for name in remove_dead_temps(folder)):
            log.info("removed %s: its writer is gone", name)
        removed = remove_dataset_debris(self.cfg.paths.dataset_dir, self.ledger)
        if removed:
            log.info("removed %d dataset files left by an interrupted ingest", len(removed))

    def shutdown(self) -> None:
        """Stop dispatch, let the engine finish what it holds, return the rest to pending,
        checkpoint the trainer, and leave a last honest state file: all within STOP_BUDGET_S."""
        deadline = time.monotonic() + STOP_BUDGET_S
        self.notifier.stopping()
        log.info("stopping (within %.0f s)", STOP_BUDGET_S)
        self.stopping = True
        try:
            if self.switching is not None:  # the set-aside run's stages are stopping already
                self.switching.stopper.join(max(0.0, deadline - time.monotonic()))
                self.switching = None  # the run stays current: the next start switches again
            else:
                self.stop_stages(deadline, "daemon stopped")
            self.record("daemon_stopped", f"pid {os.getpid()}")
            self.publish(final=True)
        finally:  # whatever failed above: the next daemon must be able to start at once
            pointer.remove(self.cfg.path)
            self.lock.close()

    def stop_stages(self, deadline: float, why: str) -> None:
        """Every stage's children ended within their graces, last stage first (the trainer's
        checkpoint is never squeezed by the ingest's wait); what was in flight back to pending.
        A stage whose stop fails (its ledger's disk gone read-only) keeps no other stage from
        ending its children, and a failure is one log line: the next start's recovery returns
        what is left in flight."""
        for stage in reversed(self.stages):
            self._stop_step(f"stopping the {stage.name} stage", lambda: stage.stop(deadline))
        self._stop_step("returning in-flight samples to pending",
                        lambda: self.ledger.requeue_inflight(why))

    def _stop_step(self, what: str, step: Callable[[], object]) -> None:
        try:
            step()
        except Exception as exc:
            log.error("%s; the next start takes it up",
                      describe(what, exc, layout.ledger(self.cfg.paths.state_dir)))

    # ---- the tick -----------------------------------------------------------------------------

    def tick(self) -> None:
        # First: a full state disk must not fail the steps that would give its reserve up.
        self.phase = "checking the state folder's disk"
        self.state_disk_pause = self.state_reserve.pause()
        if self.reload_requested and self.switching is None:  # one taken during a switch waits
            self.reload_requested = False
            self.phase = "reloading the config"
            self.reload()
        if self.switching is not None:
            if self.switching.stopper.is_alive():
                # The stages stop in another thread: no request may act on them meanwhile.
                control.refuse_all(self.cfg.paths.state_dir, (
                    f"the daemon is switching runs ({self.switching.state['reason']}): nothing "
                    "was done; send it again once eagle3ctl status shows the new run"))
                self.publish()
                return
            self.phase = "switching runs"
            self.finish_switch()
        self.phase = "applying control requests"
        control.apply_all(self.cfg.paths.state_dir,
                          lambda request: requests.handle(request, self.ledger, self.unblock,
                                                          self.root_cfg.paths.state_dir))
        for run in self.aside:
            self.refuse_set_aside(run)
        self.phase = "observing"
        decision = stages.derive(self.observe())
        if self.decision is None or decision.stage != self.decision.stage:
            self.ledger.event("stage", f"{decision.stage.value}: {decision.reason}")
            self.stage_since = time.time()
            log.info("stage %s: %s", decision.stage.value, decision.reason)
            self._last_state = float("-inf")
            self._last_progress = float("-inf")  # each stage's totals in the log from its start
        self.decision = decision
        if not self.until_met():  # `--until train` must not start the trainer it will not wait for
            for stage in self.stages:
                self.phase = f"stepping the {stage.name} stage"
                stage.step(decision)
        self.publish()

    def observe(self) -> Facts:
        self.note_set_aside()
        plan = plan_meta.read(self.ledger)  # first: see stages.Seen
        counts = self.ledger.counts()
        # The verified set's fingerprint costs a pass over it: only worth it once the gate is
        # open, when it changes rarely (per-sample cost must stay flat at a million samples).
        share = self.cfg.shard.count > 1
        seen = Seen(counts, self.verified_fingerprint() if stages.gate(counts, share).open
                    else None, plan)
        facts = stages.merge(counts, (stage.observe(seen) for stage in self.stages),
                             operator_pause=requests.operator_pause(self.root_cfg.paths.state_dir),
                             share=share, state_disk_pause=self.state_disk_pause)
        if facts.budget_pause and self.set_aside:
            facts = facts._replace(budget_pause=facts.budget_pause
                                   + budgets.reclaimable(self.set_aside))
        return facts

    def unblock(self, all_failed: bool) -> None:
        """An operator's retry: the stages try again what had stopped them."""
        for stage in self.stages:
            stage.unblock(all_failed)

    def reload(self) -> None:
        """SIGHUP: take a new config if it validates; one that edits a contract key switches
        runs."""
        self.notifier.reloading()
        try:
            new = engines.checked(load_config(self.root_cfg.path))
            verdict = run_select.judge_reload(self.root_cfg, self.current, new,
                                              self.ledger.counts())
        except ConfigError as exc:
            verdict = run_select.Verdict(REFUSED, f"the new config does not validate: {exc}")
        if verdict.kind in (NEEDS_RESTART, REFUSED):
            problem = verdict.why
            self.config_problem = f"reload refused, the old config stays in force: {problem}"
            self.config_problem_since = time.time()
            log.error("%s", self.config_problem)
            self.ledger.event("reload_refused", problem)
        elif verdict.kind == run_select.SWITCH:
            self.config_problem = None
            self.switch(new, verdict.weights)
            return  # ready once the new run's stages are there
        else:
            self.root_cfg = new
            self.cfg = runs.run_config(new, self.current)
            write_in_force(self.cfg)
            self.config_problem = None
            for stage in self.stages:
                stage.reconfigure(self.cfg)
            log.info("config reloaded from %s", new.path)
            self.ledger.event("reloaded", str(new.path))
        self.notifier.ready()

    def switch(self, new: Config, weights: str) -> None:
        """Set the current run aside: its stages stop within their bounds, in a thread, while
        the loop keeps the watchdog and the state file going (finish_switch takes it on)."""
        reason = (f"setting run {self.current.id} aside for "
                  f"{runs.run_key(new.contract_keys(), weights)}: its stages stop (within "
                  f"{STOP_BUDGET_S:.0f} s)")
        log.info("%s", reason)
        state = {**snapshot(self), "stage": "switching", "reason": reason, "since": time.time()}
        stopper = threading.Thread(target=self.stop_stages, name="run-switch", daemon=True,
                                   args=(time.monotonic() + STOP_BUDGET_S, "run set aside"))
        self.switching = Switching(new, weights, stopper, state)
        stopper.start()
        self._last_state = float("-inf")
        self.publish()

    def finish_switch(self) -> None:
        """The set-aside run's stages have stopped (its state intact): go on with the run of
        the new contract, resumed where it stopped, or new."""
        assert self.switching is not None
        new, weights = self.switching.new, self.switching.weights
        self.switching = None
        before, stopped = self.cfg, snapshot(self, final=True)
        self.root_cfg = new
        selected = run_select.select(new, weights)
        self.ledger.event("run_set_aside", f"{self.current.id}; now {selected.run.id}")
        self.ledger.close()
        self.enter(selected)
        # Its state file says where it stopped: once eagle3ctl finds the new run, never before.
        self._write_state(before, stopped)
        self.recover_run("run resumed")
        log.info("config reloaded from %s", new.path)
        self.notifier.ready()

    def refuse_set_aside(self, run: runs.Run) -> None:
        """A request eagle3ctl dropped into a set-aside run's folder (it read which run was in
        force just before a switch, or was killed before it withdrew its request) is answered,
        never left to act when that run is current again, weeks later."""
        if run.id != self.current.id:
            control.refuse_all(run.state_dir, f"run {run.id} is set aside (the run in force is "
                               f"{self.current.id}): nothing was done; send it again")

    # ---- publishing ---------------------------------------------------------------------------

    def publish(self, final: bool = False) -> None:
        """The watchdog's ping, and each second the state file. Never raises: a state that
        cannot be taken (a ledger another process locks) is the last one taken, alive; a state
        file that cannot be written (its disk full) is logged once per cause, and the pings go
        on either way."""
        with self._publishing:
            self._ping()
            now = time.monotonic()
            if not final and now - self._last_state < STATE_EVERY:
                return
            self._last_state = now
            state = self._state(final)
            if state is None:
                return
            problem = None
            try:
                self._write_state(self.cfg, state)
            except OSError as exc:
                problem = (f"cannot write the state file in {self.cfg.paths.state_dir}: "
                           f"{exc.strerror or exc}")
            self._publish_problem("write", problem)
            self._say_stale(problem, state)
            if self.cfg.metrics.textfile:
                # On a disk of their own the metrics go on, heartbeat fresh and the state's
                # staleness said: a stale textfile would page a live daemon as dead.
                self.write_metrics({**state, "state_stale": self.stale_state})
            if problem is not None:
                return
            status = progress.line(state)
            self.notifier.status(status)
            if now - self._last_progress >= progress.PROGRESS_EVERY_S or final:
                self._last_progress = now
                log.info("progress %s", status)

    def _ping(self) -> None:
        ping = self.notifier.watchdog_interval()
        if ping is not None and time.monotonic() - self._last_ping >= ping:
            self.notifier.watchdog()
            self._last_ping = time.monotonic()

    def _state(self, final: bool) -> dict[str, Any] | None:
        """What the state file says now, with the loop's condition; None when there is nothing
        to say yet."""
        try:
            # While a switch stops the stages, their last snapshot: nothing else reads them.
            state = snapshot(self, final) if self.switching is None else self.switching.state
            self._publish_problem("snapshot", None)
        except Exception as exc:  # guarded: publishing is what keeps status honest
            self._publish_problem("snapshot", f"cannot take the state ({exc}); the last one "
                                  "taken is published")
            state = self._last_snapshot
        if state is None:
            return None
        self._last_snapshot = state
        now = time.time()
        condition = self.conditions.current
        return {**state, "updated": now, "daemon": {**state["daemon"], "heartbeat": now},
                "condition": condition.as_state() if condition else None}

    def _say_stale(self, problem: str | None, state: dict[str, Any]) -> None:
        """While the state file cannot be written, its heartbeat goes to the pointer instead,
        with why and since when (statemachine/pointer.py's say_stale): status shows a live
        daemon whose state is stale, never NOT RUNNING. Taken back once the state file is
        written again."""
        if problem is None and self.stale_state is None:
            return
        since = self.stale_state["since"] if self.stale_state else state["updated"]
        self.stale_state = None if problem is None else {
            "problem": problem, "since": since, "heartbeat": state["daemon"]["heartbeat"]}
        try:
            pointer.say_stale(self.cfg.path, self.stale_state)
            self._publish_problem("pointer", None)
        except (OSError, ValueError) as exc:  # the runtime folder too: status says NOT RUNNING
            self._publish_problem("pointer", f"cannot write the daemon's pointer ({exc}): "
                                  "status cannot tell this daemon is alive")

    def _publish_problem(self, part: str, problem: str | None) -> None:
        """Log a problem of publishing's `part` once per cause, and its end."""
        before = self.publish_problems.get(part)
        if problem and problem != before:
            log.error("%s; the loop and the watchdog's pings go on", problem)
        elif problem is None and before:
            log.info("publishing: %s is over", before)
        self.publish_problems[part] = problem

    def write_metrics(self, state: dict[str, Any]) -> None:
        """node_exporter's textfile. A folder that is missing or not writable is logged once per
        cause and shown by status; the pipeline goes on without its metrics."""
        shard = str(self.cfg.shard.index) if self.cfg.shard.count > 1 else ""
        try:
            metrics.write(Path(self.cfg.metrics.textfile), state, shard)
        except OSError as exc:
            problem = f"cannot write {self.cfg.metrics.textfile}: {exc.strerror or exc}"
            if problem != self.metrics_problem:
                log.warning("metrics: %s", problem)
            self.metrics_problem = problem
        else:
            self.metrics_problem = None

    @staticmethod
    def _write_state(cfg: Config, state: dict[str, Any]) -> None:
        write_state(cfg.paths.state_dir, state)
        if cfg.shard.count > 1:  # for the training node, which never opens this ledger
            write_state(cfg.paths.state_dir, state, layout.published_state(cfg.paths.dataset_dir))


def run(config_path: str, until: str | None) -> int:
    """The daemon's life; a start that fails is one log line and its exit code, no traceback."""
    try:
        daemon = Daemon(engines.checked(load_config(config_path)), until)
    except ConfigError as exc:  # the config itself, before anything is touched
        log.error("%s", exc)
        return entry.REFUSED
    except StartFailed as exc:
        log.error("%s", exc)
        return exc.code
    return daemon.run()
