"""What the daemon publishes in state.toml: one snapshot of every stage, taken each second."""

from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING, Any

from eagle3d.daemon import budgets, requests
from eagle3d.statemachine import plan_meta, stages
from eagle3d.statemachine.ledger import STATUSES

if TYPE_CHECKING:
    from eagle3d.daemon.reconcile import Daemon


def snapshot(daemon: "Daemon", final: bool = False) -> dict[str, Any]:
    counts = daemon.ledger.counts()
    decision = daemon.decision
    bytes_per_token = plan_meta.read(daemon.ledger).bytes_per_token
    stage = decision.underlying.value if decision else "plan"
    reason = decision.reason if decision else ""
    statuses = {s.name: (s.state_key, s.status()) for s in daemon.stages}
    eta = statuses[stage][1].get("eta_s") if stage in statuses else None
    # The throughput and the spool's bytes: figures of the stage that ingests.
    ingest = next((statuses[s.name][1] for s in daemon.stages if s.ingests), {})
    gate = stages.gate(counts, daemon.cfg.shard.count > 1)
    return {
        "stage": "stopped" if final else "stopping" if daemon.stopping else (
            decision.stage.value if decision else "plan"),
        "underlying": stage,
        "reason": f"daemon stopped; {reason}" if final else reason,
        "since": daemon.stage_since,
        "updated": time.time(),
        "config": {"path": str(daemon.cfg.path), "problem": daemon.config_problem,
                   "problem_since": daemon.config_problem_since if daemon.config_problem else None},
        "metrics": {"textfile": daemon.cfg.metrics.textfile, "problem": daemon.metrics_problem},
        "run": {"id": daemon.current.id, "created": daemon.current.created,
                "switched": daemon.switched or "",
                "set_aside": [{"id": run.id, "bytes": size} for run, size in daemon.set_aside]},
        "samples": {**{k: counts.get(k) for k in STATUSES},
                    "total": counts.total, "skipped": daemon.ledger.skipped_count()},
        "tokens": {"done": counts.done_tokens, "total": counts.wanted_tokens},
        "rate": ingest.get("rate", {}),
        "eta_s": None if eta is None else round(eta, 1),
        "bytes": {"written": sum(counts.bytes.values()),
                  "projected": bytes_per_token * counts.wanted_tokens,
                  "spool": ingest.get("spool_bytes", 0)},
        "disk": [{"role": x.role, "path": x.path, "free": x.free, "total": x.total}
                 for x in budgets.disks(daemon.cfg)],
        "state_reserve": {"bytes": budgets.STATE_RESERVE, "held": daemon.state_reserve.held},
        **dict(statuses.values()),
        # A budget's pause waits for a person (space, or a [budget] key); an operator's does not.
        "paused_by": (("operator" if requests.operator_pause(daemon.root_cfg.paths.state_dir)
                       and not daemon.state_disk_pause else "budget")
                      if decision and decision.stage == stages.Stage.PAUSED else None),
        "gate": {"open": gate.open, "describe": gate.describe(),
                 "waits_for_operator": gate.waits_for_operator},
        "daemon": {"pid": os.getpid(), "started": daemon.started, "heartbeat": time.time(),
                   "alive": not final},
    }
