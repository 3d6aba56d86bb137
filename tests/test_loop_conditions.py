"""The loop never dies of a tick's error: a ledger another process holds, a full state disk, a
clock stepped back. The daemon stays up, pings the watchdog, shows the condition with its reason
and since when, and recovers by itself when the cause goes. Real processes, a real SQLite lock,
a real notify socket and real small tmpfs mounts."""

from __future__ import annotations

import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from eagle3d.ctl.status import HEARTBEAT_STALE_S
from eagle3d.daemon import control
from eagle3d.daemon.children import Supervisor
from eagle3d.daemon.reconcile import Daemon
from eagle3d.statemachine import layout
from eagle3d.statemachine.config_validation import load_config
from eagle3d.statemachine.ledger import Ledger
from tests.chaos.operator_disks import read_only
from tests.pipeline import DaemonProcess, ctl, fill_file_system, status

# A second process holds the ledger's write lock (an operator's sqlite3 shell left open, a
# backup tool): readers go on, every writer waits.
LOCK_HOLDER = """
import sqlite3, sys, time
db = sqlite3.connect(sys.argv[1], isolation_level=None)
db.execute("BEGIN EXCLUSIVE")
db.execute("INSERT INTO events (t, kind, detail) VALUES (0, 'test', 'lock held')")
print("held", flush=True)
time.sleep(600)
"""


def paused_config(config_factory, metrics: dict[str, str] | None = None, **paths: str) -> Path:
    """A daemon paused from its first tick: no planner, no engine; only the loop runs."""
    sections = {key: value for key, value in (("paths", paths), ("metrics", metrics)) if value}
    config = config_factory(sections or None)
    state_dir = load_config(config).paths.state_dir
    layout.control_dir(state_dir).mkdir(parents=True, mode=0o700)
    control.submit(state_dir, "pause", {"reason": "the loop alone"})
    return config


def heartbeat_stays_fresh(d: DaemonProcess, seconds: float, bound_s: float = 10.0) -> None:
    """At every look for `seconds`, the daemon runs and its heartbeat is younger than `bound_s`:
    it publishes every second, and a tick stuck on a lock ages it. The bound leaves a busy
    machine room above the loop's 2 s busy timeout, and lies under status's 15 s stale bound."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        st = status(d.config)
        assert d.proc.poll() is None and st["daemon"]["alive"], d.output()[-4000:]
        assert st["daemon"]["heartbeat_age_s"] < bound_s, st["daemon"]
        time.sleep(0.5)


def events(state_dir: Path, kind: str) -> list[str]:
    with Ledger(layout.ledger(state_dir), readonly=True) as ledger:
        return [row[0] for row in ledger.db.execute(
            "SELECT detail FROM events WHERE kind = ? ORDER BY seq", (kind,))]


@pytest.mark.slow
def test_a_ledger_held_by_another_process_is_a_condition_and_the_daemon_recovers(
        config_factory):
    config = paused_config(config_factory)
    state_dir = load_config(config).paths.state_dir
    with DaemonProcess(config) as d:
        d.status_until(lambda st: st["stage"] == "paused", 60, "the pause")
        holder = subprocess.Popen([sys.executable, "-c", LOCK_HOLDER,
                                   str(layout.ledger(state_dir))],
                                  stdout=subprocess.PIPE, text=True)
        try:
            assert holder.stdout.readline().strip() == "held"
            held = time.time()
            # A request the daemon must write down: its tick waits for the lock.
            control.submit(state_dir, "pause", {"reason": "while the ledger is held"})
            st = d.status_until(lambda st: st.get("condition"), 30, "the condition")
            assert "ledger locked" in st["condition"]["reason"], st["condition"]
            assert held - 1 <= st["condition"]["since"] <= time.time()
            # Held through several backoffs (retried after 1, 2, 4 s, each waiting the loop's
            # 2 s busy timeout): the daemon lives and its heartbeat stays fresh all along. The old
            # busy timeout (30 s) aged the heartbeat past the bound in its first wait, seen
            # within seconds, where a wait past 30 s cost the suite half a minute.
            heartbeat_stays_fresh(d, 12)
            proc = ctl(config, "status")
            assert d.proc.poll() is None, d.output()[-4000:]
            assert proc.returncode == 9, proc.stdout + proc.stderr
            assert re.search(r"condition ledger locked .* since \d\d:\d\d:\d\d", proc.stdout), \
                proc.stdout
            assert "NOT RUNNING" not in proc.stdout, proc.stdout
            assert d.output().count("Traceback") == 1, "logged once per distinct error"
        finally:
            holder.kill()
            holder.wait()
        st = d.status_until(lambda st: not st.get("condition"), 90, "the recovery")
        assert st["stage"] == "paused" and ctl(config, "status").returncode == 0
        assert d.stop() == 0
    # Recorded once the ledger takes it again (while it was held, the log alone had it).
    assert any("ledger locked" in e for e in events(state_dir, "condition_cleared"))


def test_the_watchdog_pings_go_on_after_the_clock_steps_back(config_factory, tmp_path,
                                                             monkeypatch):
    """NTP steps the clock back an hour: the pings must not wait for the wall clock to catch
    up with the last one, or systemd kills a healthy daemon."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    listener.bind(str(tmp_path / "notify"))
    listener.setblocking(False)
    monkeypatch.setenv("NOTIFY_SOCKET", str(tmp_path / "notify"))
    monkeypatch.setenv("WATCHDOG_USEC", "200000")  # a ping every 0.1 s
    daemon = Daemon(load_config(paused_config(config_factory)))
    try:
        daemon.recover()
        daemon.tick()
        real = time.time
        monkeypatch.setattr(time, "time", lambda: real() - 3600)
        pings = 0
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline:
            daemon.tick()
            time.sleep(0.05)
            try:
                while True:
                    pings += listener.recv(4096) == b"WATCHDOG=1"
            except BlockingIOError:
                pass
        assert pings >= 10, f"{pings} watchdog pings in 2 s after the clock stepped back"
    finally:
        daemon.shutdown()
        listener.close()



