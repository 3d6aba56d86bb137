"""What a reload (systemctl reload eagle3d) does with an edited config: take it on the fly,
refuse it, or ask for a restart; and the configs the daemon refuses outright."""

from __future__ import annotations

from eagle3d.statemachine.config_schema import Config, PathsConfig

# What a reload does with a config it cannot take live (eagle3ctl check-config says which).
NEEDS_RESTART, REFUSED = "needs a restart", "refused"


def reload_verdict(old: Config, new: Config) -> tuple[str, str] | None:
    """(NEEDS_RESTART or REFUSED, why) where a new config cannot be taken on the fly, else None.
    An edit of the contract keys is taken: it switches runs (statemachine/runs.py,
    daemon/reconcile.py)."""
    if new.paths != old.paths:
        moved = ", ".join(k for k in PathsConfig._fields
                          if getattr(new.paths, k) != getattr(old.paths, k))
        return NEEDS_RESTART, (f"[paths] {moved} changed: restart the daemon to switch to other "
                               "folders (systemctl restart eagle3d)")
    if new.target.engine != old.target.engine:
        return NEEDS_RESTART, "[target] engine changed: restart the daemon to switch engines"
    problem = daemon_problem(new)
    return None if problem is None else (REFUSED, problem)


def daemon_problem(cfg: Config) -> str | None:
    """Why the daemon must not run with this config, or None: only node 0 runs the pipeline
    (it owns the ledger and the train stage); the other nodes of a multi-node training only
    lend their GPUs to it."""
    if cfg.train.node_rank == 0:
        return None
    return (f"{cfg.path}: [train] node_rank = {cfg.train.node_rank}: the daemon runs on node 0 "
            f"only; on this node run `eagle3d train-node -c {cfg.path}`")
