"""A sharded extraction under kill -9: three daemons on one machine, each its own shard under one
shared root, killed at seeded random moments (plan, extract, verify, the training node's wait and
training) and started again; at the end every shard passes the audit on its own folders,
nothing is left running, and the training node's trainer read every sample of every shard
exactly once."""

from __future__ import annotations

import random
import time
from pathlib import Path

import psutil
import pytest

from eagle3d.capture.planner import owned
from eagle3d.dataset.conversations import iter_conversations
from eagle3d.statemachine.config_validation import load_config
from tests.chaos.figures import SCALE, SEED
from tests.chaos.harness import EVAL, TRAIN, audit, counts, describe, end, kill9, until
from tests.conftest import shard_configs
from tests.pipeline import DaemonProcess

pytestmark = [pytest.mark.slow, pytest.mark.chaos, pytest.mark.timeout(1800 * SCALE)]

N = 3


def chaos_shard_configs(tmp_path: Path, n: int) -> list[Path]:
    return shard_configs(tmp_path, n, N, {"train": dict(TRAIN, max_steps=6), "eval": dict(EVAL)})


def planned(config: Path) -> int:
    """The conversations of the source this shard owns: what its audit must account for."""
    cfg = load_config(config)
    return sum(owned(c, cfg.shard, cfg.data.responses) for c in iter_conversations(cfg.data.source_path, "messages"))


def working_for(index: int) -> list[psutil.Process]:
    """The live processes of shard `index`: its daemon (its config) and its children (the
    config in force in its own state folder)."""
    marks = (f"/shard{index}.toml", f"/shard-{index}-of-{N}/")
    found = []
    for p in psutil.process_iter(["cmdline", "status"]):
        try:
            line = " ".join(p.info["cmdline"] or [])
            if p.info["status"] != psutil.STATUS_ZOMBIE and any(m in line for m in marks):
                found.append(p)
        except psutil.Error:
            continue
    return found


def test_kill_9_across_three_shards_loses_nothing_and_trains_every_sample_once(
        tmp_path, figures):
    rng = random.Random(SEED)
    configs = chaos_shard_configs(tmp_path, 12 * SCALE)
    lives = [DaemonProcess(c) for c in configs]
    orphans = []
    try:
        for _ in range(3 * SCALE):
            i = rng.randrange(N)
            time.sleep(rng.uniform(0.5, 6.0))
            kill9(lives[i])
            figures.crashes += 1
            deadline = time.time() + 30  # children die with their daemon (PR_SET_PDEATHSIG)
            while (left := working_for(i)) and time.time() < deadline:
                time.sleep(0.1)
            if left:
                orphans.append(describe(left))
                end(left)
            lives[i] = DaemonProcess(configs[i])
            figures.faults += 1
        for d in lives:
            d.stop()
        # The last lives run to the end: shards 1 and 2 publish, shard 0 waits for them, trains.
        lives = [DaemonProcess(c, "--until", "done") for c in configs]
        for d in lives:
            until(None, lambda d=d: d.proc.poll() is not None, 900, "every shard done")
            assert d.proc.returncode == 0, d.output()[-4000:]
        for i, config in enumerate(configs):
            assert figures.audited(audit(config, planned(config), trained=i == 0)) == 0
        assert not orphans, "orphan processes:\n  " + "\n  ".join(orphans)
        from eagle3d.drafter.train import checked_manifest  # what the trainer read
        union = checked_manifest(load_config(configs[0]))
        ids = [s["id"] for s in union["samples"]]
        verified = [counts(load_config(c))["verified"] for c in configs]
        assert all(verified) and len(ids) == len(set(ids)) == sum(verified)
    finally:
        for d in lives:
            if d.proc.poll() is None:
                d.proc.kill()
                d.proc.wait()
        figures.notes.append(f"shards: {3 * SCALE} daemon kills over {N} shards")
