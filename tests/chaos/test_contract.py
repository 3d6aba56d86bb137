"""Target switches under load: the daemon killed while it extracts target A, restarted with the
config edited to target B (another model file), switched back to A by a reload while B's engine
works. Each run's dataset holds its own contract's dumps only, A's dataset completes with
nothing lost, and B's run waits, resumable, in its own folders."""

from __future__ import annotations

import shutil
import signal
from pathlib import Path

import pytest

from eagle3d.dataset import contract as capture_contract, dumpformat, readrate
from eagle3d.statemachine import runs
from eagle3d.statemachine.config_validation import load_config
from tests.chaos.figures import SCALE
from tests.chaos.harness import (audit, chaos_config, counts, describe, end, kill9,
                                 orphans_after_kill, until)
from tests.pipeline import DaemonProcess, edit_config

pytestmark = [pytest.mark.slow, pytest.mark.chaos]


def own_dumps_only(run: runs.Run) -> int:
    """The run's dataset files, each of its own contract; returns how many."""
    fingerprint = capture_contract.read_checked(run.dataset_dir)["fingerprint"]
    dumps = list(readrate.dumps(run.dataset_dir))
    strangers = [p.name for p in dumps if dumpformat.read_header(p).contract != fingerprint]
    assert not strangers, f"{run.id} holds another contract's dumps: {strangers[:5]}"
    return len(dumps)


def test_target_switches_under_load_mix_nothing_and_lose_nothing(config_factory, tmp_path,
                                                                 figures):
    n = 6 * SCALE
    config = chaos_config(config_factory, tmp_path, n)
    cfg = load_config(config)
    model_a = cfg.target.model
    model_b = str(shutil.copy(cfg.target.model_path, tmp_path / "target-b.gguf"))
    with DaemonProcess(config) as d:
        until(d, lambda: counts(cfg).get("extracted", 0) + counts(cfg).get("verified", 0) >= 1,
              300, "A's first extracted sample")
        kill9(d)
    left = orphans_after_kill(config)
    end(left)
    assert not left, f"children outlived the daemon: {describe(left)}"
    figures.crashes += 1

    a = runs.read(cfg.paths.state_dir).current
    edit_config(config, "target", model=model_b)
    with DaemonProcess(config, "--until", "train") as d:  # the restart opens B's run
        until(d, lambda: runs.read(cfg.paths.state_dir).current != a, 120, "B's run")
        reg = runs.read(cfg.paths.state_dir)
        run_b = reg.runs[reg.current]
        b_cfg = runs.run_config(cfg, run_b)
        until(d, lambda: counts(b_cfg).get("inflight", 0) + counts(b_cfg).get("extracted", 0),
              300, "B's engine at work")
        edit_config(config, "target", model=model_a)
        d.proc.send_signal(signal.SIGHUP)  # back to A, B's samples in flight
        assert d.wait(600) == 0, d.output()[-4000:]
    reg = runs.read(cfg.paths.state_dir)
    run_a = reg.runs[a]
    assert reg.current == a and run_a.in_place and not run_b.in_place
    assert f"{run_b.id} set aside, {run_a.id} resumed" in d.output()
    assert counts(b_cfg).get("inflight", 0) == 0  # B's in-flight samples went back to pending
    own_dumps_only(run_b)
    assert own_dumps_only(run_a) == n
    figures.faults += 1
    assert figures.audited(audit(config, n, trained=False)) == 0
