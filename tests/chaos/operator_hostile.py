"""The randomized operator's hostile campaign: the operator campaign's actions (operator_walk.py)
and what a shared server's hostile week does (issue 59), with the long switch of issue 52 item 7
and the nested run folders of item 1 that check-config cannot refuse (a [paths] edit that puts
the next run's folder inside the last run's root).

Its invariants are the operator campaign's, which include two of issue 59's rules: the daemon
never exits but by the walk's own stop or kill (rule 1), and its heartbeat and watchdog pings go
on (rule 4). Each action below adds what it alone can observe.
"""

from __future__ import annotations

import json
import os
import random
import signal
import struct
import subprocess
import sys
import threading
import time
import tomllib
import uuid
from pathlib import Path
from typing import Any

import psutil
import tomli_w

from eagle3d.dataset import contract as capture_contract, dumpformat
from eagle3d.statemachine import layout, pointer
from eagle3d.statemachine.atomic import atomic_write_bytes
from eagle3d.statemachine.ledger import Ledger
from tests.chaos import operator_clock, operator_disks, operator_walk as ow
from tests.chaos.operator_walk import Violation, World
from tests.pipeline import DaemonProcess, edit_config


def _child(world: World, pick: int, module: str = "") -> psutil.Process | None:
    kids = [k for k in ow._children(world.daemon.proc.pid) if module in " ".join(_cmd(k))]
    return kids[pick % len(kids)] if kids else None


def _cmd(p: psutil.Process) -> list[str]:
    try:
        return p.cmdline()
    except psutil.Error:
        return []


def act_sigstop(world: World, p: dict[str, Any]) -> str:
    """SIGSTOP of any child (engine, planner, trainer, evaluation): alive, and silent."""
    if not world.alive() or (kid := _child(world, p["pick"])) is None:
        return "skip"
    try:
        kid.suspend()
    except psutil.Error:
        return "skip"
    world.stopped.append(kid.pid)
    return f"SIGSTOP {' '.join(_cmd(kid)[1:3])[:60]}"


def act_sigcont(world: World, p: dict[str, Any]) -> str:
    if not world.stopped:
        return "skip"
    for pid in world.stopped:
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            pass
    resumed, world.stopped = world.stopped, []
    return f"SIGCONT {resumed}"


LOCK_HOLDER = """
import sqlite3, sys, time
db = sqlite3.connect(sys.argv[1], isolation_level=None)
db.execute("BEGIN EXCLUSIVE")
print("held", flush=True)
time.sleep(float(sys.argv[2]))
"""


def act_hold_ledger(world: World, p: dict[str, Any]) -> str:
    """Another process holds the current run's ledger (BEGIN EXCLUSIVE) for a while: the daemon
    lives, and status never calls it not running."""
    run = ow._current(world)
    if not world.alive() or run is None or not layout.ledger(run.state_dir).exists():
        return "skip"
    holder = subprocess.Popen([sys.executable, "-c", LOCK_HOLDER,
                               str(layout.ledger(run.state_dir)), str(p["s"])],
                              stdout=subprocess.PIPE, text=True)
    try:
        if holder.stdout.readline().strip() != "held":
            return "skip"  # the daemon held it first for longer than sqlite's wait
        with watching(world, "while another process held the ledger"):
            holder.wait(p["s"] + 60)
    finally:
        if holder.poll() is None:
            holder.kill()
            holder.wait()
    return f"ledger held {p['s']} s"


class watching:
    """Polls `eagle3ctl status` while an action lasts: a live daemon is never NOT RUNNING and
    never exits unbidden, at any moment of it, not only after it."""

    def __init__(self, world: World, during: str) -> None:
        self.world, self.during = world, during
        self.problem: Violation | None = None
        self.done = threading.Event()

    def _poll(self) -> None:
        while not self.done.wait(1.0) and self.problem is None:
            code, st = ow.status(self.world)
            if not self.world.alive():
                self.problem = Violation("the loop never dies (rule 1)",
                                         f"the daemon exited {self.world.daemon.proc.returncode} "
                                         f"{self.during}: {self.world.daemon.output()[-800:]}")
            elif code == 3:
                self.problem = Violation("status's exit code is the daemon's condition",
                                         f"eagle3ctl status said NOT RUNNING {self.during} (stage "
                                         f"{st.get('stage')!r})")

    def __enter__(self) -> "watching":
        self.thread = threading.Thread(target=self._poll, daemon=True)
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.done.set()
        self.thread.join()
        if self.problem is not None and exc[0] is None:
            raise self.problem


