"""The trainer's data path from disk: does the reader keep up with the GPU, and how near the
disk's own limit does it read?

It writes a dataset in the dump format with the project's own writer (dumpformat.write_dump,
states encoded by precision.encode_states as the capture encodes them), then, in one run:

- the disk's sequential read rate of those files: plain 16 MiB reads, one stream per reader
  process, each file evicted from the page cache after it is read;
- the reader alone (drafter/reader.py's batches, to the device, no step) over the same files,
  checking each file against its checksum as the trainer does;
- the trainer (drafter/train.py's build_drafter, make_optimizer, train_step through
  bench/gpu_train.py's OurTrainer) fed the same batches from memory (held on the device), then
  fed from disk by the reader as train_loop feeds it: read ahead, copied, decoded on the device.

Every read evicts its file after reading (posix_fadvise DONTNEED), so the page cache never serves
a read twice; the output says whether the dataset would have fitted in memory anyway.
Judged by, side by side,

    tokens/s from disk / tokens/s from memory   (goal >= 0.95 where the disk is not the limit)
    reader bytes/s / disk sequential bytes/s     (goal >= 0.85)

printed last. `--readers 8` reads instead as 8 ranks of one machine would, 8 processes each
reading its share of the epoch's plan, and compares their aggregate rate with 8 processes of
plain reads.

    python bench/data_path.py --shape kimi-k2.5 --dump-dtype fp8 --dir /data/bench
    python bench/data_path.py --shape kimi-k2.5 --dump-dtype fp8 --readers 8
    python bench/data_path.py --tiny             # anywhere (the tests, on CPU)
"""

from __future__ import annotations

import argparse
import atexit
import multiprocessing
import os
import queue
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_train import (KIMI_K25, LLAMA_8B, TINY, OurTrainer, Shape,  # noqa: E402
                       bench_device, initial_weights, random_target, synchronize)

from eagle3d.dataset import checksum, dumpformat, precision  # noqa: E402
from eagle3d.drafter import data, reader  # noqa: E402
from eagle3d.statemachine.config_schema import FP8  # noqa: E402

SMOLLM2 = Shape("SmolLM2-135M-sized", hidden=576, intermediate=1536, heads=9, kv_heads=3,
                head_dim=64, vocab=49152, draft_vocab=32000, rope_theta=100000.0)
SHAPES = {"kimi-k2.5": KIMI_K25, "8b": LLAMA_8B, "smollm2": SMOLLM2}
DUMP_DTYPES = {"bf16": "bfloat16", "fp8": FP8}
PLAIN_READ = 16 << 20  # bytes per read of the disk's own rate
TEMPLATES = 4  # distinct sample contents, written under distinct names (files are all apart)
TOKENS_GOAL, DISK_GOAL = 0.95, 0.85
LR, TTT = 1e-4, 7


