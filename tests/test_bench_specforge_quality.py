"""bench/specforge_quality.py at its smallest, end to end on CPU: both trainers train a few steps
on the real cached SmolLM2 dataset, both exports are evaluated as `eagle3ctl eval` evaluates
them, and the ratio is printed last. Skipped where SpecForge is not installed (CI installs
neither it nor the Triton its import needs: `pip install --no-deps` its wheel, and triton)."""

from __future__ import annotations

import importlib.util
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from drafter_fixtures import cached_dataset, write_config

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "bench" / "specforge_quality.py"
TRAIN = {"draft_vocab": 2048, "ttt_steps": 2, "epochs": 1.0, "batch_tokens": 1024, "lr": 3e-4,
         "warmup_steps": 1}
EVAL = {"first": 17000, "limit": 3, "steps": 2, "max_new_tokens": 16}
ROW = re.compile(r"^(ours|specforge)\s+acceptance length (\d+\.\d+) \(95% .*\); per position "
                 r"(\d\.\d+) / (\d\.\d+); .*identical to greedy: True")

needs_specforge = pytest.mark.skipif(
    importlib.util.find_spec("specforge") is None or importlib.util.find_spec("triton") is None,
    reason="SpecForge (and the triton its import needs) is not installed: CI does not install "
           "it")


@pytest.mark.slow  # 30 s on 2 idle cores, ~3 min busy: it loads SmolLM2 twice
@needs_specforge
def test_smallest_comparison_trains_both_evaluates_both_and_prints_the_ratio_last(tmp_path):
    config = write_config(tmp_path, cached_dataset(32), TRAIN, EVAL)
    out = subprocess.run([sys.executable, str(SCRIPT), "-c", str(config), "--steps", "3",
                          "--out", str(tmp_path / "exports")], cwd=ROOT, capture_output=True,
                         text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.strip().splitlines()
    rows = {m.group(1): m for m in map(ROW.match, lines) if m}
    assert sorted(rows) == ["ours", "specforge"], out.stdout
    for m in rows.values():
        assert float(m.group(2)) >= 1.0  # a forward keeps at least the target's own token
        assert float(m.group(3)) >= float(m.group(4))  # positions compound
    last = re.fullmatch(r"ours / SpecForge acceptance length at 3 equal steps: (\d+\.\d+)",
                        lines[-1])
    assert last, lines[-1]
    ratio = float(last.group(1))
    assert math.isfinite(ratio) and ratio == pytest.approx(
        float(rows["ours"].group(2)) / float(rows["specforge"].group(2)), abs=1e-3)
    # Both in our export format, trained apart from the same start.
    from safetensors.torch import load_file
    ours, theirs = (load_file(str(tmp_path / "exports" / name / "model.safetensors"))
                    for name in ("ours", "specforge"))
    assert sorted(ours) == sorted(theirs)
    assert not torch.equal(ours["fc.weight"], theirs["fc.weight"])


@needs_specforge
def test_specforge_learns_the_same_positions_as_ours_at_every_ttt_step():
    """The loss mask handed to SpecForge makes it count, at every TTT step, exactly the output
    indices whose teacher ours learns there: SpecForge shifts the target states one left
    (TargetHead.preprocess) and, after each step, its loss mask one more (utils.padding)."""
    sys.path.insert(0, str(SCRIPT.parent))
    from specforge_quality import specforge_batch
    from specforge.utils import padding

    from eagle3d.drafter import data, loss
    steps, B, T, H = 3, 2, 12, 4
    targets = torch.zeros(B, T, dtype=torch.bool)
    targets[0, 2:7] = True   # an answer in the middle of row 0
    targets[1, :10] = True   # row 1: every position but its last (loss_on = "all")
    batch = data.Batch(torch.zeros(B, T, dtype=torch.long), torch.zeros(B, T, 3 * H),
                       torch.zeros(B, T, H), targets, int(targets.sum()))
    mask = specforge_batch(batch).loss_mask
    picks = loss.teacher(batch.last, targets, torch.zeros(8, H), steps).picks
    for k in range(steps):
        ours = sorted(zip(picks[k].batch.tolist(), picks[k].index.tolist()))
        theirs = sorted(map(tuple, mask.nonzero().tolist()))
        assert ours == theirs, k
        mask = padding(mask, left=False)