def test_a_child_restarts_after_its_backoff_whatever_the_clock_does(monkeypatch):
    """A child's backoff of 2 s ends after 2 s: a clock stepped forward a day does not skip
    it, one stepped back an hour does not keep the child down for that hour."""
    real = time.time
    supervisor = Supervisor("[extract] engine_max_restarts", 5)
    supervisor.exited(1, "the engine exited with code 1")
    monkeypatch.setattr(time, "time", lambda: real() + 86400)
    assert not supervisor.may_start and supervisor.state == "backoff"
    monkeypatch.setattr(time, "time", lambda: real() - 3600)
    time.sleep(2.2)
    assert supervisor.may_start and supervisor.state == "stopped"


@pytest.mark.slow
def test_a_full_state_disk_pauses_the_daemon_which_says_so_and_goes_on(config_factory, tmpfs):
    """Another tenant fills the state folder's disk to the last byte: the daemon gives up its
    reserve, pauses, and status says so; it goes on by itself once space is freed."""
    disk = tmpfs("state", "80m")
    config = paused_config(config_factory, state_dir=str(disk / "state"))
    with DaemonProcess(config) as d:
        st = d.status_until(lambda st: st["stage"] == "paused", 60, "the pause")
        assert st["state_reserve"]["held"], st
        ballast = fill_file_system(disk)
        st = d.status_until(lambda st: "state disk full" in st["reason"], 30, "the disk's pause")
        assert st["paused_by"] == "budget" and not st["state_reserve"]["held"], st
        proc = ctl(config, "status")
        assert proc.returncode == 4 and "given up: the disk is full" in proc.stdout, proc.stdout
        ballast.unlink()
        st = d.status_until(lambda st: st["paused_by"] == "operator", 30, "the pause lifted")
        assert st["state_reserve"]["held"] and d.proc.poll() is None
        assert d.stop() == 0


