"""Benchmark: does `eagle3ctl status` on the training node of a sharded dataset still answer in
a blink? Its own ledger of `--samples` rows, and `--shards` shards (itself among them) each
publishing a state file of `--samples` samples under the shared dataset root, as the daemons do.
Whole processes alternate, all with this Python: `python -c pass` and
`eagle3ctl -c CONFIG status --json`. Judged, printed last:

    ratio = median over pairs of (eagle3ctl status wall time / python -c pass wall time)
                                                                        (goal <= 2)

    .venv/bin/python bench/shard_status.py [--samples 100000] [--shards 3] [--runs 40] [--quick]
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
from common import fill_ledger, timed_cpu, write_config  # noqa: E402
from status import daemon_state, judged  # noqa: E402

from eagle3d.statemachine import layout, shards  # noqa: E402
from eagle3d.statemachine.ledger import Ledger  # noqa: E402
from eagle3d.statemachine.statefile import write_state  # noqa: E402


def sharded_config(root: Path, count: int) -> Path:
    """The training node's config: shard 0 of `count`."""
    config = write_config(root)
    config.write_text(config.read_text().replace(
        'format = "messages"\n', f'format = "messages"\nshards = {count}\nshard = 0\n'))
    return config


def publish_all(ledger: Ledger, root: Path, count: int, started: float) -> None:
    """Every shard's state file, fresh: its own in its state folder and a copy in its dataset
    folder (the training node's heartbeat must be fresh for status to exit 0)."""
    state = daemon_state(ledger, root, started)
    write_state(root / "state" / shards.folder_name(0, count), state)
    for _, folder in shards.all_folders(root / "dataset", count):
        write_state(folder, state, layout.published_state(folder))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--samples", type=int, default=100_000, help="samples per shard (100k)")
    ap.add_argument("--shards", type=int, default=3)
    ap.add_argument("--runs", type=int, default=40, help="alternations (default 40)")
    ap.add_argument("--dir", default="/var/tmp", help="disk folder for state and dataset")
    ap.add_argument("--quick", action="store_true", help="smoke run: 2k rows, 4 runs")
    args = ap.parse_args(argv)
    samples, runs = (2000, 4) if args.quick else (args.samples, args.runs)
    ctl = os.path.join(os.path.dirname(sys.executable), "eagle3ctl")
    with tempfile.TemporaryDirectory(prefix="eagle3d-bench-shards-", dir=args.dir) as disk:
        root = Path(disk)
        config = sharded_config(root, args.shards)
        for _, folder in shards.all_folders(root / "dataset", args.shards):
            folder.mkdir(parents=True)
        state_dir = root / "state" / shards.folder_name(0, args.shards)
        env = {**os.environ, "PYTHONPYCACHEPREFIX": str(root / "pycache")}
        arms = {"python -c pass": [sys.executable, "-c", "pass"],
                "eagle3ctl status": [ctl, "-c", str(config), "status", "--json"]}
        times: dict[str, list[float]] = {name: [] for name in arms}
        started = time.time()
        with Ledger(layout.ledger(state_dir)) as ledger:
            fill_ledger(ledger, samples, 0)
            publish_all(ledger, root, args.shards, started)
            for argv in arms.values():  # warm-up; checks exit 0 (a fresh heartbeat)
                timed_cpu(argv, env)
            for r in range(runs):
                publish_all(ledger, root, args.shards, started)
                for name in (list(arms) if r % 2 == 0 else list(reversed(arms))):
                    times[name].append(timed_cpu(arms[name], env)[0])
    base = times["python -c pass"]
    for name, ts in times.items():
        print(f"{name:<20} median {statistics.median(ts) * 1e3:.1f} ms")
    ratio = statistics.median(t / b for t, b in zip(times["eagle3ctl status"], base))
    print(f"eagle3ctl status over {args.shards} shards x {samples:,} samples / python -c pass "
          f"wall time, median of {runs} pairs: {judged(ratio, args.quick)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
