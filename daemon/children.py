"""The daemon's child processes: started, watched, stopped (always with their grace before
SIGKILL), restarted by one policy (`Supervisor`), and found again after a crash.

Each child runs in its own process group (so stopping it stops what it started too, such as
torchrun's ranks), dies with the daemon (PR_SET_PDEATHSIG), and is recorded in a pid file with
its start time: a restarted daemon ends the children of its previous life by (pid, start time),
never by a bare pid that the kernel may have handed to an unrelated process since.
"""

from __future__ import annotations

import collections
import json
import logging
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import IO, Any, Callable, Sequence

import psutil

from eagle3d.statemachine import entry
from eagle3d.statemachine.ledger import Ledger
from eagle3d.statemachine.lifecycle import die_with_parent

log = logging.getLogger("eagle3d")


def child_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment for a child: ours, minus systemd's notify and watchdog variables (only
    the daemon talks to systemd), plus unbuffered Python output and no progress bars."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID", "LISTEN_FDS")}
    env["PYTHONUNBUFFERED"] = "1"
    # The journal wants one line per event, not progress bars redrawn with carriage returns.
    env.setdefault("TQDM_DISABLE", "1")
    env.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    env.update(extra or {})
    return env


class Child:
    """One running child process, recorded in `<pid_dir>/<name>.json`."""

    def __init__(self, name: str, argv: Sequence[str], pid_dir: Path,
                 env: dict[str, str] | None = None, stdin: int | None = None,
                 stdout: int | IO | None = None) -> None:
        self.name = name
        self.argv = list(argv)
        self.pid_file = Path(pid_dir) / f"{name}.json"
        self.started = time.time()
        # A stop begun by `terminate`: the tree it signalled, when, and when SIGKILL follows.
        self._stopping: tuple[list[psutil.Process], float, float] | None = None
        self.proc = subprocess.Popen(self.argv, env=child_env(env), stdin=stdin, stdout=stdout,
                                     start_new_session=True, preexec_fn=die_with_parent,
                                     close_fds=True)
        try:
            created = psutil.Process(self.proc.pid).create_time()
        except psutil.NoSuchProcess:
            created = 0.0
        self.pid_file.parent.mkdir(parents=True, exist_ok=True)
        self.pid_file.write_text(json.dumps({"pid": self.proc.pid, "create_time": created,
                                             "argv": self.argv}))
        log.info("started %s (pid %d): %s", name, self.proc.pid, " ".join(self.argv))

    @property
    def pid(self) -> int:
        return self.proc.pid

    def poll(self) -> int | None:
        code = self.proc.poll()
        if code is not None:
            self.pid_file.unlink(missing_ok=True)
        return code

    def descendants(self) -> list[psutil.Process]:
        try:
            return psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.Error:
            return []

    def signal(self, sig: int, tree: list[psutil.Process] | None = None) -> None:
        """To its process group and to every descendant: torchrun's ranks have sessions of
        their own, so the group alone would miss them."""
        try:
            os.killpg(self.proc.pid, sig)
        except ProcessLookupError:
            pass
        for p in self.descendants() if tree is None else tree:
            try:
                p.send_signal(sig)
            except psutil.Error:
                pass

    def terminate(self, grace: float) -> None:
        """Begin a stop without waiting for it: SIGTERM to the whole tree now, SIGKILL to what is
        left `grace` seconds later, sent by `stopped()` or `stop()`. The loop goes on meanwhile
        (a trainer's checkpoint may take longer than the watchdog allows a tick), and several
        children stop side by side within one grace. A stop begun already goes on as it was."""
        if self._stopping is not None:
            return
        tree = self.descendants()  # taken now: once the leader is gone its children are orphans
        now = time.monotonic()
        self._stopping = (tree, now, now + grace)
        if self.proc.poll() is None:
            self.signal(signal.SIGTERM, tree)

    def stopped(self) -> bool:
        """Whether a stop begun by `terminate` is over (ended at its grace's end if need be)."""
        assert self._stopping is not None
        tree, _, kill_at = self._stopping
        # Until the grace ends the whole tree may finish: torchrun can exit before its ranks
        # have written their checkpoint, and they must not be killed for that.
        running = self.proc.poll() is None or any(_alive(p) for p in tree)
        if running and time.monotonic() < kill_at:
            return False
        self.stop(0.0)
        return True

    def stop(self, grace: float) -> int:
        """SIGTERM to the whole tree, SIGKILL to what is left `grace` seconds later (the whole
        stop takes no longer; one begun by `terminate` keeps its own SIGKILL time, if sooner);
        returns the exit code."""
        if self._stopping is None:
            self.terminate(grace)
        assert self._stopping is not None
        tree, sent, kill_at = self._stopping
        kill_at = min(kill_at, time.monotonic() + grace)
        try:
            self.proc.wait(max(0.0, kill_at - time.monotonic()))
        except subprocess.TimeoutExpired:
            waited = time.monotonic() - sent
            if waited >= 1.0:  # with no grace left, SIGKILL was the plan, not news
                log.warning("%s did not stop within %.0f s of SIGTERM: killing it", self.name,
                            waited)
        _, alive = psutil.wait_procs(tree, timeout=max(0.0, kill_at - time.monotonic()))
        self.signal(signal.SIGKILL, alive)
        code = self.proc.wait()
        self.pid_file.unlink(missing_ok=True)
        # Ended by the signal it was sent: the stop asked for, not a failure to report.
        how = f"by {signal.Signals(-code).name}" if code < 0 else f"exit {code}"
        log.info("stopped %s (pid %d) %s", self.name, self.proc.pid, how)
        return code


