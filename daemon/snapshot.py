"""What the daemon publishes in state.toml: one snapshot of every stage, taken each second."""

from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING, Any

from eagle3d.daemon import budgets
from eagle3d.statemachine import stages
from eagle3d.statemachine.ledger import STATUSES

if TYPE_CHECKING:
    from eagle3d.daemon.reconcile import Daemon


def snapshot(daemon: "Daemon", final: bool = False) -> dict[str, Any]:
    counts = daemon.ledger.counts()
    decision = daemon.decision
    samples_rate, tokens_rate = daemon.extract.rates()
    bytes_per_token = int(daemon.ledger.meta("plan.bytes_per_token", "0") or 0)
    stage = decision.underlying.value if decision else "plan"
    reason = decision.reason if decision else ""
    trainer = daemon.train.status()
    eta = None
    if stage == "generate":
        eta = daemon.generate.eta()
    elif stage == "extract" and tokens_rate > 0:
        eta = (counts.wanted_tokens - counts.done_tokens) / tokens_rate
    elif stage == "verify":
        eta = daemon.verify.eta(counts)
    elif stage == "train":
        eta = trainer.get("eta_s")
    gate = stages.gate(counts)
    spool = daemon.extract.spool
    return {
        "stage": "stopped" if final else "stopping" if daemon.stopping else (
            decision.stage.value if decision else "plan"),
        "underlying": stage,
        "reason": f"daemon stopped; {reason}" if final else reason,
        "since": daemon.stage_since,
        "updated": time.time(),
        "config": {"path": str(daemon.cfg.path), "problem": daemon.config_problem},
        "samples": {**{k: counts.get(k) for k in STATUSES},
                    "total": counts.total, "skipped": daemon.ledger.skipped_count()},
        "tokens": {"done": counts.done_tokens, "total": counts.wanted_tokens},
        "rate": {"samples_per_s": round(samples_rate, 3), "tokens_per_s": round(tokens_rate, 1)},
        "eta_s": None if eta is None else round(eta, 1),
        "bytes": {"written": sum(counts.bytes.values()),
                  "projected": bytes_per_token * counts.wanted_tokens,
                  "spool": spool.bytes_waiting if spool else 0},
        "disk": [{"role": x.role, "path": x.path, "free": x.free, "total": x.total}
                 for x in budgets.disks(daemon.cfg)],
        "generate": daemon.generate.status(),
        "engine": daemon.extract.status(),
        "trainer": trainer,
        "verify": daemon.verify.status(),
        "gate": {"open": gate.open, "describe": gate.describe(),
                 "waits_for_operator": gate.waits_for_operator},
        "daemon": {"pid": os.getpid(), "started": daemon.started, "heartbeat": time.time(),
                   "alive": not final},
    }
