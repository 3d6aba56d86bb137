"""Capture throughput of the transformers engine, as a ratio to a bare forward, for each dump
precision.

A Llama-3.1-8B-shaped model with random weights (bf16) runs the same length-sorted, padded
sub-batches three times per round: bare (the decoder alone, nothing kept) and through the
worker's capture path with bfloat16 dumps and with float8_e4m3fn dumps (hooks, quantization on
the device, device-to-host copies, dumps written to --out by the writer threads, and a thread
that deletes finished dumps the way ingest would, so tmpfs does not fill). Judged by

    ratio = capture tokens/s / bare tokens/s        (goal: >= 0.9, for each dump dtype)

printed last, after the dump bytes per token of each precision (goal: fp8 <= 0.55 x bf16).
`--tiny` swaps in a tiny model so the script runs anywhere (on CPU in the tests).

    python bench/gpu_extract.py                 # on a GPU server
    python bench/gpu_extract.py --tiny          # anywhere
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import sys
import threading
import time
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from eagle3d.dataset import contract, dumpformat
from eagle3d.capture.engines.transformers.worker import Capturer, Job, _Pending, sub_batches

LLAMA_8B = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                max_position_embeddings=8192, rope_theta=500000.0)
DUMP_DTYPES = ("bfloat16", "float8_e4m3fn")
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=8, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=512, max_position_embeddings=2048)


def build_model(shape: dict, dtype: torch.dtype, device: str) -> LlamaForCausalLM:
    torch.manual_seed(0)
    # Built directly on the device: initialising 8B parameters on the CPU takes minutes.
    with torch.device(device):
        model = LlamaForCausalLM(LlamaConfig(**shape, attn_implementation="sdpa"))
    return model.to(dtype).eval()


def conversation_lengths(total: int, longest: int, seed: int = 0) -> list[int]:
    """Lengths shaped like chat data: many short, a long tail, capped at `longest`."""
    rng = random.Random(seed)
    out: list[int] = []
    while sum(out) < total:
        out.append(max(16, min(longest, int(rng.lognormvariate(6.3, 0.8)))))
    return out


def make_requests(lengths: list[int], vocab: int, request_tokens: int) -> list[list[Job]]:
    """Jobs grouped like the daemon's dispatch: up to request_tokens tokens per request."""
    g = torch.Generator().manual_seed(1)
    requests: list[list[Job]] = [[]]
    used = 0
    for n, length in enumerate(lengths):
        if requests[-1] and used + length > request_tokens:
            requests.append([])
            used = 0
        ids = torch.randint(0, vocab, (length,), generator=g).tolist()
        requests[-1].append(Job(f"{n:032x}", ids, [1] * length))
        used += length
    return requests


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def bare_pass(capturer: Capturer, requests: list[list[Job]]) -> float:
    """Seconds for the decoder alone over the same sub-batches the capture pass runs."""
    t0 = time.perf_counter()
    with torch.inference_mode():
        for jobs in requests:
            for group in sub_batches([len(j.input_ids) for j in jobs], capturer.batch_tokens):
                ids, mask = capturer.inputs([jobs[i] for i in group])
                capturer.decoder(input_ids=ids, attention_mask=mask, use_cache=False)
    synchronize(capturer.device)
    return time.perf_counter() - t0


def capture_pass(model: torch.nn.Module, layer_ids: list[int], batch_tokens: int,
                 dump_dtype: str, requests: list[list[Job]], out: Path) -> tuple[float, int]:
    """Seconds until every dump is on disk, and how many samples failed."""
    capturer = Capturer(model, layer_ids, "b" * 32, batch_tokens, dump_dtype)
    finished: list[_Pending] = []
    t0 = time.perf_counter()
    for jobs in requests:
        capturer.submit(jobs, out, _Pending(ids=[j.id for j in jobs]), finished.append)
    capturer.close()
    seconds = time.perf_counter() - t0
    return seconds, sum(len(p.errors) for p in finished)


