"""The transformers engine: `python -m eagle3d.capture.engines.transformers.worker -c CONFIG`, a long-lived child of
the daemon that turns token ids into hidden-state dumps.

Protocol (one JSON object per line, UTF-8):

  start     The worker loads the config, `<dataset_dir>/capture.toml` (the capture contract) and
            the target, then writes on stdout
              {"event": "ready", "pid": 1234, "device": "cuda:0" | "cpu", "dtype": "bfloat16",
               "dump_dtype": "bfloat16" | "float8_e4m3fn", "model": "..."}
            Everything else the process or its libraries print goes to stderr: stdout carries the
            protocol only. Exit REFUSED (statemachine/entry.py), with a message on stderr, when
            the contract is missing or was edited by hand; CONTRACT_MISMATCH when the target's
            weights or shape are not the contract's.
  request   on stdin:
              {"batch": [{"id": SID, "input_ids": [int, ...], "loss_mask": [0|1, ...]}, ...],
               "out": "/folder"}
            writes one dump per sample, `<out>/<SID>.safetensors` (dumpformat: written under a
            dot-prefixed temp name and renamed, stamped with the contract's fingerprint).
  replies   for each sample that cannot be done (bad input; a forward that fails even alone;
            a failed write):
              {"event": "error", "ids": [SID], "error": "why"}
            with "kind": "disk_full" added when the write failed for lack of space, "write_failed"
            for any other file-system error (the output folder gone, a read-only disk): the sample
            is not at fault, the daemon returns it without counting an attempt; then, once every
            dump of the request is on disk, one
              {"event": "done", "ids": [SID, ...], "tokens": N, "seconds": S}
            naming the samples written (tokens: their total; seconds: from the request's arrival).
            A line that is not a request gets {"event": "error", "ids": [], "error": "..."}.
            Requests may be sent without waiting for "done": the next one is read and its forwards
            start while the previous one's dumps are still being written, so "done" events can
            arrive after later requests were read, but always in request order.
  stop      stdin closed: finish everything, exit 0. SIGTERM: finish the current request (its
            forwards and writes), exit 0 without reading more.

A forward that fails (out of memory, mostly) is retried as two halves, down to single samples.
The states are cast or quantized to the contract's dump dtype on the device (precision.py), so
the copy to the host moves only the bytes the dump stores. Dumps are written by a thread pool
while the next forward runs; on CUDA the device-to-host copy runs on its own stream into pinned
memory, so the GPU does not wait for the disk.
"""

from __future__ import annotations

import argparse
import errno
import json
import math
import os
import signal
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import torch
from torch import nn

from eagle3d.dataset import contract, dumpformat, precision
from eagle3d.target import identity, loading
from eagle3d.target.taps import LayerTap, decoder_of
from eagle3d.statemachine.config_schema import Config
from eagle3d.statemachine.entry import OK, ContractMismatch, child_main


@dataclass(frozen=True)
class Job:
    id: str
    input_ids: Sequence[int]
    loss_mask: Sequence[int]


def parse_job(raw: Any, vocab_size: int) -> Job:
    """A request's sample, checked: the forward must never see ids it cannot embed."""
    if not isinstance(raw, dict):
        raise ValueError("a batch entry is not an object")
    sid, ids, mask = raw.get("id"), raw.get("input_ids"), raw.get("loss_mask")
    if not isinstance(sid, str) or not dumpformat.SAMPLE_ID.fullmatch(sid):
        raise ValueError(f"malformed sample id {sid!r}")
    if not isinstance(ids, list) or not ids or not all(type(i) is int for i in ids):
        raise ValueError("input_ids must be a non-empty list of integers")
    if not isinstance(mask, list) or len(mask) != len(ids) or not all(m in (0, 1) for m in mask):
        raise ValueError("loss_mask must be a list of 0/1 as long as input_ids")
    bad = next((i for i in ids if not 0 <= i < vocab_size), None)
    if bad is not None:
        raise ValueError(f"input id {bad} outside the vocabulary (size {vocab_size})")
    return Job(sid, ids, mask)


# What one more forward costs beyond its tokens, in tokens: mainly streaming the weights once,
# which on an H100-class GPU takes about as long as computing ~200 tokens of a dense model.
FORWARD_COST_TOKENS = 256


