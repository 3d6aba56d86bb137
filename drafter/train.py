"""Train the EAGLE-3 drafter: `torchrun --nproc_per_node N -m eagle3d.drafter.train -c CONFIG`.

Reads the verified dataset (refusing one that no longer matches the ledger, exit code 2), builds
or reloads the draft vocabulary, trains with the training-time test under DDP, checkpoints every
[train] checkpoint_every steps and on SIGTERM, resumes from the last checkpoint of the same
manifest, and ends with `export/` (SGLang layout), `metrics.jsonl` and `metrics.png` in the
train folder. `progress.json` tells the daemon where it is.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import sys
import time
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from eagle3d.capture.target import load_config as load_target_config
from eagle3d.capture.target import pick_device
from eagle3d.drafter import checkpoint, data, loss as loss_mod, vocab as vocab_mod
from eagle3d.drafter.export import export
from eagle3d.drafter.model import LOSS_DECAY, DraftConfig, Eagle3Drafter
from eagle3d.drafter.plots import plot_metrics
from eagle3d.drafter.target_weights import load_embedding_and_head
from eagle3d.statemachine import manifest as manifest_mod
from eagle3d.statemachine.atomic import atomic_write_bytes
from eagle3d.statemachine.config import Config, ConfigError, load_config
from eagle3d.statemachine.ledger import Ledger, LedgerError
from eagle3d.statemachine.lifecycle import die_with_parent

EXIT_REFUSED = 2


@dataclass(frozen=True)
class Runtime:
    rank: int
    world: int
    local_world: int
    device: torch.device

    @property
    def main(self) -> bool:
        return self.rank == 0


def init_runtime(cfg: Config) -> Runtime:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))
    kind = pick_device(cfg.train.device)
    if kind == "cuda":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
        torch.set_num_threads(cfg.train.threads or max(1, (os.cpu_count() or 1) // local_world))
    if world > 1:
        dist.init_process_group("nccl" if kind == "cuda" else "gloo")
    return Runtime(rank, world, local_world, device)


def broadcast(rt: Runtime, value: Any) -> Any:
    """Rank 0's value on every rank."""
    if rt.world == 1:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def checked_manifest(cfg: Config) -> dict[str, Any]:
    """The dataset manifest, only if it names exactly the ledger's verified samples."""
    try:
        with Ledger(cfg.paths.state_dir / "ledger.sqlite", readonly=True) as ledger:
            manifest = manifest_mod.read(cfg.paths.dataset_dir)
            manifest_mod.check(manifest, ledger)
    except (manifest_mod.ManifestMismatch, LedgerError) as exc:
        raise SystemExit(f"eagle3d.drafter: refusing to train: {exc}") from None
    if not manifest["samples"]:
        raise SystemExit("eagle3d.drafter: refusing to train: the manifest lists no samples")
    return manifest


class Progress:
    """`progress.json`, rewritten atomically at most once a second (and at every status)."""

    def __init__(self, path: Path, fingerprint: str, total_steps: int) -> None:
        self.path, self.fingerprint, self.total_steps = path, fingerprint, total_steps
        self.last_write = 0.0

    def write(self, status: str, force: bool = True, **fields: Any) -> None:
        now = time.monotonic()
        if not force and now - self.last_write < 1.0:
            return
        self.last_write = now
        doc = {"status": status, "step": 0, "total_steps": self.total_steps, "epoch": 0,
               "loss": None, "acc": [], "tokens_per_s": 0.0, "eta_s": None,
               "manifest_fingerprint": self.fingerprint, **fields}
        atomic_write_bytes(self.path, json.dumps(doc).encode())


def draft_vocabulary(cfg: Config, rt: Runtime, manifest: dict[str, Any], paths: list[Path],
                     vocab_size: int) -> vocab_mod.DraftVocab:
    """Rank 0 counts (or reloads what this run saved); every rank gets the same vocabulary."""
    fp = manifest["fingerprint"]
    if rt.main:
        found = vocab_mod.load(cfg.paths.train_dir, fp)
        if found is None or found.size != min(cfg.train.draft_vocab, vocab_size):
            counts = vocab_mod.count_loss_tokens(paths, vocab_size)
            found = vocab_mod.from_counts(counts, cfg.train.draft_vocab)
            vocab_mod.save(found, cfg.paths.train_dir, fp)
        d2t, t2d = found.d2t, found.t2d
    else:
        d2t, t2d = None, None
    d2t, t2d = broadcast(rt, (d2t, t2d))
    return vocab_mod.DraftVocab(d2t=d2t, t2d=t2d)


