"""A start that fails, and a stop that fails, as the operator sees them: the daemon's output is
one line naming the file and what to do, never a traceback; a failed start's exit code tells
systemd whether to start it again (2: the operator must act; 75: it may mend by itself), and a
stop that cannot write its ledger still ends cleanly and releases the state folder. Real damaged
files, a real second process holding the ledger, a real tmpfs remounted read-only."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from eagle3d.daemon.reconcile import Daemon, prepare_dirs
from eagle3d.statemachine import daemon_lock, entry, layout
from eagle3d.statemachine.config_validation import load_config
from eagle3d.statemachine.ledger import Ledger
from tests.conftest import venv_bin
from tests.pipeline import DaemonProcess, ctl
from tests.test_loop_conditions import LOCK_HOLDER as WRITER, paused_config


def start(config: Path) -> tuple[int, str]:
    """`eagle3d run` on `config`, which must end by itself: its exit code and its output."""
    proc = subprocess.run([venv_bin("eagle3d"), "run", "-c", str(config)], capture_output=True,
                          text=True, timeout=60)
    return proc.returncode, proc.stdout + proc.stderr


def one_line(out: str, *said: str) -> str:
    """The one error line of the output, which says each of `said`; no traceback."""
    assert "Traceback" not in out, out
    errors = [line for line in out.splitlines() if "ERROR" in line]
    assert len(errors) == 1, out
    for words in said:
        assert words in errors[0], errors[0]
    return errors[0]


def status_says(config: Path, *said: str) -> None:
    proc = ctl(config, "status")
    assert "Traceback" not in proc.stdout + proc.stderr, proc.stderr
    for words in said:
        assert words in proc.stdout, proc.stdout


def not_sqlite(ledger: Path) -> None:
    ledger.write_bytes(b"a backup script's text where the ledger was\n" * 200)


def damaged(ledger: Path) -> None:
    Ledger(ledger).close()
    data = ledger.read_bytes()
    ledger.write_bytes(data[:len(data) // 2] + b"\xff" * 512)


def a_folder(ledger: Path) -> None:
    ledger.mkdir()


@pytest.mark.parametrize("spoil, said", [(not_sqlite, "is damaged (file is not a database)"),
                                         (damaged, "is damaged (database disk image is malformed)"),
                                         (a_folder, "is a folder where the ledger file belongs")])
def test_a_damaged_ledger_is_one_line_and_exit_2(config_factory, spoil, said):
    config = config_factory()
    ledger = layout.ledger(load_config(config).paths.state_dir)
    ledger.parent.mkdir(mode=0o750)
    spoil(ledger)
    code, out = start(config)
    assert code == entry.REFUSED, out
    one_line(out, f"cannot start: {ledger} {said}", "exit 2")
    status_says(config, f"note      ledger not readable ({ledger} {said}")


def test_a_damaged_runs_registry_is_one_line_and_exit_2(config_factory):
    config = config_factory()
    registry = layout.runs_registry(load_config(config).paths.state_dir)
    registry.parent.mkdir(mode=0o750)
    registry.write_text("current = 'r1'\n[runs.r1]\nkey = 'k'\n")  # a run without its keys
    code, out = start(config)
    assert code == entry.REFUSED, out
    one_line(out, f"{registry} is unreadable (KeyError: 'model')", "put it back")
    shown = ctl(config, "status")
    assert shown.returncode == 2 and f"{registry} is unreadable" in shown.stderr, shown


def test_a_folder_in_the_config_in_force_place_is_one_line_and_exit_2(config_factory):
    config = config_factory()
    in_force = layout.config_in_force(load_config(config).paths.state_dir)
    in_force.mkdir(parents=True)
    (in_force / "notes").write_text("an operator's")
    code, out = start(config)
    assert code == entry.REFUSED, out
    one_line(out, f"cannot start: {in_force}: Is a directory", "exit 2")
    status_says(config, "NOT RUNNING")


def test_a_failed_start_releases_the_state_folder(config_factory):
    """In-process as in a test or an embedding: the lock goes with the failed start."""
    cfg = load_config(config_factory())
    cfg.paths.state_dir.mkdir(0o750)
    not_sqlite(layout.ledger(cfg.paths.state_dir))
    with pytest.raises(Exception, match=f"cannot start: {layout.ledger(cfg.paths.state_dir)} is "
                                        "damaged"):
        Daemon(cfg)
    daemon_lock.hold(cfg.paths.state_dir).close()  # no Held: the failed start let it go


# A second process holds the ledger in SQLite's exclusive locking mode (a backup tool, an
# sqlite3 shell): readers wait as writers do, beyond the daemon's bounded wait.
LOCK_HOLDER = """
import sqlite3, sys, time
db = sqlite3.connect(sys.argv[1], isolation_level=None)
db.execute("PRAGMA locking_mode=EXCLUSIVE")
db.execute("BEGIN EXCLUSIVE")
db.execute("INSERT INTO events (t, kind, detail) VALUES (0, 'test', 'lock held')")
print("held", flush=True)
time.sleep(600)
"""


def test_a_ledger_locked_at_start_exits_75_and_the_next_start_goes_on(config_factory):
    config = paused_config(config_factory)
    ledger = layout.ledger(load_config(config).paths.state_dir)
    Ledger(ledger).close()
    holder = subprocess.Popen([sys.executable, "-c", LOCK_HOLDER, str(ledger)],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        code, out = start(config)
        assert code == entry.RETRY, out
        one_line(out, f"cannot start for now: {ledger}: database is locked", "exit 75")
        status_says(config, f"ledger not readable right now ({ledger}: database is locked)")
    finally:
        holder.kill()
        holder.wait()
    with DaemonProcess(config) as d:  # what systemd's restart does once the holder is gone
        d.status_until(lambda st: st["stage"] == "paused", 60, "the pause")
        assert d.stop() == 0


def test_a_state_disk_read_only_at_start_exits_75_and_the_next_start_goes_on(config_factory,
                                                                            tmpfs):
    """The state disk turned read-only (errors=remount-ro) while the daemon was down."""
    disk = tmpfs("state", "80m")
    config = paused_config(config_factory, state_dir=str(disk / "state"))
    cfg = load_config(config)
    prepare_dirs(cfg)  # as a previous life left them
    Ledger(layout.ledger(cfg.paths.state_dir)).close()
    subprocess.run(["mount", "-o", "remount,ro", str(disk)], check=True)
    try:
        code, out = start(config)
        assert code == entry.RETRY, out
        one_line(out, "cannot start for now: ", "Read-only file system", "exit 75")
    finally:
        subprocess.run(["mount", "-o", "remount,rw", str(disk)], check=True)
    with DaemonProcess(config) as d:
        d.status_until(lambda st: st["stage"] == "paused", 60, "the pause after the remount")
        assert d.stop() == 0


def test_a_stop_that_cannot_write_the_ledger_still_releases_the_folder(config_factory):
    """Another process holds the ledger when SIGTERM comes: the stop cannot return what is in
    flight, says so in one line, exits 0 and lets the state folder go: the next daemon starts
    at once (its recovery returns what is left in flight)."""
    config = paused_config(config_factory)
    ledger = layout.ledger(load_config(config).paths.state_dir)
    with DaemonProcess(config) as d:
        d.status_until(lambda st: st["stage"] == "paused", 60, "the pause")
        # The writer's lock: the running daemon's connection keeps the exclusive mode out.
        holder = subprocess.Popen([sys.executable, "-c", WRITER, str(ledger)],
                                  stdout=subprocess.PIPE, text=True)
        try:
            assert holder.stdout.readline().strip() == "held"
            assert d.stop() == 0, d.output()[-4000:]
        finally:
            holder.kill()
            holder.wait()
        out = d.output()
        assert "Traceback" not in out, out
        assert (f"ledger locked (another process holds {ledger}; while returning in-flight "
                "samples to pending); the next start takes it up") in out, out
    with DaemonProcess(config) as d:
        d.status_until(lambda st: st["stage"] == "paused", 60, "the next start")
        assert d.stop() == 0
