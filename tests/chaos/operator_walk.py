"""The randomized operator (issue 53): a seeded random walk of what operators and machines do to a
real daemon on a tiny config, with the issue's invariants checked after every step.

A seed draws a fixed list of actions up front (`plan`); each action has a guard (a reload needs a
live daemon, a forget a set-aside run) and is skipped where the guard does not hold, so any
subset of the list is again a valid walk: shrinking deletes actions and replays (`shrink`), and
`EAGLE3D_CHAOS_SEED=N EAGLE3D_CHAOS_ACTIONS=i,j,k` replays exactly the kept ones.

Everything is real: `eagle3d run` processes, eagle3ctl, SIGHUP, SIGTERM, kill -9, a real
sd_notify socket with WATCHDOG_USEC (the daemon pings it as it pings systemd), real files.
The daemon waits cheaply by default: `[budget] reserve` far above the disk pauses it after the
plan with no model loaded, and the walk lifts that budget (an edit) when it wants extraction.
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import socket
import subprocess
import threading
import time
import tomllib
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import psutil

from eagle3d.daemon.requests import VERIFY_FULL
from eagle3d.dataset import contract as capture_contract, dumpformat
from eagle3d.statemachine import layout, pointer, runs
from eagle3d.statemachine.config_validation import ConfigError, load_config
from eagle3d.statemachine.ledger import Ledger
from tests.chaos.harness import describe, end, kill9, processes_of
from tests.conftest import make_config, venv_bin, write_conversations
from tests.pipeline import DaemonProcess, edit_config

WATCHDOG_S = 10.0       # WatchdogSec of the walk's daemons: systemd kills a daemon silent this long
LIFT = "100MiB"         # [budget] reserve that lets extraction run
# ... and one that pauses it after the plan with no model loaded: more than the disk has free,
# less than its size (check-config refuses a reserve that can never stay free).
HOLD = f"{shutil.disk_usage('/tmp').total // 2**30 - 1}GiB"
SETTLE_S = 180.0        # a start or a reload must have shown its outcome by then


class Violation(AssertionError):
    """An invariant broken at one step of a walk."""

    def __init__(self, invariant: str, detail: str) -> None:
        super().__init__(f"{invariant}: {detail}")
        self.invariant = invariant
        self.detail = detail


# ---- the sd_notify socket -------------------------------------------------------------------

class Notify:
    """A real NOTIFY_SOCKET: every datagram the daemon sends, with its arrival time."""

    def __init__(self, path: Path) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(str(path))
        self.sock.settimeout(0.2)
        self.path = path
        self.messages: list[tuple[float, str]] = []
        self.closed = False
        threading.Thread(target=self._listen, daemon=True).start()

    def _listen(self) -> None:
        while not self.closed:
            try:
                data = self.sock.recv(65536)
            except (socket.timeout, OSError):
                continue
            self.messages.append((time.monotonic(), data.decode(errors="replace")))

    def env(self) -> dict[str, str]:
        return {"NOTIFY_SOCKET": str(self.path), "WATCHDOG_USEC": str(int(WATCHDOG_S * 1e6))}

    def after(self, t: float, word: str) -> float | None:
        """When the first message holding `word` arrived after monotonic time t."""
        return next((at for at, m in list(self.messages) if at > t and word in m), None)

    def longest_silence(self, since: float, until: float) -> float:
        """The longest gap between WATCHDOG=1 pings in [since, until]."""
        pings = [at for at, m in list(self.messages) if "WATCHDOG=1" in m and since <= at <= until]
        edges = [since, *pings, until]
        return max(b - a for a, b in zip(edges, edges[1:]))

    def close(self) -> None:
        self.closed = True
        self.sock.close()


# ---- the walk's world -----------------------------------------------------------------------

@dataclass
class World:
    """One episode: its folders, its config, the live daemon, and what the operator did."""
    root: Path
    config: Path
    notify: Notify
    n: int
    daemon: DaemonProcess | None = None
    watched_from: float = 0.0              # watchdog silences are measured from here
    paused: bool = False                   # `eagle3ctl pause` done, no resume since
    planned: dict[str, set[str]] = field(default_factory=dict)  # run id -> every id it planned
    verified: dict[str, set[str]] = field(default_factory=dict)  # run id -> ids once verified
    excluded: set[str] = field(default_factory=set)
    damaged: set[str] = field(default_factory=set)   # ids whose dump the walk truncated
    crashes: int = 0
    printed: str = ""                      # the last `--until done` output
    stopped: list[int] = field(default_factory=list)  # children the walk SIGSTOPped
    # [paths] folders the walk put on file systems of their own (operator_disks.py): the first
    # part of an edit's value ("state", "dataset") names the folder on its disk
    moved: dict[str, Path] = field(default_factory=dict)
    faults: int = 0                        # disk faults the walk did (operator_disks.py)
    # the wall clock of the daemon and of eagle3ctl, where the walk steps it (operator_clock.py)
    clock: Any = None

    def env(self) -> dict[str, str]:
        """What the walk's daemons run with: its sd_notify socket, and its clock if any."""
        return {**self.notify.env(), **self.clock_env()}

    def clock_env(self) -> dict[str, str]:
        return self.clock.env() if self.clock is not None else {}

    def alive(self) -> bool:
        return self.daemon is not None and self.daemon.proc.poll() is None

    def folder(self, key: str) -> Path:
        """A [paths] folder as the operator's file names it, read without validating: the file
        may hold what check-config refuses (nested [paths]), and the walk still looks there."""
        return Path(tomllib.loads(self.config.read_text())["paths"][key])

    def place(self, value: str) -> Path:
        """Where an edit's relative [paths] value lies: under the world's root, or on the disk
        its first folder was moved to."""
        head, *rest = Path(value).parts
        return self.moved.get(head, self.root / head).joinpath(*rest)

    def hold(self) -> str | int:
        """A [budget] reserve that pauses the daemon after its plan: more than the dataset's
        disk has free, less than its size. /tmp's is HOLD; a small disk of the walk's own holds a
        ballast file (operator_disks.py), and half of what is used on it stays within."""
        if not self.moved:
            return HOLD
        anchor = self.folder("dataset_dir")
        while not anchor.exists():
            anchor = anchor.parent
        usage = shutil.disk_usage(anchor)
        return usage.total - (usage.total - usage.free) // 2

    def registry(self) -> runs.Registry:
        return runs.read(self.folder("state_dir"))

    def live_registry(self) -> runs.Registry:
        """The registry under the folders the live daemon works in (the file may name others)."""
        running = pointer.read(self.config)
        if running:
            in_force = load_config(running["in_force"])
            for root in (in_force.paths.state_dir, *in_force.paths.state_dir.parents):
                if layout.runs_registry(root).exists():
                    return runs.read(root)
        return self.registry()


