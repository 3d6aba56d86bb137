"""Three daemons on one machine, each its own shard of one dataset under shared roots, with the
real SmolLM2 engine: one killed (-9) mid-extract and restarted resumes from its folder; while it
is away the training node's gate stays closed and its status names it; once it is back the
gate opens and the training node's trainer reads every sample of every shard exactly once."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from eagle3d.statemachine.config import load_config
from tests.conftest import shard_configs
from tests.pipeline import DaemonProcess, status

pytestmark = pytest.mark.slow


def test_three_shards_one_killed_and_held_back_then_one_training_of_every_sample(tmp_path):
    configs = shard_configs(tmp_path, 24)
    with DaemonProcess(configs[0], "--until", "train") as trainer_node, \
            DaemonProcess(configs[1], "--until", "done") as one, \
            DaemonProcess(configs[2]) as two:
        two.status_until(lambda st: st["stage"] == "extract" and st["samples"]["verified"] +
                         st["samples"]["extracted"] >= 1, 240, "shard 2 extracting")
        os.kill(two.proc.pid, signal.SIGKILL)  # its engine dies with it (PR_SET_PDEATHSIG)
        two.proc.wait()
        assert one.wait(240) == 0
        # The node's state file may still date from before shard 1 published: wait for the one
        # that names shard 2 alone.
        st = trainer_node.status_until(lambda st: "waiting for shards" in st["reason"] and
                                       "shard-1" not in st["reason"], 240,
                                       "the training node waiting for shard 2 alone")
        assert "shard-2-of-3: extract" in st["reason"]
        view = {sh["name"]: sh for sh in st["shards"]}
        assert view["shard-1-of-3"]["manifest"] and not view["shard-2-of-3"]["manifest"]
        assert view["shard-2-of-3"]["heartbeat_age_s"] is not None
        assert st["stage"] == "verify" and trainer_node.proc.poll() is None

        # Brought back (on this node: on another, the same config with shard = 2), it resumes.
        with DaemonProcess(configs[2], "--until", "done") as back:
            assert back.wait(240) == 0, back.output()[-3000:]
        assert trainer_node.wait(240) == 0, trainer_node.output()[-3000:]

    counts = [status(c)["samples"] for c in configs]
    assert all(c["verified"] > 0 for c in counts)
    from eagle3d.drafter.train import checked_manifest  # what the trainer reads
    from eagle3d.drafter import data
    from eagle3d.dataset import shards
    cfg = load_config(configs[0])
    union = checked_manifest(cfg)
    ids = [s["id"] for s in union["samples"]]
    assert len(ids) == len(set(ids)) == sum(c["verified"] for c in counts)
    assert all(p.is_file() for p in data.sample_paths(union, shards.samples_root(cfg)))
    assert status(configs[0])["reason"] == "daemon stopped; training the drafter"
