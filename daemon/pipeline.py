"""The one shape of every stage, and the list of stages: the loop (reconcile.py) and the state
file (snapshot.py) iterate over that list, and only `build` names a stage.

A stage owns its children (through children.Supervisor's one restart policy), its progress and
its stop. Each tick it reports facts (`observe`) and takes one step for the decision `derive`
made from every stage's facts (`step`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, NamedTuple, Protocol

from eagle3d.daemon.stages.extract import EngineFactory, ExtractStage
from eagle3d.daemon.stages.generate import GenerateStage
from eagle3d.daemon.stages.plan import PlanStage
from eagle3d.daemon.stages.shard_gate import ShardGate
from eagle3d.daemon.stages.train import TrainStage
from eagle3d.daemon.stages.verify import VerifyStage
from eagle3d.statemachine.config_schema import Config
from eagle3d.statemachine.ledger import Ledger
from eagle3d.statemachine.stages import Decision, Seen


class PipelineStage(Protocol):
    name: str       # the statemachine Stage it works for
    state_key: str  # where state.toml publishes its status
    # The one stage that ingests: its status holds the pipeline's "rate" and "spool_bytes".
    ingests: bool

    def observe(self, seen: Seen) -> tuple[Any, ...]:
        """Its facts: its own record of statemachine.stages (PlanFacts, ...), whose fields are
        Facts fields no other stage reports; what stops it needing the operator in `blocked`."""

    def step(self, decision: Decision) -> None:
        """One idempotent step for this tick's decision, whatever stage it names."""

    def status(self) -> dict[str, Any]:
        """For state.toml: its progress, "eta_s" (None when unknown) and "blocked"."""

    def stop(self, deadline: float) -> None:
        """End its children, each given its configured grace, never past `deadline`
        (time.monotonic())."""

    def unblock(self, all_failed: bool) -> None:
        """The operator retried (`all_failed`: `eagle3ctl retry --failed`): try again."""

    def reconfigure(self, cfg: Config) -> None:
        """A reloaded config is in force from now on."""


class Pipeline(NamedTuple):
    stages: tuple[PipelineStage, ...]
    verified_fingerprint: Callable[[], str]


def build(cfg: Config, ledger: Ledger, pid_dir: Path, engine_factory: EngineFactory,
          heartbeat: Callable[[], None]) -> Pipeline:
    """The stages in their order, wired to what they lend each other: the engine (extract to
    verify's spot check), the verified set's fingerprint (verify to train), and the GPUs (no
    engine starts while the trainer still holds them)."""
    extract = ExtractStage(cfg, ledger, pid_dir, engine_factory, heartbeat)
    verify = VerifyStage(cfg, ledger, lambda: extract.ready_engine)
    extract.lend_engine_to(verify)
    # Sharded, training is tied to every shard's samples, not this node's alone.
    gate = ShardGate(cfg) if cfg.shard.count > 1 else None
    train = TrainStage(cfg, ledger, pid_dir,
                       gate.fingerprint if gate else verify.verified_fingerprint)
    extract.gpus_taken = train.holds_gpus
    stages = (PlanStage(cfg, ledger, pid_dir), GenerateStage(cfg, ledger, pid_dir), extract, verify,
              *((gate,) if gate else ()), train)
    return Pipeline(stages, verify.verified_fingerprint)
