"""The daemon's handle on the SGLang engine: a server with the capture plugin, fed through its
HTTP API (client.py). Light (stdlib and the protocol modules): it runs in the daemon.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
from pathlib import Path
from typing import Any

from eagle3d.capture.engines import Process
from eagle3d.capture.engines.sglang.client import SGLangClient, Startup
from eagle3d.capture.engines.sglang.plugin import SPOT_FOLDER, failed_writes
from eagle3d.capture.engines.sglang.serve import API_KEY_ENV
from eagle3d.capture.engines.sglang.spec import (ENV_REQUEST_KEY, ENV_TOKEN, NAME, SETTINGS,
                                                 SPOT_PREFIX)
from eagle3d.statemachine.atomic import temp_path
from eagle3d.statemachine.config_schema import Config

log = logging.getLogger("eagle3d")


class SGLangEngine:
    """An SGLang server with the eagle3d capture plugin, fed through its HTTP API."""

    kind = NAME

    def __init__(self, cfg: Config, contract: dict[str, Any], child: Process,
                 env: dict[str, str]) -> None:
        """`child`: the server, started with `env` (launcher.launch_command's)."""
        self.child = child
        server = SETTINGS.of(cfg)
        self.client = SGLangClient(f"http://{server.host}:{server.port}",
                                   cfg.extract.max_inflight_samples, env[API_KEY_ENV],
                                   env[ENV_REQUEST_KEY])
        self.ready = False
        self.spool = cfg.paths.spool_dir
        self._redirected: dict[str, Path] = {}  # sample id → folder its dump is wanted in
        self.problem: str | None = None  # why the engine will not become ready, once known
        self.device = f"sglang tp={server.tp}"
        # Ready only once the plugin reports the contract's target weights (as loaded), dtype
        # and layers: before that no request is sent, so no dump of another model is ingested.
        self.startup = Startup(self.client, cfg.paths.spool_dir, env[ENV_TOKEN], contract,
                               server.tp, server.startup_timeout_s,
                               exited=lambda: self.child.proc.poll() is not None)

    @property
    def pid(self) -> int:
        return self.child.pid

    def submit(self, batch: list[dict[str, Any]], out: Path) -> None:
        if Path(out) == self.spool:
            self.client.submit([(s["id"], s["input_ids"]) for s in batch])
            return
        # Elsewhere (the spot check's folder): the plugin writes only under the spool, so these
        # go to its spot folder under another request id, and are moved on from there.
        self._redirected.update((s["id"], Path(out)) for s in batch)
        self.client.submit([(SPOT_PREFIX + s["id"], s["input_ids"]) for s in batch])

    def events(self) -> list[dict]:
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


def deliver_redirected(spool: Path, redirected: dict[str, Path]) -> None:
    """Move the dumps that have arrived in the spool's spot folder to where they were wanted,
    each under a temporary name first: the folder's reader must never see half a file."""
    from eagle3d.dataset import dumpformat
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
