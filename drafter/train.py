"""Train the EAGLE-3 drafter: `python -m eagle3d.drafter.train -c CONFIG`, started by
`eagle3d.drafter.launch` for several processes on one node and by torchrun on several nodes.

Reads the verified dataset (refusing one that no longer matches the ledger or a target that is
not the dataset's, with the exit codes of statemachine/entry.py, also written to refusal.json
since torchrun turns them into 1 (the launcher keeps them); a file changed since verify passed it, by its size and time
at the start or by its checksum as the reader reads it, is refused naming its sample, which the
daemon sends back to verify), builds
or reloads the draft vocabulary, trains with the training-time test under DDP, checkpoints every
[train] checkpoint_every steps and on SIGTERM, resumes from the last checkpoint of the same
manifest, and ends with `export/` (SGLang layout), `metrics.jsonl` and `metrics.png` in the
train folder. `progress.json` tells the daemon where it is.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from eagle3d.dataset import contract as contract_mod, dumpformat, shard_union
from eagle3d.target import identity
from eagle3d.target.loading import cpu_computes_bf16, pick_device
from eagle3d.target.loading import load_config as load_target_config
from eagle3d.drafter import checkpoint, data, loss as loss_mod, reader, vocab as vocab_mod
from eagle3d.drafter.export import export
from eagle3d.drafter.model import DraftConfig, Eagle3Drafter
from eagle3d.drafter.plots import plot_metrics
from eagle3d.drafter.reporting import Reporter, StepFigures
from eagle3d.drafter.target_weights import load_embedding_and_head
from eagle3d.statemachine import layout, train_files
from eagle3d.statemachine import manifest as manifest_mod
from eagle3d.statemachine.atomic import atomic_write_bytes
from eagle3d.statemachine.config_schema import Config
from eagle3d.statemachine.entry import OK, ContractMismatch, DatasetChanged, Refusal, child_main
from eagle3d.statemachine.ledger import Ledger, LedgerError
from eagle3d.statemachine.lifecycle import die_with_parent

log = logging.getLogger("eagle3d.trainer")


@dataclass(frozen=True)
class Runtime:
    rank: int
    world: int
    local_rank: int
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
        # Minutes of compiling that a restarted or resumed trainer then skips.
        cache = layout.compile_cache_dir(cfg.paths.train_dir)
        os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(cache))
        os.environ.setdefault("TRITON_CACHE_DIR", str(cache / "triton"))
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
        torch.set_num_threads(cfg.train.threads or max(1, (os.cpu_count() or 1) // local_world))
    if world > 1:
        # One node's ranks meet in the launcher's FileStore (drafter/launch.py), several nodes'
        # through torchrun's environment.
        store = os.environ.get(layout.RENDEZVOUS_ENV)
        dist.init_process_group("nccl" if kind == "cuda" else "gloo",
                                init_method=f"file://{store}" if store else "env://",
                                rank=rank, world_size=world)
    return Runtime(rank, world, local_rank, local_world, device)


def broadcast(rt: Runtime, value: Any) -> Any:
    """Rank 0's value on every rank."""
    if rt.world == 1:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def checked_manifest(cfg: Config) -> dict[str, Any]:
    """The dataset manifest, only if it names exactly the ledger's verified samples and the
    target is the model the dataset was captured with."""
    try:
        with Ledger(layout.ledger(cfg.paths.state_dir), readonly=True) as ledger:
            manifest = manifest_mod.read(cfg.paths.dataset_dir)
            manifest_mod.check(manifest, ledger)
    except (manifest_mod.ManifestMismatch, LedgerError) as exc:
        raise Refusal(f"refusing to train: {exc}") from None
    # A shard's own manifest may be empty (an empty share); what is trained may not.
    trained = shard_union.trained_union(cfg, manifest) if cfg.shard.count > 1 else manifest
    if not trained["samples"]:
        raise Refusal("refusing to train: the manifest lists no samples")
    return trained


def read_dump(path: Path) -> tuple[dumpformat.DumpHeader, os.stat_result]:
    """A dataset file's header and its stat, of one open file; Refusal naming it."""
    try:
        fd = dumpformat.open_dump(path)
        try:
            return dumpformat.header_of(fd), os.fstat(fd)
        finally:
            os.close(fd)
    except (OSError, dumpformat.DumpError) as exc:
        raise Refusal(f"refusing to train: {path}: {exc}") from None


