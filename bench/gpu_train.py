"""Drafter training tokens/s and peak memory, as a ratio to SpecForge's EAGLE-3 trainer.

A Llama-3.1-8B-sized draft (hidden 4096, intermediate 14336, 32/8 heads, draft vocabulary 32,000
of 128,256, TTT 7, batch 1, bf16), or with `--shape kimi-k2.5` a Kimi-K2.5-sized one (hidden
7168, intermediate 18432, 64/64 heads of dim 128, draft vocabulary 32,000 of 163,840, rope theta
1e6: one decoder layer on [embedding ; fc(aux)], 2 x 7168 wide), trains on the same random
batches, from the same initial
weights, with the same draft vocabulary, learning rate and gradient clipping, twice in one
process: with our trainer (drafter/train.py's build_drafter, make_optimizer and train_step) and
with SpecForge's (`LlamaForCausalLMEagle3` with flex attention, `OnlineEagle3Model`, `TargetHead`,
`Eagle3TrainStrategy.forward_loss` and `BF16Optimizer`, one GPU, no FSDP). Every run is built
anew, warmed up, then timed; runs alternate ours/theirs in ABBA order so both share the noise.
Judged by, per sequence length,

    ratio = our tokens/s / SpecForge's tokens/s
            (goal: >= 1.3 at no more peak memory, with the loss after the same tokens no worse)

printed last. Each row also gives the model FLOPs utilization (MFU): the model's FLOPs per step
(train_flops: 6 x weights x rows for the trainable matmuls, attention as it is masked, the
frozen teacher head forward only) per second, over the bf16 matmul peak measured in the same
run. SpecForge is optional (its wheel installs with `pip install --no-deps`; its import also
needs triton, which a GPU server has); without it our trainer runs alone. `--tiny` swaps in a
tiny shape so the script runs anywhere (on CPU in the tests).

`--compare-storage` runs our trainer twice instead, fed as drafter/train.py feeds it from the
dataset: each batch held on the host (pinned on CUDA) as bf16 dumps store it, or as fp8 dumps do
(dataset/precision.py's encoding), and copied and decoded on the device at every step by
data.StoredBatch.to, inside the timed loop. Judged by

    fp8 / bf16 tokens/s   (goal: >= 0.98, the lowest over the lengths)

printed last.

    python bench/gpu_train.py                       # on a GPU server
    python bench/gpu_train.py --shape kimi-k2.5     # the Kimi-K2.5-sized draft
    python bench/gpu_train.py --compare-storage     # fp8 against bf16 storage
    python bench/gpu_train.py --tiny                # anywhere

`--profile` times nothing against SpecForge: it runs our trainer once per length under the
PyTorch profiler and prints where a step's device time goes, by kind of kernel (matmuls,
attention, fused and plain elementwise work, copies) and the costliest kernels by name: what
to fix before the ratio can rise.
"""

from __future__ import annotations

import argparse
import atexit
import functools
import gc
import importlib
import shutil
import sys
import tempfile
import time
import tomllib
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, NamedTuple, Protocol, TypeVar

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

REPO = Path(__file__).resolve().parent.parent


def temporary_folder(prefix: str) -> Path:
    """A new folder under the system's temporary folder, removed when the process exits."""
    folder = Path(tempfile.mkdtemp(prefix=prefix))
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    return folder


def ensure_eagle3d(repo: Path = REPO) -> Path | None:
    """Make `eagle3d.*` importable. Where the editable install is missing (a bare GPU machine
    without network), mirror its mapping (pyproject's package-dir) with symlinks in a temporary
    folder put first on sys.path; returns that folder (removed at exit), or None."""
    try:
        importlib.import_module("eagle3d.drafter")
        return None
    except ImportError:
        pass
    for name in [m for m in sys.modules if m == "eagle3d" or m.startswith("eagle3d.")]:
        del sys.modules[name]  # a half-finished import would shadow the mapping
    package_dir = tomllib.loads((repo / "pyproject.toml").read_text())["tool"]["setuptools"][
        "package-dir"]
    root = temporary_folder("eagle3d-import-")
    (root / "eagle3d").mkdir()
    (root / "eagle3d" / "__init__.py").write_text("")
    for package, folder in package_dir.items():
        (root / package.replace(".", "/")).symlink_to(repo / folder, target_is_directory=True)
    sys.path.insert(0, str(root))
    importlib.invalidate_caches()
    print(f"eagle3d is not installed: importing it from {repo} through {root}", file=sys.stderr)
    return root


ensure_eagle3d()

from eagle3d.dataset import precision  # noqa: E402
from eagle3d.drafter import data, vocab as vocab_mod  # noqa: E402
from eagle3d.drafter.model import LOSS_DECAY, DraftConfig  # noqa: E402
from eagle3d.drafter.train import build_drafter, make_optimizer, train_step  # noqa: E402
from eagle3d.statemachine.config_schema import FP8  # noqa: E402

