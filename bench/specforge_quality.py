"""Drafter quality at equal steps: ours against SpecForge's offline EAGLE-3 trainer (issue 57).

Two drafters train on a config's verified dataset, N optimizer steps each, one after the other in
one process, and `python -m eagle3d.drafter.evaluate` (what `eagle3ctl eval` runs) measures both
on the config's held-out [eval] prompts with its [eval] drafting (a chain of [eval] steps):

- ours: drafter/train.py's build_drafter, make_optimizer, train_step and schedule (linear warmup,
  cosine to zero at the last step), as its train_loop runs them;
- SpecForge's: bench/gpu_train.py's SpecForgeTrainer (OnlineEagle3Model, TargetHead,
  Eagle3TrainStrategy.forward_loss, BF16Optimizer with its "cosine" scheduler).

Both start from the same weights (the trainer's, seeded by [train] seed), keep the draft's shape
(the target's, [train] intermediate_size) and our draft vocabulary, and train on the same batches
in the same order (the trainer's epoch plans, read by drafter/reader.py), with the same lr,
warmup, weight decay, gradient clipping, TTT steps and loss decay. Each is written in our export
format (SGLang's layout); SpecForge's weights keep our names (gpu_train's mapping), read from its
fp32 masters. Judged by, printed last,

    ours / SpecForge acceptance length at N equal steps   (goal >= 1.0)

    python bench/specforge_quality.py -c CONFIG --steps 200

On CPU SpecForge's Triton loss kernel cannot run ("0 active drivers"): its own reference formula
stands in (gpu_train.cpu_reference_loss), and attention is SDPA; on a GPU it runs as shipped, with
flex attention. `--eval-limit` reads fewer [eval] conversations (the tests).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
import torch.nn.functional as F

from gpu_train import (REPO, Batch, SpecForgeSchedule, SpecForgeTrainer, Target, bench_device,
                       specforge_missing, temporary_folder)

from eagle3d.drafter import data, reader
from eagle3d.drafter.export import export
from eagle3d.drafter.model import DraftConfig, Eagle3Drafter
from eagle3d.drafter.target_weights import load_embedding_and_head
from eagle3d.drafter.train import (Runtime, build_drafter, checked_manifest, draft_vocabulary,
                                   epoch_plans, make_optimizer, schedule, train_step)
from eagle3d.drafter.vocab import DraftVocab
from eagle3d.dataset import shard_union
from eagle3d.statemachine.config_schema import Config
from eagle3d.statemachine.config_validation import load_config
from eagle3d.target.loading import load_config as load_target_config

LOG_EVERY = 50  # steps between progress lines


@dataclass
class Setup:
    """What both trainers share: the dataset's files and plan, the draft's shape and vocabulary,
    the target's embedding and head, and the starting weights."""
    cfg: Config
    contract: dict[str, Any]
    paths: list[Path]
    recorded: list[tuple[str, str]]
    plan: list[data.Planned]
    draft: DraftConfig
    vocab: DraftVocab
    embed: torch.Tensor
    head: torch.Tensor
    weights: dict[str, torch.Tensor]


@dataclass
class Trained:
    name: str
    seconds: float
    tokens: int
    lrs: list[float]
    losses: list[float]  # per step, the first TTT step's, each trainer's own normalisation


def prepare(cfg: Config, steps: int, device: torch.device) -> Setup:
    """The verified dataset (refused as the trainer refuses it), the first `steps` batches of
    the trainer's plan, and the trainer's starting drafter."""
    manifest = checked_manifest(cfg)
    paths = data.sample_paths(manifest, shard_union.samples_root(cfg))
    plans = epoch_plans(cfg, 1, 0, [s["tokens"] for s in manifest["samples"]])
    plan = list(data.remaining(plans, 0, steps))
    if len(plan) < steps:
        raise SystemExit(f"the config's [train] epochs plan {len(plan)} steps, fewer than "
                         f"--steps {steps}: raise [train] epochs")
    target_cfg = load_target_config(cfg.target.model_path)
    cfg.paths.train_dir.mkdir(parents=True, exist_ok=True)  # the vocabulary is kept there
    vocab = draft_vocabulary(cfg, Runtime(0, 1, 0, 1, device), manifest, paths,
                             target_cfg.vocab_size)
    embed, head = load_embedding_and_head(cfg.target.model_path)
    draft = DraftConfig.from_target(target_cfg, vocab.size, cfg.train.intermediate_size)
    torch.manual_seed(cfg.train.seed)  # as train.setup seeds it
    model, _ = build_drafter(draft, embed, head[vocab.target_ids], device)
    weights = {name: w.detach().float().cpu().clone()
               for name, w in model.served_weights().items()}
    return Setup(cfg, manifest["contract"], paths,
                 [(s["id"], s["checksum"]) for s in manifest["samples"]], plan, draft, vocab,
                 embed, head, weights)