def ctl(world: World, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([venv_bin("eagle3ctl"), "-c", str(world.config), *args],
                          capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **world.clock_env()})


def new_world(tmp: Path, rng: random.Random, scale: int) -> World:
    """A tiny config over a few conversations, its [paths] apart. Nested [paths] come from the
    walk's edits, which check-config, a start and a reload must all refuse alike (a nested start
    would be refused before any scenario: issue 52 item 1)."""
    n = 3 * scale
    source = write_conversations(tmp / "conv.jsonl", n + 2)
    rng.random()  # where a nested start was drawn: every seed keeps the plan it had
    sections: dict[str, dict[str, Any]] = {
        "data": {"source": str(source), "format": "messages", "limit": n},
        "verify": {"spot_checks": 0},
        "budget": {"reserve": HOLD},
        "extract": {"batch_tokens": 512, "max_inflight_tokens": 1024,
                    "engine_stop_grace_s": rng.choice([5, 40])},
        "train": {"device": "cpu", "nproc": 1, "draft_vocab": 512, "ttt_steps": 2,
                  "batch_tokens": 512, "warmup_steps": 2, "checkpoint_every": 3, "max_steps": 4,
                  "threads": 1, "stop_grace_s": rng.choice([5, 60])},
        "eval": {"limit": 2, "max_new_tokens": 8, "steps": 2}}
    config = make_config(tmp, sections)
    return World(tmp, config, Notify(Path("/tmp") / f"eagle3d-notify-{uuid.uuid4().hex[:10]}"), n)


# ---- what a check-config says, and what then happened ---------------------------------------