def schedule(warmup: int, total: int):
    """Linear warmup, then cosine decay to zero at the last step."""
    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / (warmup + 1)
        progress = (step - warmup) / max(1, total - warmup)
        return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))
    return factor


def epoch_plans(cfg: Config, rt: Runtime, lengths: list[int]) -> list[list[list[int]]]:
    """This rank's batches for each epoch; a fractional last epoch is cut short."""
    plans = []
    for epoch in range(math.ceil(cfg.train.epochs)):
        plan = data.plan_epoch(lengths, cfg.train.batch_tokens, cfg.train.seed, epoch,
                               rt.world)[rt.rank]
        fraction = min(1.0, cfg.train.epochs - epoch)
        plans.append(plan[:max(1, round(fraction * len(plan)))])
    return plans


class Stop:
    """SIGTERM asks for a checkpoint and a clean exit at the end of the current step."""

    def __init__(self) -> None:
        self.requested = False
        signal.signal(signal.SIGTERM, self._handle)

    def _handle(self, signum: int, frame: Any) -> None:
        self.requested = True

    def agreed(self, rt: Runtime) -> bool:
        """Ranks stop at the same step, or their collectives would no longer pair up."""
        if rt.world == 1:
            return self.requested
        flag = torch.tensor([1.0 if self.requested else 0.0], device=rt.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())


def rng_states(rt: Runtime) -> list[Any]:
    mine = {"torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state(rt.device) if rt.device.type == "cuda" else None}
    if rt.world == 1:
        return [mine]
    gathered: list[Any] = [None] * rt.world
    dist.all_gather_object(gathered, mine)
    return gathered


def restore_rng(rt: Runtime, states: list[Any]) -> None:
    if len(states) != rt.world:
        return  # another world size: the data order already differs, RNG continuity is moot
    mine = states[rt.rank]
    torch.set_rng_state(mine["torch"])
    if mine["cuda"] is not None and rt.device.type == "cuda":
        torch.cuda.set_rng_state(mine["cuda"], rt.device)


def build_drafter(draft_cfg: DraftConfig, embed: torch.Tensor, head_rows: torch.Tensor,
                  device: torch.device) -> tuple[Eagle3Drafter, torch.Tensor]:
    """The drafter to train and the teacher's head (`head_rows`: the target lm_head's rows of
    the draft vocabulary). The drafter's lm_head starts as that head: it starts out speaking in
    the target's output space and only has to learn to predict one token further. On CUDA the
    frozen target tensors are kept in bf16 (autocast computes in bf16 anyway)."""
    frozen = torch.bfloat16 if device.type == "cuda" else torch.float32
    teacher_head = head_rows.to(device, frozen)
    with torch.device(device):
        model = Eagle3Drafter(draft_cfg, embed.to(device, frozen))
    with torch.no_grad():
        model.lm_head.weight.copy_(teacher_head)
    return model, teacher_head


def make_optimizer(model: torch.nn.Module, lr: float,
                   weight_decay: float) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay,
                             fused=next(model.parameters()).is_cuda)


def train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, batch: data.Batch,
               teacher_head: torch.Tensor, ttt_steps: int,
               grad_clip: float
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One optimizer step on one batch (bf16 autocast on GPU; on CPU it measured no faster,
    and float32 keeps resumes exact). Returns the weighted total loss and, per TTT step, the
    mean loss, the count of argmaxes equal to the teacher's and of positions."""
    cuda = batch.input_ids.is_cuda
    with torch.autocast("cuda", dtype=torch.bfloat16) if cuda else nullcontext():
        teacher = loss_mod.teacher(batch.last, batch.targets, teacher_head, ttt_steps)
        loss, per_step, correct, counted = model(
            batch.input_ids, batch.aux if cuda else batch.aux.float(), teacher, ttt_steps)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    if grad_clip > 0:
        torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    optimizer.step()
    return loss.detach(), per_step, correct, counted


