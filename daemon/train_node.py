"""`eagle3d train-node`: on node k > 0 of a multi-node training, lend this node's GPUs to the
trainings that node 0's daemon runs.

Node 0 runs the pipeline: its daemon owns the ledger and the train stage, starts its share of
the trainer when the training gate opens, restarts it from the last checkpoint, exports,
evaluates and marks the drafter done. This command starts this node's share (torchrun with
[train] node_rank), which waits at node 0's rendezvous; whenever that training ends (finished,
crashed, stopped by node 0) it starts again and waits for node 0's next one. It holds no GPU
memory while it waits, and runs until it is stopped (SIGTERM, Ctrl-C). It reads the config in
force where a daemon wrote one for its config's state folder, as eagle3ctl does.
"""

from __future__ import annotations

import logging
import signal
import time
from typing import Any

from eagle3d.capture import engines
from eagle3d.daemon.children import Child, end_orphans
from eagle3d.daemon.stages.train import trainer_argv
from eagle3d.statemachine import entry, layout
from eagle3d.statemachine.config_in_force import load_in_force
from eagle3d.statemachine.config_validation import ConfigError

log = logging.getLogger("eagle3d")

POLL_S = 0.5
RETRY_DELAY_S = 5.0  # lets node 0's last training finish tearing down before this node rejoins


class _Stop:
    def __init__(self) -> None:
        self.requested = False
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._handle)

    def _handle(self, signum: int, frame: Any) -> None:
        self.requested = True

    def sleep(self, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while not self.requested and time.monotonic() < deadline:
            time.sleep(POLL_S)


def run(config_path: str) -> int:
    try:
        cfg = engines.checked(load_in_force(config_path))
    except ConfigError as exc:
        log.error("%s", exc)
        return entry.REFUSED
    if cfg.train.node_rank == 0:
        log.error("%s: [train] node_rank = 0 is the daemon's node (`eagle3d run`); train-node "
                  "runs on nodes 1 to nnodes - 1", cfg.path)
        return entry.REFUSED
    pid_dir = layout.children_dir(cfg.paths.state_dir)
    for ended in end_orphans(pid_dir):
        log.warning("ended %s, left by a previous train-node", ended)
    argv = trainer_argv(cfg, cfg.path)
    stop = _Stop()
    log.info("node %d of %d: joining the trainings of node 0 at %s", cfg.train.node_rank,
             cfg.train.nnodes, cfg.train.rendezvous)
    while not stop.requested:
        child = Child("trainer", argv, pid_dir)
        while (code := child.poll()) is None and not stop.requested:
            time.sleep(POLL_S)
        if stop.requested:
            child.stop(cfg.train.stop_grace_s)
            break
        log.info("this node's trainer exited with code %d; waiting for node 0's next training",
                 code)
        stop.sleep(RETRY_DELAY_S)
    log.info("stopped")
    return entry.OK