RMS_EPS = 1e-5
GRAD_CLIP = 0.5  # [train] grad_clip's default, and SpecForge's max_grad_norm
OUT_OF_DRAFT_SCALE = 0.1
SPEEDUP_GOAL = 1.3  # issue 17: ours / SpecForge tokens/s at every length, both shapes
LOSS_TOLERANCE = 0.01  # "no worse": within 1% (bf16 runs differ in the last bits)
STORAGE = {"bf16": "bfloat16", "fp8": FP8}  # --compare-storage's runs: the dumps' dtypes
STORAGE_GOAL = 0.98  # fp8 storage must keep the training tokens/s within 2% of bf16's


@dataclass(frozen=True)
class Shape:
    name: str
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    draft_vocab: int
    rope_theta: float

    @property
    def rope(self) -> dict:
        return {"rope_type": "default", "rope_theta": self.rope_theta}


LLAMA_8B = Shape("Llama-3.1-8B-sized", hidden=4096, intermediate=14336, heads=32, kv_heads=8,
                 head_dim=128, vocab=128256, draft_vocab=32000, rope_theta=500000.0)
# Kimi-K2.5 (DeepSeek-V3's layout): its draft is a Llama layer of 64 heads of 128, wider than
# the hidden size (8192 vs 7168), with as many KV heads.
KIMI_K25 = Shape("Kimi-K2.5-sized", hidden=7168, intermediate=18432, heads=64, kv_heads=64,
                 head_dim=128, vocab=163840, draft_vocab=32000, rope_theta=1e6)
TINY = Shape("tiny", hidden=64, intermediate=128, heads=4, kv_heads=2, head_dim=16, vocab=512,
             draft_vocab=128, rope_theta=500000.0)
SHAPES = {"llama-8b": LLAMA_8B, "kimi-k2.5": KIMI_K25}


@dataclass(frozen=True)
class Target:
    """The parts of a random target both trainers read: its embedding, its lm_head and the
    draft vocabulary (bf16, as a Llama checkpoint holds them)."""
    embed: Tensor  # [V, H]
    head: Tensor   # [V, H]
    vocab: vocab_mod.DraftVocab

    @property
    def head_rows(self) -> Tensor:
        """The head's rows of the draft vocabulary: the teacher's head."""
        return self.head[self.vocab.target_ids.to(self.head.device)]


@dataclass(frozen=True)
class Batch:
    input_ids: Tensor  # [1, T]
    aux: Tensor        # [1, T, 3H]: the three captured hidden states
    last: Tensor       # [1, T, H]: the target's final hidden state
    loss_mask: Tensor  # [1, T]: 1 where token t is trained on (SpecForge's and the dumps' sense)

    @property
    def tokens(self) -> int:
        return self.input_ids.numel()

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in (self.input_ids, self.aux, self.last, self.loss_mask))

    @property
    def targets(self) -> Tensor:
        """Where our loss counts: index t, when token t+1 is trained on (as read_batch)."""
        return F.pad(self.loss_mask[:, 1:].bool(), (0, 1), value=False)

    def stored(self, dump_dtype: str, pin: bool) -> data.StoredBatch:
        """This batch as the trainer reads it from dumps of `dump_dtype` (a config name): the
        states encoded on their device as the capture encodes them, then held on the host
        (pinned with `pin`, as data.read_batch holds them on CUDA)."""
        def host(t: Tensor) -> Tensor:
            t = t.cpu()
            return t.pin_memory() if pin else t
        states = precision.encode_states(self.aux, self.last, dump_dtype)
        return data.StoredBatch(host(self.input_ids), {k: host(t) for k, t in states.items()},
                                host(self.targets), self.tokens)


def random_target(shape: Shape, device: torch.device) -> Target:
    g = torch.Generator(device=device).manual_seed(0)
    embed = torch.randn(shape.vocab, shape.hidden, generator=g, device=device) * 0.02
    head = torch.randn(shape.vocab, shape.hidden, generator=g, device=device) * 0.02
    counts = torch.randint(0, 1_000_000, (shape.vocab,), generator=torch.Generator().manual_seed(0))
    vocab = vocab_mod.from_counts(counts, shape.draft_vocab)
    # The draft vocabulary holds the target's frequent tokens; shrinking the other rows keeps
    # every teacher argmax inside it, so SpecForge's position mask (argmax in the draft
    # vocabulary) keeps every position, as ours does, and the two losses average alike.
    head[~vocab.t2d.to(device)] *= OUT_OF_DRAFT_SCALE
    return Target(embed.bfloat16(), head.bfloat16(), vocab)


def random_batches(shape: Shape, seq_len: int, count: int, device: torch.device) -> list[Batch]:
    g = torch.Generator(device=device).manual_seed(seq_len)
    batches = []
    for _ in range(count):
        ids = torch.randint(0, shape.vocab, (1, seq_len), generator=g, device=device)
        aux = torch.randn(1, seq_len, 3 * shape.hidden, generator=g, device=device)
        last = torch.randn(1, seq_len, shape.hidden, generator=g, device=device)
        batches.append(Batch(ids, aux.bfloat16(), last.bfloat16(),
                             torch.ones(1, seq_len, dtype=torch.int64, device=device)))
    return batches


