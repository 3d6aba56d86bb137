"""Benchmark: does ingest run near `cp` speed?

Realistic dumps (bf16, hidden size 4096: 32 KiB per token, ~5 MB to ~100 MB each) sit in a tmpfs
spool; rounds alternate `cp` of the spool files into a folder on disk with the daemon's ingest of
the same files into a dataset folder on the same disk (`--threads` threads, each its own Ingestor
and Ledger connection, as `[extract] ingest_threads` runs it). Judged, printed last:

    ratio = ingest throughput / cp throughput          (medians over the rounds; goal >= 0.8)

Ingest does not fsync each file; it runs a syncfs of the dataset's file system every GiB, as the
daemon does (daemon/durability.py), and those are inside its timing. `cp` never waits for the
disk, so the ratio to `cp` followed by `sync` of the copied files is printed too, as context.

    .venv/bin/python bench/ingest.py [--total-gb 3] [--threads N] [--also-threads M]
                                     [--dir /var/tmp] [--quick]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (BYTES_PER_TOKEN, INGEST_THREADS, IngestRig, empty_folder,  # noqa: E402
                    timed, write_dumps)

GOAL = 0.8


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--total-gb", type=float, default=3.0, help="bytes of dumps (default 3)")
    ap.add_argument("--quick", action="store_true",
                    help="smoke run: 0.05 GB, small dumps, 2 rounds")
    ap.add_argument("--rounds", type=int, default=5, help="A/B rounds (default 5)")
    ap.add_argument("--threads", type=int, default=INGEST_THREADS,
                    help=f"ingest threads (default: the daemon's, {INGEST_THREADS})")
    ap.add_argument("--dir", default="/var/tmp",
                    help="disk folder for the dataset (default /var/tmp)")
    ap.add_argument("--spool-dir", default="/dev/shm", help="tmpfs folder for the spool")
    ap.add_argument("--also-threads", type=int, default=0, metavar="N",
                    help="experiment: also time ingest with N threads each round (not judged)")
    args = ap.parse_args(argv)
    total_gb, rounds, min_mb, max_mb = args.total_gb, args.rounds, 5, 100
    if args.quick:
        total_gb, rounds, min_mb, max_mb = 0.05, 2, 1, 8
    min_tokens, max_tokens = (int(mb * 1e6 / BYTES_PER_TOKEN) for mb in (min_mb, max_mb))

    with tempfile.TemporaryDirectory(prefix="eagle3d-bench-ingest-", dir=args.spool_dir) as shm, \
            tempfile.TemporaryDirectory(prefix="eagle3d-bench-ingest-", dir=args.dir) as disk:
        master, spool, copies = Path(shm) / "master", Path(shm) / "spool", Path(disk) / "cp"
        master.mkdir()
        copies.mkdir()
        start = time.perf_counter()
        dumps = write_dumps(master, int(total_gb * 1e9), min_tokens, max_tokens)
        rig = IngestRig(dumps, spool, Path(disk) / "dataset", Path(disk) / "ledger.sqlite")
        sizes = sorted(d.path.stat().st_size for d in dumps)
        print(f"{len(dumps)} dumps, {rig.nbytes / 1e9:.2f} GB ({sizes[0] / 1e6:.1f} to "
              f"{sizes[-1] / 1e6:.1f} MB) written in {time.perf_counter() - start:.0f} s; "
              f"spool {spool}, dataset {rig.dataset}, {args.threads} ingest threads")

        def settle() -> None:
            """Untimed: write out what the arm just deleted or left, so its journal commits and
            discards (the disk is mounted with -o discard) do not land in the next arm's time."""
            os.sync()

        def cp_pass() -> tuple[float, float]:
            rig.fill_spool()
            paths = [str(spool / d.path.name) for d in dumps]
            cp = timed(["cp", "--", *paths, str(copies)])
            sync = timed(["sync", "--", *(str(copies / d.path.name) for d in dumps)])
            empty_folder(copies)
            empty_folder(spool)
            settle()
            return cp, sync

        syncs: list[int] = []

        def ingest_pass(threads: int) -> float:
            rig.fill_spool()
            seconds = rig.ingest_pass(threads)
            syncs.append(rig.syncs)
            rig.reset()
            settle()
            return seconds

        ingest_pass(args.threads)  # warm-up: creates the shard folder, warms the caches
        other = f"ingest x{args.also_threads}"
        rates: dict[str, list[float]] = {"cp": [], "cp+sync": [], "ingest": []}
        if args.also_threads:
            rates[other] = []
        print(f"{'round':>6}" + "".join(f"{name + ' GB/s':>{len(name) + 6}}" for name in rates))
        for r in range(rounds):
            arms = ["cp", "ingest"] + ([other] if args.also_threads else [])
            # Alternate the order, so a drift of the machine's load hits every arm alike.
            for arm in arms if r % 2 == 0 else reversed(arms):
                if arm == "cp":
                    cp_s, sync_s = cp_pass()
                    rates["cp"].append(rig.nbytes / cp_s / 1e9)
                    rates["cp+sync"].append(rig.nbytes / (cp_s + sync_s) / 1e9)
                else:
                    threads = args.threads if arm == "ingest" else args.also_threads
                    rates[arm].append(rig.nbytes / ingest_pass(threads) / 1e9)
            print(f"{r + 1:>6}" + "".join(f"{v[-1]:>{len(k) + 6}.2f}" for k, v in rates.items()),
                  flush=True)
    medians = {k: statistics.median(v) for k, v in rates.items()}
    print(f"{'median':>6}" + "".join(f"{v:>{len(k) + 6}.2f}" for k, v in medians.items()))
    cp, synced, ingest = medians["cp"], medians["cp+sync"], medians["ingest"]
    if args.also_threads:
        print(f"experiment: {other}/cp throughput ratio: {medians[other] / cp:.2f}, "
              f"{other}/ingest x{args.threads}: {medians[other] / ingest:.2f}")
    print(f"syncfs calls per ingest pass: {min(syncs)} to {max(syncs)}")
    print(f"ingest / (cp + sync) throughput ratio: {ingest / synced:.2f}")
    ratio = ingest / cp
    verdict = "smoke run, too small to judge" if args.quick else \
        "met" if ratio >= GOAL else "NOT met"
    print(f"ingest/cp throughput ratio: {ratio:.2f} (goal >= {GOAL}: {verdict})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