def act_second_daemon(world: World, p: dict[str, Any]) -> str:
    """A second `eagle3d run` on the same config: refused with exit 2, the first untouched (its
    pid, and every child it had)."""
    if not world.alive():
        return "skip"
    engines = {k for k in ow._children(world.daemon.proc.pid)
               if "eagle3d.capture.engines.transformers.worker" in " ".join(_cmd(k))}
    second = DaemonProcess(world.config)
    try:
        code = second.proc.wait(90)
    except subprocess.TimeoutExpired:
        second.proc.kill()
        second.proc.wait()
        raise Violation("one daemon per state folder", "a second `eagle3d run` on the same "
                        f"config still ran after 90 s: {second.output()[-600:]}") from None
    finally:
        second.log.close()
    if code != 2:
        raise Violation("one daemon per state folder", f"a second `eagle3d run` exited {code}, "
                        f"not 2: {second.output()[-600:]}")
    if not world.alive():
        raise Violation("one daemon per state folder", "the first daemon died when a second "
                        f"started: {world.daemon.output()[-600:]}")
    killed = [e.pid for e in engines if _zombie(e)]
    if killed:
        raise Violation("one daemon per state folder",
                        f"the first daemon's engine {killed} died as a second started")
    return f"second daemon refused (2): {second.output().strip().splitlines()[-1][:90]}"