def draft_config(shape: Shape, max_len: int) -> DraftConfig:
    return DraftConfig(hidden_size=shape.hidden, target_hidden_size=shape.hidden,
                       intermediate_size=shape.intermediate, num_attention_heads=shape.heads,
                       num_key_value_heads=shape.kv_heads, head_dim=shape.head_dim,
                       rms_norm_eps=RMS_EPS, max_position_embeddings=max_len,
                       vocab_size=shape.vocab, draft_vocab_size=shape.draft_vocab,
                       rope_parameters=shape.rope)


def initial_weights(shape: Shape, target: Target, max_len: int,
                    device: torch.device) -> dict[str, Tensor]:
    """The drafter's starting parameters, as drafter/train.py makes them; both trainers start
    from these."""
    torch.manual_seed(0)
    model, _ = build_drafter(draft_config(shape, max_len), target.embed, target.head_rows,
                             device)
    weights = {name: w.float().clone() for name, w in model.served_weights().items()}
    del model
    return weights


class Trainer(Protocol):
    def prepare(self, batches: list[Batch]) -> None:
        """Whatever the trainer derives from the run's batches, before the clock starts."""

    def step(self, batch: Batch) -> Tensor:
        """One training step on `batch`; its loss, as ours weighs it."""


class OurTrainer:
    """drafter/train.py's model, optimizer and training step, on batches already on the
    device."""

    def __init__(self, shape: Shape, target: Target, weights: dict[str, Tensor], max_len: int,
                 lr: float, ttt: int, device: torch.device) -> None:
        self.ttt, self.device = ttt, device
        self.model, self.teacher_head = build_drafter(draft_config(shape, max_len), target.embed,
                                                      target.head_rows, device)
        self.model.load_served_weights(weights)
        self.optimizer = make_optimizer(self.model, lr, weight_decay=0.0)
        self.targets: dict[int, Tensor] = {}  # per batch, on the host

    def prepare(self, batches: list[Batch]) -> None:
        # The batches are trained where they lie, but for the targets: the trainer reads them
        # on the host (data.StoredBatch.to).
        self.targets = {id(b): b.targets.cpu() for b in batches}

    def step(self, batch: Batch) -> Tensor:
        return self.train(data.Batch(batch.input_ids, batch.aux, batch.last,
                                     self.targets[id(batch)], batch.tokens))

    def train(self, batch: data.Batch) -> Tensor:
        loss, _, _, _ = train_step(self.model, self.optimizer, batch, self.teacher_head,
                                   self.ttt, GRAD_CLIP)
        return loss