def batches(s: Setup, device: torch.device) -> Iterator[data.Batch]:
    return reader.batches(s.paths, iter(s.plan), device,
                          answers_only=s.cfg.train.loss_on == "answers", recorded=s.recorded)


def specforge_batch(batch: data.Batch) -> Batch:
    """Our batch as SpecForge reads it. Our targets[t]: token t+1 is learned, by the teacher at
    index t (the target's final state there). SpecForge's TargetHead.preprocess shifts the
    states one to the left and its loss mask not: its position t learns the state at t+1 where
    loss_mask[t]. So loss_mask[t] = targets[t+1]: both learn the same indices at every TTT
    step."""
    mask = F.pad(batch.targets[:, 1:], (0, 1)).long().to(batch.input_ids.device)
    return Batch(batch.input_ids, batch.aux.bfloat16(), batch.last.bfloat16(), mask)


def progress(name: str, step: int, total: int, started: float, loss: float) -> None:
    if step % LOG_EVERY == 0 or step == total:
        print(f"  {name}: step {step}/{total}, loss {loss:.3f}, "
              f"{time.monotonic() - started:.0f} s", file=sys.stderr, flush=True)


def train_ours(s: Setup, device: torch.device, out: Path) -> Trained:
    """drafter/train.py's model, optimizer, schedule and step, as train_loop runs them."""
    t = s.cfg.train
    torch.manual_seed(t.seed)
    model, teacher_head = build_drafter(s.draft, s.embed, s.head[s.vocab.target_ids], device)
    model.load_served_weights(s.weights)
    optimizer = make_optimizer(model, t.lr, t.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule(t.warmup_steps,
                                                                      len(s.plan)))
    lrs, losses, tokens, started = [], [], 0, time.monotonic()
    for step, batch in enumerate(batches(s, device), 1):
        lrs.append(scheduler.get_last_lr()[0])
        _, per_step, _, _ = train_step(model, optimizer, batch, teacher_head, t.ttt_steps,
                                       t.grad_clip)
        scheduler.step()
        losses.append(float(per_step[0]))
        tokens += batch.tokens
        progress("ours", step, len(s.plan), started, losses[-1])
    seconds = time.monotonic() - started
    export(model, s.vocab, s.contract, out, t.ttt_steps)
    return Trained("ours", seconds, tokens, lrs, losses)


def train_specforge(s: Setup, device: torch.device, out: Path, backend: str) -> Trained:
    """SpecForge's step on the same batches; its weights then exported as ours."""
    t = s.cfg.train
    torch.manual_seed(t.seed)
    trainer = SpecForgeTrainer(
        s.draft, Target(s.embed.bfloat16(), s.head.bfloat16(), s.vocab), s.weights, t.lr,
        t.ttt_steps, device, backend, temporary_folder("eagle3d-sfq-"),
        SpecForgeSchedule("cosine", len(s.plan), t.warmup_steps), t.weight_decay, t.grad_clip)
    lrs, losses, tokens, started = [], [], 0, time.monotonic()
    for step, batch in enumerate(batches(s, device), 1):
        lrs.append(trainer.lr)
        losses.append(float(trainer.train(specforge_batch(batch))[0]))
        tokens += batch.tokens
        progress("specforge", step, len(s.plan), started, losses[-1])
    seconds = time.monotonic() - started
    model = Eagle3Drafter(s.draft, s.embed)
    model.load_served_weights(trainer.served_weights())
    export(model, s.vocab, s.contract, out, t.ttt_steps)
    return Trained("specforge", seconds, tokens, lrs, losses)


def evaluate(config: Path, drafter: Path, limit: int | None, threads: int) -> dict[str, Any]:
    """`python -m eagle3d.drafter.evaluate` on the export, as `eagle3ctl eval` runs it."""
    report = drafter.with_suffix(".eval.json")
    argv = [sys.executable, "-m", "eagle3d.drafter.evaluate", "-c", str(config), "--drafter",
            str(drafter), "--out", str(report)]
    if limit is not None:
        argv += ["--limit", str(limit)]
    # Where this process found eagle3d (gpu_train.ensure_eagle3d's mapping on a bare machine).
    found = Path(importlib.import_module("eagle3d").__path__[0]).parent
    env = {**os.environ, "OMP_NUM_THREADS": str(threads),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(found),
                                                       os.environ.get("PYTHONPATH")]))}
    done = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, env=env)
    # DIVERGED (output not the target's greedy decoding) still writes its report: judged below.
    if not report.exists():
        raise SystemExit(f"evaluating {drafter} failed ({done.returncode}):\n"
                         f"{done.stderr[-3000:]}")
    return json.loads(report.read_text())


