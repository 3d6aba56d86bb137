"""The shards of one dataset as the training node sees them: what each published in its folder
under the shared dataset root (statemachine/shards.py), checked, and the union training reads.

A shard joins when its manifest is whole (its fingerprint sums the samples it lists), its daemon
published that it is done, and it was captured under this node's contract; a shard of another
contract is refused by name. Nothing here opens another node's ledger.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, NamedTuple

from eagle3d.dataset import contract as capture_contract
from eagle3d.statemachine import layout, manifest, shards
from eagle3d.statemachine.config import Config
from eagle3d.statemachine.entry import Refusal
from eagle3d.statemachine.statefile import read_state


class Join(NamedTuple):
    manifest: dict[str, Any] | None  # every shard's samples, once every shard has joined
    waiting: list[str]  # "shard-1-of-3: extract, 40/100 verified, heartbeat 3 s ago"
    refused: list[str]  # "shard-2-of-3: captured under another contract (...)"


def union(parts: list[tuple[str, dict[str, Any]]], contract: dict[str, Any]) -> dict[str, Any]:
    """One manifest of every shard's samples, paths relative to the shared dataset root; its
    fingerprint sums the shards' own."""
    samples = [{**s, "path": f"{name}/{s['path']}"} for name, doc in parts for s in doc["samples"]]
    return {"fingerprint": manifest.fingerprint((name, doc["fingerprint"]) for name, doc in parts),
            "contract": contract, "samples": samples,
            "shards": [{"name": name, "fingerprint": doc["fingerprint"],
                        "samples": len(doc["samples"])} for name, doc in parts]}


class ShardSet:
    """Every shard's published manifest, re-read only when its file changes (one lists every
    sample of its shard)."""

    def __init__(self, dataset_root: Path, count: int, contract: dict[str, Any]) -> None:
        self.folders = shards.all_folders(dataset_root, count)
        self.contract = contract
        self._read: dict[str, tuple[int, dict[str, Any] | None]] = {}

    def _manifest(self, name: str, folder: Path) -> dict[str, Any] | None:
        try:
            mtime = layout.manifest_file(folder).stat().st_mtime_ns
        except FileNotFoundError:
            return None
        if self._read.get(name, (None,))[0] != mtime:
            doc = manifest.read(folder)
            self._read[name] = (mtime, doc if doc and manifest.intact(doc) else None)
        return self._read[name][1]

    def _refusal(self, index: int, doc: dict[str, Any]) -> str | None:
        recorded = doc.get("contract", {}).get("shard", {})
        if recorded != {"index": index, "count": len(self.folders)}:
            return f"its manifest is of another shard ({recorded or 'none recorded'})"
        diff = capture_contract.differences(self.contract, doc["contract"])
        if diff:
            return (f"captured under another contract than this node's ({'; '.join(diff)}): "
                    "it cannot join this training")
        return None

    def join(self, own: str = "") -> Join:
        """`own`: the training node's shard, whose completeness its own ledger judges."""
        now = time.time()
        parts, waiting, refused = [], [], []
        for index, (name, folder) in enumerate(self.folders):
            doc = self._manifest(name, folder)
            state, _ = read_state(folder, layout.published_state(folder))
            done = name == own or (state or {}).get("underlying") == "done"
            if doc is None or not done:
                waiting.append(f"{name}: {shards.progress(state, now)}")
                continue
            problem = self._refusal(index, doc)
            if problem:
                refused.append(f"{name}: {problem}")
            else:
                parts.append((name, doc))
        if waiting or refused:
            return Join(None, waiting, refused)
        return Join(union(parts, self.contract), [], [])


def samples_root(cfg: Config) -> Path:
    """The folder a manifest's sample paths are relative to: the shared root for the union."""
    folder = cfg.paths.dataset_dir
    return shards.root_of(folder) if cfg.shard.count > 1 else folder


def trained_union(cfg: Config, own: dict[str, Any]) -> dict[str, Any]:
    """For the trainer on the training node: the union of every shard, given this node's checked
    manifest `own`; Refusal naming the shards that have not joined."""
    joined = ShardSet(shards.root_of(cfg.paths.dataset_dir), cfg.shard.count,
                      own["contract"]).join(own=cfg.shard.name)
    if joined.manifest is None:
        raise Refusal("refusing to train: not every shard has joined: "
                      + "; ".join(joined.refused + joined.waiting))
    return joined.manifest
