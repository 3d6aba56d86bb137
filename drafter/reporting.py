"""What a training step reports, and how it gets to the host without slowing the GPU: each
step's figures (StepFigures) become a row of metrics.jsonl (with its wall time), the progress
file the daemon reads, TensorBoard scalars where asked, and a log line every 10 s with the ETA
(Reporter), with the tokens/s of the last seconds (RecentRate)."""

from __future__ import annotations

import collections
import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist

from eagle3d.drafter import data
from eagle3d.drafter.model import LOSS_DECAY
from eagle3d.statemachine import train_files

log = logging.getLogger("eagle3d.trainer")


class RecentRate:
    """Tokens per second over the steps of the last `window_s` seconds, waits for data between
    them included: what the log, the status and the metrics report. One step's own rate swung
    from 84 to 147,400 tokens/s in one H200 run (a step pays for whatever the GPU's queue
    held), which reads as a stall or a spike that is not there."""

    def __init__(self, window_s: float = 10.0) -> None:
        self.window_s = window_s
        self.steps: collections.deque[tuple[float, float, float, float]] = collections.deque()

    def add(self, started: float, ended: float, tokens: float, waited: float = 0.0) -> float:
        """A step from `started` to `ended` that trained `tokens` after `waited` seconds for
        its batch; returns the window's tokens/s."""
        self.steps.append((started, ended, tokens, waited))
        while ended - self.steps[0][1] > self.window_s:
            self.steps.popleft()
        return sum(s[2] for s in self.steps) / self.span

    @property
    def span(self) -> float:
        return max(self.steps[-1][1] - self.steps[0][0], 1e-9)

    @property
    def wait_share(self) -> float:
        """The share of the window's time the steps spent waiting for their batches."""
        return min(1.0, sum(s[3] for s in self.steps) / self.span)


@dataclass
class StepFigures:
    """One step's figures on their way to the host: [loss x count per TTT step, correct per TTT
    step, count per TTT step, tokens, stop requests, seconds waited for the batch / world],
    summed over the ranks (the wait: its mean over them). They are read one
    step late, with the next step already queued on the GPU: reading them at once would drain
    its queue at every step and leave it idle while the host starts the next."""
    step: int
    epoch: float  # epochs done after the step
    lr: float
    started: float
    values: torch.Tensor
    copied: torch.cuda.Event | None

    @classmethod
    def send(cls, device: torch.device, world: int, step: int, epoch: float, lr: float,
             started: float, per_step: torch.Tensor, correct: torch.Tensor,
             counted: torch.Tensor, tokens: int, stop_requested: bool,
             waited: float = 0.0) -> StepFigures:
        extra = data.sent(torch.tensor([float(tokens), float(stop_requested), waited / world]),
                          device)
        values = torch.cat([per_step.float() * counted, correct.float(), counted.float(), extra])
        if world > 1:
            dist.all_reduce(values)
        if not values.is_cuda:
            return cls(step, epoch, lr, started, values, None)
        copied = torch.cuda.Event()
        values = values.to("cpu", non_blocking=True)  # into pinned memory
        copied.record()
        return cls(step, epoch, lr, started, values, copied)

    def read(self) -> torch.Tensor:
        if self.copied is not None:
            self.copied.synchronize()
        return self.values


