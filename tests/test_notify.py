"""sd_notify as systemd receives it: real datagram sockets (a path and an abstract name), real
child processes for the environment that must not leak."""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
import time
import uuid

import pytest

from eagle3d.daemon.notify import Notifier, watchdog_interval


@pytest.fixture(params=["path", "abstract"])
def notify_socket(request, tmp_path, monkeypatch):
    """A datagram socket bound like systemd's, with NOTIFY_SOCKET naming it."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    if request.param == "path":
        name = str(tmp_path / "notify")
        sock.bind(name)
    else:
        name = "@eagle3d-test-" + uuid.uuid4().hex
        sock.bind("\0" + name[1:])
    sock.settimeout(5)
    monkeypatch.setenv("NOTIFY_SOCKET", name)
    yield sock
    sock.close()


def received(sock: socket.socket) -> dict[str, str]:
    return dict(line.split("=", 1) for line in sock.recv(4096).decode().split("\n"))


def test_every_message_reaches_the_socket(notify_socket):
    notifier = Notifier.from_env()
    assert notifier.enabled

    notifier.ready()
    assert received(notify_socket) == {"READY": "1"}
    notifier.status("extract 41.7% (41700/100000 samples), ETA 3h12m")
    assert received(notify_socket) == {"STATUS": "extract 41.7% (41700/100000 samples), ETA 3h12m"}
    notifier.watchdog()
    assert received(notify_socket) == {"WATCHDOG": "1"}
    notifier.reloading()
    reload_msg = received(notify_socket)
    assert reload_msg["RELOADING"] == "1"
    # The reload's timestamp is on the clock systemd compares it with: CLOCK_MONOTONIC, in µs.
    now_usec = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
    assert 0 <= now_usec - int(reload_msg["MONOTONIC_USEC"]) < 5_000_000
    notifier.stopping()
    assert received(notify_socket) == {"STOPPING": "1"}
    notifier.close()


def test_a_multiline_status_stays_one_assignment(notify_socket):
    notifier = Notifier.from_env()
    notifier.status("paused: disk budget\nfree 9GiB < reserve 10GiB")
    assert received(notify_socket) == {"STATUS": "paused: disk budget free 9GiB < reserve 10GiB"}


def test_children_do_not_inherit_the_socket_or_the_watchdog(notify_socket, monkeypatch):
    monkeypatch.setenv("WATCHDOG_USEC", "90000000")
    monkeypatch.setenv("WATCHDOG_PID", str(os.getpid()))
    notifier = Notifier.from_env()
    assert notifier.watchdog_interval() == 45.0

    child = subprocess.run(
        [sys.executable, "-c", "import os; print([k for k in ('NOTIFY_SOCKET', 'WATCHDOG_USEC', "
         "'WATCHDOG_PID') if k in os.environ])"],
        capture_output=True, text=True, check=True)
    assert child.stdout.strip() == "[]"
    # ...and the daemon itself still reaches systemd after the variables are gone.
    notifier.ready()
    assert received(notify_socket) == {"READY": "1"}


def test_outside_systemd_every_call_is_a_no_op(monkeypatch):
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    monkeypatch.setenv("WATCHDOG_USEC", "10000000")
    notifier = Notifier.from_env()
    assert not notifier.enabled
    # No socket to ping: the daemon must not schedule pings into the void.
    assert notifier.watchdog_interval() is None
    for call in (notifier.ready, notifier.watchdog, notifier.reloading, notifier.stopping):
        call()
    notifier.status("plan")


def test_a_vanished_socket_is_logged_once_and_never_raises(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("NOTIFY_SOCKET", str(tmp_path / "gone"))
    notifier = Notifier.from_env()
    with caplog.at_level(logging.DEBUG, logger="eagle3d.daemon.notify"):
        for _ in range(5):
            notifier.watchdog()
            notifier.status("extract")
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1
    assert "gone" in warnings[0].getMessage()


def test_an_unsupported_socket_kind_is_reported_not_raised(monkeypatch, caplog):
    monkeypatch.setenv("NOTIFY_SOCKET", "vsock:2:1234")
    with caplog.at_level(logging.WARNING, logger="eagle3d.daemon.notify"):
        notifier = Notifier.from_env()
    assert not notifier.enabled
    assert "vsock:2:1234" in caplog.text
    notifier.ready()


@pytest.mark.parametrize("env, expected", [
    ({"WATCHDOG_USEC": "90000000"}, 45.0),
    ({"WATCHDOG_USEC": "500000", "WATCHDOG_PID": "OWN"}, 0.25),
    ({"WATCHDOG_USEC": "90000000", "WATCHDOG_PID": "1"}, None),  # meant for another process
    ({"WATCHDOG_USEC": "0"}, None),
    ({"WATCHDOG_USEC": "ninety"}, None),
    ({}, None),
])
def test_watchdog_interval_is_half_of_watchdog_usec_for_this_process(env, expected):
    env = {k: (str(os.getpid()) if v == "OWN" else v) for k, v in env.items()}
    assert watchdog_interval(env) == expected


def test_a_listener_that_stops_reading_never_blocks_the_daemon(tmp_path):
    path = str(tmp_path / "n.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    listener.bind(path)
    try:
        notifier = Notifier(path)
        started = time.monotonic()
        for _ in range(5000):  # far more than a datagram queue holds
            notifier.status("extract: 1/2 samples")
        assert time.monotonic() - started < 5
    finally:
        listener.close()
