"""The randomized operator (tests/chaos/operator_walk.py): seeded walks of operator and machine
actions on the real daemon, every invariant of issue 53 checked after every step, in campaigns:
`operator` (operator_walk.py), `hostile` (operator_hostile.py: issue 59's hostile week and issue
52's long switch) and `shards` (operator_shards.py: shard daemons on one root).

CI walks a fixed set of (campaign, seed) pairs (tests/chaos/README.md lists them); `make
chaos-large` (EAGLE3D_CHAOS_SCALE=10) walks many more, longer. EAGLE3D_CHAOS_CAMPAIGN and
EAGLE3D_CHAOS_SEED replay one walk, EAGLE3D_CHAOS_ACTIONS=i,j,k only those of its actions: the
command a failure prints.
"""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest

from eagle3d.daemon.requests import VERIFY_FULL
from eagle3d.statemachine import layout
from eagle3d.statemachine.ledger import Ledger, PlannedSample
from tests.chaos import operator_walk
from tests.chaos.figures import SCALE
from tests.chaos.operator_hostile import HOSTILE
from tests.chaos.operator_shards import SHARDS

pytestmark = [pytest.mark.slow, pytest.mark.chaos, pytest.mark.timeout(3600 * SCALE)]

CAMPAIGNS = {c.name: c for c in (operator_walk.OPERATOR, HOSTILE, SHARDS)}

# Operator seeds that found defects of issue 52 on the commit before their fixes (98a0ed9's
# successor be24b59); after the fixes they must walk clean. 12: a [paths] edit that check-config
# calls "no change" and the reload refuses (item 10); 98: forgetting the first run with nested
# [paths] deletes the current run's files (item 1); 14: an operator's pause lost across a run
# switch (item 16); 10: `eagle3d run --until done` after a switch names no drafter of the
# current run (item 11; the one walk that trains, about two minutes). Then one walk of each
# newer campaign; hostile 93 walks every disk fault (state disk full, state and dataset disk
# read-only), a clock step back, and ends by training on the stepped clock.
CI_WALKS = [("operator", 12), ("operator", 98), ("operator", 14), ("operator", 10),
            ("hostile", 93), ("shards", 1)]
LENGTH = 16 * min(SCALE, 3)  # actions per walk
SHRINK_S = float(os.environ.get("EAGLE3D_CHAOS_SHRINK_S", "300"))


def walks() -> list[tuple[str, int]]:
    if "EAGLE3D_CHAOS_SEED" in os.environ:
        return [(os.environ.get("EAGLE3D_CHAOS_CAMPAIGN", "operator"),
                 int(os.environ["EAGLE3D_CHAOS_SEED"]))]
    if SCALE == 1:
        return CI_WALKS
    return [(name, seed) for name in CAMPAIGNS for seed in range(1, 1 + 2 * SCALE)]


def kept_actions() -> list[int] | None:
    chosen = os.environ.get("EAGLE3D_CHAOS_ACTIONS")
    return [int(i) for i in chosen.split(",")] if chosen else None


def test_verify_full_loses_no_verified_sample_but_any_other_way_out_does(tmp_path):
    """Hostile seed 3: `verify --full` (the walk's truncate-dump) sends every verified sample
    back to extracted by design, and the check right after it called the undamaged ones lost.
    The ledger the daemon writes says why (an `unverified` event of verify --full): that is no
    loss; a verified sample back to pending, or unverified for another reason, still is."""
    state_dir = tmp_path / "state"
    state_dir.mkdir()
    run = SimpleNamespace(id="r", state_dir=state_dir)  # what the check reads of a runs.Run
    world = operator_walk.World(root=tmp_path, config=tmp_path / "eagle3d.toml", notify=None, n=3)
    with Ledger(layout.ledger(state_dir)) as ledger:
        ledger.add_planned([PlannedSample(f"{i:032x}", i, 10, 5, "h", b"\0" * 4, b"\1")
                            for i in range(3)], [], {})
        for s in ledger.claim(3, 10**6):
            ledger.mark_extracted(s.id, f"{s.id}.e3d", 100, "c")
            ledger.mark_verified(ledger.sample(s.id), "stat")
        operator_walk.ledger_facts(world, run)
        ledger.unverify_all(VERIFY_FULL)  # what the daemon does on `eagle3ctl verify --full`
        operator_walk.ledger_facts(world, run)
        first = ledger.sample(f"{0:032x}")
        ledger.mark_verified(first, "stat")  # verify read it again
        operator_walk.ledger_facts(world, run)
        ledger.unverify([first.id], "the trainer: changed since verify")
        with pytest.raises(operator_walk.Violation, match="no verified sample is lost"):
            operator_walk.ledger_facts(world, run)


@pytest.mark.parametrize("campaign,seed", walks())
def test_random_operator_breaks_no_invariant(campaign, seed, tmp_path, figures, tmpfs,
                                             unit_umask):
    """Under the unit's UMask (its files' modes are an invariant: shared servers)."""
    chosen = CAMPAIGNS[campaign]
    out = operator_walk.walk(chosen, seed, tmp_path / "walk", SCALE, LENGTH, kept_actions(),
                             tmpfs)
    done = [s for s in out.steps if not s.endswith("-> skip")]
    figures.crashes += out.crashes
    figures.notes.append(f"random operator {campaign} seed {seed}: {len(done)} actions in "
                         f"{out.seconds:.0f} s ({60 * len(done) / max(out.seconds, 1):.1f}/min)"
                         + (f", broke {out.violation.invariant}" if out.violation else ""))
    if out.violation is not None and kept_actions() is None and SHRINK_S > 0:
        out = operator_walk.shrink(chosen, out, tmp_path, SCALE, LENGTH, SHRINK_S, tmpfs)
    print(f"{campaign} seed {seed}:\n  " + "\n  ".join(out.steps))  # what it did, with -s
    if out.violation is not None:
        pytest.fail(operator_walk.report(out, SCALE), pytrace=False)
    figures.faults += out.crashes
