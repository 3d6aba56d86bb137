"""Running the real daemon in tests: a process, its status, its end."""

from __future__ import annotations

import ipaddress
import json
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any, Callable

import psutil
import tomli_w

from eagle3d.ctl.main import load_for_command
from eagle3d.ctl.status import collect_status
from eagle3d.statemachine import pointer
from eagle3d.statemachine.atomic import atomic_write_bytes
from tests.conftest import venv_bin, write_conversations


def status(config: Path) -> dict[str, Any]:
    """What `eagle3ctl -c CONFIG status --json` prints, read in the test's own process: tests
    poll it twice a second while a daemon loads its model and extracts, and a Python process a
    poll (0.1 s of CPU each) took a fifth of a core from the daemon on a 2-core machine. The
    command's own output is tested through ctl() and tests/test_ctl.py."""
    st = collect_status(load_for_command(str(config), "status"), pointer.read(config))
    return json.loads(json.dumps(st))  # as the command prints it: lists, string keys


def ctl(config: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([venv_bin("eagle3ctl"), "-c", str(config), *args], capture_output=True,
                          text=True, timeout=120)


def switch(daemon: Any) -> None:
    """An in-process daemon's reload of another contract, taken to its end without a tick: the
    set-aside run's stages stopped, the new run entered (none of its stages stepped yet)."""
    daemon.reload()
    assert daemon.switching is not None, daemon.config_problem
    daemon.switching.stopper.join()
    daemon.finish_switch()


def wait_for(predicate: Callable[[], Any], timeout: float, what: str, poll: float = 0.5) -> Any:
    deadline = time.time() + timeout
    while time.time() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(poll)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


class DaemonProcess:
    """`eagle3d run` as a child of the test, its log kept in a file for the assertion messages."""

    def __init__(self, config: Path, *args: str, env: dict[str, str] | None = None) -> None:
        self.config = config
        self.log_path = config.parent / f"daemon-{time.time_ns()}.log"
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen([venv_bin("eagle3d"), "run", "-c", str(config), *args],
                                     stdout=self.log, stderr=subprocess.STDOUT,
                                     env={**os.environ, **(env or {})})

    def output(self) -> str:
        return self.log_path.read_text()

    def wait(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"daemon still running after {timeout} s:\n{self.output()[-4000:]}")

    def status_until(self, predicate: Callable[[dict], bool], timeout: float, what: str) -> dict:
        def check() -> dict | None:
            if self.proc.poll() is not None:
                raise AssertionError(f"daemon exited ({self.proc.returncode}) while waiting for "
                                     f"{what}:\n{self.output()[-4000:]}")
            st = status(self.config)
            return st if predicate(st) else None
        try:
            return wait_for(check, timeout, what)
        except AssertionError as exc:
            raise AssertionError(f"{exc}; status {status(self.config)}; daemon log:\n"
                                 f"{self.output()[-4000:]}") from None

    def stop(self, timeout: float = 120) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        code = self.wait(timeout)
        self.log.close()
        return code

    def __enter__(self) -> "DaemonProcess":
        return self

    def __exit__(self, *exc: object) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


def run_until(config: Path, until: str, timeout: float = 600) -> str:
    """Run the daemon to a stage; returns its output, raising with it on failure."""
    with DaemonProcess(config, "--until", until) as d:
        code = d.wait(timeout)
        out = d.output()
    assert code == 0, out[-6000:]
    return out


def listeners_beyond_loopback(pid: int) -> set[tuple[str, str, int]]:
    """The sockets of `pid`'s process tree listening beyond loopback (0.0.0.0, ::, an address
    of the network), as (process, address, port): none may, on a shared server."""
    found = set()
    try:
        procs = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
    except psutil.Error:
        return found
    for p in procs:
        try:
            for c in p.net_connections(kind="inet"):
                if c.status == psutil.CONN_LISTEN and \
                        not ipaddress.ip_address(c.laddr.ip).is_loopback:
                    found.add((" ".join(p.cmdline()[1:4]), c.laddr.ip, c.laddr.port))
        except psutil.Error:
            pass
    return found


def fill_file_system(folder: Path) -> Path:
    """Fill a file system to the last byte, as another tenant of the disk would: large writes
    first, then small ones for what is left."""
    ballast = folder / "ballast"
    with open(ballast, "wb", buffering=0) as f:
        for size in (1 << 20, 1 << 12, 1):
            try:
                while True:
                    f.write(b"\0" * size)
            except OSError:
                pass
    return ballast


def messages_config(config_factory: Callable[..., Path], tmp_path: Path, n: int,
                    **sections: dict[str, Any]) -> Path:
    """A config over n of 60 short generated conversations, without spot checks."""
    source = write_conversations(tmp_path / "conv.jsonl", 60)
    merged: dict[str, dict[str, Any]] = {
        "data": {"source": str(source), "format": "messages", "limit": n},
        "verify": {"spot_checks": 0}}
    for section, values in sections.items():
        merged.setdefault(section, {}).update(values)
    return config_factory(merged)


def edit_config(config: Path, section: str, **values: Any) -> None:
    """What an operator does before `systemctl reload`: values changed, the file replaced whole
    (an editor's save), so a reader never sees half of it."""
    import tomllib
    doc = tomllib.loads(config.read_text())
    doc.setdefault(section, {}).update(values)
    atomic_write_bytes(config, tomli_w.dumps(doc).encode())


def stop_cleanly(daemon: subprocess.Popen, config: Path) -> None:
    """SIGTERM, as systemctl stop sends it: the daemon exits 0 and status then says not running."""
    daemon.send_signal(signal.SIGTERM)
    out, _ = daemon.communicate(timeout=120)
    assert daemon.returncode == 0, out
    assert ctl(config, "status").returncode == 3