def promise(world: World) -> tuple[str, str]:
    """check-config's verdict, as one of "switch", "live", "refused", "start", "start-refused",
    with its words."""
    out = ctl(world, "check-config")
    words = (out.stdout + out.stderr).strip().splitlines()[-1:] or [""]
    line = words[0]
    if "no daemon runs" in line:
        return "start", line
    if out.returncode != 0:
        return ("refused" if world.alive() else "start-refused"), line
    return ("switch" if "switches runs" in line else "live"), line


def status(world: World) -> tuple[int, dict[str, Any]]:
    import json
    out = ctl(world, "status", "--json")
    try:
        return out.returncode, json.loads(out.stdout)
    except ValueError:
        return out.returncode, {}


def settled(world: World, d: DaemonProcess) -> bool:
    """This life has published a state past its plan (or exited)."""
    if d.proc.poll() is not None:
        return True
    _, st = status(world)
    return st.get("daemon", {}).get("pid") == d.proc.pid and st.get("stage") not in (
        None, "not started", "plan")


def wait(predicate: Callable[[], Any], timeout: float) -> Any:
    deadline = time.time() + timeout
    while time.time() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.3)
    return None


# ---- actions ---------------------------------------------------------------------------------

def act_start(world: World, p: dict[str, Any]) -> str:
    if world.alive():
        return "skip"
    verdict, words = promise(world)
    d = DaemonProcess(world.config, env=world.env())
    t0 = time.monotonic()
    world.daemon = d
    refused = wait(lambda: d.proc.poll() is not None or world.notify.after(t0, "READY=1"), 60) \
        and d.proc.poll() is not None
    if verdict == "start-refused" and not refused:
        raise Violation("check-config = what the start does",
                        f"check-config said {words!r}; the daemon started")
    if verdict == "start" and refused:
        raise Violation("check-config = what the start does",
                        f"check-config said {words!r}; the daemon refused "
                        f"({d.proc.returncode}): {d.output()[-600:]}")
    if refused:
        world.daemon = None
        return f"refused, as check-config said ({words[:80]})"
    world.watched_from = world.notify.after(t0, "READY=1") or time.monotonic()
    wait(lambda: settled(world, d), SETTLE_S)
    reg = world.registry()
    current = reg.runs.get(reg.current or "")
    said = words.split(" run ")[-1].strip().split()[0] if " run " in words else ""
    if verdict == "start" and current is not None and said not in (current.id, current.key):
        raise Violation("check-config = what the start does",
                        f"check-config said {words!r}; the start made {current.id} current")
    return f"started, run {current.id if current else None}"


def act_reload(world: World, p: dict[str, Any]) -> str:
    """check-config first, then SIGHUP: the verdict must be what the reload does."""
    if not world.alive():
        return "skip"
    verdict, words = promise(world)
    before = world.live_registry().current
    t0 = time.monotonic()
    world.daemon.proc.send_signal(signal.SIGHUP)
    done = wait(lambda: world.notify.after(t0, "READY=1") or not world.alive(), SETTLE_S)
    if not world.alive():
        raise Violation("the daemon lives", f"it exited at a reload: {world.daemon.output()[-800:]}")
    if not done:
        raise Violation("a reload ends", f"no READY=1 {SETTLE_S:.0f} s after SIGHUP")
    time.sleep(1.5)  # one publish after the reload
    code, st = status(world)
    after = world.live_registry().current
    did = ("refused" if st.get("config_problem") else "switch" if after != before else "live")
    if did != verdict:
        raise Violation("check-config = what the reload does",
                        f"check-config said {words!r} ({verdict}); the reload did {did}: "
                        f"{st.get('config_problem') or f'run {before} -> {after}'}")
    wait(lambda: settled(world, world.daemon), SETTLE_S)
    return f"{did} ({words[:90]})"


def act_restart(world: World, p: dict[str, Any]) -> str:
    if not world.alive():
        return "skip"
    code = world.daemon.stop(timeout=200)
    world.daemon = None
    if code != 0:
        raise Violation("a stop is clean", f"the daemon exited {code} on SIGTERM")
    return "stopped; " + act_start(world, p)


