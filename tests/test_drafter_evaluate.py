"""The demo-sized run end to end: ~200 real ShareGPT samples of SmolLM2, the demo's [train]
settings, then speculative decoding on held-out prompts with the real target."""

import json
import subprocess
import sys

import pytest

from drafter_fixtures import cached_dataset, write_config

# etc/demo.toml's [train] with the learning rate recommended for so short a run.
DEMO_TRAIN = {"draft_vocab": 8192, "ttt_steps": 3, "epochs": 2.0, "batch_tokens": 2048,
              "lr": 1e-3, "warmup_steps": 10, "checkpoint_every": 50}
DEMO_EVAL = {"first": 17000, "limit": 8, "steps": 4, "max_new_tokens": 48}


@pytest.mark.slow
@pytest.mark.long
def test_demo_sized_drafter_accepts_more_than_one_token_and_keeps_greedy_output(tmp_path):
    data_root = cached_dataset(200, 0, 1024)
    config = write_config(tmp_path, data_root, DEMO_TRAIN, DEMO_EVAL, max_tokens=1024)
    run = subprocess.run([sys.executable, "-m", "eagle3d.drafter.train", "-c", str(config)],
                         capture_output=True, text=True, timeout=1200)
    assert run.returncode == 0, run.stderr[-3000:]
    ev = subprocess.run([sys.executable, "-m", "eagle3d.drafter.evaluate", "-c", str(config),
                         "--json"], capture_output=True, text=True, timeout=1200)
    assert ev.returncode == 0, ev.stderr[-3000:]
    report = json.loads(ev.stdout.splitlines()[-1])
    print(report)
    assert report["identical_to_greedy"] is True
    # Measured 1.25 with these settings (1.19 with lr 3e-4); an untrained drafter scores 1.00.
    assert report["acceptance_length"] > 1.1
    acc = report["per_position_acceptance"]
    assert acc[0] > 0.1 and acc[0] >= acc[-1]  # positions compound