class StoredTrainer(OurTrainer):
    """Ours fed as drafter/train.py feeds it from the dataset: each batch held on the host as
    dumps of `dump_dtype` store it, and at every step copied to the device and decoded there
    by data.StoredBatch.to, inside the timed loop as in train_loop."""

    def __init__(self, dump_dtype: str, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.dump_dtype = dump_dtype
        self.stored: dict[int, data.StoredBatch] = {}

    def prepare(self, batches: list[Batch]) -> None:
        pin = self.device.type == "cuda"
        self.stored = {id(b): b.stored(self.dump_dtype, pin) for b in batches}

    def step(self, batch: Batch) -> Tensor:
        return self.train(self.stored[id(batch)].to(self.device))


class SpecForgeSchedule(NamedTuple):
    """BF16Optimizer's learning-rate schedule: `kind` "constant" or "cosine" (linear warmup of
    `warmup` steps, then cosine decay to zero at step `total`)."""
    kind: str = "constant"
    total: int = 1_000_000
    warmup: int = 0


def cpu_reference_loss() -> None:
    """Make SpecForge's EAGLE-3 loss run on CPU tensors. Its LogSoftmaxLoss is a Triton kernel,
    which runs on GPUs alone: on CPU tensors the launch fails. The same module holds the formula
    the kernel fuses, `_compute_loss` (SpecForge's "reference implementation": -sum(mask * p *
    log_softmax(z)) over the vocabulary, averaged over all B x T positions, as the kernel
    averages), and that is what is put in the kernel's place, for CPU tensors only."""
    from specforge.algorithms.eagle3 import model as eagle3_model
    from specforge.core import loss

    kernel = loss.LogSoftmaxLoss
    if getattr(kernel, "eagle3d_cpu_reference", False):
        return

    class LogSoftmaxLoss(kernel):
        eagle3d_cpu_reference = True

        @staticmethod
        def apply(logits: Tensor, target: Tensor, position_mask: Tensor) -> Tensor:
            if logits.is_cuda:
                return kernel.apply(logits, target, position_mask)
            return loss._compute_loss(logits, target, position_mask)

    eagle3_model.LogSoftmaxLoss = LogSoftmaxLoss


class SpecForgeTrainer:
    """SpecForge 0.2's offline EAGLE-3 step on one device without FSDP, as its trainer runs it:
    `Eagle3TrainStrategy.forward_loss` (TargetHead re-projecting the stored final hidden state),
    backward, `BF16Optimizer.step` (fp32 masters, clipping, its scheduler). On CPU its loss is
    its reference formula (cpu_reference_loss)."""

    def __init__(self, cfg: DraftConfig, target: Target, weights: dict[str, Tensor],
                 lr: float, ttt: int, device: torch.device, backend: str,
                 config_dir: Path, schedule: SpecForgeSchedule = SpecForgeSchedule(),
                 weight_decay: float = 0.0, grad_clip: float = GRAD_CLIP) -> None:
        from specforge.algorithms.eagle3.model import OnlineEagle3Model
        from specforge.modeling.auto import AutoDraftModel
        from specforge.modeling.target.target_head import TargetHead
        from specforge.optimizer import BF16Optimizer
        from specforge.runtime.contracts import TrainBatch
        from specforge.training.strategies.base import Eagle3TrainStrategy
        from transformers import LlamaConfig

        if device.type == "cpu":
            cpu_reference_loss()
        self.TrainBatch = TrainBatch
        config = LlamaConfig(
            architectures=["LlamaForCausalLMEagle3"], hidden_size=cfg.hidden_size,
            intermediate_size=cfg.intermediate_size, num_attention_heads=cfg.num_attention_heads,
            num_key_value_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim,
            num_hidden_layers=1, vocab_size=cfg.vocab_size,
            draft_vocab_size=cfg.draft_vocab_size, hidden_act=cfg.hidden_act,
            max_position_embeddings=cfg.max_position_embeddings, rms_norm_eps=cfg.rms_norm_eps,
            rope_parameters=dict(cfg.rope_parameters), tie_word_embeddings=False,
            target_hidden_size=cfg.target_hidden_size)
        config.save_pretrained(config_dir)  # TargetHead reads the target's config from a folder
        with torch.device(device):
            self.draft = draft = AutoDraftModel.from_config(config, attention_backend=backend,
                                                            torch_dtype=torch.bfloat16)
            head = TargetHead(str(config_dir))
        loaded = draft.load_state_dict(weights, strict=False)
        trainable = {n for n, p in draft.named_parameters() if n != "embed_tokens.weight"}
        if loaded.unexpected_keys or trainable & set(loaded.missing_keys):
            raise RuntimeError(f"our weights do not map onto SpecForge's draft: unexpected "
                               f"{loaded.unexpected_keys}, missing "
                               f"{sorted(trainable & set(loaded.missing_keys))}")
        self.served = sorted(weights)  # our names of its weights: the load's mapping
        with torch.no_grad():
            draft.embed_tokens.weight.copy_(target.embed)
            draft.d2t.copy_(target.vocab.d2t)
            draft.t2d.copy_(target.vocab.t2d)
            head.fc.weight.copy_(target.head)
        draft.freeze_embedding()
        head.freeze_weights()
        model = OnlineEagle3Model(draft_model=draft, length=ttt, attention_backend=backend)
        model = model.to(device=device, dtype=torch.bfloat16)
        self.head = head.eval().to(device=device, dtype=torch.bfloat16)
        self.strategy = Eagle3TrainStrategy(model, target_head=self.head, ploss_decay=LOSS_DECAY)
        # BF16Optimizer takes the warmup as a share of the steps and rounds it down.
        self.optimizer = BF16Optimizer(model, lr=lr, weight_decay=weight_decay,
                                       max_grad_norm=grad_clip, total_steps=schedule.total,
                                       warmup_ratio=(schedule.warmup + 0.5) / schedule.total,
                                       lr_scheduler=schedule.kind)
        self.t2d = target.vocab.t2d.to(device)
        self.ttt = ttt
        self.counts: dict[int, Tensor] = {}  # per batch, see positions()

    def served_weights(self) -> dict[str, Tensor]:
        """The trained weights under our names (the reverse of the load's mapping, which keeps
        the names): the fp32 masters BF16Optimizer steps, not the bf16 copies the model runs."""
        masters = dict(zip((id(p) for p in self.optimizer.model_params),
                           self.optimizer.fp32_params))
        params = dict(self.draft.named_parameters())
        return {name: masters[id(params[name])].detach().cpu() for name in self.served}

    @property
    def lr(self) -> float:
        return self.optimizer.optimizer.param_groups[0]["lr"]

    def prepare(self, batches: list[Batch]) -> None:
        self.counts.update({id(b): self.positions(b) for b in batches})

    def positions(self, batch: Batch) -> Tensor:
        """Per TTT step, how many positions SpecForge's loss counts: its loss is a sum over
        them divided by all T, ours a mean over them, so its figure is rescaled by T / count."""
        shifted = F.pad(batch.last[:, 1:], (0, 0, 0, 1))  # TargetHead.preprocess
        argmax = torch.cat([(rows @ self.head.fc.weight.T).argmax(-1)
                            for rows in shifted.split(512, dim=1)], dim=1)
        kept = (self.t2d[argmax] & batch.loss_mask.bool())[0]
        return torch.stack([kept[k:].sum() for k in range(self.ttt)]).clamp(min=1)

    def train(self, batch: Batch) -> Tensor:
        """One step; per TTT step, SpecForge's own loss (a sum over the counted positions over
        all B x T)."""
        out = self.strategy.forward_loss(self.TrainBatch(
            sample_ids=["bench"], strategy="eagle3",
            # Causal attention: a right-padded row's real tokens never see its padding, which
            # the loss mask leaves out.
            tensors={"input_ids": batch.input_ids, "attention_mask": torch.ones_like(
                batch.loss_mask), "loss_mask": batch.loss_mask, "hidden_state": batch.aux,
                "target": batch.last},
            metadata={"target_repr": "hidden_state"}))
        out.loss.backward()
        self.optimizer.step()
        return torch.stack([p.float() for p in out.metrics["plosses"]])

    def step(self, batch: Batch) -> Tensor:
        per_step = self.train(batch)
        weights = LOSS_DECAY ** torch.arange(self.ttt, device=per_step.device,
                                             dtype=torch.float32)
        return (per_step * batch.tokens / self.counts[id(batch)] * weights).sum()


@dataclass
class Run:
    seconds: float
    tokens: int
    peak: int  # bytes
    loss: float


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work and, under DDP, for every rank: a clock started or
    stopped here times the same steps on all of them."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    if dist.is_initialized():
        dist.barrier()


def free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def timed_run(build: Callable[[], Trainer], batches: list[Batch],
              warmup: int, steps: int, device: torch.device) -> Run:
    """Build a trainer, warm it up, time `steps` steps. The peak counts what the trainer
    allocates over what existed before it (the shared inputs and weights), plus one batch
    where the trainer reads the shared one on the device; the loss is the mean over the last
    pass through the batches."""
    free(device)
    cuda = device.type == "cuda"
    if cuda:
        before = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
    trainer = build()
    trainer.prepare(batches)
    losses = []
    for i in range(warmup + steps):
        if i == warmup:
            synchronize(device)
            t0 = time.perf_counter()
        losses.append(trainer.step(batches[i % len(batches)]))
    synchronize(device)
    seconds = time.perf_counter() - t0
    # A stored feed allocates its device batch in its steps: already counted.
    held = 0 if isinstance(trainer, StoredTrainer) else batches[0].nbytes
    peak = (torch.cuda.max_memory_allocated(device) - before + held) if cuda else 0
    loss = torch.stack(losses[-len(batches):]).mean().item()
    del trainer, losses
    free(device)
    return Run(seconds, steps * batches[0].tokens, peak, loss)


def train_flops(shape: Shape, seq_len: int, ttt: int, tokens_once: bool = False) -> float:
    """The model FLOPs of one training step on one sequence whose every next token counts (the
    random batches), counted as the drafter computes them. A matmul of an [n, k] input by a
    trainable [k, m] weight is 2nkm forward, 2nkm for the input's gradient and 2nkm for the
    weight's (6 x weights x rows); fc's input (the captured states) needs no gradient (4 x);
    the teacher head (frozen) runs forward only, once. Per TTT step k the decoder layer runs on
    all T rows, the lm_head on the T - 2 - k rows that learn a teacher, and attention reads
    (T + 1) / 2 context keys on average (causal) plus k drafts per query: 4 x heads x head_dim
    per key forward, 3 x that with the backward. Norms, rotations and softmaxes are left out.
    Both trainers are judged by the same count: it is the model's work, not the kernels'.
    `tokens_once` counts what ours computes instead: q, k and v of the embedding's half of the
    input once per unroll, not at every TTT step (drafter/model.py Attention)."""
    H, T = shape.hidden, seq_len
    attention_width = shape.heads * shape.head_dim
    qkv = H * (attention_width + 2 * shape.kv_heads * shape.head_dim)  # of each half
    layer = qkv + attention_width * H + 3 * H * shape.intermediate  # o, gate, up, down
    counted = T - 1  # every index whose next token exists
    flops = 4 * T * 3 * H * H + 2 * counted * H * shape.draft_vocab  # fc; the teacher head
    for k in range(ttt):
        flops += 6 * T * layer + 6 * max(0, T - 2 - k) * H * shape.draft_vocab
        flops += 6 * T * qkv if k == 0 or not tokens_once else 0
        flops += 12 * attention_width * T * ((T + 1) / 2 + k)
    return float(flops)


def matmul_peak(device: torch.device) -> float:
    """FLOP/s of the best of a few bf16 square matmuls, timed here: the ceiling MFU is read
    against (on an H200 it comes out below the data sheet's 989 TFLOP/s dense)."""
    n, reps = (8192, 20) if device.type == "cuda" else (256, 3)
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    best = float("inf")
    for _ in range(4):  # the first round warms up
        synchronize(device)
        t0 = time.perf_counter()
        for _ in range(reps):
            a @ b
        synchronize(device)
        best = min(best, (time.perf_counter() - t0) / reps)
    del a, b
    free(device)
    return 2 * n ** 3 / best


@dataclass
class Result:
    tokens_per_s: float
    peak_gib: float
    loss: float


def summarize(runs: list[Run]) -> Result:
    return Result(sum(r.tokens for r in runs) / sum(r.seconds for r in runs),
                  max(r.peak for r in runs) / 2**30, sum(r.loss for r in runs) / len(runs))


Arm = TypeVar("Arm")


def abba(arms: list[Arm], repeats: int) -> Iterator[Arm]:
    """`repeats` runs of every arm, in the order A B, B A, A B, ...: a drift in the machine's
    speed (clocks, heat, neighbours) falls on all arms alike."""
    for r in range(repeats):
        yield from (arms if r % 2 == 0 else arms[::-1])


def training_arguments(parser: argparse.ArgumentParser, steps: int, warmup: int) -> None:
    """The arguments every training bench takes: the draft's shape, where it runs, and how much
    is timed."""
    parser.add_argument("--tiny", action="store_true", help="a tiny shape (runs on CPU)")
    parser.add_argument("--shape", choices=sorted(SHAPES),
                        help="the draft's shape (default llama-8b)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--steps", type=int, default=steps, help="timed steps per run")
    parser.add_argument("--warmup", type=int, default=warmup,
                        help="untimed steps first (compiles)")
    parser.add_argument("--repeats", type=int, default=2,
                        help="runs of each arm, alternating ABBA (A B, B A, ...)")
    parser.add_argument("--batches", type=int, default=4,
                        help="distinct random batches, cycled through")
    parser.add_argument("--ttt", type=int, default=7)
    parser.add_argument("--lr", type=float, default=1e-4)


def checked_shape(parser: argparse.ArgumentParser, args: argparse.Namespace) -> Shape:
    """The shape training_arguments asked for, once they make sense (else parser.error)."""
    if min(args.steps, args.repeats, args.batches, args.ttt) < 1 or args.warmup < 0:
        parser.error("--steps, --repeats, --batches and --ttt must be >= 1, --warmup >= 0")
    if args.tiny and args.shape:
        parser.error("--tiny is a shape of its own: give --tiny or --shape")
    return shape_of(args)


def shape_of(args: argparse.Namespace) -> Shape:
    return TINY if args.tiny else SHAPES[args.shape or "llama-8b"]


def bench_device(kind: str, index: int = 0) -> torch.device:
    """Where a run trains: GPU `index`, made current, or the CPU with one thread (CPU runs are
    the tiny smoke runs: their tensors gain nothing from threads, and on a busy machine
    spinning OpenMP threads make a step take seconds instead of ~20 ms)."""
    if kind == "cuda":
        device = torch.device("cuda", index)
        torch.cuda.set_device(device)
        return device
    torch.set_num_threads(1)
    return torch.device(kind)


def specforge_missing() -> str | None:
    try:
        importlib.import_module("specforge.algorithms.eagle3.model")
        return None
    except Exception as exc:  # an import error deep in its dependencies counts as missing
        return f"{type(exc).__name__}: {exc}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    training_arguments(parser, steps=20, warmup=3)
    parser.add_argument("--seq-lens", default="",
                        help="comma-separated sequence lengths (default: 2048,4096; 32,64 with "
                             "--tiny)")
    parser.add_argument("--no-specforge", action="store_true", help="run ours alone")
    parser.add_argument("--compare-storage", action="store_true",
                        help="instead of SpecForge: ours fed from batches stored as bf16 and "
                             "as fp8, alternating ABBA")
    parser.add_argument("--specforge-backend", default="flex_attention",
                        choices=("flex_attention", "sdpa"))
    parser.add_argument("--profile", action="store_true",
                        help="instead of timing: where a step of ours spends its device time")
    args = parser.parse_args(argv)
    shape = checked_shape(parser, args)
    seq_lens = [int(s) for s in (args.seq_lens or ("32,64" if args.tiny else "2048,4096"))
                .split(",")]
    if min(seq_lens) <= args.ttt:
        parser.error(f"sequence lengths must exceed --ttt {args.ttt}")
    device = bench_device(args.device)
    skipped = ("--compare-storage" if args.compare_storage else
               "--no-specforge" if args.no_specforge else specforge_missing())
    max_len = max(seq_lens) + args.ttt

    target = random_target(shape, device)
    weights = initial_weights(shape, target, max_len, device)
    config_dir = temporary_folder("eagle3d-bench-train-")
    common = (shape, target, weights, max_len, args.lr, args.ttt, device)
    trainers: dict[str, Callable[[], Trainer]] = {
        "ours": functools.partial(OurTrainer, *common)}
    if args.compare_storage:
        trainers = {name: functools.partial(StoredTrainer, dtype, *common)
                    for name, dtype in STORAGE.items()}
    elif skipped is None:
        trainers["specforge"] = functools.partial(
            SpecForgeTrainer, draft_config(shape, max_len), target, weights, args.lr, args.ttt,
            device, args.specforge_backend, config_dir)

    if args.profile:
        for seq_len in seq_lens:
            profile(trainers["ours"], random_batches(shape, seq_len, args.batches, device),
                    args.warmup, args.steps, device)
        return 0
    peak = matmul_peak(device)
    results = measure(trainers, seq_lens, batches=lambda n: random_batches(
        shape, n, args.batches, device), warmup=args.warmup, steps=args.steps,
        repeats=args.repeats, device=device)
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"draft {shape.name} (hidden {shape.hidden}, intermediate {shape.intermediate}, "
          f"heads {shape.heads}/{shape.kv_heads} of dim {shape.head_dim}, draft vocab "
          f"{shape.draft_vocab} of {shape.vocab}, rope theta {shape.rope_theta:g}), TTT "
          f"{args.ttt}, batch 1, bf16, {where}; {args.warmup} warm-up + {args.steps} timed steps "
          f"x {args.repeats} runs; "
          + ("ours fed from batches held on the host as bf16 and as fp8 dumps store them, "
             "copied and decoded at every step" if args.compare_storage else
             f"SpecForge {args.specforge_backend if skipped is None else 'skipped'}"))
    fewer = [1 - train_flops(shape, n, args.ttt, tokens_once=True)
             / train_flops(shape, n, args.ttt) for n in seq_lens]
    print(f"MFU: the model's FLOPs per second (bench/gpu_train.py train_flops) over the bf16 "
          f"matmul peak measured here, {peak / 1e12:.3g} TFLOP/s; ours computes "
          f"{', '.join(f'{f:.1%}' for f in fewer)} fewer (the embeddings' share of q, k and v "
          f"once per unroll, not per TTT step)")
    table(results, seq_lens, list(trainers), lambda n: train_flops(shape, n, args.ttt) / n / peak)
    if args.compare_storage:
        judge_storage(results, seq_lens)
    elif skipped is None:
        judge_specforge(results, seq_lens)
    else:
        print(f"comparison with SpecForge skipped ({skipped})")
    return 0 if all(isinstance(r, Result) for r in results.values()) else 1


