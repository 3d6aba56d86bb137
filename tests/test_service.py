"""The daemon as systemd runs it: sd_notify over a real datagram socket, SIGTERM, SIGHUP reloads,
and a kill -9 that leaves no orphan behind."""

from __future__ import annotations

import os
import signal
import socket
import threading
import time
import uuid

import psutil
import pytest

from tests.pipeline import DaemonProcess, edit_config, messages_config, status, wait_for

pytestmark = pytest.mark.slow


def test_sd_notify_ready_status_watchdog_and_stopping(config_factory, tmp_path):
    config = messages_config(config_factory, tmp_path, 20)
    sock_path = f"/tmp/eagle3d-notify-{uuid.uuid4().hex[:8]}.sock"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(sock_path)
    sock.settimeout(0.2)
    got: list[str] = []
    listening = True

    def listen() -> None:  # as systemd does: always reading
        while listening:
            try:
                got.extend(sock.recv(65536).decode().splitlines())
            except (socket.timeout, BlockingIOError):
                pass

    reader = threading.Thread(target=listen, daemon=True)
    reader.start()

    try:
        with DaemonProcess(config, env={"NOTIFY_SOCKET": sock_path,
                                        "WATCHDOG_USEC": "2000000"}) as d:
            wait_for(lambda: "READY=1" in got, 60, "READY=1")
            wait_for(lambda: sum(m == "WATCHDOG=1" for m in got) >= 2, 60, "watchdog pings")
            wait_for(lambda: any(m.startswith("STATUS=extract") for m in got), 300,
                     "a STATUS line with the stage")
            st = d.status_until(lambda s: s["samples"]["inflight"] > 0 or
                                s["samples"]["verified"] > 0, 300, "work in flight")
            engine_pid = st["engine"].get("pid")
            started = time.time()
            assert d.stop(timeout=180) == 0, d.output()[-3000:]
            assert time.time() - started < 180  # the unit's TimeoutStopSec
        wait_for(lambda: "STOPPING=1" in got, 5, "STOPPING=1")
        st = status(config)
        assert st["samples"]["inflight"] == 0
        assert sum(st["samples"][k] for k in ("pending", "extracted", "verified", "failed")) == 20
        if engine_pid:
            assert not psutil.pid_exists(engine_pid)
    finally:
        listening = False
        reader.join()
        sock.close()
        os.unlink(sock_path)


def test_sighup_adds_samples_and_refuses_an_invalid_edit(config_factory, tmp_path):
    """A reload of a file that does not validate is refused, a contract edit among its lines
    switching nothing; a raised limit extends the run."""
    config = messages_config(config_factory, tmp_path, 8)
    with DaemonProcess(config, "--until", "train") as d:
        st = d.status_until(lambda s: s["samples"]["total"] == 8 and s["stage"] == "extract",
                            300, "the first plan")
        run = st["run"]["id"]
        edit_config(config, "target", dtype="bfloat16")
        edit_config(config, "extract", batch_tokens=-1)
        d.proc.send_signal(signal.SIGHUP)
        # The log, not status: eagle3ctl reads the operator's file, invalid until put back.
        wait_for(lambda: "reload refused" in d.output(), 60, "the refusal")
        assert "does not validate" in d.output() and "[extract.batch_tokens]" in d.output()
        edit_config(config, "target", dtype="float32")
        edit_config(config, "extract", batch_tokens=2048)
        st = d.status_until(lambda s: bool(s.get("config_problem")), 60, "the refusal")
        assert "does not validate" in st["config_problem"] and st["run"]["id"] == run
        edit_config(config, "data", limit=14)
        d.proc.send_signal(signal.SIGHUP)
        assert d.wait(600) == 0, d.output()[-4000:]
    st = status(config)
    assert st["samples"]["total"] == 14 and st["samples"]["verified"] == 14
    assert st["run"]["id"] == run and not st["run"]["set_aside"]
    assert "reload refused" in d.output() and "config reloaded" in d.output()


def test_kill_9_of_the_daemon_leaves_no_orphan_after_restart(config_factory, tmp_path):
    config = messages_config(config_factory, tmp_path, 20)
    with DaemonProcess(config) as d:
        st = d.status_until(lambda s: s["engine"].get("pid"), 300, "the engine")
        engine_pid = st["engine"]["pid"]
        d.proc.kill()
        d.proc.wait()
    time.sleep(0.5)
    # PR_SET_PDEATHSIG ends the engine with its parent; the restarted daemon checks anyway.
    with DaemonProcess(config, "--until", "train") as d2:
        assert d2.wait(600) == 0, d2.output()[-4000:]
    assert not psutil.pid_exists(engine_pid) or psutil.Process(engine_pid).status() == "zombie"
    st = status(config)
    assert st["samples"]["verified"] == 20 and st["samples"]["inflight"] == 0
