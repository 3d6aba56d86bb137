"""The ledger and the stage rules: a sample is never in two states nor counted twice, the gate
opens only when every sample is verified or excluded with a reason."""

from __future__ import annotations

import json
import threading

import pytest

from eagle3d.statemachine.ledger import Ledger, LedgerError, PlannedSample
from eagle3d.statemachine.stages import Facts, Stage, derive, gate


def planned(n: int, start: int = 0) -> list[PlannedSample]:
    return [PlannedSample(f"{i:032x}", i, 10 + i, 5, "h", b"\0" * 4, b"\1") for i in
            range(start, start + n)]


@pytest.fixture
def ledger(tmp_path):
    with Ledger(tmp_path / "ledger.sqlite") as led:
        yield led


def test_counts_follow_every_transition(ledger):
    ledger.add_planned(planned(5), [(5, "empty")], {"plan.through": "5"})
    claimed = ledger.claim(10, 1000)
    assert [s.idx for s in claimed] == [0, 1, 2, 3, 4]
    ledger.mark_extracted(claimed[0].id, "p", 100, "c")
    ledger.mark_retry(claimed[1].id, "boom", max_attempts=1)
    ledger.mark_retry(claimed[2].id, "boom", max_attempts=3)
    ledger.mark_verified(ledger.sample(claimed[0].id), "stat")
    c = ledger.counts()
    assert c.n == {"ungenerated": 0, "generating": 0, "pending": 1, "inflight": 2,
                   "extracted": 0, "verified": 1, "failed": 1, "excluded": 0, "skipped": 1}
    assert c.bytes["verified"] == 100
    assert c.tokens["inflight"] == claimed[3].tokens + claimed[4].tokens
    actual = dict(ledger.db.execute("SELECT status, count(*) FROM samples GROUP BY status"))
    assert {k: v for k, v in c.n.items() if v and k != "skipped"} == actual
    assert ledger.skipped_count() == 1


def test_a_transition_from_the_wrong_state_does_nothing(ledger):
    ledger.add_planned(planned(1), [], {})
    sid = planned(1)[0].id
    assert not ledger.mark_verified(ledger.sample(sid), "x")  # pending cannot become verified
    ledger.claim(1, 100)
    assert ledger.mark_extracted(sid, "p", 1, "c")
    assert not ledger.mark_extracted(sid, "p", 1, "c")  # no double counting
    assert ledger.counts().get("extracted") == 1


def test_duplicate_conversations_are_recorded_once(ledger):
    dup = [PlannedSample("a" * 32, 0, 10, 5, "h", b"", b""),
           PlannedSample("a" * 32, 1, 10, 5, "h", b"", b"")]
    assert ledger.add_planned(dup, [], {}) == 1
    assert ledger.counts().total == 1
    assert ledger.skipped_reasons() == {"duplicate": 1}


def test_concurrent_claims_never_hand_out_a_sample_twice(tmp_path):
    path = tmp_path / "ledger.sqlite"
    with Ledger(path) as led:
        led.add_planned(planned(400), [], {})
    got: list[str] = []
    lock = threading.Lock()

    def worker():
        with Ledger(path) as led:
            while batch := led.claim(7, 10_000):
                with lock:
                    got.extend(s.id for s in batch)

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(got) == 400 and len(set(got)) == 400


def test_exclusion_needs_a_reason(ledger):
    ledger.add_planned(planned(1), [], {})
    with pytest.raises(LedgerError):
        ledger.exclude([planned(1)[0].id], "  ")


def test_gate_opens_only_when_everything_is_accounted_for(ledger):
    ledger.add_planned(planned(3), [], {})
    ids = [s.id for s in ledger.claim(3, 1000)]
    for sid in ids:
        ledger.mark_extracted(sid, "p", 1, "c")
    ledger.mark_verified(ledger.sample(ids[0]), "s")
    ledger.mark_verified(ledger.sample(ids[1]), "s")
    assert not gate(ledger.counts()).open
    ledger.mark_retry(ids[2], "bad", 1, frm=("extracted",))
    g = gate(ledger.counts())
    assert not g.open and g.blocking == {"failed": 1}
    d = derive(Facts(ledger.counts(), plan_complete=True, verify_complete=True))
    assert d.stage == Stage.VERIFY and "retry" in d.reason
    ledger.exclude([ids[2]], "operator: known bad conversation")
    assert gate(ledger.counts()).open
    d = derive(Facts(ledger.counts(), plan_complete=True, verify_complete=True))
    assert d.stage == Stage.TRAIN


