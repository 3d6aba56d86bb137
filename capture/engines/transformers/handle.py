"""The daemon's handle on the transformers engine: `python -m
eagle3d.capture.engines.transformers.worker`, spoken to in JSON lines over its pipes (the
protocol is documented in worker.py). Stdlib only: it runs in the daemon.
"""

from __future__ import annotations

import json
import logging
import queue
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

from eagle3d.capture.engines import Process
from eagle3d.capture.engines.transformers.spec import NAME

log = logging.getLogger("eagle3d")


class WorkerEngine:
    """The worker child: the target loaded by transformers in its own process."""

    kind = NAME

    def __init__(self, child: Process) -> None:
        """`child`: the worker, started with pipes to its stdin and stdout."""
        self.child = child
        self.ready = False
        self.device = ""
        self.model = ""  # the target the worker loaded, as it reports it
        self._events: queue.Queue[dict] = queue.Queue()
        self._outbox: queue.Queue[bytes | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True, name="engine-out").start()
        threading.Thread(target=self._write, daemon=True, name="engine-in").start()

    @property
    def pid(self) -> int:
        return self.child.pid

    def _read(self) -> None:
        assert self.child.proc.stdout is not None
        for raw in self.child.proc.stdout:
            try:
                event = json.loads(raw)
            except ValueError:
                log.warning("engine said something that is not protocol: %r", raw[:200])
                continue
            if isinstance(event, dict):
                self._events.put(event)

    def _write(self) -> None:
        # A separate thread: a large batch must never block the reconcile loop on a full pipe.
        stdin = self.child.proc.stdin
        assert stdin is not None
        while (line := self._outbox.get()) is not None:
            try:
                stdin.write(line)
                stdin.flush()
            except (BrokenPipeError, ValueError, OSError):
                return
        try:
            stdin.close()
        except OSError:
            pass

    def submit(self, batch: list[dict[str, Any]], out: Path) -> None:
        self._outbox.put(json.dumps({"batch": batch, "out": str(out)}).encode() + b"\n")

    def events(self) -> list[dict]:
        out = []
        while True:
            try:
                event = self._events.get_nowait()
            except queue.Empty:
                break
            if event.get("event") == "ready":
                self.ready = True
                self.device = str(event.get("device", ""))
                self.model = str(event.get("model", ""))
            out.append(event)
        return out

    def poll(self) -> int | None:
        return self.child.poll()

    def stop(self, grace: float) -> int:
        """Close its input (it finishes the batch in hand and exits), then signals: all within
        `grace` seconds."""
        deadline = time.monotonic() + grace
        self._outbox.put(None)
        try:
            self.child.proc.wait(grace / 2)
        except subprocess.TimeoutExpired:
            return self.child.stop(max(0.0, deadline - time.monotonic()))
        return self.child.stop(0)  # reaps it and ends whatever it left behind