def act_kill_daemon(world: World, p: dict[str, Any]) -> str:
    if not world.alive():
        return "skip"
    kill9(world.daemon)
    world.daemon = None
    world.crashes += 1
    left = wait(lambda: not processes_of(world.config), 30) is None and processes_of(world.config)
    if left:
        end(left)
        raise Violation("children die with the daemon", describe(left))
    return "killed -9"


def act_kill_child(world: World, p: dict[str, Any]) -> str:
    """kill -9 of whatever child the daemon has (engine, planner, trainer rank, evaluation)."""
    if not world.alive():
        return "skip"
    kids = _children(world.daemon.proc.pid)
    if not kids:
        return "skip"
    kid = kids[p["pick"] % len(kids)]
    try:
        name = " ".join(kid.cmdline()[1:4])
        kid.kill()
    except psutil.Error:  # it ended by itself meanwhile
        return "skip"
    world.crashes += 1
    return f"killed -9 {name[:80]}"


def _children(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        return []


def act_edit(world: World, p: dict[str, Any]) -> str:
    """An operator's edit of the file, then (check-config first) a reload of the live daemon or
    a restart, or nothing yet."""
    section, key, value = p["section"], p["key"], p["value"]
    if section == "paths":
        value = str(world.place(value))
    if key == "reserve" and value == HOLD:
        value = world.hold()
    if key == "limit":  # the episode's size, or one more
        value = world.n + value
    edit_config(world.config, section, **{key: value})
    edited = f"[{section}] {key} = {value!r}"
    if p["apply"] == "reload" and world.alive():
        return f"{edited}; reload: {act_reload(world, p)}"
    if p["apply"] == "restart":
        return f"{edited}; {act_restart(world, p) if world.alive() else act_start(world, p)}"
    return edited


def act_pause(world: World, p: dict[str, Any]) -> str:
    if not world.alive():
        return "skip"
    out = ctl(world, "pause", "--reason", "walk") if p["pause"] else ctl(world, "resume")
    if out.returncode == 0:
        world.paused = p["pause"]
    return f"{'pause' if p['pause'] else 'resume'} -> {out.returncode}"


def act_forget(world: World, p: dict[str, Any]) -> str:
    """Forget a set-aside run: not one byte of any other run may go."""
    reg = world.registry()
    aside = [r for r in reg.runs.values() if r.id != reg.current and not r.forgotten]
    if not aside:
        return "skip"
    victim = aside[p["pick"] % len(aside)]
    kept = {path: rid for rid, r in reg.runs.items() if rid != victim.id and not r.forgotten
            for path in owned_files(r)}
    spool = world.folder("spool_dir")
    out = ctl(world, "forget", victim.id, "--reason", "walk")
    gone = sorted(str(path) for path in kept if not path.exists())
    if gone:
        raise Violation("forget never removes a byte of a run not forgotten",
                        f"forgetting {victim.id} deleted {len(gone)} files of "
                        f"{sorted({kept[Path(g)] for g in gone})}: {gone[:4]}")
    if not spool.is_dir() and world.alive():
        raise Violation("forget never removes a byte of a run not forgotten",
                        f"forgetting {victim.id} deleted the live spool {spool}")
    world.planned.pop(victim.id, None)
    world.verified.pop(victim.id, None)
    return f"forget {victim.id} -> {out.returncode}: {(out.stdout + out.stderr).strip()[:90]}"


def dumps_of(dataset_dir: Path) -> list[Path]:
    """Every dump in a run's sample folders (layout.sample_folders: any width)."""
    return [d for folder in layout.sample_folders(dataset_dir)
            for d in folder.glob(f"*{dumpformat.SUFFIX}")]


def owned_files(run: runs.Run) -> list[Path]:
    """The files that make a run: its ledger, config in force, contract, manifest, dumps and
    drafter."""
    files = [layout.ledger(run.state_dir), layout.config_in_force(run.state_dir),
             layout.contract_file(run.dataset_dir), layout.manifest_file(run.dataset_dir)]
    files += list(dumps_of(run.dataset_dir))
    files += list(layout.export_dir(run.train_dir).glob("*"))
    return [f for f in files if f.exists()]


def _current(world: World) -> runs.Run | None:
    reg = world.live_registry()
    return reg.runs.get(reg.current or "")


def act_exclude(world: World, p: dict[str, Any]) -> str:
    run = _current(world)
    if not world.alive() or run is None or not layout.ledger(run.state_dir).exists():
        return "skip"
    with Ledger(layout.ledger(run.state_dir), readonly=True, timeout=5) as ledger:
        ids = [s.id for s in ledger.samples() if s.status != "excluded"]
    if not ids:
        return "skip"
    sid = ids[p["pick"] % len(ids)]
    out = ctl(world, "exclude", sid, "--reason", "walk")
    if out.returncode == 0:
        world.excluded.add(sid)
    return f"exclude {sid} -> {out.returncode}"


def act_retry(world: World, p: dict[str, Any]) -> str:
    if not world.alive():
        return "skip"
    return f"retry --failed -> {ctl(world, 'retry', '--failed').returncode}"


def act_truncate_dump(world: World, p: dict[str, Any]) -> str:
    """A dump damaged on disk, found by `eagle3ctl verify --full`."""
    run = _current(world)
    if not world.alive() or run is None:
        return "skip"
    dumps = sorted(dumps_of(run.dataset_dir))
    if not dumps:
        return "skip"
    victim = dumps[p["pick"] % len(dumps)]
    with open(victim, "r+b") as f:
        f.truncate(max(1, victim.stat().st_size // 2))
    world.damaged.add(victim.stem)
    return f"truncated {victim.name}; verify --full -> {ctl(world, 'verify', '--full').returncode}"


def act_spool_junk(world: World, p: dict[str, Any]) -> str:
    spool = world.folder("spool_dir")
    if not spool.is_dir():
        return "skip"
    (spool / f"{'0' * 16}{dumpformat.SUFFIX}").write_bytes(os.urandom(p["size"]))
    return f"dropped {p['size']} bytes of junk into the spool"


def act_wait(world: World, p: dict[str, Any]) -> str:
    time.sleep(p["s"])
    return f"waited {p['s']} s"


def act_finish(world: World, p: dict[str, Any]) -> str:
    """The operator's `eagle3d run --until done` with the budget lifted: every drafter path it
    prints must be the current run's."""
    if world.alive():
        code = world.daemon.stop(timeout=200)
        world.daemon = None
        if code != 0:
            raise Violation("a stop is clean", f"the daemon exited {code} on SIGTERM")
    edit_config(world.config, "budget", reserve=LIFT)
    verdict, _ = promise(world)
    if verdict == "start-refused":
        return "skip"
    d = until_done(world)
    code = d.wait(900)
    world.printed = d.output()
    if code != 0:
        return f"--until done exited {code}"
    run = _current(world)
    shown = [line.split()[1] for line in world.printed.splitlines()
             if line.startswith("drafter:")]
    export = layout.export_dir(run.train_dir)
    if shown != [str(export)]:
        raise Violation("every drafter path printed is the current run's",
                        f"`eagle3d run --until done` on run {run.id} printed drafter "
                        f"{shown or 'none'}; the run's drafter is {export}")
    return f"done, drafter {export}"


def until_done(world: World) -> DaemonProcess:
    """The operator's `eagle3d run --until done`, its pause resumed: an operator's pause holds
    across restarts, and a paused run would never reach done."""
    t0 = time.monotonic()
    d = DaemonProcess(world.config, "--until", "done", env=world.env())
    if world.paused and wait(lambda: world.notify.after(t0, "READY=1"), 60):
        ctl(world, "resume")
        world.paused = False
    return d


ACTIONS: dict[str, Callable[[World, dict[str, Any]], str]] = {
    "start": act_start, "reload": act_reload, "restart": act_restart,
    "kill-daemon": act_kill_daemon, "kill-child": act_kill_child, "edit": act_edit,
    "pause": act_pause, "forget": act_forget, "exclude": act_exclude, "retry": act_retry,
    "truncate-dump": act_truncate_dump, "spool-junk": act_spool_junk, "wait": act_wait,
    "finish": act_finish}

EDITS = [  # (section, key, values): contract keys, live keys, [budget], [paths] (nested too)
    ("target", "dtype", ["float32", "bfloat16"]),
    ("target", "aux_layers", ["default", [1, 5, 9]]),
    ("data", "first", [0, 1]),
    ("data", "limit", [0, 1]),  # added to the episode's size
    ("train", "max_steps", [4, 6]),
    ("train", "stop_grace_s", [5, 60]),
    ("extract", "engine_stop_grace_s", [5, 40]),
    ("budget", "reserve", [HOLD, LIFT]),
    ("paths", "dataset_dir", ["dataset", "state/dataset", "dataset2"]),
    ("paths", "train_dir", ["train", "state/train", "train2"]),
]

WEIGHTS = {"start": 3, "reload": 2, "restart": 1, "kill-daemon": 2, "kill-child": 2, "edit": 16,
           "pause": 4, "forget": 4, "exclude": 1, "retry": 1, "truncate-dump": 1,
           "spool-junk": 1, "wait": 1, "finish": 1}


def draw(rng: random.Random, name: str, p: dict[str, Any], edits: list = EDITS) -> None:
    """An action's parameters, drawn into `p` (the operator campaign's; others add to it)."""
    if name == "edit":
        section, key, values = rng.choice(edits)
        p.update(section=section, key=key, value=rng.choice(values),
                 apply=rng.choices(["reload", "restart", "none"], [6, 2, 2])[0])
    elif name == "pause":
        p["pause"] = rng.random() < 0.7
    elif name == "spool-junk":
        p["size"] = rng.choice([0, 17, 4096])
    elif name == "wait":
        p["s"] = rng.choice([1, 3, 8])


@dataclass(frozen=True)
class Campaign:
    """A family of walks: the world it builds, the actions it draws (their weights, how each
    draws its parameters) and the invariants checked after every step. A seed means a walk
    within one campaign: `EAGLE3D_CHAOS_CAMPAIGN` names it in a replay."""
    name: str
    world: Callable[[Path, random.Random, int], World]
    actions: dict[str, Callable[[World, dict[str, Any]], str]]
    weights: dict[str, int]
    draw: Callable[[random.Random, str, dict[str, Any]], None]
    check: Callable[[World], None]
    close: Callable[[World], None] = lambda world: None  # what the world holds beyond `close`
    # puts the world's folders on small real file systems (tests/conftest.py's tmpfs), before
    # its first action; a campaign that needs none ignores it
    disks: Callable[[World, Callable[[str, str], Path]], None] = lambda world, mount: None
    end: Callable[[World], None] = lambda world: None  # invariants of the walk's end


def plan(campaign: Campaign, seed: int, length: int) -> list[tuple[str, dict[str, Any]]]:
    """The seed's actions, drawn before any runs: a start first, then weighted draws."""
    rng = random.Random(seed)
    names = list(campaign.weights)
    out: list[tuple[str, dict[str, Any]]] = [("start", {})]
    for _ in range(length - 1):
        name = rng.choices(names, [campaign.weights[n] for n in names])[0]
        p: dict[str, Any] = {"pick": rng.randrange(1000)}
        campaign.draw(rng, name, p)
        out.append((name, p))
    return out


# ---- invariants ------------------------------------------------------------------------------

def check(world: World) -> None:
    """The issue's invariants, from the files and the real eagle3ctl, after every step."""
    reg = world.live_registry()
    for rid, run in reg.runs.items():
        if run.forgotten:
            continue
        one_contract(run)
        ledger_facts(world, run)
    if world.alive():
        now = time.monotonic()
        silence = world.notify.longest_silence(world.watched_from, now)
        if silence > WATCHDOG_S:
            raise Violation("the watchdog is pinged while the daemon lives",
                            f"no WATCHDOG=1 for {silence:.1f} s (WatchdogSec={WATCHDOG_S:.0f})")
        world.watched_from = now
    if world.daemon is not None and not world.alive():
        raise Violation("the loop never dies (rule 1)",
                        f"daemon pid {world.daemon.proc.pid} exited {world.daemon.proc.returncode} "
                        f"with no stop or kill of the walk's: {world.daemon.output()[-800:]}")
    code, st = status(world)
    alive = world.alive()
    beat = st.get("daemon", {}).get("heartbeat_age_s")
    if alive and beat is not None and beat > WATCHDOG_S:
        raise Violation("the heartbeat advances (rule 4)",
                        f"live daemon pid {world.daemon.proc.pid}: heartbeat {beat} s old, stage "
                        f"{st.get('stage')!r}")
    if alive and code == 3:
        raise Violation("status's exit code is the daemon's condition",
                        f"eagle3ctl status exits 3 (NOT RUNNING) for live daemon pid "
                        f"{world.daemon.proc.pid}: stage {st.get('stage')!r}, heartbeat "
                        f"{st.get('daemon', {}).get('heartbeat_age_s')} s old")
    if not alive and code != 3 and not (code == 2 and refused_file(world)):
        raise Violation("status's exit code is the daemon's condition",
                        f"eagle3ctl status exits {code} with no daemon running")
    # The state file is published once a second: a pause shows within a few.
    if alive and world.paused and not wait(lambda: operator_paused(world), 5):
        code, st = status(world)
        raise Violation("an operator's pause holds until resume",
                        f"paused by `eagle3ctl pause`, never resumed; status now says stage "
                        f"{st.get('stage')!r}, paused_by {st.get('paused_by')!r}, run "
                        f"{st.get('run', {}).get('id')}")


def refused_file(world: World) -> bool:
    """The operator's file does not validate (exit 2 is then status's answer, daemon or not)."""
    try:
        load_config(world.config)
    except ConfigError:
        return True
    return False


def operator_paused(world: World) -> bool:
    _, st = status(world)
    return st.get("stage") == "failed" or st.get("paused_by") == "operator"


def one_contract(run: runs.Run) -> None:
    doc = capture_contract.read(run.dataset_dir)
    if not doc:
        return
    for dump in dumps_of(run.dataset_dir):
        try:
            theirs = dumpformat.read_header(dump).contract
        except Exception:  # a dump the walk truncated: verify's to judge, not this check's
            continue
        if theirs != doc["fingerprint"]:
            raise Violation("no dataset folder holds dumps of two contracts",
                            f"{dump} has contract {theirs}, run {run.id}'s is "
                            f"{doc['fingerprint']}")


def ledger_facts(world: World, run: runs.Run) -> None:
    """No sample planned is lost, none verified is lost, no id twice."""
    path = layout.ledger(run.state_dir)
    if not path.exists():
        if world.planned.get(run.id):
            raise Violation("no verified sample is lost", f"run {run.id}'s ledger {path} is gone")
        return
    with Ledger(path, readonly=True, timeout=10) as ledger:
        rows = ledger.samples()
        status_of = {r.id: r.status for r in rows}
        gone = {s for s in world.verified.get(run.id, set())
                if status_of.get(s) not in ("verified", "excluded") and s not in world.damaged
                and not (status_of.get(s) == "extracted" and sent_back_to_verify(ledger, s))}
    ids = [r.id for r in rows]
    if len(ids) != len(set(ids)):
        raise Violation("a sample id appears once", f"run {run.id} lists an id twice")
    lost = world.planned.get(run.id, set()) - set(ids)
    if lost:
        raise Violation("no verified sample is lost", f"run {run.id} lost {sorted(lost)[:4]}")
    if gone:
        raise Violation("no verified sample is lost",
                        f"run {run.id}: {sorted(gone)[:4]} were verified, now "
                        f"{[status_of.get(s) for s in sorted(gone)[:4]]}")
    world.planned.setdefault(run.id, set()).update(ids)
    world.verified.setdefault(run.id, set()).update(r.id for r in rows if r.status == "verified")


def sent_back_to_verify(ledger: Ledger, sid: str) -> bool:
    """`eagle3ctl verify --full` sends every verified sample back to extracted, each with an
    `unverified` event, until verify reads it again (docs/operations.md): by design, not lost.
    Any other way out of verified (the trainer's pre-check included) is still a loss here."""
    last = ledger.db.execute("SELECT kind, detail FROM events WHERE sample = ? "
                             "ORDER BY seq DESC LIMIT 1", (sid,)).fetchone()
    return tuple(last or ()) == ("unverified", VERIFY_FULL)


# ---- a walk, its replay and its shrinking ----------------------------------------------------

@dataclass
class Outcome:
    campaign: str
    seed: int
    steps: list[str]                 # what each action did
    violation: Violation | None
    failed_at: int | None            # index into the plan
    kept: list[int]                  # the plan's indices walked
    seconds: float
    crashes: int


def walk(campaign: Campaign, seed: int, tmp: Path, scale: int, length: int,
         kept: list[int] | None = None, mount: Callable[[str, str], Path] | None = None) -> Outcome:
    """Walk the seed's plan (or only its `kept` indices) on a fresh world under `tmp`, its
    small file systems made by `mount` (tests/conftest.py's tmpfs)."""
    actions = plan(campaign, seed, length)
    kept = list(range(len(actions))) if kept is None else kept
    tmp.mkdir(parents=True, exist_ok=True)
    world = campaign.world(tmp, random.Random(seed), scale)
    if mount is not None:
        campaign.disks(world, mount)
    steps: list[str] = []
    t0 = time.time()
    violation, failed_at = None, None
    try:
        for i in kept:
            name, p = actions[i]
            try:
                did = campaign.actions[name](world, p)
                if did != "skip":
                    campaign.check(world)
            except Violation as v:
                violation, failed_at = v, i
                steps.append(f"{i}: {name} {_short(p)} -> VIOLATION")
                break
            steps.append(f"{i}: {name} {_short(p)} -> {did}")
        if violation is None:
            try:
                campaign.end(world)
            except Violation as v:
                violation, failed_at = v, kept[-1]
                steps.append("end -> VIOLATION")
    finally:
        campaign.close(world)
        close(world)
    return Outcome(campaign.name, seed, steps, violation, failed_at, kept, time.time() - t0,
                   world.crashes)


def _short(p: dict[str, Any]) -> str:
    return " ".join(f"{k}={v}" for k, v in p.items() if k != "pick") or ""


def close(world: World) -> None:
    for pid in world.stopped:  # a stopped child would hold the daemon's stop for its grace
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            pass
    if world.alive():
        world.daemon.proc.send_signal(signal.SIGTERM)
        try:
            world.daemon.proc.wait(200)
        except subprocess.TimeoutExpired:
            world.daemon.proc.kill()
            world.daemon.proc.wait()
    left = processes_of(world.config)
    end(left)
    world.notify.close()
    world.notify.path.unlink(missing_ok=True)
    spool = world.folder("spool_dir")
    if str(spool).startswith("/dev/shm/eagle3d-test-"):
        shutil.rmtree(spool, ignore_errors=True)


def shrink(campaign: Campaign, failed: Outcome, tmp: Path, scale: int, length: int, budget_s: float,
           mount: Callable[[str, str], Path] | None = None) -> Outcome:
    """Delete actions while the same invariant still breaks: first everything after the failing
    step, then one action at a time from the front, within `budget_s` seconds of replays."""
    assert failed.violation is not None and failed.failed_at is not None
    best = failed
    kept = [i for i in failed.kept if i <= failed.failed_at]
    deadline = time.time() + budget_s
    j = 0
    while j < len(kept) - 1 and time.time() < deadline:
        trial = kept[:j] + kept[j + 1:]
        out = walk(campaign, failed.seed, tmp / f"shrink-{uuid.uuid4().hex[:6]}", scale, length, trial,
                   mount)
        if out.violation is not None and out.violation.invariant == failed.violation.invariant:
            best, kept = out, [i for i in trial if i <= out.failed_at]
        else:
            j += 1
    return best


def replay_command(campaign: str, seed: int, kept: list[int], scale: int) -> str:
    scale_env = f"EAGLE3D_CHAOS_SCALE={scale} " if scale != 1 else ""
    campaign_env = f"EAGLE3D_CHAOS_CAMPAIGN={campaign} " if campaign != "operator" else ""
    return (f"{scale_env}{campaign_env}EAGLE3D_CHAOS_SEED={seed} EAGLE3D_CHAOS_ACTIONS="
            f"{','.join(map(str, kept))} .venv/bin/python -m pytest -q "
            "tests/chaos/test_random_operator.py")


def report(out: Outcome, scale: int) -> str:
    v = out.violation
    return (f"{out.campaign} seed {out.seed}: invariant broken: {v.invariant}\n  {v.detail}\n"
            f"  after {len(out.steps)} actions:\n    " + "\n    ".join(out.steps) +
            f"\n  replay: {replay_command(out.campaign, out.seed, out.kept[:len(out.steps)], scale)}")


OPERATOR = Campaign("operator", new_world, ACTIONS, WEIGHTS, draw, check)