class Consumer(threading.Thread):
    """Deletes finished dumps as they appear, standing in for ingest, and counts their bytes."""

    def __init__(self, folder: Path) -> None:
        super().__init__(daemon=True)
        self.folder = folder
        self.stop = threading.Event()
        self.bytes = 0

    def run(self) -> None:
        while not self.stop.is_set():
            self.sweep()
            time.sleep(0.01)

    def sweep(self) -> None:
        for entry in os.scandir(self.folder):
            if not entry.name.startswith("."):
                self.bytes += entry.stat().st_size
                os.unlink(entry.path)

    def drained_bytes(self) -> int:
        """Once the folder is empty, the bytes deleted since the last call."""
        while any(not e.name.startswith(".") for e in os.scandir(self.folder)):
            time.sleep(0.01)
        counted, self.bytes = self.bytes, 0
        return counted


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiny", action="store_true", help="a tiny model (runs on CPU)")
    parser.add_argument("--tokens", type=int, default=0,
                        help="tokens per pass (default: 400000; 4000 with --tiny)")
    parser.add_argument("--batch-tokens", type=int, default=0,
                        help="padded tokens per forward ([extract] batch_tokens; default: 8192, "
                             "1024 with --tiny)")
    parser.add_argument("--request-tokens", type=int, default=65536,
                        help="tokens per request ([extract] max_inflight_tokens)")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path("/dev/shm/eagle3d-bench"))
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args(argv)

    shape = TINY if args.tiny else LLAMA_8B
    tokens = args.tokens or (4000 if args.tiny else 400_000)
    args.batch_tokens = args.batch_tokens or (1024 if args.tiny else 8192)
    dtype = torch.bfloat16
    model = build_model(shape, dtype, args.device)
    layer_ids = contract.default_layer_ids(shape["num_hidden_layers"])
    longest = min(2048, args.batch_tokens)
    requests = make_requests(conversation_lengths(tokens, longest), shape["vocab_size"],
                             args.request_tokens)
    total = sum(len(j.input_ids) for jobs in requests for j in jobs)

    args.out.mkdir(parents=True, exist_ok=True)
    per_token = {d: dumpformat.bytes_per_token(shape["hidden_size"], d) for d in DUMP_DTYPES}
    need = 4 * args.batch_tokens * max(per_token.values())  # the sub-batches a writer may hold
    free = shutil.disk_usage(args.out).free
    if free < need:
        print(f"{args.out}: {free >> 20} MiB free, the bench needs about {need >> 20} MiB; "
              "pass --out on a larger file system", file=sys.stderr)
        return 2
    consumer = Consumer(args.out)
    consumer.start()

    probe = Capturer(model, layer_ids, "b" * 32, args.batch_tokens, "bfloat16")
    warm = requests[:1]
    bare_pass(probe, warm)
    for dump_dtype in DUMP_DTYPES:
        capture_pass(model, layer_ids, args.batch_tokens, dump_dtype, warm, args.out)
    consumer.drained_bytes()

    rows = []
    failed = 0
    dump_bytes = {}
    for _ in range(args.repeats):
        rows.append(("bare forward", bare_pass(probe, requests)))
        for dump_dtype in DUMP_DTYPES:
            seconds, errors = capture_pass(model, layer_ids, args.batch_tokens, dump_dtype,
                                           requests, args.out)
            rows.append((f"capture + dumps {dump_dtype}", seconds))
            failed += errors
            dump_bytes[dump_dtype] = consumer.drained_bytes()
    probe.close()
    consumer.stop.set()
    consumer.join()
    shutil.rmtree(args.out, ignore_errors=True)

    device = torch.cuda.get_device_name(args.device) if args.device.startswith("cuda") \
        else "cpu"
    print(f"model {'tiny' if args.tiny else 'Llama-3.1-8B-shaped'} ({dtype}), {device}, "
          f"{total} tokens per pass in {sum(len(r) for r in requests)} samples, "
          f"batch_tokens {args.batch_tokens}, layers {layer_ids}")
    print(f"{'pass':<30}{'seconds':>10}{'tokens/s':>12}")
    for name, seconds in rows:
        print(f"{name:<30}{seconds:>10.2f}{total / seconds:>12.0f}")
    if failed:
        print(f"{failed} samples failed to capture", file=sys.stderr)
        return 1
    # Measured on the files written, headers included; the dataset's own figure beside it.
    bf16, fp8 = (dump_bytes[d] / total for d in DUMP_DTYPES)
    print(f"dump bytes per token: bfloat16 {bf16:.1f}, float8_e4m3fn {fp8:.1f} "
          f"(fp8/bf16 {fp8 / bf16:.3f}, goal <= 0.55; without headers "
          f"{per_token['bfloat16']} and {per_token['float8_e4m3fn']})")
    best_bare = min(s for n, s in rows if n == "bare forward")
    ratios = [f"{d} {best_bare / min(s for n, s in rows if n.endswith(d)):.3f}"
              for d in DUMP_DTYPES]
    print(f"ratio capture/bare: {'  '.join(ratios)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
