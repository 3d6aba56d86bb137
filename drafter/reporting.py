"""What a training step reports, and how it gets to the host without slowing the GPU: each
step's figures (StepFigures) become a row of metrics.jsonl, the progress file the daemon reads,
and a log line every 10 s (Reporter), with the tokens/s of the last seconds (RecentRate)."""

from __future__ import annotations

import collections
import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path

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
        self.steps: collections.deque[tuple[float, float, float]] = collections.deque()

    def add(self, started: float, ended: float, tokens: float) -> float:
        self.steps.append((started, ended, tokens))
        while ended - self.steps[0][1] > self.window_s:
            self.steps.popleft()
        return sum(t for _, _, t in self.steps) / max(ended - self.steps[0][0], 1e-9)


@dataclass
class StepFigures:
    """One step's figures on their way to the host: [loss x count per TTT step, correct per TTT
    step, count per TTT step, tokens, stop requests], summed over the ranks. They are read one
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
             counted: torch.Tensor, tokens: int, stop_requested: bool) -> StepFigures:
        extra = data.sent(torch.tensor([float(tokens), float(stop_requested)]), device)
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
    and progress only where given (the main rank)."""

    def __init__(self, ttt_steps: int, total: int, started_step: int,
                 metrics_path: Path | None, progress: train_files.ProgressWriter | None) -> None:
        self.ttt_steps, self.total = ttt_steps, total
        self.recent = RecentRate()
        self.last_log = 0.0
        # The pace the ETA projects is counted from the first step reported: the wait for it
        # (on CUDA the kernels compile, a minute or more) would make the early ETAs hours long.
        self.first: tuple[float, int] | None = None
        self.metrics = open(metrics_path, "a") if metrics_path is not None else None
        self.progress = progress
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
        tokens_per_s = self.recent.add(figures.started, now, values[3 * k])
        if self.metrics is not None and self.progress is not None:
            weighted = sum(LOSS_DECAY ** i * v for i, v in enumerate(step_loss))
            row = {"step": figures.step, "epoch": figures.epoch, "loss": weighted,
                   "loss_per_step": step_loss, "acc": acc, "tokens_per_s": tokens_per_s,
                   "lr": figures.lr}
            self.metrics.write(json.dumps(row) + "\n")
            self.metrics.flush()
            if self.first is None:
                self.first = (now, figures.step)
            since, step = self.first
            eta = ((now - since) / (figures.step - step) * (self.total - figures.step)
                   if figures.step > step else None)
            last = figures.step == self.total
            self.progress.write(train_files.TRAINING, force=last, step=figures.step,
                                epoch=figures.epoch, loss=weighted, acc=acc,
                                tokens_per_s=tokens_per_s, eta_s=eta)
            if now - self.last_log > 10 or last:
                self.last_log = now
                log.info("step %d/%d loss %.3f acc %s %.0f tok/s", figures.step, self.total,
                         weighted, " ".join(f"{a:.2f}" for a in acc), tokens_per_s)
        return values[3 * k + 1] > 0

    def close(self) -> None:
        if self.metrics is not None:
            self.metrics.close()