def check_this_node(cfg: Config, rt: Runtime, manifest: dict[str, Any]) -> None:
    """What each rank checks with its own node's files against node 0's manifest: the target
    weights it loads the embedding and head from, and the headers of its share of the node's
    dataset files (the node's ranks together read every file's header): sample, contract and
    token count, then each file's size and modification time against verify's (DatasetChanged,
    naming every changed file of the share: the daemon sends them all back to verify at once)."""
    identity.check(manifest["contract"], cfg.target.model_path, cfg.target.model)
    share = slice(rt.local_rank, None, rt.local_world)
    paths = data.sample_paths(manifest, shard_union.samples_root(cfg))[share]
    changed: list[tuple[str, str]] = []
    for sample, path in zip(manifest["samples"][share], paths):
        header, st = read_dump(path)
        wanted = (sample["id"], manifest["contract"]["fingerprint"])
        if (header.sample_id, header.contract) != wanted:
            raise Refusal(f"refusing to train: {path} holds sample {header.sample_id} of contract "
                          f"{header.contract}, the manifest lists sample {wanted[0]} of contract "
                          f"{wanted[1]}")
        # The batches are planned by the manifest's counts and read by the header's.
        if sample.get("tokens") != header.tokens:
            raise Refusal(f"refusing to train: {path} holds {header.tokens} tokens, the manifest "
                          f"lists {sample.get('tokens')!r} for sample {sample['id']}")
        why = manifest_mod.file_changed(sample, st)
        if why:
            changed.append((sample["id"], f"{path} ({why})"))
    if changed:
        named = "; ".join(said for _, said in changed[:3])
        more = f" and {len(changed) - 3} more" if len(changed) > 3 else ""
        raise DatasetChanged(f"refusing to train: {len(changed)} dataset file(s) changed since "
                             f"verify passed them: {named}{more}", [sid for sid, _ in changed])


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


def epoch_plans(cfg: Config, world: int, rank: int,
                lengths: list[int]) -> list[list[data.Planned]]:
    """Rank `rank`'s batches for each epoch of a `world`-process run; a fractional last epoch
    is cut short. Every rank's epoch has as many batches: one step takes one of each."""
    plans = []
    for epoch in range(math.ceil(cfg.train.epochs)):
        plan = data.plan_epoch(lengths, cfg.train.batch_tokens, cfg.train.seed, epoch,
                               world)[rank]
        fraction = min(1.0, cfg.train.epochs - epoch)
        plans.append(plan[:max(1, round(fraction * len(plan)))])
    return plans


class Stop:
    """SIGTERM asks for a checkpoint and a clean exit. The request travels with a step's figures
    (StepFigures): every rank reads the same sum of them, so all stop at the same step, or
    their collectives would no longer pair up."""

    def __init__(self) -> None:
        self.requested = False
        signal.signal(signal.SIGTERM, self._handle)

    def _handle(self, signum: int, frame: Any) -> None:
        self.requested = True


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


def data_parallel(model: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    """The model under DDP, as every rank trains it (the process group is up). The frozen
    embedding is a buffer that every rank loads alike: nothing to broadcast at each step."""
    return torch.nn.parallel.DistributedDataParallel(
        model, device_ids=[device.index] if device.type == "cuda" else None,
        broadcast_buffers=False)


def make_optimizer(model: torch.nn.Module, lr: float,
                   weight_decay: float) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay,
                             fused=next(model.parameters()).is_cuda)


def train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, batch: data.Batch,
               teacher_head: torch.Tensor, ttt_steps: int,
               grad_clip: float
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One optimizer step on one batch, its matmuls in bf16 (autocast) on a GPU and on a CPU
    with bf16 units. Returns the weighted total loss and, per TTT step, the mean loss, the
    count of argmaxes equal to the teacher's and of positions."""
    # On the 2-core VM's CPU the demo trains 1.6x faster so (2026-12-03, etc/demo.toml).
    bf16 = batch.input_ids.is_cuda or cpu_computes_bf16()
    with torch.autocast(batch.input_ids.device.type, dtype=torch.bfloat16, enabled=bf16):
        teacher = loss_mod.teacher(batch.last, batch.targets, teacher_head, ttt_steps)
        # Under autocast the stored states go in as they are; float32 weights need float32.
        loss, per_step, correct, counted = model(
            batch.input_ids, batch.aux if bf16 else batch.aux.float(), teacher, ttt_steps)
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