def evict(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def file_system(folder: Path) -> str:
    """The type of the file system `folder` is on (the longest mount point above it)."""
    best, kind = "", "?"
    with open("/proc/mounts") as mounts:
        for line in mounts:
            _, point, fs = line.split()[:3]
            if str(folder).startswith(point) and len(point) > len(best):
                best, kind = point, fs
    return kind


def memory_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def write_dataset(folder: Path, shape: Shape, dump_dtype: str, seq_len: int, count: int,
                  device: torch.device) -> tuple[list[Path], list[tuple[str, str]]]:
    """`count` dumps of `seq_len` tokens, written as the pipeline writes them, then flushed to
    the disk and evicted from the page cache; and (sample id, checksum) of each, as verify
    records them for the trainer's reader to check."""
    g = torch.Generator(device=device).manual_seed(0)
    entries = []
    for _ in range(TEMPLATES):
        aux = torch.randn(seq_len, 3 * shape.hidden, generator=g, device=device).bfloat16()
        last = torch.randn(seq_len, shape.hidden, generator=g, device=device).bfloat16()
        states = precision.encode_states(aux, last, dump_dtype)
        ids = torch.randint(0, shape.vocab, (seq_len,), generator=g, device=device)
        entries.append({
            dumpformat.INPUT_IDS: precision.dump_entry(ids.to(torch.int32)),
            dumpformat.LOSS_MASK: ("U8", (seq_len,), bytes([1]) * seq_len),
            **{name: precision.dump_entry(t) for name, t in states.items()}})
    paths = [dumpformat.write_dump(folder, f"{n:032x}", "bench", entries[n % TEMPLATES])
             for n in range(count)]
    recorded = [(path.stem, checksum.file_checksum(path)) for path in paths]
    os.sync()
    for path in paths:
        evict(path)
    return paths, recorded


def plain_read(paths: list[Path]) -> int:
    """Read the files whole with large plain reads, evicting each after; returns the bytes."""
    buffer = memoryview(bytearray(PLAIN_READ))
    total = 0
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            while got := os.readv(fd, [buffer]):
                total += got
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return total


def read_batches(paths: list[Path], recorded: list[tuple[str, str]], plan: list[data.Planned],
                 device: torch.device, ahead: int, threads: int) -> int:
    """The reader alone: every planned batch read and put on the device; returns the bytes."""
    for _ in reader.batches(paths, plan, device, ahead, threads, evict=True, recorded=recorded):
        pass
    synchronize(device)
    return sum(paths[i].stat().st_size for planned in plan for i in planned.indices)


@dataclass(frozen=True)
class Timed:
    seconds: float
    tokens: int = 0
    nbytes: int = 0
    waited: float = 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds

    @property
    def bytes_per_s(self) -> float:
        return self.nbytes / self.seconds


def timed(work, device: torch.device) -> tuple[float, object]:
    synchronize(device)
    start = time.perf_counter()
    result = work()
    synchronize(device)
    return time.perf_counter() - start, result


def train_from_memory(trainer: OurTrainer, held: list[data.Batch], warmup: int, steps: int,
                      device: torch.device) -> Timed:
    for i in range(warmup):
        trainer.train(held[i % len(held)])
    seconds, _ = timed(lambda: [trainer.train(held[i % len(held)]) for i in range(steps)], device)
    return Timed(seconds, sum(held[i % len(held)].tokens for i in range(steps)))


def train_from_disk(trainer: OurTrainer, paths: list[Path], recorded: list[tuple[str, str]],
                    plan: list[data.Planned], warmup: int, steps: int, device: torch.device,
                    ahead: int, threads: int) -> Timed:
    """As train_loop: the reader's batches, `warmup` steps untimed, then `steps` timed, with the
    seconds spent waiting for each batch."""
    loader = reader.batches(paths, plan, device, ahead, threads, evict=True, recorded=recorded)
    try:
        for _ in range(warmup):
            trainer.train(next(loader))
        tokens, waited = 0, 0.0

        def run() -> None:
            nonlocal tokens, waited
            for _ in range(steps):
                started = time.perf_counter()
                batch = next(loader)
                waited += time.perf_counter() - started
                trainer.train(batch)
                tokens += batch.tokens
        seconds, _ = timed(run, device)
    finally:
        loader.close()
    timed_plan = plan[warmup:warmup + steps]
    nbytes = sum(paths[i].stat().st_size for planned in timed_plan for i in planned.indices)
    return Timed(seconds, tokens, nbytes, waited)


def rank_reads(rank: int, world: int, paths: list[Path], recorded: list[tuple[str, str]],
               lengths: list[int], batch_tokens: int, kind: str, ahead: int, threads: int,
               barrier, results) -> None:
    """One of `world` reader processes: its share of the epoch's plan, first with plain reads,
    then with the reader; each phase starts with every process at the barrier."""
    device = bench_device(kind)
    plan = data.plan_epoch(lengths, batch_tokens, seed=0, epoch=0, world=world)[rank]
    mine = sorted({paths[i] for planned in plan for i in planned.indices})
    times = []
    for phase in (lambda: plain_read(mine),
                  lambda: read_batches(paths, recorded, plan, device, ahead, threads)):
        barrier.wait()
        start = time.time()
        nbytes = phase()
        times.append((start, time.time(), nbytes))
    results.put((rank, times))


def aggregate(times: list[tuple[float, float, int]]) -> float:
    """Bytes per second of processes that ran side by side: all bytes over the whole span."""
    return sum(t[2] for t in times) / (max(t[1] for t in times) - min(t[0] for t in times))


def many_readers(world: int, paths: list[Path], recorded: list[tuple[str, str]],
                 lengths: list[int], batch_tokens: int, kind: str, ahead: int,
                 threads: int) -> tuple[float, float]:
    """Aggregate (plain, reader) bytes/s of `world` processes, each its rank's share."""
    ctx = multiprocessing.get_context("spawn")
    barrier, results = ctx.Barrier(world), ctx.Queue()
    procs = [ctx.Process(target=rank_reads, args=(rank, world, paths, recorded, lengths,
                                                  batch_tokens, kind, ahead, threads, barrier,
                                                  results))
             for rank in range(world)]
    for p in procs:
        p.start()
    got: dict[int, list[tuple[float, float, int]]] = {}
    while len(got) < world:
        try:
            rank, times = results.get(timeout=5)
            got[rank] = times
        except queue.Empty:
            failed = [p.exitcode for p in procs if p.exitcode]
            if failed:  # the others wait at the barrier for it: end them
                for p in procs:
                    p.terminate()
                raise RuntimeError(f"a reader process exited with code {failed[0]}")
    for p in procs:
        p.join()
    return (aggregate([got[r][0] for r in got]), aggregate([got[r][1] for r in got]))


def mb(rate: float) -> str:
    return f"{rate / 1e6:,.0f} MB/s" if rate >= 1e7 else f"{rate / 1e6:.3f} MB/s"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiny", action="store_true", help="a tiny shape (runs on CPU)")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="kimi-k2.5")
    parser.add_argument("--dump-dtype", choices=sorted(DUMP_DTYPES), default="fp8")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dir", type=Path,
                        help="where the dataset is written (default: a new folder under "
                             "$TMPDIR or /var/tmp), removed at the end")
    parser.add_argument("--dataset-gib", type=float,
                        help="dataset size (default 16; 0.01 with --tiny); at least the "
                             "batches trained")
    parser.add_argument("--seq-len", type=int, help="tokens per sample (default 4096; 64 "
                                                    "with --tiny)")
    parser.add_argument("--batch-tokens", type=int,
                        help="tokens per batch, as [train] batch_tokens (default --seq-len)")
    parser.add_argument("--steps", type=int, default=40, help="timed steps per arm")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps first")
    parser.add_argument("--ahead", type=int, default=reader.READ_AHEAD,
                        help="batches read ahead (the trainer's default)")
    parser.add_argument("--threads", type=int, default=reader.READERS,
                        help="reader threads per process (the trainer's default)")
    parser.add_argument("--readers", type=int, default=1,
                        help="reader processes; above 1 each reads its rank's share, and "
                             "nothing trains")
    args = parser.parse_args(argv)
    shape = TINY if args.tiny else SHAPES[args.shape]
    seq_len = args.seq_len or (64 if args.tiny else 4096)
    batch_tokens = args.batch_tokens or seq_len
    if min(args.steps, args.readers, args.ahead, args.threads) < 1 or args.warmup < 0 \
            or seq_len <= TTT or batch_tokens < seq_len:
        parser.error(f"--steps, --readers, --ahead and --threads must be >= 1, --warmup >= 0, "
                     f"--seq-len > {TTT}, --batch-tokens >= --seq-len")
    device = bench_device(args.device)
    dump_dtype = DUMP_DTYPES[args.dump_dtype]
    folder = Path(tempfile.mkdtemp(prefix="eagle3d-data-path-", dir=args.dir or os.environ.get(
        "TMPDIR") or "/var/tmp"))
    atexit.register(shutil.rmtree, folder, ignore_errors=True)

    per_batch = batch_tokens // seq_len
    file_bytes = dumpformat.bytes_per_token(shape.hidden, dump_dtype) * seq_len
    wanted = (args.dataset_gib if args.dataset_gib is not None else 0.01 if args.tiny else 16)
    count = max(round(wanted * 2**30 / file_bytes), (args.warmup + args.steps) * per_batch,
                args.readers * per_batch)
    paths, recorded = write_dataset(folder, shape, dump_dtype, seq_len, count, device)
    lengths = [seq_len] * count
    dataset = sum(p.stat().st_size for p in paths)
    larger = dataset > memory_bytes()
    print(f"dataset: {count} dumps of {seq_len} tokens, {dataset / 2**30:.2f} GiB of "
          f"{args.dump_dtype} dumps in {folder} ({file_system(folder)}); page cache: "
          + ("the dataset is larger than the memory" if larger else
             f"the dataset fits in the {memory_bytes() / 2**30:.0f} GiB of memory")
          + ", and every file is evicted after each read (posix_fadvise DONTNEED)")
    print(f"draft {shape.name} (hidden {shape.hidden}), TTT {TTT}, {batch_tokens} tokens per "
          f"batch, on {torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}; "
          f"reader: {args.ahead} batches ahead, {args.threads} threads per process")

    if args.readers > 1:
        plain, ours = many_readers(args.readers, paths, recorded, lengths, batch_tokens,
                                   device.type, args.ahead, args.threads)
        print(f"{args.readers} processes, each its rank's share: plain reads {mb(plain)}, "
              f"the reader {mb(ours)} (aggregate)")
        print(f"reader bytes/s / disk sequential bytes/s, {args.readers} processes: "
              f"{ours / plain:.3f} (goal >= {DISK_GOAL})")
        return 0

    plan = data.plan_epoch(lengths, batch_tokens, seed=0, epoch=0, world=1)[0]
    seconds, nbytes = timed(lambda: plain_read(paths), device)
    disk = Timed(seconds, nbytes=nbytes)
    seconds, nbytes = timed(lambda: read_batches(paths, recorded, plan, device, args.ahead,
                                                 args.threads), device)
    alone = Timed(seconds, nbytes=nbytes)

    target = random_target(shape, device)
    weights = initial_weights(shape, target, seq_len + TTT, device)
    trainer = OurTrainer(shape, target, weights, seq_len + TTT, LR, TTT, device)
    held = list(reader.batches(paths, plan[:min(len(plan), 8)], device, evict=True,
                               recorded=recorded))
    memory = train_from_memory(trainer, held, args.warmup, args.steps, device)
    del held
    disk_fed = train_from_disk(trainer, paths, recorded, plan, args.warmup, args.steps, device,
                               args.ahead, args.threads)
    needed = memory.tokens_per_s * dumpformat.bytes_per_token(shape.hidden, dump_dtype)
    print(f"disk, plain {PLAIN_READ >> 20} MiB reads: {mb(disk.bytes_per_s)}; the reader alone "
          f"(batches to the device, no step): {mb(alone.bytes_per_s)}")
    print(f"train from memory (batches on the device): {memory.tokens_per_s:,.0f} tokens/s, "
          f"which needs {mb(needed)} of dumps: the disk "
          + ("is the limit" if needed > disk.bytes_per_s else "is not the limit"))
    print(f"train from disk: {disk_fed.tokens_per_s:,.0f} tokens/s, reading "
          f"{mb(disk_fed.bytes_per_s)}, waiting for data {disk_fed.waited / disk_fed.seconds:.0%} "
          f"of the time")
    print(f"tokens/s from disk / from memory: {disk_fed.tokens_per_s / memory.tokens_per_s:.3f} "
          f"(goal >= {TOKENS_GOAL} where the disk is not the limit)")
    print(f"reader bytes/s / disk sequential bytes/s: "
          f"{alone.bytes_per_s / disk.bytes_per_s:.3f} (goal >= {DISK_GOAL})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