class Reporter:
    """The metrics file, the progress file and the log, from each step's figures; the metrics
    and progress only where given (the main rank). `bytes_per_token` (the dataset's) turns the
    tokens/s into the read rate the log names when the reader is the limit."""

    def __init__(self, ttt_steps: int, total: int, started_step: int,
                 metrics_path: Path | None, progress: train_files.ProgressWriter | None,
                 bytes_per_token: int = 0, tensorboard: Path | None = None) -> None:
        self.ttt_steps, self.total, self.bytes_per_token = ttt_steps, total, bytes_per_token
        self.reader_named = False  # the log names the reader as the limit once
        self.recent = RecentRate()
        self.last_log = 0.0
        # The pace the ETA projects is counted from the first step reported: the wait for it
        # (on CUDA the kernels compile, a minute or more) would make the early ETAs hours long.
        self.first: tuple[float, int] | None = None
        self.metrics = open(metrics_path, "a") if metrics_path is not None else None
        self.progress = progress
        self.board = _board(tensorboard) if tensorboard is not None and progress else None
        if progress is not None:
            progress.write(train_files.STARTING, step=started_step)

    def report(self, figures: StepFigures) -> bool:
        """Writes the step's figures; whether a rank asked to stop by then."""
        values = figures.read().tolist()
        k = self.ttt_steps
        counts = [max(n, 1.0) for n in values[2 * k:3 * k]]
        step_loss = [v / n for v, n in zip(values[:k], counts)]
        acc = [v / n for v, n in zip(values[k:2 * k], counts)]
        now = time.monotonic()
        tokens_per_s = self.recent.add(figures.started, now, values[3 * k], values[3 * k + 2])
        if self.metrics is not None and self.progress is not None:
            weighted = sum(LOSS_DECAY ** i * v for i, v in enumerate(step_loss))
            row = {"step": figures.step, "time": round(time.time(), 3), "epoch": figures.epoch,
                   "loss": weighted, "loss_per_step": step_loss, "acc": acc,
                   "tokens_per_s": tokens_per_s, "lr": figures.lr,
                   "data_wait": round(self.recent.wait_share, 4)}
            self.metrics.write(json.dumps(row) + "\n")
            self.metrics.flush()
            if self.board is not None:
                self.board(row)
            if self.first is None:
                self.first = (now, figures.step)
            since, step = self.first
            eta = ((now - since) / (figures.step - step) * (self.total - figures.step)
                   if figures.step > step else None)
            last = figures.step == self.total
            self.progress.write(train_files.TRAINING, force=last, step=figures.step,
                                epoch=figures.epoch, loss=weighted, acc=acc,
                                tokens_per_s=tokens_per_s, eta_s=eta,
                                data_wait=round(self.recent.wait_share, 4))
            self.name_the_reader(tokens_per_s)
            if now - self.last_log > 10 or last:
                self.last_log = now
                log.info("step %d/%d loss %.3f acc %s %.0f tok/s, ETA %s", figures.step,
                         self.total, weighted, " ".join(f"{a:.2f}" for a in acc), tokens_per_s,
                         "-" if eta is None else f"{eta:.0f} s")
        return values[3 * k + 1] > 0

    def name_the_reader(self, tokens_per_s: float) -> None:
        """Once a whole window of steps waited for data past the limit, say so, with figures."""
        share = self.recent.wait_share
        if (self.reader_named or share < train_files.READER_LIMIT
                or self.recent.span < self.recent.window_s):
            return
        self.reader_named = True
        log.warning("the dataset's reader is the limit, not the GPU: the steps waited for data "
                    "%.0f%% of the last %.0f s, training %.0f tokens/s, reading %.0f MB/s of "
                    "dumps (%d bytes per token); a faster disk, or the dataset on local NVMe, "
                    "would train faster", 100 * share, self.recent.span, tokens_per_s,
                    tokens_per_s * self.bytes_per_token / 1e6, self.bytes_per_token)

    def close(self) -> None:
        if self.metrics is not None:
            self.metrics.close()
        if self.board is not None:
            self.board(None)


def _board(folder: Path) -> Callable[[dict | None], None]:
    """TensorBoard's writer as one call per metrics row (None: close), each row's wall time
    its own: a resumed run's steps continue the same curves."""
    from torch.utils.tensorboard import SummaryWriter
    writer = SummaryWriter(str(folder))

    def write(row: dict | None) -> None:
        if row is None:
            writer.close()
            return
        step, at = row["step"], row["time"]
        for name in ("loss", "tokens_per_s", "lr", "data_wait"):
            writer.add_scalar(f"train/{name}", row[name], step, walltime=at)
        for k, (loss, acc) in enumerate(zip(row["loss_per_step"], row["acc"])):
            writer.add_scalar(f"ttt_step_{k}/loss", loss, step, walltime=at)
            writer.add_scalar(f"ttt_step_{k}/accuracy", acc, step, walltime=at)
    return write
