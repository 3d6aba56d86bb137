"""Shards: extraction over N nodes, each its own daemon planning a deterministic share.

A conversation belongs to shard `int(content id) mod N`, its content id being the id its sample
will carry (the hash of its messages; where the target writes the answers, of its system and
user turns): the split does not depend on the order, on [data] limit or on which other nodes
ever ran, so a raised limit only adds conversations to each shard and a shard re-run on another
node plans exactly what it planned before; and two records of one sample id are one shard's,
whose ledger plans the sample once.

Every shard keeps its folders under the configured ones, as `<folder>/shard-<i>-of-<N>/` (state,
spool, dataset); the dataset roots of all shards are one shared folder, where each shard
publishes its manifest (statemachine/manifest.py) and a copy of its state file
(statemachine/statefile.py). Shard 0 is the training node: it reads what the others published,
never their ledgers.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import NamedTuple

# The state, spool and dataset folders are per shard; the train folder is the training node's.
SHARDED_PATHS = ("state_dir", "spool_dir", "dataset_dir")
TRAIN_NODE = 0


class Shard(NamedTuple):
    index: int = 0
    count: int = 1

    @property
    def name(self) -> str:
        return folder_name(self.index, self.count)

    @property
    def trains(self) -> bool:
        return self.index == TRAIN_NODE


def folder_name(index: int, count: int) -> str:
    return f"shard-{index}-of-{count}"


def owner(content_id: str, count: int) -> int:
    """The shard that plans the conversation of this content id (a hex digest)."""
    return int(content_id, 16) % count


def index_from_env(variable: str, count: int) -> int:
    """The shard index a cluster scheduler hands each task (SLURM_ARRAY_TASK_ID, Kubernetes'
    JOB_COMPLETION_INDEX). ValueError says what is wrong with it."""
    value = os.environ.get(variable)
    if value is None:
        raise ValueError(f"the environment variable {variable} is not set (a SLURM array task or "
                         "a Kubernetes Indexed Job sets it; elsewhere write [data] shard = i)")
    if not value.strip().isdigit():
        raise ValueError(f"the environment variable {variable} is {value!r}, not a shard index")
    index = int(value)
    if index >= count:
        raise ValueError(f"the environment variable {variable} is {index}, but [data] shards = "
                         f"{count} allows 0 to {count - 1} (a SLURM array must be --array=0-"
                         f"{count - 1})")
    return index


def shard_folder(root: Path, shard: Shard) -> Path:
    return Path(root) / shard.name


def root_of(folder: Path) -> Path:
    """The configured folder a shard's folder sits in."""
    return Path(folder).parent


def all_folders(dataset_root: Path, count: int) -> list[tuple[str, Path]]:
    """(name, dataset folder) of every shard, under the shared dataset root."""
    return [(folder_name(i, count), Path(dataset_root) / folder_name(i, count))
            for i in range(count)]


def progress(state: dict | None, now: float) -> str:
    """A shard's last published progress, for a reason or a status line."""
    if not state:
        return "nothing published yet"
    s = state.get("samples", {})
    beat = state.get("daemon", {}).get("heartbeat")
    age = f", heartbeat {now - beat:.0f} s ago" if beat else ""
    return (f"{state.get('stage', '?')}, {s.get('verified', 0)}/{s.get('total', 0)} verified"
            f"{age}")
