"""The daemon's handle on the engine child: the transformers worker (JSON lines over pipes) or
an SGLang server (HTTP). Both look the same to the reconcile loop: submit batches, read events,
stop. Events are hints; the dumps in the spool are the results.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import shutil
import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

from eagle3d.daemon.children import Child, module_argv, remaining
from eagle3d.statemachine.atomic import temp_path
from eagle3d.statemachine.config import Config
from eagle3d.statemachine.ledger import token_ids

log = logging.getLogger("eagle3d")


class EngineUnavailable(RuntimeError):
    """The engine cannot be started as configured; the message tells the operator why."""


def worker_argv(cfg: Config) -> list[str]:
    return module_argv(cfg, "eagle3d.capture.worker")


class WorkerEngine:
    """`python -m eagle3d.capture.worker`: the protocol is documented in capture/worker.py."""

    kind = "transformers"

    def __init__(self, cfg: Config, pid_dir: Path) -> None:
        self.child = Child("engine", worker_argv(cfg), pid_dir,
                           stdin=subprocess.PIPE, stdout=subprocess.PIPE)
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
            return self.child.stop(remaining(deadline, grace))
        return self.child.stop(0)  # reaps it and ends whatever it left behind


class SGLangEngine:
    """An SGLang server with the eagle3d capture plugin, fed through its HTTP API."""

    kind = "sglang"

    def __init__(self, cfg: Config, pid_dir: Path, contract: dict[str, Any]) -> None:
        from eagle3d.capture.sglang_client import SGLangClient, Startup
        from eagle3d.capture.sglang_launcher import launch_command, launch_problem
        from eagle3d.capture.sglang_plugin import ENV_REQUEST_KEY, ENV_TOKEN
        from eagle3d.capture.sglang_serve import API_KEY_ENV
        problem = launch_problem(cfg)
        if problem:
            raise EngineUnavailable(problem)
        try:
            argv, env = launch_command(cfg, contract)
        except ValueError as exc:
            raise EngineUnavailable(f"[sglang] {exc}") from None
        self.child = Child("engine", argv, pid_dir, env=env)
        self.client = SGLangClient(f"http://{cfg.sglang.host}:{cfg.sglang.port}",
                                   cfg.extract.max_inflight_samples, env[API_KEY_ENV],
                                   env[ENV_REQUEST_KEY])
        self.ready = False
        self.spool = cfg.paths.spool_dir
        self._redirected: dict[str, Path] = {}  # sample id → folder its dump is wanted in
        self.problem: str | None = None  # why the engine will not become ready, once known
        self.device = f"sglang tp={cfg.sglang.tp}"
        # Ready only once the plugin reports the contract's target weights (as loaded), dtype
        # and layers: before that no request is sent, so no dump of another model is ingested.
        self.startup = Startup(self.client, cfg.paths.spool_dir, env[ENV_TOKEN], contract,
                               cfg.sglang.tp, cfg.sglang.startup_timeout_s,
                               exited=lambda: self.child.proc.poll() is not None)

    @property
    def pid(self) -> int:
        return self.child.pid

    def submit(self, batch: list[dict[str, Any]], out: Path) -> None:
        from eagle3d.capture.sglang_plugin import SPOT_PREFIX
        if Path(out) == self.spool:
            self.client.submit([(s["id"], s["input_ids"]) for s in batch])
            return
        # Elsewhere (the spot check's folder): the plugin writes only under the spool, so these
        # go to its spot folder under another request id, and are moved on from there.
        self._redirected.update((s["id"], Path(out)) for s in batch)
        self.client.submit([(SPOT_PREFIX + s["id"], s["input_ids"]) for s in batch])

    def events(self) -> list[dict]:
        from eagle3d.capture.sglang_plugin import SPOT_PREFIX, failed_writes
        if self.ready:
            deliver_redirected(self.spool, self._redirected)
            events = [{"event": "error", "ids": [sid], "kind": kind,
                       "error": f"the capture plugin could not write the dump ({kind})"}
                      for sid, kind in failed_writes(self.spool)]
            for event in self.client.poll():
                if event["ids"][0].startswith(SPOT_PREFIX):
                    if event["event"] == "error":  # the spot check times out on its own
                        log.warning("spot-check re-extraction failed: %s", event["error"])
                else:
                    events.append(event)
            return events
        if self.startup.state == "ready":
            self.ready = True
            info = self.startup.info or {}
            self.device = f"sglang {info.get('sglang')} tp={info.get('tp_size')}"
            return [{"event": "ready", "device": self.device}]
        if self.startup.state == "failed" and self.problem is None:
            # A server without working capture must not take samples: end it, so the daemon
            # sees the engine exit (the message is in the log and in `problem`).
            self.problem = self.startup.problem
            log.error("the SGLang engine is not ready: %s", self.problem)
            self.child.signal(signal.SIGTERM)
        return []

    def poll(self) -> int | None:
        return self.child.poll()

    def stop(self, grace: float) -> int:
        self.startup.stop()
        self.client.close()
        return self.child.stop(grace)


def plan_batch_item(sid: str, ids: bytes, mask: bytes) -> dict[str, Any]:
    """A sample as the engine protocol carries it, from the ledger's planned tokens."""
    return {"id": sid, "input_ids": token_ids(ids), "loss_mask": list(mask)}


def deliver_redirected(spool: Path, redirected: dict[str, Path]) -> None:
    """Move the dumps that have arrived in the spool's spot folder to where they were wanted,
    each under a temporary name first: the folder's reader must never see half a file."""
    from eagle3d.dataset import dumpformat
    from eagle3d.capture.sglang_plugin import SPOT_FOLDER
    for sid, folder in list(redirected.items()):
        name = dumpformat.dump_name(sid)
        source = spool / SPOT_FOLDER / name
        if not source.exists():
            continue
        tmp = temp_path(folder / name)
        shutil.copyfile(source, tmp)
        os.replace(tmp, folder / name)
        source.unlink()
        del redirected[sid]


def start_engine(cfg: Config, pid_dir: Path, contract: dict[str, Any]) -> WorkerEngine | SGLangEngine:
    if cfg.target.engine == "sglang":
        return SGLangEngine(cfg, pid_dir, contract)
    return WorkerEngine(cfg, pid_dir)