HOSTILE_CONFIGS = {
    "garbage": lambda text: os.urandom(700),
    "truncated": lambda text: text.encode()[: len(text) // 3],
    "nan": lambda text: _set(text, "train", "stop_grace_s", float("nan")),
    "huge": lambda text: _set(text, "data", "limit", 2 ** 70),
    "past-sqlite": lambda text: _set(text, "train", "max_steps", 2 ** 63),
    "inf": lambda text: _set(text, "budget", "reserve", float("inf")),
    "wrong-type": lambda text: _set(text, "extract", "batch_tokens", {"a": [1, "b"]}),
}


def _set(text: str, section: str, key: str, value: Any) -> bytes:
    doc = tomllib.loads(text)
    doc.setdefault(section, {})[key] = value
    return tomli_w.dumps(doc).encode()


def act_hostile_config(world: World, p: dict[str, Any]) -> str:
    """A reload of a hostile file (garbage bytes, nan, inf, integers past SQLite's): check-config
    refuses it, the reload refuses it with the daemon alive, and the config in force is unchanged;
    then the operator's own file is put back and reloaded."""
    if not world.alive() or (running := pointer.read(world.config)) is None:
        return "skip"
    in_force = Path(running["in_force"])
    kept, saved = in_force.read_bytes(), world.config.read_text()
    atomic_write_bytes(world.config, HOSTILE_CONFIGS[p["kind"]](saved))
    try:
        checked = ow.ctl(world, "check-config")
        if checked.returncode != 2 or "Traceback" in checked.stderr:
            raise Violation("every config number is bounded and finite",
                            f"check-config of a {p['kind']} file exited {checked.returncode}: "
                            f"{(checked.stdout + checked.stderr)[-400:]}")
        _reload(world, f"at a reload of a {p['kind']} config")
        if in_force.read_bytes() != kept:
            raise Violation("a hostile reload leaves the config in force",
                            f"a {p['kind']} reload changed {in_force}")
        code, st = ow.status(world)
        if not st.get("config_problem"):
            raise Violation("a hostile reload leaves the config in force",
                            f"status names no refused edit after a {p['kind']} reload (exit {code})")
    finally:
        atomic_write_bytes(world.config, saved.encode())
    _reload(world, "at the reload of the operator's own file")
    return f"{p['kind']} config refused by check-config and the reload; file put back"


def _reload(world: World, during: str) -> None:
    t0 = time.monotonic()
    world.daemon.proc.send_signal(signal.SIGHUP)
    with watching(world, during):
        ow.wait(lambda: world.notify.after(t0, "READY=1") or not world.alive(), ow.SETTLE_S)
    time.sleep(1.5)  # one publish after the reload


HOSTILE_RECORDS = {
    "not-json": b"{\"messages\": [{\"role\": \"user\", \"content\": \"x\"\n",
    "nul": b"\0" * 64 + b"\n",
    "not-utf8": b"{\"messages\": \"\xff\xfe\xfd\"}\n",
    "surrogate": b'{"messages": [{"role": "user", "content": "\\ud800"}, '
                 b'{"role": "assistant", "content": "a"}]}\n',
    "deep": b"[" * 100000 + b"]" * 100000 + b"\n",
    "huge-number": b'{"messages": [{"role": "user", "content": 1' + b"0" * 5000 + b"}]}\n",
    "no-assistant": b'{"messages": [{"role": "user", "content": "only a question"}]}\n',
}


def act_hostile_record(world: World, p: dict[str, Any]) -> str:
    """A hostile record appended to the source, and the limit raised over it (check-config, then
    a reload): the daemon lives and skips or refuses it by its line, never by a traceback."""
    if not world.alive():
        return "skip"
    source = Path(tomllib.loads(world.config.read_text())["data"]["source"])
    with open(source, "ab") as f:
        f.write(HOSTILE_RECORDS[p["kind"]])
    lines = sum(1 for _ in open(source, "rb"))
    edit_config(world.config, "data", limit=lines)
    did = ow.act_reload(world, p)
    return f"{p['kind']} record at line {lines}, [data] limit = {lines}; reload: {did}"


def hostile_header(kind: str, sid: str, contract: str) -> bytes:
    """A dump whose header lies: about its tensors, its counts, its own length."""
    meta = {"format": dumpformat.FORMAT, "sample_id": sid, "tokens": "8", "contract": contract}
    tensor = {"dtype": "BF16", "shape": [8, 576], "data_offsets": [0, 9216]}
    header: Any = {"__metadata__": meta, "input_ids": dict(tensor, dtype="I32", shape=[8],
                                                           data_offsets=[0, 32])}
    if kind == "huge-shape":
        header["aux_hidden_states"] = dict(tensor, shape=[2 ** 62, 2 ** 62])
    elif kind == "nan-tokens":
        meta["tokens"] = "NaN"
    elif kind == "negative-offsets":
        header["last_hidden_state"] = dict(tensor, data_offsets=[-9216, -1])
    elif kind == "wrong-types":
        header["aux_hidden_states"] = {"dtype": ["BF16"], "shape": "8x576", "data_offsets": None}
    elif kind == "deep":
        header = json.loads("[" * 500 + "]" * 500)
    raw = json.dumps(header).encode() if kind != "length-lies" else b"{}"
    length = 2 ** 63 if kind == "length-lies" else len(raw)
    return struct.pack("<Q", length) + raw + b"\0" * 64


def act_hostile_dump(world: World, p: dict[str, Any]) -> str:
    """A dump with a hostile header renamed into the spool, named for a pending sample of the
    current run: rejected (it leaves the spool), the daemon alive, the sample never verified
    from it."""
    run = ow._current(world)
    spool = world.folder("spool_dir")
    contract = capture_contract.read(run.dataset_dir) if run else None
    if not world.alive() or not spool.is_dir() or not contract \
            or not layout.ledger(run.state_dir).exists():
        return "skip"
    with Ledger(layout.ledger(run.state_dir), readonly=True, timeout=5) as ledger:
        pending = [s.id for s in ledger.samples("pending", limit=100)]
    if not pending:
        return "skip"
    sid = pending[p["pick"] % len(pending)]
    staged = spool.parent / f".eagle3d-test-{uuid.uuid4().hex}.tmp"  # a rename: one file system
    staged.write_bytes(hostile_header(p["kind"], sid, contract["fingerprint"]))
    name = spool / dumpformat.dump_name(sid)
    os.rename(staged, name)
    with watching(world, f"after a {p['kind']} dump header in the spool"):
        gone = ow.wait(lambda: not name.exists(), 30)
    if not gone:
        raise Violation("every problem in a dump's header is a rejection",
                        f"a {p['kind']} header for {sid} still sits in the spool after 30 s")
    with Ledger(layout.ledger(run.state_dir), readonly=True, timeout=10) as ledger:
        now = {s.id: s.status for s in ledger.samples()}.get(sid)
    if now in ("extracted", "verified") and not _engine_ran(world):
        raise Violation("every problem in a dump's header is a rejection",
                        f"{sid} is {now} after a {p['kind']} header with no engine running")
    return f"{p['kind']} header for {sid}: left the spool, sample {now}"


def _engine_ran(world: World) -> bool:
    return any("eagle3d.capture.engines.transformers.worker" in " ".join(_cmd(k))
               for k in ow._children(world.daemon.proc.pid))


def act_long_switch(world: World, p: dict[str, Any]) -> str:
    """Issue 52 item 7: a run switch while the engine will not stop (SIGSTOPped as it starts)
    with a stop grace well past WatchdogSec. The pings go on, status never says NOT RUNNING, and
    the old engine is gone after its grace; the budget holds the new run again."""
    if not world.alive() or ow._current(world) is None:
        return "skip"
    grace = p["grace"]
    edit_config(world.config, "extract", engine_stop_grace_s=grace)
    edit_config(world.config, "budget", reserve=ow.LIFT)
    ow.act_reload(world, p)
    engine = ow.wait(lambda: _child(world, 0, "eagle3d.capture.engines.transformers.worker"), 90)
    if engine is None:
        return f"grace {grace} s: no engine came (stage {ow.status(world)[1].get('stage')!r})"
    engine.suspend()
    world.stopped.append(engine.pid)
    dtype = tomllib.loads(world.config.read_text())["target"].get("dtype", "float32")
    edit_config(world.config, "target", dtype="bfloat16" if dtype == "float32" else "float32")
    edit_config(world.config, "budget", reserve=world.hold())
    t0 = time.monotonic()
    with watching(world, "during a switch with a stopped engine"):
        did = ow.act_reload(world, p)
        ow.wait(lambda: not psutil.pid_exists(engine.pid) or _zombie(engine), grace + 60)
    if psutil.pid_exists(engine.pid) and not _zombie(engine):
        raise Violation("a switch stops the old run's stages",
                        f"the stopped engine {engine.pid} outlived its {grace} s grace by 60 s")
    return f"grace {grace} s, engine SIGSTOPped; {did}; engine gone after " \
           f"{time.monotonic() - t0:.0f} s"


def _zombie(p: psutil.Process) -> bool:
    try:
        return p.status() == psutil.STATUS_ZOMBIE
    except psutil.Error:
        return True


ACTIONS = {**ow.ACTIONS, "sigstop": act_sigstop, "sigcont": act_sigcont,
           "hold-ledger": act_hold_ledger, "second-daemon": act_second_daemon,
           "hostile-config": act_hostile_config, "hostile-record": act_hostile_record,
           "hostile-dump": act_hostile_dump, "long-switch": act_long_switch,
           **operator_disks.ACTIONS, **operator_clock.ACTIONS}

# The operator campaign's, with less editing and killing and the hostile actions; no `finish`
# (training is the operator campaign's) so that a walk stays about a minute.
WEIGHTS = {**ow.WEIGHTS, "edit": 8, "kill-daemon": 1, "finish": 0, "sigstop": 3, "sigcont": 2,
           "hold-ledger": 2, "second-daemon": 2, "hostile-config": 3, "hostile-record": 2,
           "hostile-dump": 3, "long-switch": 1, **operator_disks.WEIGHTS,
           **operator_clock.WEIGHTS}

# Item 1 where check-config cannot refuse it: the next run's folder inside the last run's root.
EDITS = [*ow.EDITS, ("paths", "dataset_dir", ["dataset/inner"]),
         ("paths", "train_dir", ["train/inner"])]


def draw(rng: random.Random, name: str, p: dict[str, Any]) -> None:
    ow.draw(rng, name, p, EDITS)
    operator_disks.draw(rng, name, p)
    operator_clock.draw(rng, name, p)
    if name == "hold-ledger":
        p["s"] = rng.choice([3, 12, 30])
    elif name == "hostile-config":
        p["kind"] = rng.choice(sorted(HOSTILE_CONFIGS))
    elif name == "hostile-record":
        p["kind"] = rng.choice(sorted(HOSTILE_RECORDS))
    elif name == "hostile-dump":
        p["kind"] = rng.choice(["huge-shape", "nan-tokens", "negative-offsets", "wrong-types",
                                "deep", "length-lies"])
    elif name == "long-switch":
        p["grace"] = rng.choice([25, 40])


def new_world(tmp: Path, rng: random.Random, scale: int) -> World:
    world = ow.new_world(tmp, rng, scale)
    world.clock = operator_clock.Clock(tmp)
    return world


HOSTILE = ow.Campaign("hostile", new_world, ACTIONS, WEIGHTS, draw, operator_disks.check,
                      disks=operator_disks.disks, end=operator_disks.finish)
