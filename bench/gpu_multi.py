"""Drafter training on two GPUs against one, and the trainer's resume after losing a rank.

Scaling: our trainer (bench/gpu_train.py's, under DDP as drafter/train.py runs it) trains the
same random batches under torchrun with one process and with two, one GPU each (NCCL), one
batch of --seq-len tokens per process per step; the runs alternate 1, 2, 2, 1 so both share the
noise. Resume: drafter/train.py itself, with two processes, on a random dataset written as the
pipeline leaves it (a random target, dumps, a ledger where every sample is verified, the
manifest); rank 1 is killed with SIGKILL after the first checkpoint, the trainer is started
again as the daemon restarts it, and must resume from that checkpoint and finish. Judged by

    ratio = tokens/s on 2 GPUs / tokens/s on 1 GPU   (goal: >= 1.85)

printed last. Needs no network. `--tiny --device cpu` runs the same over gloo on CPU.

    python bench/gpu_multi.py                        # on a host with 2 GPUs
    python bench/gpu_multi.py --shape kimi-k2.5      # the Kimi-K2.5-sized draft
    python bench/gpu_multi.py --tiny --device cpu    # anywhere
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_train  # noqa: E402  (makes eagle3d importable where it is not installed)
from gpu_train import REPO, TINY, Run, Shape, shape_of  # noqa: E402

sys.path.insert(0, str(REPO / "tests"))
GOAL = 1.85
# The resume check's draft: big enough for real GPU kernels, small enough to start in seconds.
RESUME_SHAPE = Shape("resume-check", hidden=1024, intermediate=2816, heads=16, kv_heads=4,
                     head_dim=64, vocab=32000, draft_vocab=4096, rope_theta=500000.0)


# ---- one torchrun process of a scaling run ----------------------------------------------------

def worker(args: argparse.Namespace) -> int:
    """gpu_train.py's timed run of our trainer, under DDP; rank 0 writes it down, with every
    rank's tokens."""
    import torch.distributed as dist
    from eagle3d.drafter.train import data_parallel
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    device = gpu_train.bench_device(args.device, int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    shape = shape_of(args)
    max_len = args.seq_len + args.ttt
    target = gpu_train.random_target(shape, device)
    weights = gpu_train.initial_weights(shape, target, max_len, device)
    # Every run cycles through the same batches; rank r of w takes every w-th.
    batches = gpu_train.random_batches(shape, args.seq_len, args.batches, device)[rank::world]

    def build() -> gpu_train.OurTrainer:
        trainer = gpu_train.OurTrainer(shape, target, weights, max_len, args.lr, args.ttt, device)
        if world > 1:
            trainer.model = data_parallel(trainer.model, device)
        return trainer

    run = gpu_train.timed_run(build, batches, args.warmup, args.steps, device)
    if rank == 0:
        Path(args.result).write_text(json.dumps(dataclasses.asdict(
            dataclasses.replace(run, tokens=run.tokens * world))))
    dist.destroy_process_group()
    return 0


def torchrun(nproc: int, *argv: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc_per_node={nproc}", *argv]


def child_env() -> dict[str, str]:
    """Ours, with the folder that maps `eagle3d` (where it is not installed) on the path of
    every process torchrun starts."""
    env = dict(os.environ)
    mapped = [p for p in sys.path if Path(p, "eagle3d", "drafter").exists()]
    env["PYTHONPATH"] = os.pathsep.join(mapped + [env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return env


def scaling_run(args: argparse.Namespace, world: int, workdir: Path) -> Run:
    result = workdir / f"result-{world}-{time.monotonic_ns()}.json"
    forwarded = ["--tiny"] if args.tiny else ["--shape", args.shape] if args.shape else []
    argv = torchrun(world, __file__, "--worker", "--result", str(result), "--device",
                    args.device, "--seq-len", str(args.seq_len), "--steps", str(args.steps),
                    "--warmup", str(args.warmup), "--batches", str(args.batches), "--ttt",
                    str(args.ttt), "--lr", str(args.lr), *forwarded)
    run = subprocess.run(argv, env=child_env(), capture_output=True, text=True, timeout=1800)
    if run.returncode != 0:
        raise RuntimeError(f"the {world}-process run failed (exit {run.returncode}):\n"
                           f"{run.stderr[-4000:]}")
    return Run(**json.loads(result.read_text()))


# ---- the resume check -------------------------------------------------------------------------

def random_dataset(root: Path, shape: Shape, samples: int, seq_len: int) -> Path:
    """A random target (its config and the two matrices the trainer reads) and a verified
    dataset of random captures of it, written as the pipeline leaves them; returns the
    target's folder."""
    from drafter_fixtures import contract_for, planned_sample, record_dataset
    from safetensors.torch import save_file
    from transformers import LlamaConfig
    target_dir = root / "target"
    cfg = LlamaConfig(hidden_size=shape.hidden, intermediate_size=shape.intermediate,
                      num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads,
                      head_dim=shape.head_dim, num_hidden_layers=32, vocab_size=shape.vocab,
                      rope_theta=shape.rope_theta, tie_word_embeddings=False,
                      max_position_embeddings=4 * seq_len)
    cfg.save_pretrained(target_dir)
    target = gpu_train.random_target(shape, torch.device("cpu"))
    save_file({"model.embed_tokens.weight": target.embed.contiguous(),
               "lm_head.weight": target.head.contiguous()}, str(target_dir / "model.safetensors"))
    gen = torch.Generator().manual_seed(0)
    rows = [planned_sample(i, ids.tolist(), [1] * seq_len,
                           torch.randn(seq_len, 3 * shape.hidden, generator=gen),
                           torch.randn(seq_len, shape.hidden, generator=gen))
            for i, ids in enumerate(torch.randint(0, shape.vocab, (samples, seq_len),
                                                  generator=gen))]
    record_dataset(root, contract_for(str(target_dir), target_dir, cfg, "transformers"), rows)
    return target_dir


def resume_config(root: Path, target_dir: Path, device: str, seq_len: int, shape: Shape) -> Path:
    (root / "conversations.jsonl").write_text("{}\n")  # validated, never read by the trainer
    path = root / "eagle3d.toml"
    path.write_text(
        f'[target]\nmodel = "{target_dir}"\ndevice = "{device}"\n\n'
        f'[data]\nsource = "{root / "conversations.jsonl"}"\nmax_tokens = {seq_len}\n\n'
        f'[paths]\nstate_dir = "{root / "state"}"\nspool_dir = "{root / "spool"}"\n'
        f'dataset_dir = "{root / "dataset"}"\ntrain_dir = "{root / "train"}"\n\n'
        f'[train]\nnproc = 2\ndevice = "{device}"\ndraft_vocab = {shape.draft_vocab}\n'
        f"ttt_steps = 3\nepochs = 100.0\nmax_steps = {RESUME_STEPS}\nbatch_tokens = {seq_len}\n"
        f"warmup_steps = 5\ncheckpoint_every = {CHECKPOINT_EVERY}\nthreads = 1\n")
    return path


RESUME_STEPS = 120
CHECKPOINT_EVERY = 20
KILL_AFTER = 30  # metrics rows: past the first checkpoint, long before the end


def metric_rows(train_dir: Path) -> int:
    path = train_dir / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0


def rank_process(torchrun_pid: int, rank: int):
    import psutil
    for proc in psutil.Process(torchrun_pid).children(recursive=True):
        try:
            if proc.environ().get("RANK") == str(rank):
                return proc
        except psutil.Error:
            continue
    return None


def resume_check(args: argparse.Namespace, workdir: Path) -> str:
    """The verdict, one line: the trainer loses rank 1 after a checkpoint, is restarted and
    resumes from that checkpoint to the last step."""
    import importlib.util
    from eagle3d.daemon.stages.train import trainer_argv
    from eagle3d.statemachine.config_validation import load_config
    # Writing the random dataset's capture contract needs tomli_w (the trainer does not).
    missing = [m for m in ("tomli_w", "transformers") if importlib.util.find_spec(m) is None]
    if missing:
        return (f"resume check: skipped ({', '.join(missing)} not installed here; pure Python: "
                f"pip install {' '.join(missing)}, or copy the package folder into bench/)")
    shape, seq_len = (TINY, 32) if args.tiny else (RESUME_SHAPE, 1024)
    root = workdir / "resume"
    config = resume_config(root, random_dataset(root, shape, 16, seq_len), args.device,
                           seq_len, shape)
    argv, train_dir = trainer_argv(load_config(config), config), root / "train"
    first = subprocess.Popen(argv, env=child_env(), stdout=subprocess.DEVNULL,
                             stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 600
    while metric_rows(train_dir) < KILL_AFTER and first.poll() is None:
        if time.monotonic() > deadline:
            first.kill()
            return "resume check: FAILED (no training progress within 600 s)"
        time.sleep(0.02)
    victim = rank_process(first.pid, 1)
    if victim is None:
        return (f"resume check: FAILED (the first run ended, exit {first.poll()}, before rank 1 "
                f"could be killed):\n{first.communicate()[1][-3000:]}")
    victim.send_signal(signal.SIGKILL)
    t0 = time.monotonic()
    try:
        _, err = first.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        first.kill()
        return "resume check: FAILED (rank 0 and torchrun still ran 300 s after rank 1 died)"
    ended = time.monotonic() - t0
    killed_at = metric_rows(train_dir)  # the last step rank 0 logged: checkpoints are no later
    if first.returncode == 0:
        return "resume check: FAILED (the trainer exited 0 although rank 1 was killed)"
    again = subprocess.run(argv, env=child_env(), capture_output=True, text=True, timeout=1200)
    resumed = re.search(r"resuming at step (\d+)", again.stderr)
    if again.returncode != 0 or resumed is None:
        return (f"resume check: FAILED (the restarted trainer exited {again.returncode}, "
                f"resumed: {bool(resumed)}):\n{again.stderr[-3000:]}")
    step = int(resumed.group(1))
    steps = [json.loads(line)["step"] for line in
             (train_dir / "metrics.jsonl").read_text().splitlines()]
    whole = steps == list(range(1, RESUME_STEPS + 1))
    ok = whole and step % CHECKPOINT_EVERY == 0 and CHECKPOINT_EVERY <= step <= killed_at
    return (f"resume check: rank 1 killed after step {killed_at}, the trainer exited "
            f"{first.returncode} {ended:.1f} s later; restarted, it resumed at step {step} "
            f"(checkpoints every {CHECKPOINT_EVERY}) and logged steps 1-{steps[-1]}"
            f"{'' if whole else ' WITH GAPS'}: {'passed' if ok else 'FAILED'}")


# ---- the parent -------------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    gpu_train.training_arguments(parser, steps=30, warmup=5)
    parser.add_argument("--seq-len", type=int, default=0,
                        help="tokens per process per step (default 4096; 64 with --tiny)")
    parser.add_argument("--part", choices=("both", "scaling", "resume"), default="both",
                        help="what to run (each part alone fits a 10-minute slot)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.seq_len = args.seq_len or (64 if args.tiny else 4096)
    if args.worker:
        return worker(args)
    shape = gpu_train.checked_shape(parser, args)
    if args.batches % 2 or args.seq_len <= args.ttt:
        parser.error("--batches must be even (both processes get as many), --seq-len > --ttt")
    if args.device == "cuda" and torch.cuda.device_count() < 2:
        parser.error(f"2 GPUs needed, {torch.cuda.device_count()} visible")

    workdir = gpu_train.temporary_folder("eagle3d-bench-multi-")
    runs: dict[int, list[Run]] = {1: [], 2: []}
    for world in gpu_train.abba([1, 2], args.repeats if args.part != "resume" else 0):
        runs[world].append(scaling_run(args, world, workdir))
        print(f"run {len(runs[1]) + len(runs[2])}: {world} process(es): "
              f"{runs[world][-1].tokens / runs[world][-1].seconds:.0f} tokens/s", flush=True)
    verdict = (resume_check(args, workdir) if args.part != "scaling"
               else "resume check: skipped (--part scaling)")
    where = torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu (gloo)"
    print(f"draft {shape.name}, TTT {args.ttt}, {args.seq_len} tokens per process per step, "
          f"bf16, {where}; {args.warmup} warm-up + {args.steps} timed steps x {args.repeats} "
          f"runs each")
    print(verdict)
    if args.part == "resume":
        return 0 if "FAILED" not in verdict else 1
    results = {world: gpu_train.summarize(done) for world, done in runs.items()}
    for world, res in results.items():
        print(f"{world} process(es): {res.tokens_per_s:.0f} tokens/s "
              f"({res.tokens_per_s / world:.0f} per process), peak {res.peak_gib:.2f} GiB per "
              f"GPU, loss {res.loss:.4f}")
    ratio = results[2].tokens_per_s / results[1].tokens_per_s
    print(f"ratio 2 GPUs / 1 GPU: {ratio:.3f} (goal >= {GOAL}): "
          f"{'met' if ratio >= GOAL else 'not met'}")
    return 0 if "FAILED" not in verdict else 1


if __name__ == "__main__":
    sys.exit(main())
