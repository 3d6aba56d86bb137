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

from eagle3d.daemon.children import Child, Supervisor, remaining
from eagle3d.daemon.run_select import weights_of
from eagle3d.dataset import contract as capture_contract
from eagle3d.statemachine import entry, plan_meta
from eagle3d.statemachine.config_schema import PLANNER_STOP_GRACE_S, Config
from eagle3d.statemachine.ledger import Ledger
from eagle3d.statemachine.stages import Decision, PlanFacts, Seen, Stage

log = logging.getLogger("eagle3d")

CONTRACT_MISMATCH = ("the config does not match this run's capture contract (the log lists "
                     "the differences): put the settings back and reload (systemctl reload "
                     "eagle3d)")


def planner_argv(cfg: Config) -> list[str]:
    return entry.module_argv(cfg, "eagle3d.capture.planner")


class PlanStage:
    name = Stage.PLAN.value
    state_key = "planner"
    ingests = False

    def __init__(self, cfg: Config, ledger: Ledger, pid_dir: Path) -> None:
        self.cfg = cfg
        self.ledger = ledger
        self.pid_dir = pid_dir
        self.child: Child | None = None
        self.supervisor = Supervisor("[data] planner_max_restarts", cfg.data.planner_max_restarts)
        # The config last judged against the capture contract, and the verdict: weighing the
        # target's weights reads a few MiB of each weight file, once per config in force.
        self._judged: tuple[Config, str | None] | None = None
        self._conflict: str | None = None  # the config against the dataset, as last observed

    def complete(self, plan: plan_meta.PlanMeta) -> bool:
        """The slice the config asks for is planned, into a ledger the config fits."""
        if plan.through is None or plan.source is None or self._conflict is not None:
            return False
        return plan.through >= self.cfg.data.first + self.cfg.data.limit - 1 or plan.exhausted

    def contract_conflict(self) -> str | None:
        """The config in force against the dataset's capture contract, once there is one (the
        planner writes it from this config)."""
        if self._judged is None or self._judged[0] is not self.cfg:
            doc = capture_contract.read(self.cfg.paths.dataset_dir)
            if doc is None:
                return None
            self._judged = (self.cfg, capture_contract.config_problem(doc, self.cfg,
                                                                      weights_of(self.cfg)))
            if self._judged[1]:
                log.error("%s", self._judged[1])
                self.ledger.event("contract_mismatch", self._judged[1])
        return self._judged[1]

    def data_conflict(self, plan: plan_meta.PlanMeta) -> str | None:
        """A config whose data slice no longer matches what this ledger was planned from."""
        if plan.source is None:
            return None
        changed = [k for k in plan_meta.SLICE if getattr(plan, k) != getattr(self.cfg.data, k)]
        if not changed:
            return None
        return (f"[data] {', '.join(changed)} changed since this dataset was planned "
                f"(was {', '.join(str(getattr(plan, k)) for k in changed)}); put them back "
                "and reload: a reload of a new data slice switches to its own run")

    def observe(self, seen: Seen) -> PlanFacts:
        # The config against the dataset (its contract, its slice), then how far the plan got,
        # as the loop read it this tick (stages.Seen: before the counts).
        self._conflict = self.contract_conflict() or self.data_conflict(seen.plan)
        return PlanFacts(self.complete(seen.plan), self.blocked)

    @property
    def blocked(self) -> str | None:
        return self.supervisor.fatal or self._conflict

    def step(self, decision: Decision) -> None:
        """Start the planner when the plan is wanted; reap it whenever it exits."""
        if self.child is None:
            if decision.stage == Stage.PLAN and self.supervisor.may_start:
                self.child = Child("planner", planner_argv(self.cfg), self.pid_dir)
            return
        code = self.child.poll()
        if code is None:
            return
        self.child = None
        if code != entry.OK:
            self.supervisor.exited(code, CONTRACT_MISMATCH if code == entry.CONTRACT_MISMATCH
                                   else f"the planner exited with code {code}")

    def unblock(self, all_failed: bool) -> None:
        self.supervisor.clear()

    def reconfigure(self, cfg: Config) -> None:
        """A new config may mend what stopped the planner (a contract, a data slice): it tries
        again."""
        self.cfg = cfg
        self.supervisor.reconfigure(cfg.data.planner_max_restarts, mended=True)

    def status(self) -> dict[str, Any]:
        return {"status": "running" if self.child is not None else self.supervisor.state,
                "restarts": self.supervisor.restarts, "restarts_total": self.supervisor.exits_total,
                "eta_s": None, "blocked": self.blocked}

    def stop(self, deadline: float) -> None:
        if self.child is not None:
            self.child.stop(remaining(deadline, PLANNER_STOP_GRACE_S))
            self.child = None
