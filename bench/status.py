"""Benchmark: does `eagle3ctl status` answer in a blink while ingest runs flat out?

A state folder like a running daemon's: a ledger of `--samples` rows and a state.toml whose
heartbeat a background process keeps fresh while it ingests realistic dumps (the machinery of
bench/ingest.py) in a loop, flat out. Meanwhile whole processes alternate, all with this Python:
`python -c pass`, `eagle3ctl -c CONFIG status --json`, and the same eagle3ctl with no bytecode
for eagle3d's modules (how it runs under PYTHONDONTWRITEBYTECODE from a source tree, where every
start compiles them). Judged, printed last:

    ratio = median over pairs of (eagle3ctl status wall time / python -c pass wall time)
                                                                        (goal <= 2)

`--idle` keeps the heartbeat alone, with no ingest: the machine at rest, where each start's
imports and teardown are not hidden behind waits for the cores.

Bytecode lives in a private PYTHONPYCACHEPREFIX, as an installed package has its .pyc files. Each
process's CPU time is printed beside its wall time: it barely moves when other work competes for
the cores, so it tells a real change from noise. `--python` times another environment's Python
and eagle3ctl (e.g. a venv with a non-editable install).

    .venv/bin/python bench/status.py [--samples 100000] [--runs 40] [--python PY] [--idle]
                                     [--quick]
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (BYTES_PER_TOKEN, INGEST_THREADS, IngestRig, fill_ledger,  # noqa: E402
                    timed_cpu, write_config, write_dumps)

from eagle3d.statemachine import layout  # noqa: E402
from eagle3d.statemachine.ledger import Ledger  # noqa: E402
from eagle3d.statemachine.statefile import write_state  # noqa: E402

GOAL = 2.0
HEARTBEAT_EVERY_S = 2.0  # the daemon's STATE_EVERY order of magnitude; eagle3ctl allows 15 s
RIG_FIRST_IDX = 10**8  # the rig's rows sit after every filler row


def judged(ratio: float, quick: bool) -> str:
    """The ratio against GOAL, in the words every status bench ends its line with."""
    verdict = "smoke run, too small to judge" if quick else "met" if ratio <= GOAL else "NOT met"
    return f"{ratio:.2f} (goal <= {GOAL}: {verdict})"


def daemon_state(ledger: Ledger, root: Path, started: float) -> dict:
    """A state.toml with the keys the daemon writes, figures as in the middle of extraction."""
    counts = ledger.counts()
    samples = {s: counts.get(s) for s in ("pending", "inflight", "extracted", "verified",
                                          "failed", "excluded")}
    now = time.time()
    return {
        "stage": "extract", "underlying": "extract",
        "reason": "extracting: engine ready, ingest keeping up", "since": started,
        "updated": now, "config": {"path": str(root / "eagle3d.toml")},
        "samples": {**samples, "total": counts.total, "skipped": counts.get("skipped")},
        "tokens": {"done": counts.tokens.get("verified", 0), "total": counts.total_tokens},
        "rate": {"samples_per_s": 41.7, "tokens_per_s": 38211.5}, "eta_s": 5123.4,
        "bytes": {"written": sum(counts.bytes.values()), "projected": 3 << 40, "spool": 1 << 30},
        "disk": [{"role": role, "path": str(root), "free": 1 << 40, "total": 4 << 40}
                 for role in ("dataset_dir", "spool_dir", "state_dir")],
        "engine": {"status": "ready", "pid": os.getppid(), "restarts": 0, "kind": "sglang",
                   "device": "cuda:0"},
        "trainer": {"status": "idle"},
        "gate": {"open": False, "describe": "waiting for extraction"},
        "daemon": {"pid": os.getpid(), "started": started, "heartbeat": now, "alive": True},
    }


def ingest_load(rig: IngestRig, threads: int, state_dir: Path, stop: multiprocessing.Event,
                passes: "multiprocessing.Value", idle: bool) -> None:
    """The background process: keep state.toml's heartbeat fresh the way the daemon does, and
    unless `idle`, ingest the rig's dumps over and over."""
    started = time.time()

    def heartbeat() -> None:
        with Ledger(layout.ledger(state_dir), readonly=True) as ledger:
            while not stop.is_set():
                write_state(state_dir, daemon_state(ledger, state_dir.parent, started))
                stop.wait(HEARTBEAT_EVERY_S)

    beat = threading.Thread(target=heartbeat, daemon=True)
    beat.start()
    if idle:
        beat.join()
    while not stop.is_set():
        rig.fill_spool()
        rig.ingest_pass(threads)
        rig.reset()
        passes.value += 1