def truncate_metrics(path: Path, step: int) -> None:
    """A resumed run rewrites the steps after its checkpoint: drop them from the log."""
    if not path.exists():
        return
    kept = [line for line in path.read_text().splitlines()
            if line.strip() and json.loads(line)["step"] <= step]
    atomic_write_bytes(path, "".join(line + "\n" for line in kept).encode())


def train(cfg: Config, rt: Runtime) -> int:
    train_dir = cfg.paths.train_dir
    if rt.main:
        train_dir.mkdir(parents=True, exist_ok=True)
    refusal = None
    manifest = None
    if rt.main:
        try:
            manifest = checked_manifest(cfg)
        except SystemExit as exc:
            refusal = str(exc)
    refusal = broadcast(rt, refusal)
    if refusal:
        if rt.main:
            print(refusal, file=sys.stderr)
        return EXIT_REFUSED
    manifest = broadcast(rt, manifest)
    fp = manifest["fingerprint"]
    contract = manifest["contract"]
    progress = Progress(train_dir / "progress.json", fp, 0) if rt.main else None
    if progress:
        progress.write("loading")

    paths = data.sample_paths(manifest, cfg.paths.dataset_dir)
    lengths = [s["tokens"] for s in manifest["samples"]]
    target_cfg = load_target_config(cfg.target.model_path)
    if contract.get("hidden_size", target_cfg.hidden_size) != target_cfg.hidden_size:
        raise SystemExit(f"eagle3d.drafter: the dataset was captured with hidden size "
                         f"{contract['hidden_size']}, the target has {target_cfg.hidden_size}")
    draft_vocab = draft_vocabulary(cfg, rt, manifest, paths, target_cfg.vocab_size)
    embed, head = load_embedding_and_head(cfg.target.model_path)
    torch.manual_seed(cfg.train.seed)
    model, teacher_head = build_drafter(DraftConfig.from_target(target_cfg, draft_vocab.size),
                                        embed, head[draft_vocab.target_ids], rt.device)
    del embed, head
    ddp = (torch.nn.parallel.DistributedDataParallel(
        model, device_ids=[rt.device.index] if rt.device.type == "cuda" else None,
        broadcast_buffers=False) if rt.world > 1 else model)
    optimizer = make_optimizer(model, cfg.train.lr, cfg.train.weight_decay)
    plans = epoch_plans(cfg, rt, lengths)
    total = sum(len(p) for p in plans)
    if cfg.train.max_steps:
        total = min(total, cfg.train.max_steps)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer,
                                                  schedule(cfg.train.warmup_steps, total))

    step, epoch, pos = 0, 0, 0
    state = checkpoint.latest(train_dir / "checkpoints", fp) if rt.main else None
    state = broadcast(rt, state)
    if state is not None:
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        step, epoch, pos = state["step"], state["epoch"], state["pos"]
        if state["world"] != rt.world:
            pos = pos * state["world"] // rt.world
            if rt.main:
                print(f"eagle3d.drafter: resuming a {state['world']}-process run with "
                      f"{rt.world} processes: the rest of epoch {epoch} is approximated",
                      file=sys.stderr)
        restore_rng(rt, state["rng"])
        if rt.main:
            print(f"eagle3d.drafter: resuming at step {step} of {total}", file=sys.stderr)
    if rt.main:
        truncate_metrics(train_dir / "metrics.jsonl", step)
        progress.total_steps = total

    def save_checkpoint() -> None:
        rng = rng_states(rt)
        if rt.main:
            checkpoint.save(train_dir / "checkpoints", step, {
                "model": model.state_dict(), "optimizer": optimizer.state_dict(),
                "scheduler": scheduler.state_dict(), "step": step, "epoch": epoch, "pos": pos,
                "world": rt.world, "rng": rng, "manifest_fingerprint": fp,
                "draft_config": model.cfg.to_dict()})
        if rt.world > 1:
            dist.barrier()

    stop = Stop()
    started, started_step, last_log = time.monotonic(), step, 0.0
    metrics = open(train_dir / "metrics.jsonl", "a") if rt.main else None
    while step < total:
        tick = time.monotonic()
        batch = data.load_batch(paths, plans[epoch][pos], rt.device)
        _, per_step, correct, counted = train_step(ddp, optimizer, batch, teacher_head,
                                                   cfg.train.ttt_steps, cfg.train.grad_clip)
        lr = scheduler.get_last_lr()[0]
        scheduler.step()
        step, pos = step + 1, pos + 1
        if pos == len(plans[epoch]):
            epoch, pos = epoch + 1, 0
        stats = torch.cat([per_step.float() * counted, correct.float(), counted.float(),
                           torch.tensor([float(batch.tokens)], device=rt.device)])
        if rt.world > 1:
            dist.all_reduce(stats)
        k = cfg.train.ttt_steps
        n = stats[2 * k:3 * k].clamp(min=1)
        step_loss = (stats[:k] / n).tolist()
        acc = (stats[k:2 * k] / n).tolist()
        elapsed = time.monotonic() - tick
        tokens_per_s = stats[-1].item() / max(elapsed, 1e-9)
        if rt.main:
            weighted = sum(LOSS_DECAY ** i * v for i, v in enumerate(step_loss))
            done_epochs = epoch + pos / len(plans[epoch]) if epoch < len(plans) else len(plans)
            row = {"step": step, "epoch": done_epochs,
                   "loss": weighted, "loss_per_step": step_loss, "acc": acc,
                   "tokens_per_s": tokens_per_s, "lr": lr}
            metrics.write(json.dumps(row) + "\n")
            metrics.flush()
            rate = (time.monotonic() - started) / (step - started_step)
            progress.write("training", force=step == total, step=step, epoch=row["epoch"],
                           loss=weighted, acc=acc, tokens_per_s=tokens_per_s,
                           eta_s=rate * (total - step))
            if time.monotonic() - last_log > 10 or step == total:
                last_log = time.monotonic()
                print(f"step {step}/{total} loss {weighted:.3f} acc "
                      f"{' '.join(f'{a:.2f}' for a in acc)} {tokens_per_s:.0f} tok/s",
                      file=sys.stderr, flush=True)
        stopping = stop.agreed(rt)
        if step % cfg.train.checkpoint_every == 0 or stopping or step == total:
            save_checkpoint()
        if stopping:
            if rt.main:
                print(f"eagle3d.drafter: stopped by SIGTERM at step {step}, checkpoint saved",
                      file=sys.stderr)
            return 0
    if metrics:
        metrics.close()
    # The last step's checkpoint is on disk and the export is atomic: a stop has nothing left
    # to wait for, and a trainer whose daemon was killed must not go on exporting beside the
    # next daemon's trainer. The next trainer resumes at the last step and exports again.
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    if rt.main:
        progress.write("exporting", step=step, epoch=float(len(plans)))
        export(model, draft_vocab, contract, train_dir / "export")
        plot_metrics(train_dir / "metrics.jsonl", train_dir / "metrics.png")
        last = json.loads((train_dir / "metrics.jsonl").read_text().splitlines()[-1]) \
            if (train_dir / "metrics.jsonl").stat().st_size else {}
        progress.write("done", step=step, epoch=float(len(plans)), loss=last.get("loss"),
                       acc=last.get("acc", []), eta_s=0.0)
    if rt.world > 1:
        dist.barrier()
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m eagle3d.drafter.train",
                                     description="Train the EAGLE-3 drafter (run under torchrun).")
    parser.add_argument("-c", "--config", required=True, help="the eagle3d TOML config")
    args = parser.parse_args(argv)
    # If torchrun dies (with the daemon, by kill -9), checkpoint and stop instead of lingering.
    die_with_parent(signal.SIGTERM)
    try:
        cfg = load_config(args.config)
    except ConfigError as exc:
        print(f"eagle3d.drafter: {exc}", file=sys.stderr)
        return EXIT_REFUSED
    rt = init_runtime(cfg)
    try:
        return train(cfg, rt)
    finally:
        if rt.world > 1 and dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