def test_stage_derivation_order(ledger):
    ledger.add_planned(planned(2), [], {})
    c = ledger.counts()
    assert derive(Facts(c, plan_complete=False)).stage == Stage.PLAN
    assert derive(Facts(c, plan_complete=True)).stage == Stage.EXTRACT
    paused = derive(Facts(c, plan_complete=True, budget_pause="disk budget: full"))
    assert paused.stage == Stage.PAUSED and paused.underlying == Stage.EXTRACT
    assert derive(Facts(c, plan_complete=True, blocked="contract")).stage == Stage.FAILED


def test_a_ledger_of_the_previous_schema_is_upgraded_in_place(tmp_path):
    path = tmp_path / "ledger.sqlite"
    with Ledger(path) as old:
        old.add_planned(planned(3), [], {})
        old.event("daemon_started", "pid 1")
        old.db.execute("DROP INDEX events_by_kind")  # what schema 1 had
        old.db.execute("PRAGMA user_version = 1")
    with Ledger(path) as led:
        assert led.counts().get("pending") == 3
        assert led.recent_events(1)[0][1:] == ("daemon_started", None, "pid 1")
        # Verify's look for life events reads them by kind, not the whole table.
        plan = led.db.execute("EXPLAIN QUERY PLAN SELECT seq FROM events WHERE seq > 0 AND "
                              "kind IN ('daemon_started', 'daemon_stopped')").fetchall()
        assert "events_by_kind" in str(plan)


def test_a_killed_writers_temp_file_is_removed_and_a_live_ones_kept(tmp_path):
    import os
    import subprocess

    from eagle3d.statemachine.atomic import HOST, remove_dead_temps, temp_path
    gone = subprocess.Popen(["true"])  # a writer that has exited
    gone.wait()
    (tmp_path / f".state.toml.{HOST}.{gone.pid}.tmp").write_text("half")
    temp_path(tmp_path / "state.toml").write_text("mine")
    # Another host's writer of that pid: nothing here can tell whether it is alive.
    (tmp_path / f".state.toml.{HOST}x.{gone.pid}.tmp").write_text("theirs")
    (tmp_path / ".note").write_text("not a temp file")
    assert remove_dead_temps(tmp_path) == [f".state.toml.{HOST}.{gone.pid}.tmp"]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([
        ".note", f".state.toml.{HOST}.{os.getpid()}.tmp", f".state.toml.{HOST}x.{gone.pid}.tmp"])


def test_a_generator_batch_takes_the_shortest_prompts_of_its_window_and_each_once(ledger):
    from eagle3d.statemachine.ledger import Prompt
    words = [40, 3, 25, 1, 30, 2, 8, 50]  # prompt lengths by source index
    ledger.add_prompts([Prompt(f"{i:032x}", i, json.dumps(
        [{"role": "system", "content": "s"}, {"role": "user", "content": "w " * n},
         {"role": "user", "content": "a long later turn " * 100}])) for i, n in enumerate(words)],
        [], {})
    first = ledger.claim_prompts(2, window=4)
    assert [s.idx for s, _ in first] == [3, 1]  # the shortest first prompts among idx 0..3
    rest = []
    while batch := ledger.claim_prompts(2, window=4):
        rest += [s.idx for s, _ in batch]
    assert sorted(rest + [3, 1]) == list(range(8))  # every conversation, once
    assert ledger.counts().get("generating") == 8


def test_a_read_only_ledger_opens_under_a_path_with_a_hash_or_a_question_mark(tmp_path):
    for name in ("state#1", "state?2", "state 3"):
        path = tmp_path / name / "ledger.sqlite"
        with Ledger(path) as writer:
            writer.add_planned(planned(2), [], {})
        with Ledger(path, readonly=True) as reader:
            assert reader.counts().n["pending"] == 2


def test_verify_marks_only_the_extraction_it_checked(ledger):
    """An exclude and a retry during a long verify pass put a newer file under the same id:
    the pass's verdict on the old file must not mark the new one verified."""
    ledger.add_planned(planned(1), [], {})
    sid = planned(1)[0].id
    ledger.claim(1, 100)
    ledger.mark_extracted(sid, "p", 1, "c")
    listed = ledger.sample(sid)  # the verify pass lists it, then reads it for a long time
    ledger.exclude([sid], "operator: looks odd")
    ledger.retry([sid])
    ledger.claim(1, 100)
    ledger.mark_extracted(sid, "p", 1, "c")  # same name, same bytes, but not yet synced
    assert not ledger.mark_verified(listed, "stat")
    assert ledger.sample(sid).status == "extracted"
    assert ledger.mark_verified(ledger.sample(sid), "stat")