class Run:
    """What one training run holds: built by `setup`, moved by `resume` and `train_loop`,
    ended by `finish`."""

    def __init__(self, cfg: Config, rt: Runtime, manifest: dict[str, Any]) -> None:
        self.cfg, self.rt = cfg, rt
        self.fingerprint: str = manifest["fingerprint"]
        self.contract: dict[str, Any] = manifest["contract"]
        self.dir = cfg.paths.train_dir
        self.paths = data.sample_paths(manifest, shard_union.samples_root(cfg))
        self.lengths = [s["tokens"] for s in manifest["samples"]]
        # What verify recorded of each file: the reader checks every file it reads against it.
        self.recorded = [(s["id"], s["checksum"]) for s in manifest["samples"]]
        self.progress = train_files.ProgressWriter(self.dir, self.fingerprint) if rt.main else None
        self.step = 0  # where it stands in the data too: data.position
        # Why this training began at step 0 beside a checkpoint it could not resume (a raised
        # [data] limit), kept in its own checkpoints: the operator is told until it is done.
        self.started_over: str | None = None


def agreed_job(cfg: Config, rt: Runtime) -> None:
    """Every node trains node 0's job. A node whose [train] settings differ from node 0's (an
    outdated copy of the config) would plan other batches and hang the collectives: every rank
    refuses instead, naming the nodes and the keys."""
    if rt.world == 1:
        return
    # node_rank differs by design; threads is a CPU setting of each machine.
    mine = cfg.train._replace(node_rank=0, threads=0)._asdict()
    theirs = broadcast(rt, mine)
    differing = sorted(key for key in mine if mine[key] != theirs[key])
    everyone: list[Any] = [None] * rt.world
    dist.all_gather_object(everyone, (cfg.train.node_rank, differing))
    bad = {node: keys for node, keys in everyone if keys}
    if bad:
        listed = "; ".join(f"node {node}: {', '.join(keys)}" for node, keys in sorted(bad.items()))
        raise Refusal(f"refusing to train: [train] settings differ from node 0's ({listed}); "
                      "give every node a copy of node 0's config in force "
                      "(<state_dir>/config.toml) with its own node_rank")


def agreed_manifest(cfg: Config, rt: Runtime) -> dict[str, Any]:
    """Rank 0 checks the manifest against the ledger, every rank checks its node's target and
    dataset against it; every rank gets the manifest, or the same refusal naming the node."""
    manifest, refusal = None, None
    if rt.main:
        try:
            manifest = checked_manifest(cfg)
        except Refusal as exc:
            refusal = exc
    refusal = broadcast(rt, refusal)
    if refusal is not None:
        raise refusal
    manifest = broadcast(rt, manifest)
    mine = None
    try:
        check_this_node(cfg, rt, manifest)
    except Refusal as exc:
        mine = exc
    gathered = [(cfg.train.node_rank, mine)]
    if rt.world > 1:
        gathered = [None] * rt.world
        dist.all_gather_object(gathered, (cfg.train.node_rank, mine))
    refused = [(node, exc) for node, exc in gathered if exc is not None]
    if refused:
        node, exc = refused[0]
        exc.args = (f"node {node} of {cfg.train.nnodes}: {exc}",)  # keeps what else it holds
        raise exc
    return manifest