@pytest.mark.slow
def test_a_read_only_state_disk_shows_a_live_daemon_whose_state_is_stale(config_factory, tmpfs):
    """The kernel turns the state disk read-only after an I/O error (here a read-only bind of it
    over itself, as hostile seed 3's walk does): the state file and its heartbeat cannot be
    rewritten. Status still shows the live daemon and its fresh heartbeat, says since when the
    state file is not written and from when the state shown is, with the condition's code 9,
    never NOT RUNNING; once the disk is back, status is the plain one again."""
    disk = tmpfs("state", "80m")
    config = paused_config(config_factory, state_dir=str(disk / "state"))
    with DaemonProcess(config) as d:
        d.status_until(lambda st: st["stage"] == "paused", 60, "the pause")
        with read_only(disk):
            time.sleep(HEARTBEAT_STALE_S + 3)  # past the age at which a silent state file is death
            proc = ctl(config, "status")
            assert d.proc.poll() is None, d.output()[-4000:]
            assert proc.returncode == 9, proc.stdout + proc.stderr
            assert "NOT RUNNING" not in proc.stdout, proc.stdout
            assert re.search(r"state     not written since \d\d:\d\d:\d\d \(cannot write the state "
                             r"file in .*: Read-only file system\); the state shown is from "
                             r"\d\d:\d\d:\d\d", proc.stdout), proc.stdout
            st = status(config)
            assert st["daemon"]["alive"] and st["daemon"]["heartbeat_age_s"] < 5, st["daemon"]
        d.status_until(lambda st: not st["state_stale"], 30, "the state file written again")
        proc = ctl(config, "status")
        assert proc.returncode == 0 and "not written" not in proc.stdout, proc.stdout
        assert d.stop() == 0


def test_a_read_only_state_disk_keeps_the_metrics_fresh_and_says_why(config_factory, tmpfs,
                                                                     tmp_path):
    """The state disk read-only, node_exporter's textfile on a healthy disk: the textfile goes on
    being written, its heartbeat fresh (a stale one pages a live daemon as dead), and it says the
    state is not written and why (eagle3d_loop_condition pages for that reason); once the disk
    is back, both are 0 again."""
    from tests.test_metrics import scrape, value
    disk = tmpfs("state", "80m")
    textfile = tmp_path / "textfile" / "eagle3d.prom"
    textfile.parent.mkdir()
    config = paused_config(config_factory, {"textfile": str(textfile)},
                           state_dir=str(disk / "state"))
    with DaemonProcess(config) as d:
        d.status_until(lambda st: st["stage"] == "paused", 60, "the pause")
        with read_only(disk):
            time.sleep(HEARTBEAT_STALE_S + 3)
            samples = scrape(textfile)
            assert d.proc.poll() is None, d.output()[-4000:]
            assert time.time() - value(samples, "eagle3d_heartbeat_timestamp_seconds") < 5
            assert value(samples, "eagle3d_loop_condition") == 1
            reason = [dict(labels)["reason"] for (name, labels), v in samples.items()
                      if name == "eagle3d_state_not_written" and v == 1]
            assert reason and "Read-only file system" in reason[0], samples
        d.status_until(lambda st: not st["state_stale"], 30, "the state file written again")
        time.sleep(2)
        samples = scrape(textfile)
        assert value(samples, "eagle3d_loop_condition") == 0
        assert value(samples, "eagle3d_state_not_written") == 0
        assert d.stop() == 0


def test_a_request_to_a_daemon_whose_state_disk_is_read_only_says_it_was_not_delivered(
        config_factory, tmpfs):
    """The control folder lies on the state disk: while it is read-only a request cannot reach
    the running daemon. eagle3ctl says so (the daemon runs, its state disk is read-only, send
    again later), exit 75, never "the daemon is not running"; once the disk is back it goes
    through."""
    disk = tmpfs("state", "80m")
    config = paused_config(config_factory, state_dir=str(disk / "state"))
    with DaemonProcess(config) as d:
        d.status_until(lambda st: st["stage"] == "paused", 60, "the pause")
        with read_only(disk):
            d.status_until(lambda st: st["state_stale"], 30, "the state file not written")
            proc = ctl(config, "resume")
            assert proc.returncode == 75, proc.stdout + proc.stderr
            assert "not running" not in proc.stderr, proc.stderr
            assert re.search(rf"the daemon runs \(pid {d.proc.pid}\), but its state disk cannot be "
                             r"written \(.*Read-only file system\): the request was not "
                             r"delivered", proc.stderr), proc.stderr
        d.status_until(lambda st: not st["state_stale"], 30, "the state file written again")
        assert ctl(config, "resume").returncode == 0
        d.status_until(lambda st: st["stage"] != "paused", 60, "the resume")
        assert d.stop() == 0