def describe(name: str, trained: Trained, report: dict[str, Any]) -> str:
    low, high = report["acceptance_length_ci95"]
    return (f"{name:<10} acceptance length {report['acceptance_length']:.3f} "
            f"(95% {low:.3f}-{high:.3f}); per position "
            + " / ".join(f"{a:.3f}" for a in report["per_position_acceptance"])
            + "; teacher-forced per step "
            + " / ".join(f"{a:.3f}" for a in report["teacher_forced_accuracy"])
            + f"; identical to greedy: {report['identical_to_greedy']}; trained "
              f"{trained.tokens} tokens in {trained.seconds:.0f} s")


def lr_gap(a: list[float], b: list[float]) -> float:
    """The largest gap between two lr schedules, relative to the larger's peak (0 when empty)."""
    return max((abs(x - y) / max(*a, *b) for x, y in zip(a, b)), default=0.0)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-c", "--config", type=Path, required=True,
                        help="an eagle3d config whose dataset is verified")
    parser.add_argument("--steps", type=int, default=200, help="optimizer steps of each")
    parser.add_argument("--eval-limit", type=int,
                        help="[eval] conversations read (default: [eval] limit)")
    parser.add_argument("--out", type=Path, help="where the exports go (default: a temporary "
                                                  "folder)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--threads", type=int, default=2, help="torch threads on CPU")
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error("--steps must be >= 1")
    missing = specforge_missing()
    if missing:
        print(f"SpecForge is not importable ({missing}): nothing to compare with",
              file=sys.stderr)
        return 2
    device = bench_device(args.device)
    if device.type == "cpu":
        torch.set_num_threads(args.threads)
    backend = "flex_attention" if device.type == "cuda" else "sdpa"
    cfg = load_config(args.config)
    out = args.out or temporary_folder("eagle3d-sfq-out-")
    s = prepare(cfg, args.steps, device)
    read = sum(len(p.indices) for p in s.plan)
    t = cfg.train
    print(f"{len(s.paths)} verified samples; {args.steps} steps of <= {t.batch_tokens} tokens "
          f"({read} samples read, {read / len(s.paths):.2f} epochs); draft hidden "
          f"{s.draft.hidden_size}, intermediate {s.draft.intermediate_size}, vocab "
          f"{s.draft.draft_vocab_size} of {s.draft.vocab_size}; TTT {t.ttt_steps}, lr {t.lr:g}, "
          f"warmup {t.warmup_steps}, clip {t.grad_clip:g}, loss on {t.loss_on}; {device}, "
          f"SpecForge {backend}", flush=True)
    arms: list[tuple[str, Callable[[Path], Trained]]] = [
        ("ours", lambda o: train_ours(s, device, o)),
        ("specforge", lambda o: train_specforge(s, device, o, backend))]
    trained, reports = {}, {}
    for name, train in arms:
        trained[name] = train(out / name)
    for name, _ in arms:
        reports[name] = evaluate(args.config, out / name, args.eval_limit, args.threads)
    ours, theirs = reports["ours"], reports["specforge"]
    d = ours["drafting"]
    lrs, warm = {name: t.lrs for name, t in trained.items()}, cfg.train.warmup_steps
    print(f"evaluated on {ours['prompts']} held-out prompts, {d['steps']} draft steps, top-k "
          f"{d['topk']} ({'chain' if d['topk'] == 1 else 'tree'}), up to "
          f"{cfg.eval.max_new_tokens} new tokens; lr schedules differ by at most "
          f"{lr_gap(lrs['ours'], lrs['specforge']):.1%} of the peak in the warmup, "
          f"{lr_gap(lrs['ours'][warm:], lrs['specforge'][warm:]):.1%} after it")
    for name in trained:
        print(describe(name, trained[name], reports[name]))
    ratio = ours["acceptance_length"] / theirs["acceptance_length"]
    print(f"ours / SpecForge acceptance length at {args.steps} equal steps: {ratio:.3f}")
    return 0 if ours["identical_to_greedy"] and theirs["identical_to_greedy"] else 1


if __name__ == "__main__":
    sys.exit(main())