def setup(cfg: Config, rt: Runtime) -> Run:
    """The model, optimizer, schedule and data plan of a run, from the checked manifest."""
    if rt.main:
        cfg.paths.train_dir.mkdir(parents=True, exist_ok=True)
    if rt.local_rank == 0:
        log.info("node %d of %d: ranks %d to %d of %d on %s", cfg.train.node_rank,
                 cfg.train.nnodes, rt.rank, rt.rank + rt.local_world - 1, rt.world, rt.device)
    agreed_job(cfg, rt)
    manifest = agreed_manifest(cfg, rt)
    run = Run(cfg, rt, manifest)
    if run.progress:
        run.progress.write(train_files.LOADING)
    target_cfg = load_target_config(cfg.target.model_path)
    if run.contract.get("hidden_size", target_cfg.hidden_size) != target_cfg.hidden_size:
        raise ContractMismatch(f"the dataset was captured with hidden size "
                               f"{run.contract['hidden_size']}, the target has "
                               f"{target_cfg.hidden_size}")
    run.draft_vocab = draft_vocabulary(cfg, rt, manifest, run.paths, target_cfg.vocab_size)
    embed, head = load_embedding_and_head(cfg.target.model_path)
    torch.manual_seed(cfg.train.seed)
    run.model, run.teacher_head = build_drafter(
        DraftConfig.from_target(target_cfg, run.draft_vocab.size, cfg.train.intermediate_size),
        embed, head[run.draft_vocab.target_ids], rt.device)
    del embed, head
    run.ddp = data_parallel(run.model, rt.device) if rt.world > 1 else run.model
    run.optimizer = make_optimizer(run.model, cfg.train.lr, cfg.train.weight_decay)
    run.plans = epoch_plans(cfg, rt.world, rt.rank, run.lengths)
    run.total = sum(len(p) for p in run.plans)
    if cfg.train.max_steps:
        run.total = min(run.total, cfg.train.max_steps)
    run.scheduler = torch.optim.lr_scheduler.LambdaLR(
        run.optimizer, schedule(cfg.train.warmup_steps, run.total))
    if run.progress:
        run.progress.total_steps = run.total
    return run


def resume(run: Run) -> None:
    """Continue from the last checkpoint of this manifest, if there is one."""
    rt = run.rt
    state, why = (checkpoint.latest(layout.checkpoint_dir(run.dir), run.fingerprint,
                                    len(run.lengths), run.model.cfg.to_dict(),
                                    run.model.state_dict(), run.cfg.train)
                  if rt.main else (None, None))
    state = broadcast(rt, state)
    run.started_over = why if state is None else state.get("started_over")
    if run.progress:
        run.progress.started_over = run.started_over
    if state is not None:
        run.model.load_state_dict(state["model"])
        run.optimizer.load_state_dict(state["optimizer"])
        run.scheduler.load_state_dict(state["scheduler"])
        run.step = state["step"]
        if state["world"] != rt.world:
            # Ranks take the epoch's batches in turn: pos·world batches of it are trained, pos
            # counted in the saved world's plans. A step is a round of this world's batches:
            # the step count and the schedule follow.
            epoch, pos = data.position(epoch_plans(run.cfg, state["world"], 0, run.lengths),
                                       run.step)
            pos = pos * state["world"] // rt.world
            run.step = sum(len(plan) for plan in run.plans[:epoch]) + pos
            run.scheduler.last_epoch = run.step
            if rt.main:
                log.warning("resuming a %d-process run with %d processes: epoch %d goes on "
                            "from batch %d of its order, as step %d", state["world"], rt.world,
                            epoch, pos * rt.world, run.step)
        restore_rng(rt, state["rng"])
        if rt.main:
            log.info("resuming at step %d of %d", run.step, run.total)
    if rt.main:
        truncate_metrics(layout.metrics_file(run.dir), run.step)


def save_checkpoint(run: Run) -> None:
    rng = rng_states(run.rt)
    if run.rt.main:
        checkpoint.save(layout.checkpoint_dir(run.dir), run.step, {
            "model": run.model.state_dict(), "optimizer": run.optimizer.state_dict(),
            "scheduler": run.scheduler.state_dict(), "step": run.step,
            "world": run.rt.world, "rng": rng,
            "manifest_fingerprint": run.fingerprint, "samples": len(run.lengths),
            "started_over": run.started_over, "draft_config": run.model.cfg.to_dict(),
            "schedule": checkpoint.schedule(run.cfg.train)})
    if run.rt.world > 1:
        dist.barrier()


