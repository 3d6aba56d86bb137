"""bfloat16 against float32 on this CPU, for the demo's three kinds of work, side by side:

- write: the target writing answers (capture/engines/transformers/decoder.py's TransformersDecoder: SmolLM2-135M-
  Instruct, the demo's batch of 32 prompts, greedy);
- capture: the target's forward over whole conversations, as extract runs it;
- train: the drafter's training step at the demo's shape (drafter/train.py's train_step, with
  and without the bf16 autocast it takes where the CPU has bf16 units).

The arms alternate ABBA, each timed after a warm-up. Judged by, for each kind of work,

    ratio = bf16 throughput / float32 throughput

and, printed last, the lowest of the three (goal: >= 1.5 where target/loading.py's
cpu_computes_bf16 finds bf16 units, which is what etc/demo.toml's dtype and the trainer's
autocast rely on; on a CPU without them the ratio says why they stay in float32 there).

    .venv/bin/python bench/cpu_bf16.py
    .venv/bin/python bench/cpu_bf16.py --quick    # a smoke run (the tests)
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import torch

from eagle3d.capture.engines.transformers.decoder import TransformersDecoder
from eagle3d.drafter import train as train_mod
from eagle3d.statemachine.config_schema import GenerateConfig
from eagle3d.statemachine.config_validation import load_config
from eagle3d.target import loading
from gpu_train import OurTrainer, Shape, abba, initial_weights, random_batches, random_target

GOAL = 1.5
DEMO = Path(__file__).resolve().parents[1] / "etc" / "demo.toml"
# The demo's draft: SmolLM2-135M's widths and the demo's draft vocabulary.
SMOLLM2 = Shape("SmolLM2-135M-sized", hidden=576, intermediate=1536, heads=9, kv_heads=3,
                head_dim=64, vocab=49152, draft_vocab=8192, rope_theta=100000.0)
DTYPES = ("float32", "bfloat16")


def writing(model_path: Path, batch: int, new_tokens: int) -> dict[str, Callable[[], int]]:
    """Per dtype, one batched greedy decode of `batch` prompts; returns the tokens it wrote."""
    tokenizer = loading.load_tokenizer(model_path)
    whats = ["cat", "pilot", "farmer", "robot", "teacher", "child", "king", "baker"]
    ids = [tokenizer(tokenizer.apply_chat_template(
        [{"role": "user", "content": f"Write a long story about a {whats[i % 8]} who codes."}],
        add_generation_prompt=True, tokenize=False), add_special_tokens=False)["input_ids"]
        for i in range(batch)]
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    arms = {}
    for dtype in DTYPES:
        model = loading.load_model(model_path, dtype, "cpu")
        # No stop token: every row decodes new_tokens, so both arms do the same work.
        decode = TransformersDecoder(model, pad, {SMOLLM2.vocab},
                                     GenerateConfig(max_new_tokens=new_tokens))
        arms[dtype] = lambda decode=decode: sum(map(len, decode(ids, [new_tokens] * batch, 0)))
    return arms


def capturing(model_path: Path, rows: int, length: int) -> dict[str, Callable[[], int]]:
    """Per dtype, one forward over `rows` sequences of `length` tokens; returns the tokens."""
    ids = torch.randint(0, SMOLLM2.vocab, (rows, length),
                        generator=torch.Generator().manual_seed(0))
    arms = {}
    for dtype in DTYPES:
        model = loading.load_model(model_path, dtype, "cpu")

        def forward(model=model) -> int:
            with torch.inference_mode():
                model.model(input_ids=ids, output_hidden_states=True)
            return ids.numel()
        arms[dtype] = forward
    return arms


def training(steps: int, seq_len: int) -> dict[str, Callable[[], int]]:
    """Per arm, `steps` training steps of drafter/train.py at the demo's shape, TTT 2; bf16 is
    the trainer as it runs here where the CPU has bf16 units, float32 the trainer without."""
    cpu = torch.device("cpu")
    target = random_target(SMOLLM2, cpu)
    weights = initial_weights(SMOLLM2, target, seq_len + 2, cpu)
    batches = random_batches(SMOLLM2, seq_len, 2, cpu)
    trainer = OurTrainer(SMOLLM2, target, weights, seq_len + 2, 2e-3, 2, cpu)
    trainer.prepare(batches)

    def run(bf16: bool) -> int:
        train_mod.cpu_computes_bf16 = lambda: bf16  # the trainer's own switch, both ways
        for i in range(steps):
            trainer.step(batches[i % len(batches)])
        return steps * seq_len
    return {"float32": lambda: run(False), "bfloat16": lambda: run(True)}


def measure(name: str, arms: dict[str, Callable[[], int]], rounds: int) -> float:
    """Throughput per arm over ABBA rounds after one warm-up each; prints a line, returns the
    bf16 / float32 ratio of the medians."""
    for fn in arms.values():
        fn()
    rates: dict[str, list[float]] = {dtype: [] for dtype in arms}
    for dtype in abba(list(arms), rounds):
        started = time.perf_counter()
        done = arms[dtype]()
        rates[dtype].append(done / (time.perf_counter() - started))
    median = {dtype: statistics.median(r) for dtype, r in rates.items()}
    ratio = median["bfloat16"] / median["float32"]
    print(f"{name}: bf16 {median['bfloat16']:,.0f} vs float32 {median['float32']:,.0f} tokens/s,"
          f" ratio {ratio:.2f}", flush=True)
    return ratio


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=4, help="timed runs of each arm, ABBA")
    p.add_argument("--quick", action="store_true", help="a smoke run: tiny work, one round")
    args = p.parse_args(argv)
    model_path = load_config(DEMO).target.model_path
    rounds = 1 if args.quick else args.rounds
    units = loading.cpu_computes_bf16()
    print(f"CPU bfloat16 units (AVX512-BF16 or AMX): {'yes' if units else 'no'}; "
          f"{torch.get_num_threads()} threads", flush=True)
    batch, new_tokens = (8, 4) if args.quick else (32, 48)
    rows, length = (1, 64) if args.quick else (4, 512)
    steps, seq_len = (2, 128) if args.quick else (10, 1024)
    ratios = [
        measure(f"write (SmolLM2, {batch} prompts, {new_tokens} new tokens each, greedy)",
                writing(model_path, batch, new_tokens), rounds),
        measure(f"capture (SmolLM2 forward, {rows} x {length} tokens)",
                capturing(model_path, rows, length), rounds),
        measure(f"train ({steps} drafter steps of {seq_len} tokens, TTT 2)",
                training(steps, seq_len), rounds),
    ]
    verdict = ("met" if min(ratios) >= GOAL else "not met") if units else \
        "n/a: no bf16 units, float32 is used"
    print(f"bf16 / float32 throughput, lowest of write, capture, train: {min(ratios):.2f} "
          f"(goal >= {GOAL} on a CPU with bf16 units): {verdict}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
