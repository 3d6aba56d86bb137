"""The train stage: torchrun with the drafter trainer, restarted from its last checkpoint when it
dies (bounded), then the acceptance-length evaluation, then the `done.json` marker that ties
the drafter to the manifest it was trained on.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from pathlib import Path
from typing import Any

from eagle3d.daemon.children import Child
from eagle3d.statemachine.atomic import atomic_write_bytes
from eagle3d.statemachine.config import Config
from eagle3d.statemachine.ledger import Ledger

log = logging.getLogger("eagle3d")

DONE = "done.json"
PROGRESS = "progress.json"
EVAL = "eval.json"


def read_json(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_bytes())
        return data if isinstance(data, dict) else None
    except (OSError, ValueError):
        return None


def trainer_argv(cfg: Config) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc_per_node={cfg.train.nproc}", "-m", "eagle3d.drafter.train",
            "-c", str(cfg.path)]


def eval_argv(cfg: Config, out: Path) -> list[str]:
    return [sys.executable, "-m", "eagle3d.drafter.evaluate", "-c", str(cfg.path), "--json",
            "--out", str(out)]


class Training:
    def __init__(self, cfg: Config, pid_dir: Path, ledger: Ledger) -> None:
        self.cfg = cfg
        self.pid_dir = pid_dir
        self.ledger = ledger  # restarts, failures and the result go to its event log
        self.child: Child | None = None
        self.phase = "idle"  # idle | training | evaluating | done | failed
        self.restarts = 0
        self.failure: str | None = None
        self.retry_at = 0.0

    @property
    def dir(self) -> Path:
        return self.cfg.paths.train_dir

    def done_for(self, fingerprint: str | None) -> bool:
        done = read_json(self.dir / DONE)
        return bool(done and fingerprint and done.get("manifest_fingerprint") == fingerprint)

    def step(self, fingerprint: str) -> None:
        """One idempotent step towards a trained, exported and evaluated drafter."""
        if self.child is not None:
            code = self.child.poll()
            if code is None:
                return
            self._finished(code, fingerprint)
            return
        if self.failure or time.time() < self.retry_at:
            return
        self.dir.mkdir(parents=True, exist_ok=True, mode=0o750)
        export = self.dir / "export" / "config.json"
        progress = read_json(self.dir / PROGRESS) or {}
        if export.exists() and progress.get("status") == "done" and \
                progress.get("manifest_fingerprint") == fingerprint:
            self.phase = "evaluating"
            (self.dir / EVAL).unlink(missing_ok=True)  # only this evaluation's result counts
            self.child = Child("evaluate", eval_argv(self.cfg, self.dir / EVAL), self.pid_dir)
        else:
            self.phase = "training"
            self.child = Child("trainer", trainer_argv(self.cfg), self.pid_dir)

    def _finished(self, code: int, fingerprint: str) -> None:
        name = self.child.name if self.child else "trainer"
        self.child = None
        result = (read_json(self.dir / EVAL) if name == "evaluate" else None) or {}
        if "acceptance_length" in result:
            if not result.get("identical_to_greedy"):
                # A measurement was made; exit 1 only flags that speculative and greedy decoding
                # disagreed somewhere. Worth an operator's look, not a retry loop.
                log.warning("evaluation: speculative decoding did not reproduce greedy decoding "
                            "exactly (see %s)", self.dir / EVAL)
                self.ledger.event("eval_not_greedy", f"see {self.dir / EVAL}")
            code = 0
        if code == 0 and name == "evaluate":
            atomic_write_bytes(self.dir / DONE, json.dumps({
                "manifest_fingerprint": fingerprint, "export": str(self.dir / "export"),
                "acceptance_length": result.get("acceptance_length"),
                "identical_to_greedy": result.get("identical_to_greedy"),
                "finished": time.time()}).encode())
            self.phase = "done"
            log.info("drafter done: acceptance length %s", result.get("acceptance_length"))
            self.ledger.event("drafter_done",
                              f"acceptance length {result.get('acceptance_length')}")
            return
        if code == 0:
            return  # trained and exported: the next step evaluates
        self.restarts += 1
        if self.restarts > self.cfg.train.max_restarts:
            self.failure = (f"{name} exited with code {code} {self.restarts} times "
                            f"([train] max_restarts = {self.cfg.train.max_restarts}); see the log")
            self.phase = "failed"
            log.error("%s", self.failure)
            self.ledger.event("train_failed", self.failure)
            return
        delay = min(60.0, 2.0 ** self.restarts)
        self.retry_at = time.time() + delay
        detail = (f"{name} exited with code {code}: restarting from its last checkpoint in "
                  f"{delay:.0f} s (restart {self.restarts} of {self.cfg.train.max_restarts})")
        log.warning("%s", detail)
        self.ledger.event("train_restart", detail)

    def progress(self) -> dict[str, Any]:
        p = read_json(self.dir / PROGRESS) or {}
        out: dict[str, Any] = {"status": self.phase, "restarts": self.restarts}
        if self.child is not None:
            out["pid"] = self.child.pid
        for key in ("step", "total_steps", "epoch", "loss", "acc", "tokens_per_s", "eta_s"):
            if key in p:
                out[key] = p[key]
        result = read_json(self.dir / EVAL)
        if result and "acceptance_length" in result:
            out["acceptance_length"] = result["acceptance_length"]
        if self.failure:
            out["failure"] = self.failure
        return out

    def stop(self, grace: float) -> None:
        """The trainer checkpoints on SIGTERM; then it, or the evaluation, is ended."""
        if self.child is not None:
            self.child.stop(grace)
            self.child = None
            if self.phase in ("training", "evaluating"):
                self.phase = "idle"
