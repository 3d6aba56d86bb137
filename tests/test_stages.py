"""Every branch of the stage derivation, as a table: the facts in, the stage and reason out."""

from __future__ import annotations

from typing import NamedTuple

import pytest

from eagle3d.statemachine.ledger import Counts
from eagle3d.statemachine.stages import (ExtractFacts, Facts, GenerateFacts, PlanFacts,
                                         ShardFacts, Stage, TrainFacts, VerifyFacts, derive,
                                         merge)


def counts(**n: int) -> Counts:
    return Counts(n, {status: 10 * k for status, k in n.items()}, {})


DONE_VERIFYING = dict(plan_complete=True, verify_complete=True)

CASES = [
    # (name, counts, facts, stage, underlying, words in the reason)
    ("planning", counts(), dict(plan_complete=False), Stage.PLAN, Stage.PLAN, "tokenizing"),
    ("an empty plan", counts(), dict(plan_complete=True), Stage.FAILED, Stage.FAILED,
     "no usable samples"),
    ("pending", counts(pending=2, verified=1), dict(plan_complete=True), Stage.EXTRACT,
     Stage.EXTRACT, "2 samples to extract"),
    ("in flight", counts(inflight=1), dict(plan_complete=True), Stage.EXTRACT, Stage.EXTRACT,
     "1 samples"),
    ("extracted", counts(extracted=3, verified=1), dict(plan_complete=True), Stage.VERIFY,
     Stage.VERIFY, "3 samples to verify"),
    ("failed samples", counts(failed=1, verified=4), dict(plan_complete=True), Stage.VERIFY,
     Stage.VERIFY, "eagle3ctl retry"),
    ("all excluded", counts(excluded=4), dict(plan_complete=True), Stage.FAILED, Stage.FAILED,
     "every sample is excluded"),
    ("spot check failed", counts(verified=4), dict(plan_complete=True, spot_check_failed="cos"),
     Stage.FAILED, Stage.FAILED, "spot check failed"),
    ("no manifest yet", counts(verified=4), dict(plan_complete=True), Stage.VERIFY, Stage.VERIFY,
     "manifest"),
    ("an empty share", counts(), dict(plan_complete=True, share=True), Stage.VERIFY,
     Stage.VERIFY, "writing the dataset manifest"),
    ("an empty share published", counts(), dict(DONE_VERIFYING, share=True, trains_elsewhere=
     "shard-1-of-3 is verified and published"), Stage.DONE, Stage.DONE, "published"),
    ("a share all excluded", counts(excluded=2), dict(plan_complete=True, share=True),
     Stage.VERIFY, Stage.VERIFY, "writing the dataset manifest"),
    ("an empty training node waits for the shards", counts(), dict(
        DONE_VERIFYING, share=True, shards_waiting="waiting for shards: shard-2-of-3: extract"),
     Stage.VERIFY, Stage.VERIFY, "shard-2-of-3: extract"),
    ("a shard published", counts(verified=4), dict(DONE_VERIFYING, trains_elsewhere="shard-1-of-3 "
     "is verified and published"), Stage.DONE, Stage.DONE, "published"),
    ("the training node waits for shards", counts(verified=4), dict(
        DONE_VERIFYING, shards_waiting="waiting for shards: shard-2-of-3: extract"),
     Stage.VERIFY, Stage.VERIFY, "shard-2-of-3: extract"),
    ("a shard refused", counts(verified=4), dict(DONE_VERIFYING, shards_waiting="waiting",
     blocked="refused shards: shard-1-of-3: captured under another contract"), Stage.FAILED,
     Stage.VERIFY, "shard-1-of-3: captured under another contract"),
    ("trained", counts(verified=4), dict(DONE_VERIFYING, train_done=True), Stage.DONE,
     Stage.DONE, "evaluated"),
    ("training failed", counts(verified=4), dict(DONE_VERIFYING, train_failed="restarts"),
     Stage.FAILED, Stage.FAILED, "training failed: restarts"),
    ("training", counts(verified=3, excluded=1), DONE_VERIFYING, Stage.TRAIN, Stage.TRAIN,
     "training"),
    ("blocked", counts(pending=1), dict(plan_complete=True, blocked="contract changed"),
     Stage.FAILED, Stage.EXTRACT, "contract changed"),
    ("operator pause", counts(pending=1), dict(plan_complete=True, operator_pause="disk swap"),
     Stage.PAUSED, Stage.EXTRACT, "paused by the operator: disk swap"),
    ("operator pause while training", counts(verified=1),
     dict(DONE_VERIFYING, operator_pause="x"), Stage.PAUSED, Stage.TRAIN, "paused"),
    ("a pause does not hide the end", counts(verified=1),
     dict(DONE_VERIFYING, train_done=True, operator_pause="x"), Stage.DONE, Stage.DONE,
     "evaluated"),
    ("a pause does not hide a failure", counts(excluded=1),
     dict(plan_complete=True, operator_pause="x"), Stage.FAILED, Stage.FAILED, "excluded"),
    ("budget pause in extract", counts(pending=1),
     dict(plan_complete=True, budget_pause="disk budget: full"), Stage.PAUSED, Stage.EXTRACT,
     "disk budget"),
    ("a budget pause holds extract only", counts(extracted=1),
     dict(plan_complete=True, budget_pause="disk budget: full"), Stage.VERIFY, Stage.VERIFY,
     "to verify"),
]


@pytest.mark.parametrize("name, n, facts, stage, underlying, words", CASES,
                         ids=[c[0] for c in CASES])
def test_stage_derivation(name, n, facts, stage, underlying, words):
    decision = derive(Facts(n, **facts))
    assert (decision.stage, decision.underlying) == (stage, underlying)
    assert words in decision.reason


RECORDS = (PlanFacts(True), GenerateFacts(), ExtractFacts(budget_pause="disk budget: full"),
           VerifyFacts(verify_complete=True), ShardFacts(), TrainFacts(train_done=True))


def test_the_stages_records_merge_into_the_facts_derive_reads():
    facts = merge(counts(verified=3), RECORDS, share=False)
    assert facts == Facts(counts(verified=3), plan_complete=True, verify_complete=True,
                          train_done=True, budget_pause="disk budget: full")
    assert derive(facts).stage == Stage.DONE


def test_a_fact_two_stages_report_is_refused_not_overwritten():
    """A second stage that reports budget_pause (its own "None" would hide extract's pause) is
    a wiring error, said at the first tick."""
    class AnotherPause(NamedTuple):
        budget_pause: str | None = None

    with pytest.raises(ValueError, match="two stages report the fact 'budget_pause'"):
        merge(counts(pending=1), (*RECORDS, AnotherPause()))
    with pytest.raises(TypeError):  # a stage cannot report what the loop itself knows
        merge(counts(), (PlanFacts(True),), plan_complete=False)


def test_the_first_blocked_stage_in_pipeline_order_is_the_reason():
    facts = merge(counts(), (PlanFacts(True), ExtractFacts(blocked="the engine failed"),
                             TrainFacts(blocked="the trainer failed")))
    assert facts.blocked == "the engine failed"
