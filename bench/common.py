"""What the bench scripts share: realistic dumps (bf16, hidden size 4096, a few MB up to ~100 MB
each) and an ingest rig that runs the daemon's Ingestor over them again and again.

The rig keeps one master copy of every dump on tmpfs and hard-links it into the spool (the same
file system) before each pass: ingest unlinks the spool name, the master survives, and re-filling
the spool costs nothing.
"""

from __future__ import annotations

import os
import queue
import resource
import shutil
import subprocess
import threading
import time
from pathlib import Path
from typing import NamedTuple

import numpy as np

from eagle3d.dataset import dumpformat
from eagle3d.daemon.durability import GroupSync
from eagle3d.daemon.ingest import Ingestor, Outcome
from eagle3d.statemachine import digests
from eagle3d.statemachine.config_schema import ExtractConfig
from eagle3d.statemachine.ledger import Ledger, PlannedSample
from eagle3d.statemachine.safepath import HeldDir

HIDDEN = 4096
FINGERPRINT = "0123456789abcdef0123456789abcdef"
CONTRACT = {"fingerprint": FINGERPRINT, "hidden_size": HIDDEN, "dtype": "bfloat16"}
BYTES_PER_TOKEN = dumpformat.bytes_per_token(HIDDEN, "bfloat16")  # 32 KiB + 5
INGEST_THREADS = ExtractConfig._field_defaults["ingest_threads"]  # the daemon's default


class Dump(NamedTuple):
    sample_id: str
    path: Path
    tokens: int
    input_ids: bytes
    loss_mask: bytes


def sample_id(n: int) -> str:
    return digests.hex_digest(str(n).encode())


def finite_bf16(rng: np.random.Generator, rows: int) -> np.ndarray:
    """Random bf16 bits with the exponent's top bit cleared: every value finite, |x| < 2."""
    bits = np.frombuffer(rng.bytes(rows * HIDDEN * 2), np.uint16)
    return bits & np.uint16(0xBFFF)


def write_dumps(folder: Path, total_bytes: int, min_tokens: int, max_tokens: int,
                seed: int = 0) -> list[Dump]:
    """Dumps adding up to `total_bytes` or a little more, lengths log-uniform in
    [min_tokens, max_tokens]: many short conversations, a few long ones."""
    rng = np.random.default_rng(seed)
    dumps: list[Dump] = []
    written = 0
    while written < total_bytes:
        tokens = int(np.exp(rng.uniform(np.log(min_tokens), np.log(max_tokens))))
        sid = sample_id(len(dumps))
        ids = rng.integers(0, 128_000, tokens, dtype=np.int32).tobytes()
        mask = (rng.random(tokens) < 0.6).astype(np.uint8).tobytes()
        path = dumpformat.write_dump(folder, sid, FINGERPRINT, {
            "input_ids": ("I32", (tokens,), ids),
            "loss_mask": ("U8", (tokens,), mask),
            "aux_hidden_states": ("BF16", (tokens, 3 * HIDDEN), finite_bf16(rng, 3 * tokens)),
            "last_hidden_state": ("BF16", (tokens, HIDDEN), finite_bf16(rng, tokens)),
        })
        written += path.stat().st_size
        dumps.append(Dump(sid, path, tokens, ids, mask))
    return dumps


def planned(dumps: list[Dump], first_idx: int = 0) -> list[PlannedSample]:
    return [PlannedSample(d.sample_id, first_idx + i, d.tokens, d.loss_mask.count(1),
                          dumpformat.ids_hash(d.input_ids), d.input_ids, d.loss_mask)
            for i, d in enumerate(dumps)]


FILLER_IDS = b"\x01\x00\x00\x00" * 8


def filler(start: int, n: int) -> list[PlannedSample]:
    """Planned samples with no dump behind them: ledger rows to give the ledger its size."""
    return [PlannedSample(f"{i:032x}", i, 512, 256, "h" * 32, FILLER_IDS, b"\1" * 8)
            for i in range(start, start + n)]


