"""The shard stage of a sharded daemon ([data] shards > 1): a shard other than the training node
is done once its manifest is written (verify) and publishes for the training node; the training
node opens training only when every shard has joined (dataset/shard_union.py), and trains on their
union, whose fingerprint stands for the dataset's.

The state file's copy in the shard's dataset folder is written by the loop's publish
(reconcile.py), with the state file itself.
"""

from __future__ import annotations

from typing import Any

from eagle3d.dataset import contract as capture_contract
from eagle3d.dataset.shard_union import Join, ShardSet
from eagle3d.statemachine import shards
from eagle3d.statemachine.config_schema import Config
from eagle3d.statemachine.stages import Decision, Seen, ShardFacts


class ShardGate:
    name = "shards"
    state_key = "shards"
    ingests = False

    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        self.set: ShardSet | None = None  # once the plan has written this node's contract
        self.last = Join(None, [], [])

    def fingerprint(self) -> str:
        """What training is tied to: the union's fingerprint, once every shard joined."""
        return self.last.manifest["fingerprint"] if self.last.manifest else ""

    def observe(self, seen: Seen) -> ShardFacts:
        shard = self.cfg.shard
        if not shard.trains:
            return ShardFacts(trains_elsewhere=f"{shard.name} is verified and published; the "
                              "training node "
                              f"({shards.folder_name(shards.TRAIN_NODE, shard.count)}) trains")
        if seen.fingerprint is None:  # this node's own samples are not all verified yet
            return ShardFacts()
        if self.set is None:
            own = capture_contract.read(self.cfg.paths.dataset_dir)
            if own is None:
                return ShardFacts()
            self.set = ShardSet(shards.root_of(self.cfg.paths.dataset_dir), shard.count, own)
        self.last = self.set.join(own=shard.name)
        if self.last.refused:
            return ShardFacts(blocked="refused shards: " + "; ".join(self.last.refused))
        if self.last.waiting:
            return ShardFacts(shards_waiting="waiting for shards to publish a verified manifest: "
                              + "; ".join(self.last.waiting))
        if not self.last.manifest["samples"]:
            return ShardFacts(blocked=f"every shard's share is empty ({shard.count} shards): "
                              "nothing to train on; check [data] source, first, limit")
        return ShardFacts()

    def step(self, decision: Decision) -> None:
        """Nothing to run: the shards' daemons do the work."""

    def status(self) -> dict[str, Any]:
        j = self.last
        return {"joined": [s["name"] for s in j.manifest["shards"]] if j.manifest else [],
                "waiting": j.waiting, "refused": j.refused, "eta_s": None, "blocked": None}

    def stop(self, deadline: float) -> None:
        """No child of its own."""

    def unblock(self, all_failed: bool) -> None:
        """A refused shard is re-run under the right contract; the next tick reads it again."""

    def reconfigure(self, cfg: Config) -> None:
        self.cfg = cfg