def wait_for_state(state_dir: Path, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not layout.state_file(state_dir).exists():
        if time.monotonic() > deadline:
            raise RuntimeError("the ingest load process wrote no state.toml")
        time.sleep(0.05)


def without_eagle3d_bytecode(python: str, prefix: Path, copy: Path) -> None:
    """A copy of a warm bytecode prefix less eagle3d's own modules (as `python` finds them): the
    standard library and site-packages stay compiled, eagle3d is compiled at every start."""
    folders = subprocess.run(
        [python, "-c", "import eagle3d.capture, eagle3d.daemon, eagle3d.statemachine as s; "
         "print('\\n'.join(p for m in (eagle3d.capture, eagle3d.daemon, s) for p in m.__path__))"],
        capture_output=True, text=True, check=True).stdout.split()
    shutil.copytree(prefix, copy)
    for folder in folders:
        shutil.rmtree(copy / Path(folder).relative_to("/"), ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--samples", type=int, default=100_000, help="ledger rows (default 100k)")
    ap.add_argument("--runs", type=int, default=40, help="alternations (default 40)")
    ap.add_argument("--load-gb", type=float, default=1.0,
                    help="bytes of dumps the load ingests per loop (default 1)")
    ap.add_argument("--threads", type=int, default=INGEST_THREADS,
                    help=f"ingest threads of the load (default: the daemon's, {INGEST_THREADS})")
    ap.add_argument("--dir", default="/var/tmp", help="disk folder for state and dataset")
    ap.add_argument("--spool-dir", default="/dev/shm", help="tmpfs folder for the spool")
    ap.add_argument("--python", default=sys.executable,
                    help="the Python to time, with its eagle3ctl beside it (default: this one; "
                         "e.g. a venv with a non-editable install)")
    ap.add_argument("--idle", action="store_true",
                    help="no ingest load: the heartbeat alone, the machine at rest")
    ap.add_argument("--quick", action="store_true", help="smoke run: 2k rows, tiny load, 4 runs")
    args = ap.parse_args(argv)
    samples, runs, load_gb, min_mb, max_mb = args.samples, args.runs, args.load_gb, 5, 100
    if args.quick:
        samples, runs, load_gb, min_mb, max_mb = 2000, 4, 0.02, 1, 4
    if args.idle:  # the rig is built as ever but never runs: its smallest
        load_gb, min_mb, max_mb = 0.02, 1, 4
    python = args.python
    ctl = os.path.join(os.path.dirname(python), "eagle3ctl")

    with tempfile.TemporaryDirectory(prefix="eagle3d-bench-status-", dir=args.spool_dir) as shm, \
            tempfile.TemporaryDirectory(prefix="eagle3d-bench-status-", dir=args.dir) as disk:
        root = Path(disk)
        config = write_config(root)
        state_dir = root / "state"
        start = time.perf_counter()
        with Ledger(layout.ledger(state_dir)) as ledger:
            fill_ledger(ledger, samples, 0)
        master = Path(shm) / "master"
        master.mkdir()
        dumps = write_dumps(master, int(load_gb * 1e9), int(min_mb * 1e6 / BYTES_PER_TOKEN),
                            int(max_mb * 1e6 / BYTES_PER_TOKEN))
        rig = IngestRig(dumps, Path(shm) / "spool", root / "dataset", layout.ledger(state_dir),
                        RIG_FIRST_IDX)
        load_text = ("no ingest (--idle)" if args.idle else f"{len(dumps)} dumps "
                     f"({rig.nbytes / 1e9:.2f} GB) ingested in a loop by {args.threads} threads")
        print(f"ledger {samples:,} rows + {load_text}; set up in "
              f"{time.perf_counter() - start:.0f} s", flush=True)

        env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
        env["PYTHONPYCACHEPREFIX"] = str(root / "pycache")
        source_env = {**env, "PYTHONPYCACHEPREFIX": str(root / "pycache-stdlib-only"),
                      "PYTHONDONTWRITEBYTECODE": "1"}
        arms = {
            "python -c pass": ([python, "-c", "pass"], env),
            "eagle3ctl status": ([ctl, "-c", str(config), "status", "--json"], env),
            "eagle3ctl status, no .pyc": ([ctl, "-c", str(config), "status", "--json"],
                                          source_env),
        }
        fork = multiprocessing.get_context("fork")
        stop, passes = fork.Event(), fork.Value("i", 0)
        load = fork.Process(target=ingest_load, args=(rig, args.threads, state_dir, stop, passes,
                                                        args.idle))
        load.start()
        try:
            wait_for_state(state_dir)
            for argv, arm_env in arms.values():  # warm-up: bytecode written, caches warm
                timed_cpu(argv, arm_env)  # also checks exit 0: a fresh heartbeat, a readable ledger
            without_eagle3d_bytecode(python, Path(env["PYTHONPYCACHEPREFIX"]),
                                     Path(source_env["PYTHONPYCACHEPREFIX"]))
            passes_before, start = passes.value, time.perf_counter()
            times: dict[str, list[float]] = {name: [] for name in arms}
            cpu: dict[str, list[float]] = {name: [] for name in arms}
            for r in range(runs):
                order = list(arms) if r % 2 == 0 else list(reversed(arms))
                for name in order:
                    wall, used = timed_cpu(*arms[name])
                    times[name].append(wall)
                    cpu[name].append(used)
                if not load.is_alive():
                    raise RuntimeError("the ingest load process died")
            loaded = (passes.value - passes_before) * rig.nbytes
            if not args.idle:
                print(f"meanwhile the load ingested {loaded / 1e9:.2f} GB "
                      f"({loaded / (time.perf_counter() - start) / 1e9:.2f} GB/s)")
        finally:
            stop.set()
            load.join(60)  # it finishes its pass: at most seconds
            if load.is_alive():
                load.kill()
    base, base_cpu = times["python -c pass"], statistics.median(cpu["python -c pass"])
    print(f"{'wall time':<28}{'median ms':>10}{'min ms':>8}{'max ms':>8}{'ratio':>7}"
          f"{'CPU ms':>8}{'CPU ratio':>10}")
    ratios = {}
    for name, ts in times.items():
        ratios[name] = statistics.median(t / b for t, b in zip(ts, base))
        used = statistics.median(cpu[name])
        print(f"{name:<28}{statistics.median(ts) * 1e3:>10.1f}{min(ts) * 1e3:>8.1f}"
              f"{max(ts) * 1e3:>8.1f}{ratios[name]:>7.2f}{used * 1e3:>8.1f}"
              f"{used / base_cpu:>10.2f}")
    print(f"eagle3ctl status / python -c pass wall time, median of {runs} pairs "
          f"{'at rest' if args.idle else 'under ingest load'}: "
          f"{judged(ratios['eagle3ctl status'], args.quick)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
