"""Stages, derived (never stored as a free-standing variable) from the facts: config + ledger +
what is on disk. The daemon calls `derive` at every tick, so a restart after a crash, a reboot or
a config edit lands exactly where the facts say the pipeline is.
"""

from __future__ import annotations

from enum import Enum
from typing import Any, Iterable, NamedTuple

from eagle3d.statemachine.ledger import Counts
from eagle3d.statemachine.plan_meta import PlanMeta

ORDER = ("plan", "generate", "extract", "verify", "train", "done")


class Stage(str, Enum):
    PLAN = "plan"
    GENERATE = "generate"  # only where the target writes the answers ([data] responses)
    EXTRACT = "extract"
    VERIFY = "verify"
    TRAIN = "train"
    DONE = "done"
    PAUSED = "paused"
    FAILED = "failed"


class Gate(NamedTuple):
    """The training gate: open only when every sample is verified or excluded with a reason."""
    open: bool
    blocking: dict[str, int]

    @property
    def waits_for_operator(self) -> bool:
        """Closed by failed samples alone: nothing else is left to do, and only an operator's
        retry or exclude moves the pipeline on (eagle3ctl status exits 4)."""
        return not self.open and set(self.blocking) == {"failed"}

    def describe(self) -> str:
        if self.open:
            return "open"
        if not self.blocking:
            return "closed: no verified samples"
        return "closed: " + ", ".join(f"{n} {s}" for s, n in self.blocking.items() if n)


def gate(counts: Counts, share: bool = False) -> Gate:
    """`share`: one shard's share of a sharded dataset, complete with no verified sample at all
    (the training node judges the union of the shares)."""
    blocking = {s: counts.get(s) for s in ("ungenerated", "generating", "pending", "inflight",
                                           "extracted", "failed") if counts.get(s)}
    return Gate(not blocking and (share or counts.get("verified") > 0), blocking)


class Seen(NamedTuple):
    """What the loop reads once per tick for every stage's `observe`."""
    counts: Counts
    fingerprint: str | None  # the verified set's, once the gate is open (None before)
    # Read before `counts`: the planner commits each batch with its plan.* keys, so a plan
    # complete here has all its samples in the counts read after it (never "0 samples").
    plan: PlanMeta = PlanMeta()


class Facts(NamedTuple):
    counts: Counts
    plan_complete: bool
    blocked: str | None = None         # config or contract problem: needs the operator
    operator_pause: str | None = None  # `eagle3ctl pause`, with who/when
    budget_pause: str | None = None    # a disk budget, with the figures
    state_disk_pause: str | None = None  # the state folder's disk is full: every stage waits
    verify_complete: bool = False      # the manifest matches the ledger's verified set
    train_done: bool = False           # the export + evaluation match the manifest
    train_failed: str | None = None    # the trainer gave up (restarts used up)
    spot_check_failed: str | None = None
    shards_waiting: str | None = None    # the training node: shards that have not published
    trains_elsewhere: str | None = None  # a shard that is not the training node
    share: bool = False  # one shard of several: an empty share is complete (gate's `share`)


# Each stage's facts, one record per stage (daemon/pipeline.py's `observe`): a fact has one owner,
# and `merge` refuses a second. `blocked` is every stage's own: what stops it needing the operator.

class PlanFacts(NamedTuple):
    plan_complete: bool
    blocked: str | None = None


class GenerateFacts(NamedTuple):
    blocked: str | None = None


class ExtractFacts(NamedTuple):
    budget_pause: str | None = None
    blocked: str | None = None


class VerifyFacts(NamedTuple):
    verify_complete: bool = False
    spot_check_failed: str | None = None
    blocked: str | None = None


class ShardFacts(NamedTuple):
    trains_elsewhere: str | None = None
    shards_waiting: str | None = None
    blocked: str | None = None


class TrainFacts(NamedTuple):
    train_done: bool = False
    train_failed: str | None = None
    blocked: str | None = None


