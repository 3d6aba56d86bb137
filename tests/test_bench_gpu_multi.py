"""bench/gpu_multi.py at a tiny shape on CPU over gloo, as the lead runs it on two GPUs: both
scaling runs train and report, and the resume check kills rank 1 of the real trainer after a
checkpoint and sees it resume from there. No timing is asserted."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "bench" / "gpu_multi.py"


@pytest.mark.slow
def test_tiny_run_over_gloo_scales_and_resumes():
    out = subprocess.run([sys.executable, str(SCRIPT), "--tiny", "--device", "cpu", "--steps",
                          "2", "--warmup", "1", "--repeats", "1"], capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    lines = out.stdout.strip().splitlines()
    assert re.fullmatch(r"resume check: rank 1 killed after step \d+, the trainer exited \d+ "
                        r"[\d.]+ s later; restarted, it resumed at step (20|40|60|80|100) "
                        r"\(checkpoints every 20\) and logged steps 1-120: passed", lines[-4])
    for world, line in zip((1, 2), lines[-3:-1]):
        assert re.match(rf"{world} process\(es\): \d+ tokens/s", line), line
    assert re.fullmatch(r"ratio 2 GPUs / 1 GPU: [\d.]+ \(goal >= 1.85\): (met|not met)",
                        lines[-1])