KERNEL_KINDS = (  # (kind, marks in a kernel's name): the first kind with a mark wins
    ("attention", ("flash", "fmha", "sdpa", "attention")),
    ("matmul", ("gemm", "nvjet", "cutlass", "xmma", "_mm", "addmm", "bmm", "aten::mm")),
    ("fused (compiled)", ("triton_",)),
    ("copy", ("copy", "memcpy", "memset", "cat")),
    ("elementwise / reduction", ("elementwise", "reduce", "softmax", "norm", "vectorized")),
)


def kernel_kind(name: str) -> str:
    lower = name.lower()
    return next((kind for kind, marks in KERNEL_KINDS if any(m in lower for m in marks)),
                "other")


class Gap(NamedTuple):
    length: float  # in the kernels' time unit (the profiler's: microseconds)
    after: str
    before: str


def idle_gaps(kernels: list[tuple[float, float, str]]) -> tuple[float, list[Gap]]:
    """Kernels of one stream as (start, end, name), in any order: the span from the first start
    to the last end, and the idle gaps between consecutive kernels, longest first. The gaps are
    where the GPU waited for the host (a sync, launches slower than the kernels run)."""
    ordered = sorted(kernels)
    gaps = [Gap(b[0] - a[1], a[2], b[2]) for a, b in zip(ordered, ordered[1:]) if b[0] > a[1]]
    span = max(end for _, end, _ in ordered) - ordered[0][0] if ordered else 0.0
    return span, sorted(gaps, reverse=True)


