"""sd_notify for the daemon: one datagram to $NOTIFY_SOCKET per message, no extra package.

Under systemd (Type=notify) the daemon says READY=1 once reconciled, STATUS= with the stage and
progress (shown by `systemctl status eagle3d`), WATCHDOG=1 from its main loop, RELOADING=1 around
a SIGHUP reload and STOPPING=1 on SIGTERM. Outside systemd every call is a no-op, so the same code
runs from a terminal, in tests and in the demo.

`Notifier.from_env()` takes NOTIFY_SOCKET, WATCHDOG_USEC and WATCHDOG_PID out of os.environ: the
engine, planner and trainer started afterwards must not inherit them, or a child could ping the
watchdog for a hung daemon, or its own sd_notify calls could confuse systemd about the main pid.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from typing import Mapping

log = logging.getLogger(__name__)

_ENV_KEYS = ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID")


def watchdog_interval(env: Mapping[str, str] | None = None) -> float | None:
    """Seconds between two WATCHDOG=1 pings: half of WATCHDOG_USEC, as sd_watchdog_enabled(3)
    recommends, so one late tick does not trip the watchdog. None when no watchdog is set or it
    is meant for another process (WATCHDOG_PID names a different pid)."""
    env = os.environ if env is None else env
    usec, pid = env.get("WATCHDOG_USEC", ""), env.get("WATCHDOG_PID", "")
    if pid:
        if not pid.isdigit() or int(pid) != os.getpid():
            return None
    if not usec.isdigit() or int(usec) == 0:
        return None
    return int(usec) / 1e6 / 2


def _socket_address(value: str) -> str | None:
    """The AF_UNIX address of a NOTIFY_SOCKET value: a path, or '@name' for Linux's abstract
    namespace (a leading NUL byte). Other transports (vsock:...) are not supported."""
    if value.startswith("/"):
        return value
    if value.startswith("@") and len(value) > 1:
        return "\0" + value[1:]
    return None


class Notifier:
    """Sends sd_notify messages; every method is a no-op when not started by systemd and never
    raises: a lost STATUS line must not take the pipeline down. The first failed send is logged
    as a warning, later ones at debug level, so a broken socket does not flood the journal."""

    def __init__(self, address: str | None, watchdog_interval_s: float | None = None) -> None:
        self._address = address
        self._watchdog_interval_s = watchdog_interval_s if address else None
        self._sock: socket.socket | None = None
        self._failed_before = False

    @classmethod
    def from_env(cls) -> "Notifier":
        """A notifier for the socket systemd handed us; removes the three variables from
        os.environ so that no child process inherits them."""
        value = os.environ.get("NOTIFY_SOCKET", "")
        interval = watchdog_interval()
        for key in _ENV_KEYS:
            os.environ.pop(key, None)
        address = _socket_address(value) if value else None
        if value and address is None:
            log.warning("NOTIFY_SOCKET=%r is not a unix socket path or @abstract name; "
                        "systemd will not hear from this daemon", value)
        return cls(address, interval)

    @property
    def enabled(self) -> bool:
        """True under systemd: the messages go somewhere."""
        return self._address is not None

    def watchdog_interval(self) -> float | None:
        """Seconds between two watchdog() calls, or None when systemd set no watchdog."""
        return self._watchdog_interval_s

    def ready(self) -> None:
        """Startup or a reload is complete: `systemctl start` / `reload` returns."""
        self._send("READY=1")

    def status(self, text: str) -> None:
        """One line for `systemctl status`. Newlines would start new assignments: flattened."""
        self._send("STATUS=" + " ".join(text.splitlines()))

    def watchdog(self) -> None:
        """The main loop is alive."""
        self._send("WATCHDOG=1")

    def reloading(self) -> None:
        """A reload began; call ready() when it is done. MONOTONIC_USEC is what Type=notify-reload
        (systemd 253+) requires to match the message to the reload; Type=notify ignores it."""
        usec = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
        self._send(f"RELOADING=1\nMONOTONIC_USEC={usec}")

    def stopping(self) -> None:
        """Shutdown began: systemd shows `deactivating` and stops expecting watchdog pings."""
        self._send("STOPPING=1")

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def _send(self, message: str) -> None:
        if self._address is None:
            return
        try:
            if self._sock is None:
                # Python sockets are not inherited across exec, so children never hold it.
                self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
            # Never block: a listener that stops reading must not stall the reconcile loop (the
            # watchdog would then kill a healthy daemon). A dropped STATUS line is harmless.
            self._sock.sendto(message.encode("utf-8", "replace"), socket.MSG_DONTWAIT,
                              self._address)
        except OSError as exc:
            level = logging.DEBUG if self._failed_before else logging.WARNING
            log.log(level, "sd_notify to %r failed: %s (further failures are logged at debug "
                    "level)", self._address.replace("\0", "@"), exc)
            self._failed_before = True