def _alive(process: psutil.Process) -> bool:
    """Still at work: a zombie (an orphan its new parent has not reaped yet) is done."""
    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


BACKOFF_MAX_S = 60.0
# The restarts a limit counts are those of the last day, as the unit's StartLimitIntervalSec
# counts starts: six unrelated crashes over a week are six mended incidents, not a child that
# cannot work. A day still holds the limit's crash loop of a target that loads for hours.
RESTART_WINDOW_S = 24 * 3600.0


class Supervisor:
    """The restart policy of one stage's child, as Supervisor runs its programs: STARTING and
    RUNNING while a child is up, BACKOFF after an exit (2, 4, 8 … s, at most a minute), FATAL
    once the restarts of the last RESTART_WINDOW_S are used up, or at once for an exit that
    would only repeat (entry.FINAL, controller-runtime's terminal error): never retried until
    the operator retries (`clear`). `on_fatal` hears the reason of every entry into FATAL (the
    stage's log line and event)."""

    def __init__(self, limit_key: str, limit: int,
                 on_fatal: Callable[[str], None] = lambda reason: None) -> None:
        self.limit_key = limit_key  # "[extract] engine_max_restarts": where the limit is set
        self.limit = limit
        self.on_fatal = on_fatal
        self.window_s = RESTART_WINDOW_S
        self._exits: collections.deque[float] = collections.deque()  # time.monotonic() of each
        self.exits_total = 0  # since the daemon started, whatever the window forgot: a counter
        self.retry_at = 0.0
        self.fatal: str | None = None

    @property
    def restarts(self) -> int:
        """The exits counted within the window (the limit's and the backoff's count)."""
        while self._exits and time.monotonic() - self._exits[0] > self.window_s:
            self._exits.popleft()
        return len(self._exits)

    @property
    def may_start(self) -> bool:
        return self.fatal is None and time.monotonic() >= self.retry_at

    @property
    def state(self) -> str:
        """Of a stage with no child running: "stopped", "backoff" or "fatal"."""
        if self.fatal is not None:
            return "fatal"
        return "backoff" if time.monotonic() < self.retry_at else "stopped"

    def exited(self, code: int | None, said: str, final: bool = False) -> str | None:
        """An exit nobody asked for (`code` None: ended by the stage because a partner died):
        back off and return None, or go FATAL and return the reason. `final`: the child said
        why it can never work (a refusal, whatever its exit code)."""
        self._exits.append(time.monotonic())
        self.exits_total += 1
        if final or code in entry.FINAL:
            return self.terminal(f"{said}; see the log")
        restarts = self.restarts
        if restarts > self.limit:
            return self.terminal(f"{said}, {restarts} times within "
                                 f"{self.window_s / 3600:g} h ({self.limit_key} = "
                                 f"{self.limit}); see the log")
        self.retry_at = time.monotonic() + min(BACKOFF_MAX_S, 2.0 ** restarts)
        return None

    def terminal(self, reason: str) -> str:
        """A failure that retrying cannot mend: FATAL with its reason."""
        self.fatal = reason
        self.retry_at = 0.0
        self.on_fatal(reason)
        return reason

    def clear(self) -> None:
        """The operator retried: from the start, with every restart again."""
        self.fatal = None
        self._exits.clear()
        self.retry_at = 0.0

    def reconfigure(self, limit: int, mended: bool) -> None:
        """A reloaded config: its limit from now on; `mended`: the new config may mend what
        stopped the child, so the stage tries again from the start (as after `clear`)."""
        self.limit = limit
        if mended:
            self.clear()