def profile(build: Callable[[], Trainer], batches: list[Batch], warmup: int, steps: int,
            device: torch.device, top: int = 15) -> None:
    """Our trainer warmed up, then `steps` steps under the profiler: per step, each kind of
    kernel's device time and share, then the `top` kernels by time; on a GPU also how long it
    sat idle between kernels, and the longest of those gaps. On CPU the operators stand in for
    kernels (the tests)."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as profiler
    cuda = device.type == "cuda"
    trainer = build()
    trainer.prepare(batches)
    for i in range(warmup):
        trainer.step(batches[i % len(batches)])
    synchronize(device)
    with profiler(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
        for i in range(steps):
            trainer.step(batches[i % len(batches)])
        synchronize(device)
    events_on = torch.autograd.DeviceType.CUDA if cuda else torch.autograd.DeviceType.CPU
    times = {e.key: (e.self_device_time_total if cuda else e.self_cpu_time_total) / steps
             for e in prof.key_averages() if e.device_type == events_on}
    times = {k: t for k, t in times.items() if t > 0}
    total = sum(times.values())
    by_kind: dict[str, float] = {}
    for name, t in times.items():
        kind = kernel_kind(name)
        by_kind[kind] = by_kind.get(kind, 0.0) + t
    print(f"T={batches[0].tokens}: {total / 1e3:.1f} ms of {'kernels' if cuda else 'operators'}"
          f" per step")
    for name, t in sorted(by_kind.items(), key=lambda kv: -kv[1]):
        print(f"  {name:<26}{t / 1e3:>9.2f} ms {t / total:>7.1%}")
    for name, t in sorted(times.items(), key=lambda kv: -kv[1])[:top]:
        print(f"    {t / 1e3:>8.2f} ms {t / total:>6.1%}  {kernel_kind(name):<24}{name[:90]}")
    if cuda:  # operators on a CPU nest and overlap: no gaps to read there
        span, gaps = idle_gaps([(e.time_range.start, e.time_range.end, e.name)
                                for e in prof.events() if e.device_type == events_on])
        idle = sum(g.length for g in gaps)
        print(f"  idle between kernels: {idle / steps / 1e3:.2f} ms per step, "
              f"{idle / max(span, 1e-9):.1%} of the span; longest gaps:")
        for g in gaps[:5]:
            print(f"    {g.length / 1e3:>8.2f} ms after {g.after[:50]} before {g.before[:50]}")
    del trainer
    free(device)


def measure(trainers: dict[str, Callable[[], Trainer]],
            seq_lens: list[int], batches: Callable[[int], list[Batch]], warmup: int, steps: int,
            repeats: int, device: torch.device) -> dict[tuple[int, str], Result | str]:
    """Per (length, trainer), its figures or why it failed; runs alternate ABBA."""
    results: dict[tuple[int, str], Result | str] = {}
    for seq_len in seq_lens:
        inputs = batches(seq_len)
        runs: dict[str, list[Run]] = {name: [] for name in trainers}
        for name in abba(list(trainers), repeats):
            if isinstance(results.get((seq_len, name)), str):
                continue  # failed once at this length: its other runs would too
            try:
                runs[name].append(timed_run(trainers[name], inputs, warmup, steps, device))
            except Exception as exc:  # one trainer failing must not lose the other's figure
                traceback.print_exc()
                results[seq_len, name] = f"failed: {type(exc).__name__}"
        for name, done in runs.items():
            if done and (seq_len, name) not in results:
                results[seq_len, name] = summarize(done)
        del inputs
        free(device)
    return results


def table(results: dict[tuple[int, str], Result | str], seq_lens: list[int],
          names: list[str], mfu_per_token: Callable[[int], float]) -> None:
    """A row per length and trainer: its figures, or why it failed; `mfu_per_token(T)` is the
    model's FLOPs per token at length T over the measured peak."""
    print(f"{'T':>6}  {'trainer':<10}{'tokens/s':>10}{'peak GiB':>10}{'loss':>9}{'MFU':>8}")
    for seq_len in seq_lens:
        for name in names:
            res = results[seq_len, name]
            if isinstance(res, str):
                print(f"{seq_len:>6}  {name:<10}{res:>29}")
            else:
                print(f"{seq_len:>6}  {name:<10}{res.tokens_per_s:>10.0f}"
                      f"{res.peak_gib:>10.2f}{res.loss:>9.4f}"
                      f"{res.tokens_per_s * mfu_per_token(seq_len):>8.3f}")