def fill_ledger(ledger: Ledger, upto: int, have: int) -> int:
    """Add filler rows idx `have`..`upto`-1, in big batches; returns `upto`."""
    while have < upto:
        n = min(20_000, upto - have)
        ledger.add_planned(filler(have, n), [], {"plan.through": str(have + n - 1)})
        # Most of a long run is already verified: put the bulk there, as in real life.
        with ledger.transaction() as db:
            db.execute("UPDATE samples SET status = 'verified', path = 'x', bytes = 1, "
                       "checksum = 'c' WHERE idx >= ? AND idx < ?", (have, have + n))
        have += n
    return have


def write_config(root: Path) -> Path:
    """A config that validates, with every folder under `root`."""
    source = root / "conversations.jsonl"
    source.write_text("")
    config = root / "eagle3d.toml"
    config.write_text(f"""
[target]
model = "{root}"
[data]
source = "{source}"
format = "messages"
[paths]
state_dir = "{root}/state"
spool_dir = "{root}/spool"
dataset_dir = "{root}/dataset"
train_dir = "{root}/train"
""")
    return config


def timed_cpu(argv: list[str], env: dict[str, str] | None = None) -> tuple[float, float]:
    """Wall seconds and CPU seconds (user + system) of one whole process. CPU time barely moves
    when other work competes for the cores; wall time is what a user waits."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    subprocess.run(argv, stdout=subprocess.DEVNULL, check=True, env=env)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime


def timed(argv: list[str], env: dict[str, str] | None = None) -> float:
    """Wall seconds of one whole process."""
    return timed_cpu(argv, env)[0]


def empty_folder(folder: Path) -> None:
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)


class IngestRig:
    """The bench's dumps, planned in a ledger and ingested by `threads` threads the way the
    daemon's `[extract] ingest_threads` do it: each thread its own Ingestor and Ledger connection,
    pulling names from one queue, all sharing one GroupSync (its syncfs calls are timed too)."""

    def __init__(self, dumps: list[Dump], spool: Path, dataset: Path, ledger_path: Path,
                 first_idx: int = 0) -> None:
        self.spool, self.dataset, self.ledger_path = spool, dataset, ledger_path
        self.dumps = dumps
        self.nbytes = sum(d.path.stat().st_size for d in dumps)
        self.syncs = 0  # syncfs calls of the last pass
        with Ledger(ledger_path) as ledger:
            ledger.add_planned(planned(dumps, first_idx), [], {})
            ledger.claim(len(dumps), 1 << 62)
        spool.mkdir(parents=True, exist_ok=True)
        dataset.mkdir(parents=True, exist_ok=True)

    def fill_spool(self) -> None:
        for d in self.dumps:
            os.link(d.path, self.spool / d.path.name)

    def ingest_pass(self, threads: int) -> float:
        """Seconds to ingest the whole spool. Connections are opened before the clock starts,
        as the daemon opens them once per thread."""
        names: queue.SimpleQueue[str] = queue.SimpleQueue()
        for d in self.dumps:
            names.put(d.path.name)
        ledgers = [Ledger(self.ledger_path) for _ in range(threads)]
        failures: list[Outcome | BaseException] = []
        group_sync = GroupSync(self.dataset)
        spool = HeldDir.open(self.spool)  # as the daemon holds it: opened once, by handle

        def work(ledger: Ledger) -> None:
            ingestor = Ingestor(ledger, spool, self.dataset, CONTRACT, max_attempts=3,
                                group_sync=group_sync)
            try:
                while True:
                    try:
                        name = names.get_nowait()
                    except queue.Empty:
                        return
                    out = ingestor.ingest(name)
                    if out.kind != "ingested":
                        failures.append(out)
            except BaseException as exc:  # reported by the caller, not lost in a thread
                failures.append(exc)

        workers = [threading.Thread(target=work, args=(lg,)) for lg in ledgers]
        start = time.perf_counter()
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        seconds = time.perf_counter() - start
        self.syncs = group_sync.syncs
        for lg in ledgers:
            lg.close()
        spool.close()
        if failures:
            raise RuntimeError(f"ingest of the bench dumps failed: {failures[:3]}")
        return seconds

    def reset(self) -> None:
        """Undo a pass: dataset files gone, the samples back to inflight."""
        empty_folder(self.dataset)
        with Ledger(self.ledger_path) as ledger, ledger.transaction() as db:
            db.executemany("UPDATE samples SET status = 'inflight', path = NULL, bytes = 0, "
                           "checksum = NULL WHERE id = ?", [(d.sample_id,) for d in self.dumps])