# How long a child may show nothing while it starts (a target's load, a first batch, the
# trainer's compile): hours on a large model from a cold disk. Once running, a child's own
# bound applies ([extract] engine_silence_s, [train] silence_s).
STARTING_SILENCE_S = 2 * 3600.0


class Silence:
    """When a child last showed progress, by the signs its stage reads (the engine's events, the
    trainer's progress file, the generator's commits): a child stopped by SIGSTOP, or stuck in a
    read the kernel never answers, has not exited, and is alive only while signs come. A child
    silent past its bound is restarted by its stage. Intervals on the monotonic clock; `since`
    (wall clock) only for status, as a time of day (its age is published as `age_s`)."""

    def __init__(self, child: str, bound_s: float) -> None:
        self.child = child
        self.bound_s = bound_s
        self.reset()

    def reset(self) -> None:
        """A child starts: it is given STARTING_SILENCE_S until it says it runs."""
        self.running = False
        self._last = time.monotonic()
        self.since = time.time()

    def sign(self, running: bool = True) -> None:
        """Progress seen; `running`: past its start (its own bound applies from now on)."""
        self.running = running
        self._last = time.monotonic()
        self.since = time.time()

    @property
    def bound(self) -> float:
        return self.bound_s if self.running else max(self.bound_s, STARTING_SILENCE_S)

    def silent_for(self) -> float:
        return time.monotonic() - self._last

    def overdue(self) -> str | None:
        """Why the child must be restarted, once its silence passed the bound; else None."""
        silent = self.silent_for()
        if silent <= self.bound:
            return None
        phase = "running" if self.running else "starting"
        return (f"the {self.child} showed no progress for {silent:.0f} s while {phase} "
                f"(silent since {time.strftime('%H:%M:%S', time.localtime(self.since))}; "
                f"bound {self.bound:.0f} s)")

    def status(self) -> dict[str, Any]:
        """For status, once the silence is half the bound (a healthy child's pauses are
        shorter): which child and since when."""
        if self.silent_for() < self.bound / 2:
            return {}
        return {"silent": {"child": self.child, "since": self.since, "bound_s": self.bound,
                           "age_s": round(self.silent_for(), 1)}}


def stage_failed(ledger: Ledger, event: str, line: str) -> Callable[[str], None]:
    """A stage's `on_fatal`: the reason logged as an error (`line` with its %s) and recorded
    in the ledger's events as `event`."""
    def record(reason: str) -> None:
        log.error(line, reason)
        ledger.event(event, reason)
    return record


def remaining(deadline: float, most: float) -> float:
    """At most `most` seconds, and never past `deadline` (a time.monotonic() value): how a stop
    made of several waits stays inside one bound."""
    return max(0.0, min(most, deadline - time.monotonic()))


def end_orphans(pid_dir: Path, grace: float = 10.0) -> list[str]:
    """End the children that a previous daemon left running; returns what was ended."""
    ended = []
    for pid_file in sorted(Path(pid_dir).glob("*.json")):
        try:
            rec = json.loads(pid_file.read_text())
            proc = psutil.Process(int(rec["pid"]))
            same = (abs(proc.create_time() - float(rec["create_time"])) < 0.05
                    and proc.status() != psutil.STATUS_ZOMBIE)
        except (OSError, ValueError, KeyError, psutil.Error):
            same = False
        if same:
            _end_group(proc.pid, grace)
            ended.append(f"{pid_file.stem} (pid {proc.pid})")
        pid_file.unlink(missing_ok=True)
    return ended


def _end_group(pgid: int, grace: float) -> None:
    members = [p for p in psutil.process_iter(["pid"]) if _pgid(p.pid) == pgid]
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            return
        _, alive = psutil.wait_procs(members, timeout=grace if sig == signal.SIGTERM else 5)
        if not alive:
            return


def _pgid(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except OSError:
        return None