def judge_specforge(results: dict[tuple[int, str], Result | str], seq_lens: list[int]) -> None:
    """Ours against SpecForge per length, then the verdict over all of them, last."""
    verdicts = []
    for seq_len in seq_lens:
        ours, theirs = results[seq_len, "ours"], results[seq_len, "specforge"]
        if not (isinstance(ours, Result) and isinstance(theirs, Result)):
            print(f"ratio ours/specforge T={seq_len}: n/a (a trainer failed)")
            verdicts.append(False)
            continue
        memory_ok = ours.peak_gib <= theirs.peak_gib
        loss_ok = ours.loss <= theirs.loss * (1 + LOSS_TOLERANCE)
        ratio = ours.tokens_per_s / theirs.tokens_per_s
        verdicts.append(ratio >= SPEEDUP_GOAL and memory_ok and loss_ok)
        print(f"ratio ours/specforge T={seq_len}: {ratio:.3f} (goal >= {SPEEDUP_GOAL}; peak "
              f"{ours.peak_gib:.2f} vs {theirs.peak_gib:.2f} GiB {'ok' if memory_ok else 'OVER'}"
              f"; loss {ours.loss:.4f} vs {theirs.loss:.4f} {'ok' if loss_ok else 'WORSE'}): "
              f"{'met' if verdicts[-1] else 'not met'}")
    print(f"goal (>= {SPEEDUP_GOAL}x SpecForge's tokens/s at <= its peak memory, loss no worse) "
          f"at every length: {'met' if all(verdicts) else 'not met'}")



