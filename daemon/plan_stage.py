"""The plan stage: the planner child tokenizes the configured slice into the ledger.

Whether the plan is complete is read from the ledger's `plan.*` keys, never from the child's exit:
the stage may move on before the exit is seen, and a restart must reach the same answer. The
plan is never complete for a config the dataset does not fit: its [data] slice against the
ledger's `plan.*` keys, and every other setting the capture contract binds against the contract,
from the daemon's start on (and after each reload), so no child captures under another model.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from eagle3d.daemon.children import Child, module_argv, remaining
from eagle3d.dataset import contract as capture_contract
from eagle3d.statemachine import entry
from eagle3d.statemachine.config import Config
from eagle3d.statemachine.ledger import Ledger
from eagle3d.statemachine.stages import Decision, Stage
from eagle3d.target import loading

log = logging.getLogger("eagle3d")

MAX_FAILURES = 3


class PlanStage:
    def __init__(self, cfg: Config, ledger: Ledger, pid_dir: Path) -> None:
        self.cfg = cfg
        self.ledger = ledger
        self.pid_dir = pid_dir
        self.child: Child | None = None
        self.failures = 0
        self.blocked: str | None = None
        # The config last judged against the capture contract, and the verdict: weighing the
        # target's weights reads a few MiB of each weight file, once per config in force.
        self._judged: tuple[Config, str | None] | None = None

    def complete(self) -> bool:
        meta = self.ledger.meta
        through = meta("plan.through")
        if through is None or self.conflict() is not None or meta("plan.source") is None:
            return False
        return int(through) >= self.cfg.data.first + self.cfg.data.limit - 1 or \
            meta("plan.exhausted") == "1"

    def conflict(self) -> str | None:
        """A config that does not fit this dataset: its capture contract or its data slice."""
        return self.contract_conflict() or self.data_conflict()

    def contract_conflict(self) -> str | None:
        """The config in force against the dataset's capture contract, once there is one (the
        planner writes it from this config)."""
        if self._judged is None or self._judged[0] is not self.cfg:
            doc = capture_contract.read(self.cfg.paths.dataset_dir)
            if doc is None:
                return None
            weights = loading.fingerprint_file_or_folder(self.cfg.target.model_path)
            self._judged = (self.cfg, capture_contract.config_problem(doc, self.cfg, weights))
            if self._judged[1]:
                log.error("%s", self._judged[1])
                self.ledger.event("contract_mismatch", self._judged[1])
        return self._judged[1]

    def data_conflict(self) -> str | None:
        """A config whose data slice no longer matches what this ledger was planned from."""
        meta = self.ledger.meta
        if meta("plan.source") is None:
            return None
        data = self.cfg.data
        changed = [k for k, v in (("source", data.source), ("first", str(data.first)),
                                  ("max_tokens", str(data.max_tokens)),
                                  ("responses", data.responses))
                   # A ledger planned before [data] responses existed has dataset answers.
                   if (meta(f"plan.{k}") or ("dataset" if k == "responses" else None)) != v]
        if not changed:
            return None
        return (f"[data] {', '.join(changed)} changed since this dataset was planned "
                f"(was {', '.join(str(meta('plan.' + k)) for k in changed)}); point [paths] "
                "state_dir and dataset_dir at new folders to start a new dataset")

    def observe(self) -> dict[str, Any]:
        return {"plan_complete": self.complete(), "blocked": self.blocked or self.conflict()}

    def step(self, decision: Decision) -> None:
        """Start the planner when the plan is wanted; reap it whenever it exits."""
        if self.child is None:
            if decision.stage == Stage.PLAN:
                self.child = Child("planner", module_argv(self.cfg, "eagle3d.capture.planner"),
                                   self.pid_dir)
            return
        code = self.child.poll()
        if code is None:
            return
        self.child = None
        if code == entry.OK:
            self.failures = 0
        elif code == entry.CONTRACT_MISMATCH:
            self.blocked = ("the config does not match this dataset's capture contract; see the "
                            "log for the differences, and point [paths] dataset_dir and "
                            "state_dir at new folders to start a new dataset")
        else:
            self.failures += 1
            if self.failures >= MAX_FAILURES:
                self.blocked = f"the planner failed {self.failures} times (exit {code}); see the log"

    def unblock(self) -> None:
        """The operator retried, or a new config was taken: try again."""
        self.blocked = None
        self.failures = 0

    def status(self) -> dict[str, Any]:
        return {"running": self.child is not None, "failures": self.failures}

    def stop(self, deadline: float) -> None:
        if self.child is not None:
            self.child.stop(remaining(deadline, 10.0))
            self.child = None
