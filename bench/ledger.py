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

from eagle3d.statemachine import layout
from eagle3d.statemachine.ledger import Ledger

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import fill_ledger, filler, write_config  # noqa: E402


def bookkeeping(ledger: Ledger, start: int, batch: int) -> float:
    """Seconds for `batch` samples through plan, dispatch, ingest and verify bookkeeping."""
    t0 = time.perf_counter()
    for off in range(0, batch, 256):
        ledger.add_planned(filler(start + off, min(256, batch - off)), [], {})
    claimed = []
    while len(claimed) < batch:
        got = ledger.claim(64, 1 << 30)
        if not got:
            break
        claimed += got
    for s in claimed:
        ledger.mark_extracted(s.id, "p", 1000, "c")
    for s in claimed:
        ledger.mark_verified(ledger.sample(s.id), "st")
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
        config = write_config(root)
        ledger = Ledger(layout.ledger(root / "state"))
        have, next_id = 0, 10**9
        for size in sizes:
            have = fill_ledger(ledger, size, have)
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