def judge_storage(results: dict[tuple[int, str], Result | str], seq_lens: list[int]) -> None:
    """fp8 / bf16 tokens/s per length, then the lowest of them, the judged figure, last."""
    ratios = {}
    for seq_len in seq_lens:
        bf16, fp8 = results[seq_len, "bf16"], results[seq_len, "fp8"]
        if isinstance(bf16, Result) and isinstance(fp8, Result):
            ratios[seq_len] = fp8.tokens_per_s / bf16.tokens_per_s
            print(f"fp8 / bf16 tokens/s T={seq_len}: {ratios[seq_len]:.3f} (peak "
                  f"{fp8.peak_gib:.2f} vs {bf16.peak_gib:.2f} GiB; loss {fp8.loss:.4f} vs "
                  f"{bf16.loss:.4f})")
    lengths = ",".join(map(str, seq_lens))
    if len(ratios) < len(seq_lens):
        print(f"fp8 / bf16 tokens/s, lowest over T={lengths}: n/a (a run failed)")
        return
    lowest = min(ratios.values())
    print(f"fp8 / bf16 tokens/s, lowest over T={lengths}: {lowest:.3f} (goal >= "
          f"{STORAGE_GOAL}): {'met' if lowest >= STORAGE_GOAL else 'not met'}")


if __name__ == "__main__":
    sys.exit(main())