def sub_batches(lengths: Sequence[int], batch_tokens: int,
                forward_cost: int = FORWARD_COST_TOKENS) -> list[list[int]]:
    """Indices grouped for right-padded forwards of at most batch_tokens padded tokens (a sample
    longer than that goes alone), minimising padded tokens + forward_cost per forward.

    Samples are sorted longest first and cut into runs by dynamic programming. On ShareGPT
    lengths (max_tokens 2048, requests of 65536 tokens, batch_tokens 8192) padding is 3.3% of
    the real tokens, where greedily filling each forward wastes 9.9%."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    longest_first = [lengths[i] for i in order]
    n = len(order)
    cost = [0.0] + [math.inf] * n  # cost[j]: the best cost of the first j samples
    cut = [0] * (n + 1)
    for j in range(1, n + 1):
        for i in range(j - 1, -1, -1):  # the last forward holds samples i..j-1
            padded = (j - i) * longest_first[i]
            if padded > batch_tokens and j - i > 1:
                break
            c = cost[i] + padded + forward_cost
            if c < cost[j]:
                cost[j], cut[j] = c, i
    groups = []
    j = n
    while j > 0:
        groups.append(order[cut[j]:j])
        j = cut[j]
    return groups[::-1]


def write_failure(exc: Exception) -> str | None:
    """The error event's kind for a dump that could not be written: "disk_full" (ENOSPC,
    EDQUOT) or "write_failed" (any other error of the file system: the folder removed, a disk
    gone read-only), which the daemon returns without counting an attempt; None where the
    sample itself may be at fault."""
    if not isinstance(exc, OSError):
        return None
    return "disk_full" if exc.errno in (errno.ENOSPC, errno.EDQUOT) else "write_failed"


@dataclass
class _Pending:
    """One request on its way to "done": counts the write tasks still running."""
    ids: list[str]
    tokens: int = 0
    t0: float = field(default_factory=time.monotonic)
    tasks: int = 1  # the request itself holds one until all its forwards are scheduled
    written: list[str] = field(default_factory=list)
    errors: list[tuple[str, str]] = field(default_factory=list)


class Capturer:
    """Runs a decoder over batches of jobs, taps the contract's layers and writes the dumps."""

    def __init__(self, model: nn.Module, layer_ids: list[int], fingerprint: str,
                 batch_tokens: int, dump_dtype: str, writers: int = 2,
                 max_pending_writes: int = 3) -> None:
        self.decoder = decoder_of(model)
        self.tap = LayerTap(self.decoder, layer_ids)
        self.fingerprint = fingerprint
        self.batch_tokens = batch_tokens
        self.dump_dtype = dump_dtype
        self.device = next(model.parameters()).device
        self.cuda = self.device.type == "cuda"
        self.copy_stream = torch.cuda.Stream(self.device) if self.cuda else None
        self.pool = ThreadPoolExecutor(writers, thread_name_prefix="dump-writer")
        # Bounds host memory held by dumps not yet written (pinned buffers on CUDA).
        self.slots = threading.Semaphore(max_pending_writes)
        self.lock = threading.Lock()

    # ---- forward --------------------------------------------------------------------------

    def inputs(self, jobs: Sequence[Job]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Right-padded ids and their attention mask (None when no row is padded, which lets
        attention take its causal fast path)."""
        longest = max(len(j.input_ids) for j in jobs)
        ids = torch.zeros(len(jobs), longest, dtype=torch.long)
        mask = torch.zeros(len(jobs), longest, dtype=torch.long)
        for row, j in enumerate(jobs):
            ids[row, :len(j.input_ids)] = torch.tensor(j.input_ids, dtype=torch.long)
            mask[row, :len(j.input_ids)] = 1
        padded = bool((mask == 0).any())
        return (ids.to(self.device, non_blocking=True),
                mask.to(self.device, non_blocking=True) if padded else None)

    @torch.inference_mode()
    def forward(self, jobs: Sequence[Job]) -> dict[str, torch.Tensor]:
        """The dumps' hidden-state tensors by name, [B, L, ...] on the model's device,
        right-padded, in the dump dtype: aux [B, L, 3H] and final [B, L, H] (with fp8, and their
        scales [B, L, 3] and [B, L, 1])."""
        ids, mask = self.inputs(jobs)
        with self.tap:
            self.decoder(input_ids=ids, attention_mask=mask, use_cache=False)
            aux, final = self.tap.take()
        return precision.encode_states(aux, final, self.dump_dtype)

    # ---- scheduling -----------------------------------------------------------------------

    def submit(self, jobs: Sequence[Job], out: Path, pending: _Pending,
               on_complete: Callable[[_Pending], None]) -> None:
        """Forward all jobs (sub-batched) and queue their dumps; `on_complete` runs (in a writer
        thread or here) once every dump of `pending` is written or failed."""
        for group in sub_batches([len(j.input_ids) for j in jobs], self.batch_tokens):
            self._run_group([jobs[i] for i in group], out, pending, on_complete)
        self._finish_task(pending, on_complete)

    def _run_group(self, jobs: list[Job], out: Path, pending: _Pending,
                   on_complete: Callable[[_Pending], None]) -> None:
        try:
            states = self.forward(jobs)
            failure = None
        except Exception as exc:  # out of memory above all; a halved batch may fit
            failure = f"forward failed: {exc}"[:2000]
        if failure is not None:
            # Outside the except block: its traceback would keep the failed forward's memory.
            if self.cuda:
                torch.cuda.empty_cache()
            if len(jobs) == 1:
                with self.lock:
                    pending.errors.append((jobs[0].id, failure))
                return
            half = len(jobs) // 2
            self._run_group(jobs[:half], out, pending, on_complete)
            self._run_group(jobs[half:], out, pending, on_complete)
            return
        host, ready = self._to_host(states)
        del states
        self.slots.acquire()
        with self.lock:
            pending.tasks += 1
        self.pool.submit(self._write_group, jobs, host, ready, out, pending, on_complete)

    def _to_host(self, states: dict[str, torch.Tensor]
                 ) -> tuple[dict[str, torch.Tensor], torch.cuda.Event | None]:
        if not self.cuda:
            return states, None
        # The copy runs on its own stream so the next forward, queued right after, overlaps it.
        self.copy_stream.wait_stream(torch.cuda.current_stream(self.device))
        host = {}
        with torch.cuda.stream(self.copy_stream):
            for name, t in states.items():
                host[name] = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
                host[name].copy_(t, non_blocking=True)
                # The caching allocator must not hand it to the next forward before the copy ends.
                t.record_stream(self.copy_stream)
            ready = torch.cuda.Event()
            ready.record(self.copy_stream)
        return host, ready

    def _write_group(self, jobs: list[Job], states: dict[str, torch.Tensor],
                     ready: torch.cuda.Event | None, out: Path, pending: _Pending,
                     on_complete: Callable[[_Pending], None]) -> None:
        written, errors, tokens = [], [], 0
        try:
            if ready is not None:
                ready.synchronize()
            for row, job in enumerate(jobs):
                try:
                    n = len(job.input_ids)
                    self.write_dump(out, job, {k: t[row, :n] for k, t in states.items()})
                    written.append(job.id)
                    tokens += len(job.input_ids)
                except Exception as exc:  # disk full, folder gone: this sample fails, not all
                    errors.append((job.id, f"write failed: {exc}", write_failure(exc)))
        finally:
            self.slots.release()
            with self.lock:
                pending.written += written
                pending.errors += errors
                pending.tokens += tokens
            self._finish_task(pending, on_complete)

    def _finish_task(self, pending: _Pending, on_complete: Callable[[_Pending], None]) -> None:
        with self.lock:
            pending.tasks -= 1
            last = pending.tasks == 0
        if last:
            on_complete(pending)

    def write_dump(self, out: Path, job: Job, states: dict[str, torch.Tensor]) -> Path:
        """One sample's dump; `states` are its rows of the batch's hidden-state tensors."""
        n = len(job.input_ids)
        return dumpformat.write_dump(out, job.id, self.fingerprint, {
            "input_ids": ("I32", (n,), np.asarray(job.input_ids, dtype="<i4").tobytes()),
            "loss_mask": ("U8", (n,), np.asarray(job.loss_mask, dtype=np.uint8).tobytes()),
            **{name: precision.dump_entry(t) for name, t in states.items()}})

    def close(self) -> None:
        """Wait for every queued write."""
        self.pool.shutdown(wait=True)


# ---- the process ------------------------------------------------------------------------------

class _Stop(Exception):
    """SIGTERM while waiting for a request."""


class Worker:
    def __init__(self, capturer: Capturer, vocab_size: int, proto: Any) -> None:
        self.capturer = capturer
        self.vocab_size = vocab_size
        self.proto = proto
        self.emit_lock = threading.Lock()
        self.stopping = False
        self.idle = False
        # "done" events leave in request order although writer threads finish out of order.
        self.order: list[_Pending] = []

    def emit(self, event: dict) -> None:
        with self.emit_lock:
            self.proto.write(json.dumps(event) + "\n")
            self.proto.flush()

    def on_sigterm(self, signum: int, frame: Any) -> None:
        self.stopping = True
        if self.idle:
            raise _Stop

    def on_complete(self, pending: _Pending) -> None:
        with self.emit_lock:
            while self.order and self.order[0].tasks == 0:
                p = self.order.pop(0)
                for sid, why, *kind in p.errors:
                    event = {"event": "error", "ids": [sid], "error": why}
                    if kind and kind[0]:
                        event["kind"] = kind[0]
                    self._write(event)
                self._write({"event": "done", "ids": p.written, "tokens": p.tokens,
                             "seconds": round(time.monotonic() - p.t0, 3)})
            self.proto.flush()

    def _write(self, event: dict) -> None:
        self.proto.write(json.dumps(event) + "\n")

    def handle(self, line: bytes) -> None:
        try:
            request = json.loads(line)
            batch, out = request["batch"], Path(request["out"])
            if not isinstance(batch, list):
                raise TypeError("batch must be a list")
        except (ValueError, KeyError, TypeError) as exc:
            self.emit({"event": "error", "ids": [], "error": f"not a request: {exc}"})
            return
        jobs, rejected = [], []
        for raw in batch:
            try:
                jobs.append(parse_job(raw, self.vocab_size))
            except ValueError as exc:
                sid = raw.get("id") if isinstance(raw, dict) and isinstance(raw.get("id"), str) \
                    else ""
                rejected.append((sid, str(exc)))
        pending = _Pending(ids=[j.id for j in jobs], errors=rejected)
        with self.emit_lock:
            self.order.append(pending)
        if jobs and not out.is_dir():
            pending.errors += [(j.id, f"output folder {out} does not exist", "write_failed")
                               for j in jobs]
            jobs = []
        self.capturer.submit(jobs, out, pending, self.on_complete)

    def serve(self, stdin: Any) -> None:
        while not self.stopping:
            self.idle = True
            try:
                line = stdin.readline()
            except _Stop:
                break
            finally:
                self.idle = False
            if not line:
                break
            if line.strip():
                self.handle(line)
        self.capturer.close()


def _serve(cfg: Config, args: argparse.Namespace) -> int:
    # stdout is the protocol; anything a library prints must not land in it.
    proto = os.fdopen(os.dup(1), "w", buffering=1, encoding="utf-8")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    doc = contract.read_checked(cfg.paths.dataset_dir)
    # Before the load: a model of the right shape but other weights must never be captured.
    identity.check(doc, cfg.target.model_path, cfg.target.model)
    model = loading.load_model(cfg.target.model_path, doc["dtype"], cfg.target.device)
    text = model.config.get_text_config()
    found = {"hidden_size": text.hidden_size, "num_layers": text.num_hidden_layers,
             "vocab_size": text.vocab_size}
    wrong = [f"{k}: contract {doc.get(k)}, model {v}" for k, v in found.items() if doc.get(k) != v]
    if wrong:
        raise ContractMismatch(f"the target does not fit the capture contract ({'; '.join(wrong)})")

    capturer = Capturer(model, list(doc["layer_ids"]), doc["fingerprint"],
                        cfg.extract.batch_tokens, contract.dump_dtype(doc))
    worker = Worker(capturer, text.vocab_size, proto)
    signal.signal(signal.SIGTERM, worker.on_sigterm)
    device = capturer.device
    worker.emit({"event": "ready", "pid": os.getpid(),
                 "device": f"cuda:{device.index or 0}" if device.type == "cuda" else device.type,
                 "dtype": doc["dtype"], "dump_dtype": capturer.dump_dtype,
                 "model": cfg.target.model})
    try:
        worker.serve(sys.stdin.buffer)
    except BrokenPipeError:  # the daemon is gone; nobody is left to tell
        return OK
    return OK


def main(argv: list[str] | None = None) -> int:
    return child_main("engine", "The transformers capture engine (a daemon child; see the module "
                      "docstring for its protocol).", _serve, argv)


if __name__ == "__main__":
    sys.exit(main())
