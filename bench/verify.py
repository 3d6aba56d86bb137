"""Benchmark: does verifying the dataset run near raw read speed?

Writes a realistic dataset (bf16 dumps of a hidden-size-4096 target, a few MB up to ~100 MB per
sample), then alternates `cat FILES > /dev/null` with `verify_many` over the same files, both on
a warm page cache, and prints the throughput ratio verify / cat last (goal: at least 0.7).

    .venv/bin/python bench/verify.py [--total-gb 3] [--quick]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from eagle3d.dataset import dumpformat
from eagle3d.dataset import checksum
from eagle3d.daemon.dump_checks import Expected, verify_many

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import FINGERPRINT, HIDDEN, timed, write_dumps  # noqa: E402

GOAL = 0.7


def write_dataset(folder: Path, total_bytes: int, max_tokens: int) -> list[Expected]:
    return [Expected(d.sample_id, str(d.path), d.tokens, d.loss_mask.count(1),
                     dumpformat.ids_hash(d.input_ids), checksum.file_checksum(d.path), FINGERPRINT,
                     HIDDEN, "bfloat16")
            for d in write_dumps(folder, total_bytes, 100, max_tokens)]


def time_verify(items: list[Expected], workers: int) -> float:
    start = time.perf_counter()
    problems = [(sid, p) for sid, p, _ in verify_many(items, workers) if p]
    elapsed = time.perf_counter() - start
    if problems:
        sys.exit(f"verify found problems in a good dataset: {problems[:3]}")
    return elapsed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--total-gb", type=float, default=3.0, help="dataset size (default 3)")
    ap.add_argument("--quick", action="store_true", help="smoke run: 0.2 GB, 2 rounds")
    ap.add_argument("--rounds", type=int, default=5, help="A/B rounds (default 5)")
    ap.add_argument("--workers", type=int, default=os.cpu_count() or 1,
                    help="verify workers (default: one per CPU)")
    ap.add_argument("--dir", default="/var/tmp", help="where the dataset folder is made")
    args = ap.parse_args()
    total_gb, rounds, max_tokens = args.total_gb, args.rounds, 3000
    if args.quick:
        total_gb, rounds, max_tokens = 0.2, 2, 300

    with tempfile.TemporaryDirectory(prefix="eagle3d-bench-verify-", dir=args.dir) as folder:
        start = time.perf_counter()
        items = write_dataset(Path(folder), int(total_gb * 1e9), max_tokens)
        paths = [e.path for e in items]
        size = sum(os.path.getsize(p) for p in paths)
        print(f"dataset: {len(items)} files, {size / 1e9:.2f} GB in {folder} "
              f"(written in {time.perf_counter() - start:.1f} s); {args.workers} verify workers")
        timed(["cat", *paths])  # warm-up: both sides then read from the page cache
        cat_rates, verify_rates = [], []
        print(f"{'round':>5} {'cat GB/s':>9} {'verify GB/s':>12}")
        for r in range(rounds):
            cat_rates.append(size / timed(["cat", *paths]) / 1e9)
            verify_rates.append(size / time_verify(items, args.workers) / 1e9)
            print(f"{r + 1:>5} {cat_rates[-1]:>9.2f} {verify_rates[-1]:>12.2f}")
    cat, verify = statistics.median(cat_rates), statistics.median(verify_rates)
    print(f"{'median':>5} {cat:>9.2f} {verify:>12.2f}")
    ratio = verify / cat
    verdict = "smoke run, too small to judge" if args.quick else \
        "met" if ratio >= GOAL else "NOT met"
    print(f"verify/cat throughput ratio: {ratio:.2f} (goal >= {GOAL}: {verdict})")


if __name__ == "__main__":
    main()
