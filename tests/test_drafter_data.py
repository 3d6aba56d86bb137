"""The training data plan across ranks: every sample once per epoch, no rank short of a batch,
and batches read from the real SmolLM2 dumps, in line or prefetched."""

from __future__ import annotations

import random

import pytest
import torch

from drafter_fixtures import cached_dataset
from eagle3d.drafter import data
from eagle3d.statemachine import manifest as manifest_mod

# 37 samples of uneven lengths: batches of 1 to several samples, and a batch count that no
# world size below divides.
LENGTHS = [random.Random(7).randint(20, 900) for _ in range(37)]


@pytest.mark.parametrize("world", [1, 2, 3])
def test_ranks_share_the_epoch_without_duplicates_or_losses(world):
    for epoch in range(3):
        plan = data.plan_epoch(LENGTHS, 1024, seed=5, epoch=epoch, world=world)
        assert len(plan) == world
        assert len({len(batches) for batches in plan}) == 1  # collectives pair up
        trained = [i for batches in plan for b in batches if b.trained for i in b.indices]
        assert sorted(trained) == list(range(len(LENGTHS)))  # each sample exactly once
        fillers = [b for batches in plan for b in batches if not b.trained]
        assert len(fillers) < world  # only the last round is filled up
        assert all(b.indices == (LENGTHS.index(min(LENGTHS)),) for b in fillers)
        for batches in plan:  # fillers come last, where a fractional epoch is cut first
            flags = [b.trained for b in batches]
            assert flags == sorted(flags, reverse=True)


def test_the_world_size_only_deals_the_same_order():
    """Step s trains batches s·world … s·world + world - 1 of one order: a resume with another
    world size goes on from the same place in the epoch."""
    one = data.plan_epoch(LENGTHS, 1024, seed=5, epoch=1, world=1)[0]
    three = data.plan_epoch(LENGTHS, 1024, seed=5, epoch=1, world=3)
    dealt = [three[r][s] for s in range(len(three[0])) for r in range(3)]
    assert [b for b in dealt if b.trained] == one


@pytest.fixture(scope="module")
def samples():
    root = cached_dataset(32)
    manifest = manifest_mod.read(root / "dataset")
    return data.sample_paths(manifest, root / "dataset"), [s["tokens"] for s in
                                                           manifest["samples"]]


def test_a_filler_is_read_but_trains_nothing(samples):
    paths, lengths = samples
    plan = data.plan_epoch(lengths, 4096, seed=0, epoch=0, world=len(lengths) + 1)
    filler = plan[-1][-1]
    assert not filler.trained
    batch = data.read_batch(paths, filler)
    assert batch.tokens == 0 and not batch.targets.any()
    assert batch.input_ids.shape[1] == min(lengths)
    real = data.read_batch(paths, data.Planned(filler.indices))
    assert real.tokens == min(lengths) and real.targets.any()
    cpu = torch.device("cpu")
    assert torch.equal(real.to(cpu).aux, batch.to(cpu).aux)


@pytest.mark.parametrize("prefetch", [0, 2])
def test_batches_come_in_plan_order_with_or_without_prefetch(samples, prefetch):
    paths, lengths = samples
    plan = data.plan_epoch(lengths, 1024, seed=0, epoch=0, world=1)[0]
    got = list(data.batches(paths, plan, torch.device("cpu"), prefetch=prefetch))
    assert len(got) == len(plan)
    for planned, batch in zip(plan, got):
        want = data.read_batch(paths, planned)
        assert batch.tokens == want.tokens == sum(lengths[i] for i in planned.indices)
        assert torch.equal(batch.input_ids, want.input_ids)
        assert torch.equal(batch.targets, want.targets)


def test_loss_on_every_position_counts_all_but_each_rows_last_and_never_padding(samples):
    """[train] loss_on = "all": the drafter learns the target's next token after prompt tokens
    too; padding and a row's last token (no next token) never count."""
    paths, lengths = samples
    planned = data.Planned(tuple(range(4)))
    answers = data.read_batch(paths, planned)
    every = data.read_batch(paths, planned, answers_only=False)
    assert every.tokens == answers.tokens
    for b, i in enumerate(planned.indices):
        n = lengths[i]
        assert every.targets[b, :n - 1].all() and not every.targets[b, n - 1:].any()
    assert answers.targets.sum() < every.targets.sum()
    assert not (answers.targets & ~every.targets).any()