def merge(counts: Counts, parts: Iterable[tuple[Any, ...]], **loop: Any) -> Facts:
    """The stages' records, in pipeline order, and the loop's own facts (`loop`) as one Facts.
    Two records that declare the same fact are a wiring bug: raised, never one silently
    overwriting the other. `blocked` is the first stage's that has one."""
    facts: dict[str, Any] = {}
    blocked = None
    for part in parts:
        for key, value in part._asdict().items():  # type: ignore[attr-defined]
            if key == "blocked":
                blocked = blocked or value
            elif key in facts:
                raise ValueError(f"two stages report the fact {key!r} ({type(part).__name__} "
                                 "is the second)")
            else:
                facts[key] = value
    return Facts(counts, blocked=blocked, **facts, **loop)


class Decision(NamedTuple):
    stage: Stage
    reason: str
    # The stage the pipeline would be in if nothing paused it: what a pause holds back.
    underlying: Stage


def _work_stage(f: Facts) -> tuple[Stage, str]:
    c = f.counts
    if not f.plan_complete:
        return Stage.PLAN, "tokenizing conversations"
    if c.total == 0 and not f.share:
        return Stage.FAILED, "the plan produced no usable samples: check [data] source, first, limit"
    if c.get("ungenerated") or c.get("generating"):
        # A sample, not a conversation: with [generate] answers = K each conversation is K.
        return Stage.GENERATE, (f"{c.get('ungenerated') + c.get('generating')} samples "
                                "for the target to write")
    if c.get("pending") or c.get("inflight"):
        return Stage.EXTRACT, f"{c.get('pending') + c.get('inflight')} samples to extract"
    if c.get("extracted"):
        return Stage.VERIFY, f"{c.get('extracted')} samples to verify"
    g = gate(c, f.share)
    if not g.open:
        if g.waits_for_operator:
            return Stage.VERIFY, (f"training gate {g.describe()}: retry them (eagle3ctl retry "
                                  "--failed) or exclude them with a reason (eagle3ctl exclude)")
        return Stage.FAILED, "every sample is excluded: nothing to train on"
    if f.spot_check_failed:
        return Stage.FAILED, (
            f"spot check failed, a fresh capture differs from the dataset: {f.spot_check_failed}. "
            "Where only the batch around the sample differs (bf16 rounding), raise [verify] "
            "spot_tolerance and reload: the check runs again (so does `eagle3ctl verify --full` "
            "or `retry --failed`); [verify] spot_checks = 0 skips it. A capture that is really "
            "wrong needs new [paths] dataset_dir and state_dir")
    if not f.verify_complete:
        return Stage.VERIFY, "writing the dataset manifest"
    if f.trains_elsewhere:
        return Stage.DONE, f.trains_elsewhere
    if f.shards_waiting:
        return Stage.VERIFY, f.shards_waiting
    if f.train_done:
        return Stage.DONE, "drafter trained, exported and evaluated"
    if f.train_failed:
        return Stage.FAILED, f"training failed: {f.train_failed}"
    return Stage.TRAIN, "training the drafter"


def derive(f: Facts) -> Decision:
    stage, reason = _work_stage(f)
    if f.blocked:
        return Decision(Stage.FAILED, f.blocked, stage)
    if stage in (Stage.DONE, Stage.FAILED):
        return Decision(stage, reason, stage)
    if f.state_disk_pause:  # before an operator's: a person must free space
        return Decision(Stage.PAUSED, f.state_disk_pause, stage)
    if f.operator_pause:
        return Decision(Stage.PAUSED, f"paused by the operator: {f.operator_pause}", stage)
    if f.budget_pause and stage == Stage.EXTRACT:
        return Decision(Stage.PAUSED, f.budget_pause, stage)
    return Decision(stage, reason, stage)


def reached(current: Stage, target: str) -> bool:
    """Whether `--until target` is satisfied by the current (work) stage."""
    if current.value not in ORDER:
        return False
    return ORDER.index(current.value) >= ORDER.index(target)
