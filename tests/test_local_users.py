"""A hostile local user on a shared server, and a second daemon on the same state folder: what
another account on the machine can and cannot do to a running service."""

from __future__ import annotations

import socket
import subprocess

import psutil

from eagle3d.statemachine import layout
from eagle3d.statemachine.config import load_config
from eagle3d.statemachine.ledger import Ledger
from tests.conftest import venv_bin
from tests.pipeline import DaemonProcess, ctl, messages_config


def test_a_second_daemon_on_the_same_state_folder_is_refused_naming_the_first(
        tmp_path, config_factory):
    """`eagle3d run` twice on one config: the second exits 2 and names the first (pid, host);
    the first runs on with its engine untouched, and the ledger records one daemon only."""
    config = messages_config(config_factory, tmp_path, 20)
    with DaemonProcess(config) as first:
        st = first.status_until(lambda s: s.get("engine", {}).get("status") == "ready", 300,
                                "the engine")
        assert ctl(config, "pause", "--reason", "hold the engine").returncode == 0
        engine = psutil.Process(st["engine"]["pid"])
        second = subprocess.run([venv_bin("eagle3d"), "run", "-c", str(config)],
                                capture_output=True, text=True, timeout=120)
        out = second.stdout + second.stderr
        assert second.returncode == 2, out
        assert f"another eagle3d daemon holds {tmp_path / 'state'} " \
               f"(pid {first.proc.pid} on {socket.gethostname()}, since " in out, out
        assert engine.is_running() and engine.status() != psutil.STATUS_ZOMBIE
        assert first.proc.poll() is None
        first.status_until(lambda s: s["daemon"]["alive"] and s["engine"]["pid"] == engine.pid,
                           60, "the first daemon's heartbeat, same engine")
        assert first.stop() == 0, first.output()[-4000:]
    state = load_config(config).paths.state_dir
    with Ledger(layout.ledger(state), readonly=True) as ledger:
        assert len(ledger.events_of(("daemon_started",))) == 1
        assert not ledger.events_of(("orphans_ended",))
