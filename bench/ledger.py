"""Ledger bookkeeping cost per sample at 1k, 100k and 1M rows (no tensors).

For each size the ledger is filled to that many samples, then a fixed batch of samples goes
through the daemon's bookkeeping: plan (insert), dispatch (claim), ingest (mark extracted),
verify (mark verified), and `eagle3ctl status`'s reads. The judged figures, printed last: the
1M/1k ratio of the per-sample cost (goal ≤ 1.2) and status time at 1M (goal < 0.5 s).

    .venv/bin/python bench/ledger.py [--sizes 1000,100000,1000000] [--batch 2000]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from eagle3d.statemachine.ledger import Ledger, PlannedSample

IDS = b"\x01\x00\x00\x00" * 8


def planned(start: int, n: int) -> list[PlannedSample]:
    return [PlannedSample(f"{i:032x}", i, 512, 256, "h" * 32, IDS, b"\1" * 8)
            for i in range(start, start + n)]


def fill(ledger: Ledger, upto: int, have: int) -> int:
    while have < upto:
        n = min(20_000, upto - have)
        ledger.add_planned(planned(have, n), [], {"plan.through": str(have + n - 1)})
        # Most of a long run is already verified: put the bulk there, as in real life.
        with ledger.transaction() as db:
            db.execute("UPDATE samples SET status = 'verified', path = 'x', bytes = 1, "
                       "checksum = 'c' WHERE idx >= ? AND idx < ?", (have, have + n))
        have += n
    return have


def bookkeeping(ledger: Ledger, start: int, batch: int) -> float:
    """Seconds for `batch` samples through plan, dispatch, ingest and verify bookkeeping."""
    t0 = time.perf_counter()
    for off in range(0, batch, 256):
        ledger.add_planned(planned(start + off, min(256, batch - off)), [], {})
    claimed = []
    while len(claimed) < batch:
        got = ledger.claim(64, 1 << 30)
        if not got:
            break
        claimed += got
    for s in claimed:
        ledger.mark_extracted(s.id, "p", 1000, "c")
    for s in claimed:
        ledger.mark_verified(s.id, "st")
    return time.perf_counter() - t0


def status_time(config: Path) -> float:
    t0 = time.perf_counter()
    subprocess.run([os.path.join(os.path.dirname(sys.executable), "eagle3ctl"), "-c", str(config),
                    "status", "--json"], capture_output=True, check=False)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="1000,100000,1000000")
    ap.add_argument("--batch", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    rows = []
    with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_DIR", "/var/tmp")) as tmp:
        root = Path(tmp)
        source = root / "c.jsonl"
        source.write_text("")
        config = root / "c.toml"
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
        ledger = Ledger(root / "state" / "ledger.sqlite")
        have, next_id = 0, 10**9
        for size in sizes:
            have = fill(ledger, size, have)
            per = []
            for _ in range(args.rounds):
                per.append(bookkeeping(ledger, next_id, args.batch) / args.batch)
                next_id += args.batch
            st = statistics.median(status_time(config) for _ in range(5))
            rows.append((size, statistics.median(per), st))
            print(f"{size:>9,} rows: {statistics.median(per) * 1e6:8.1f} µs per sample, "
                  f"status {st * 1000:6.1f} ms", flush=True)
        ledger.close()
    base, top = rows[0], rows[-1]
    print(f"\nper-sample cost {top[0]:,}/{base[0]:,} rows: {top[1] / base[1]:.2f} (goal <= 1.2); "
          f"status at {top[0]:,} rows: {top[2]:.3f} s (goal < 0.5)")


if __name__ == "__main__":
    main()
