"""How far two captures of the same sample differ when only the batch around it changes: the
figure [verify] spot_tolerance must clear with margin (the spot check re-extracts a verified
sample in another batch than the one that wrote it).

Each of N ShareGPT conversations (the demo's target, SmolLM2-135M-Instruct, on CPU) is captured
inside one right-padded batch of N, and again alone (--group 1) or in batches of --group samples
with other neighbours and another padded length, and the two dumps are
compared as the spot check compares them (daemon/dump_checks.py: relative error of each token row,
the SPOT_QUANTILE row of each captured layer), in bf16 and in fp8 dumps.

    .venv/bin/python bench/spot_tolerance.py [--n 16] [--max-tokens 384]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import numpy as np

from eagle3d.capture.engines.transformers.worker import Capturer, Job
from eagle3d.daemon import dump_checks
from eagle3d.dataset import dumpformat, precision
from eagle3d.dataset.conversations import iter_conversations
from eagle3d.statemachine.config_schema import FP8
from eagle3d.statemachine.config_validation import load_config
from eagle3d.target import loading

DEMO = Path(__file__).resolve().parent.parent / "etc" / "demo.toml"


def jobs(cfg, n: int, max_tokens: int) -> list[Job]:
    tok = loading.load_tokenizer(cfg.target.model_path)
    out: list[Job] = []
    for conv in iter_conversations(cfg.data.source_path, cfg.data.format, cfg.data.first, 4 * n):
        if conv.messages is None:
            continue
        text = tok.apply_chat_template(list(conv.messages), tokenize=False)
        ids = tok(text, add_special_tokens=False)["input_ids"][:max_tokens]
        if len(ids) >= 16:
            out.append(Job(f"{len(out):032x}", list(ids), [1] * len(ids)))
        if len(out) == n:
            return out
    return out


def errors(stored: Path, fresh: Path) -> float:
    """The spot check's figure: the worst captured layer's SPOT_QUANTILE row, over both tensors."""
    a, b = dumpformat.read_header(stored), dumpformat.read_header(fresh)
    worst = 0.0
    with open(stored, "rb") as fa, open(fresh, "rb") as fb:
        for name in dumpformat.HIDDEN:
            e = dump_checks._relative_errors(fa.fileno(), a, fb.fileno(), b, name)
            worst = max(worst, float(np.quantile(e, dump_checks.SPOT_QUANTILE, axis=0,
                                                 method="higher").max()))
    return worst


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--n", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=384)
    p.add_argument("--group", type=int, default=1,
                   help="the other capture: in batches of this many (1: each sample alone)")
    args = p.parse_args()
    cfg = load_config(DEMO)
    model = loading.load_model(cfg.target.model_path, cfg.target.dtype, "cpu")
    layers = [2, 15, 27]
    batch = jobs(cfg, args.n, args.max_tokens)
    print(f"{len(batch)} samples, {min(len(j.input_ids) for j in batch)}-"
          f"{max(len(j.input_ids) for j in batch)} tokens, target dtype {cfg.target.dtype}")
    for dump_dtype in ("bfloat16", FP8):
        cap = Capturer(model, layers, "f" * 16, 10**9, dump_dtype)
        with tempfile.TemporaryDirectory() as tmp:
            alone, together = Path(tmp, "alone"), Path(tmp, "together")
            alone.mkdir(), together.mkdir()
            states = cap.forward(batch)
            for row, j in enumerate(batch):
                n = len(j.input_ids)
                cap.write_dump(together, j, {k: t[row, :n] for k, t in states.items()})
            # Every g-th sample together: other neighbours, another padded length.
            groups = max(len(batch) // args.group, 1)
            for first in range(groups):
                group = batch[first::groups]
                other = cap.forward(group)
                for row, j in enumerate(group):
                    n = len(j.input_ids)
                    cap.write_dump(alone, j, {k: t[row, :n] for k, t in other.items()})
            errs = sorted(errors(alone / dumpformat.dump_name(j.id),
                                 together / dumpformat.dump_name(j.id)) for j in batch)
        bound = precision.spot_tolerance(cfg.verify.spot_tolerance, "F8_E4M3" if dump_dtype == FP8
                                         else "BF16")
        print(f"{dump_dtype:9s} in batches of {args.group} vs one of {len(batch)}: "
              f"median {np.median(errs):.4f}, "
              f"max {errs[-1]:.4f} (per-sample: {' '.join(f'{e:.4f}' for e in errs)}); "
              f"the check's bound at spot_tolerance {cfg.verify.spot_tolerance}: {bound:.4f}")
        cap.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
