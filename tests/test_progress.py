"""The progress line that the log and `systemctl status` show: every long stage with its
totals, rate and ETA, and a real daemon's log carrying one for each stage it went through."""

from __future__ import annotations

import json

import pytest

from eagle3d.daemon.progress import line
from tests.pipeline import DaemonProcess, messages_config

SAMPLES = {"ungenerated": 0, "generating": 0, "pending": 40, "inflight": 10, "extracted": 30,
           "verified": 20, "failed": 0, "excluded": 0, "total": 100, "skipped": 3}


def state(stage: str, **parts) -> dict:
    return {"stage": stage, "underlying": stage, "reason": "why", "samples": dict(SAMPLES),
            "tokens": {"done": 1_250_000, "total": 3_000_000}, "eta_s": 3725, **parts}


@pytest.mark.parametrize("stage, parts, says", [
    ("plan", {}, "plan: 100 samples planned (3 conversations skipped), ETA 1h 02m; why"),
    ("generate", {"samples": {**SAMPLES, "ungenerated": 60, "generating": 8},
                  "generate": {"rate_per_s": 2.5}},
     "generate: 32/100 answers written by the target, 2.50 samples/s, ETA 1h 02m; why"),
    ("extract", {"rate": {"tokens_per_s": 3100.4}},
     "extract: 50/100 samples, 1.2M/3.0M tokens, 3,100 tokens/s, ETA 1h 02m; why"),
    ("verify", {"verify": {"done": 7, "total": 50}},
     "verify: 7/50 checked in this pass, 20/100 samples verified, ETA 1h 02m; why"),
    ("train", {"trainer": {"status": "training", "step": 120, "total_steps": 900, "loss": 2.5,
                           "acc": [0.41, 0.3], "tokens_per_s": 15000}},
     "train: step 120/900, loss 2.500, accuracy 0.41/0.30, 15,000 tokens/s, ETA 1h 02m; why"),
    ("train", {"trainer": {"status": "evaluating"}, "eta_s": None},
     "train: evaluating the drafter on held-out prompts; why"),
    ("done", {"trainer": {"acceptance_length": 2.5453}, "eta_s": None},
     "done: drafter exported, acceptance length 2.545; why"),
])
def test_each_stage_says_how_far_of_how_much(stage, parts, says):
    assert line(state(stage, **parts)) == says


def test_a_pause_names_the_stage_it_holds():
    paused = {**state("extract"), "stage": "paused", "eta_s": None, "reason": "disk budget"}
    assert line(paused) == "paused (extract): 50/100 samples, 1.2M/3.0M tokens; disk budget"


@pytest.mark.slow
def test_the_log_has_a_progress_line_for_every_stage_it_went_through(config_factory, tmp_path):
    config = messages_config(config_factory, tmp_path, 4)
    with DaemonProcess(config, "--until", "train",
                       env={"EAGLE3D_LOG_FORMAT": "json"}) as d:  # plan, extract, verify
        assert d.wait(600) == 0, d.output()[-4000:]
        records = [json.loads(text) for text in d.output().splitlines() if text.startswith("{")]
    said = [r["message"] for r in records if r["message"].startswith("progress ")]
    for stage in ("plan", "extract", "verify"):
        assert any(m.startswith(f"progress {stage}: ") for m in said), said
    assert any(m.startswith("progress extract: 0/4 samples, 0/") for m in said), said  # totals
