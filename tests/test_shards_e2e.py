"""Three daemons on one machine, each its own shard of one dataset under shared roots, with the
real SmolLM2 engine: one killed (-9) mid-extract and restarted resumes from its folder; while it
is away the training node's gate stays closed and its status names it; once it is back the
gate opens and the training node's trainer reads every sample of every shard exactly once."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from eagle3d.statemachine.config_validation import load_config
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
    from eagle3d.dataset import shard_union
    cfg = load_config(configs[0])
    union = checked_manifest(cfg)
    ids = [s["id"] for s in union["samples"]]
    assert len(ids) == len(set(ids)) == sum(c["verified"] for c in counts)
    assert all(p.is_file() for p in data.sample_paths(union, shard_union.samples_root(cfg)))
    assert status(configs[0])["reason"] == "daemon stopped; training the drafter"


def test_many_shards_on_a_tiny_source_the_empty_ones_are_done_and_shard_0_trains_the_rest(
        tmp_path):
    """Four shards of two conversations: shards 0, 2 and 3 own none. An empty share is done with
    an empty manifest, and the training node, empty itself, trains on the union of the rest."""
    from eagle3d.capture.planner import owned
    from eagle3d.dataset.conversations import iter_conversations
    from eagle3d.drafter.train import checked_manifest
    from eagle3d.statemachine import manifest
    configs = shard_configs(tmp_path, 2, 4)
    cfgs = [load_config(c) for c in configs]
    owns = [sum(owned(c, cfg.shard, cfg.data.responses)
                for c in iter_conversations(cfg.data.source_path, "messages")) for cfg in cfgs]
    assert owns == [0, 2, 0, 0]  # the split of this source: the training node owns nothing
    with DaemonProcess(configs[0], "--until", "train") as trainer_node, \
            DaemonProcess(configs[1], "--until", "done") as one, \
            DaemonProcess(configs[2], "--until", "done") as two, \
            DaemonProcess(configs[3], "--until", "done") as three:
        for daemon in (two, three, one, trainer_node):
            assert daemon.wait(300) == 0, daemon.output()[-3000:]
    for cfg, config in zip(cfgs[2:], configs[2:]):
        st = status(config)
        assert (st["stage"], st["samples"]["total"]) == ("stopped", 0)
        assert "is verified and published" in st["reason"]
        assert manifest.read(cfg.paths.dataset_dir)["samples"] == []
    assert status(configs[0])["reason"] == "daemon stopped; training the drafter"
    union = checked_manifest(cfgs[0])
    assert [s["path"].split("/")[0] for s in union["samples"]] == ["shard-1-of-4"] * 2