def train_loop(run: Run) -> bool:
    """Step until the last step or an agreed SIGTERM (checkpointed); True when stopped early."""
    cfg, rt = run.cfg, run.rt
    stop = Stop()
    reporter = Reporter(cfg.train.ttt_steps, run.total, run.step,
                        layout.metrics_file(run.dir) if rt.main else None, run.progress,
                        dumpformat.bytes_per_token(run.model.cfg.target_hidden_size,
                                                   contract_mod.dump_dtype(run.contract)
                                                   or "bfloat16"),
                        layout.tensorboard_dir(run.dir)
                        if cfg.train.report_to == "tensorboard" else None)
    # This rank's batches from where the run stands to its last step.
    loader = reader.batches(run.paths, data.remaining(run.plans, run.step, run.total - run.step),
                            rt.device, answers_only=cfg.train.loss_on == "answers",
                            recorded=run.recorded)
    pending: StepFigures | None = None  # the step before, not yet reported
    try:
        while run.step < run.total:
            started = time.monotonic()
            batch = next(loader)
            waited = time.monotonic() - started
            _, per_step, correct, counted = train_step(run.ddp, run.optimizer, batch,
                                                       run.teacher_head, cfg.train.ttt_steps,
                                                       cfg.train.grad_clip)
            lr = run.scheduler.get_last_lr()[0]
            run.scheduler.step()
            run.step += 1
            at, pos = data.position(run.plans, run.step)
            epoch = at + pos / len(run.plans[at]) if at < len(run.plans) else float(at)
            figures = StepFigures.send(rt.device, rt.world, run.step, epoch, lr, started,
                                       per_step, correct, counted, batch.tokens,
                                       stop.requested, waited)
            stopping = pending is not None and reporter.report(pending)
            pending = figures
            checkpoint_due = run.step % cfg.train.checkpoint_every == 0 or run.step == run.total
            # On a CPU the step has run by now: nothing to overlap. A checkpoint's step is in
            # the metrics before it: a resumed run keeps them.
            if figures.copied is None or stopping or checkpoint_due:
                stopping = reporter.report(figures) or stopping
                pending = None
            if stopping or checkpoint_due:
                save_checkpoint(run)
                if rt.main:  # the curves so far, for whoever looks while it trains
                    plot_metrics(layout.metrics_file(run.dir), layout.metrics_plot(run.dir))
            if stopping:
                if rt.main:
                    log.info("stopped by SIGTERM at step %d, checkpoint saved", run.step)
                return True
    finally:
        loader.close()
        reporter.close()
    return False


def finish(run: Run) -> None:
    """Export the drafter in SGLang's layout, plot the curves, and say it is done."""
    # The last step's checkpoint is on disk and the export is atomic: a stop has nothing left
    # to wait for, and a trainer whose daemon was killed must not go on exporting beside the
    # next daemon's trainer. The next trainer resumes at the last step and exports again.
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    if run.progress is not None:
        epochs = float(len(run.plans))
        run.progress.write(train_files.EXPORTING, step=run.step, epoch=epochs)
        export(run.model, run.draft_vocab, run.contract, layout.export_dir(run.dir),
               run.cfg.train.ttt_steps)
        metrics = layout.metrics_file(run.dir)
        plot_metrics(metrics, layout.metrics_plot(run.dir))
        last = json.loads(metrics.read_text().splitlines()[-1]) if metrics.stat().st_size else {}
        run.progress.write(train_files.DONE, step=run.step, epoch=epochs, loss=last.get("loss"),
                           acc=last.get("acc", []), eta_s=0.0)
    if run.rt.world > 1:
        dist.barrier()


def train(cfg: Config, rt: Runtime) -> int:
    run = setup(cfg, rt)
    resume(run)
    if not train_loop(run):
        finish(run)
    return OK


def _run(cfg: Config, args: argparse.Namespace) -> int:
    rt = init_runtime(cfg)
    try:
        return train(cfg, rt)
    except Refusal as exc:
        # Under torchrun (several nodes) the exit code reaches the daemon as 1: the file says
        # what it was.
        train_files.write_refusal(cfg.paths.train_dir, train_files.Refused(
            exc.code, str(exc), exc.samples))
        raise
    finally:
        if rt.world > 1 and dist.is_initialized():
            dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    # If the launcher or torchrun dies (with the daemon, by kill -9), checkpoint and stop
    # instead of lingering.
    die_with_parent(signal.SIGTERM)
    return child_main("trainer", "Train the EAGLE-3 drafter (one process, or a rank started by "
                      "eagle3d.drafter.launch or torchrun).", _run, argv)


if __name__ == "__main__":
    sys.exit(main())
