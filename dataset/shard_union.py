"""The shards of one dataset as the training node sees them: what each published in its folder
under the shared dataset root (statemachine/shards.py), checked, and the union training reads.

A shard joins when its manifest is whole (its fingerprint sums the samples it lists), its daemon
published that it is done, and it was captured under this node's contract; a shard of another
contract is refused by name, and so are two shards that list one sample id. Nothing here opens
another node's ledger.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Callable, NamedTuple

from eagle3d.dataset import contract as capture_contract
from eagle3d.statemachine import layout, manifest, shards
from eagle3d.statemachine.config_schema import Config
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


def duplicates(parts: list[tuple[str, dict[str, Any]]]) -> list[str]:
    """The samples two shards both list, one line per pair of shards: a sample is one shard's
    (its owner by the id it carries), so one listed twice means shards that split the source
    differently, and training would read it twice."""
    first: dict[str, str] = {}
    twice: dict[tuple[str, str], list[str]] = {}
    for name, doc in parts:
        for s in doc["samples"]:
            owner = first.setdefault(s["id"], name)
            if owner != name:
                twice.setdefault((owner, name), []).append(s["id"])
    return [f"{a} and {b} both list {len(ids)} sample{'s' * (len(ids) > 1)} "
            f"({', '.join(ids[:3])}{', ...' * (len(ids) > 3)}), which training would read "
            "twice: redo one of the two shards" for (a, b), ids in twice.items()]


Stamp = tuple[int, int, int]


def _stamp(path: Path) -> Stamp | None:
    """What changes when a file is written again: rewritten in place, its (mtime_ns, size);
    replaced by a rename, as the shards publish, its inode."""
    try:
        st = path.stat()
    except FileNotFoundError:
        return None
    return st.st_mtime_ns, st.st_size, st.st_ino


class ShardSet:
    """Every shard's published files, each re-read only when it changes (a manifest lists every
    sample of its shard), and their union, joined again only when a manifest in it changed: a
    gate that joins at every tick reads and builds nothing for an unchanged set."""

    def __init__(self, dataset_root: Path, count: int, contract: dict[str, Any]) -> None:
        self.folders = shards.all_folders(dataset_root, count)
        self.contract = contract
        self._read: dict[Path, tuple[Stamp, Any]] = {}
        self._union: tuple[list[tuple[str, Stamp]], Join] | None = None
        self.reads = 0  # files read (not found unchanged): what the cache saves shows here

    def _cached(self, path: Path, read: Callable[[], Any]) -> tuple[Stamp | None, Any]:
        """(stamp, what `read` makes of the file), read again only when its stamp changed."""
        stamp = _stamp(path)
        if stamp is None:
            self._read.pop(path, None)
            return None, None
        if path not in self._read or self._read[path][0] != stamp:
            self.reads += 1
            self._read[path] = (stamp, read())
        return self._read[path]

    def _manifest(self, folder: Path) -> tuple[Stamp | None, dict[str, Any] | None]:
        def read() -> dict[str, Any] | None:
            doc = manifest.read(folder)
            return doc if doc and manifest.intact(doc) else None
        return self._cached(layout.manifest_file(folder), read)

    def _state(self, folder: Path) -> dict[str, Any] | None:
        path = layout.published_state(folder)
        return self._cached(path, lambda: read_state(folder, path)[0])[1]

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
        parts, stamps, waiting, refused = [], [], [], []
        for index, (name, folder) in enumerate(self.folders):
            stamp, doc = self._manifest(folder)
            state = self._state(folder)
            done = name == own or (state or {}).get("underlying") == "done"
            if doc is None or not done:
                waiting.append(f"{name}: {shards.progress(state, now)}")
                continue
            problem = self._refusal(index, doc)
            if problem:
                refused.append(f"{name}: {problem}")
            else:
                parts.append((name, doc))
                stamps.append((name, stamp))
        if waiting or refused:
            return Join(None, waiting, refused)
        if self._union is None or self._union[0] != stamps:
            twice = duplicates(parts)
            self._union = (stamps, Join(None, [], twice) if twice else
                           Join(union(parts, self.contract), [], []))
        return self._union[1]


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
