"""Changing targets by editing the config: a reload sets the current run aside and starts (or
resumes) the run of the new target (SmolLM2 with other weights), each in its own folders;
nothing is mixed, lost or done twice, across a kill -9 of the daemon too, and each dataset's
dumps are its own target's (checked against independent forwards)."""

from __future__ import annotations

import signal
from collections import Counter

import pytest
import torch
from safetensors.torch import load_file

from eagle3d.dataset import contract, dumpformat, readrate
from eagle3d.statemachine import layout, runs
from eagle3d.statemachine.config_validation import load_config
from eagle3d.statemachine.ledger import Ledger
from eagle3d.target import loading
from tests.conftest import SMOLLM
from tests.test_config_in_force import SMOLLM_FILE, perturbed_model
from tests.pipeline import DaemonProcess, ctl, edit_config, messages_config, status

N = 6


def extracted(st: dict) -> int:
    return st["samples"]["extracted"] + st["samples"]["verified"]


def check_run(run: runs.Run) -> None:
    """Every sample of the run extracted once, its dataset holding its own contract's dumps
    only, one per sample."""
    doc = contract.read_checked(run.dataset_dir)
    dumps = sorted(readrate.dumps(run.dataset_dir))
    headers = [dumpformat.read_header(p) for p in dumps]
    assert {h.contract for h in headers} == {doc["fingerprint"]}
    with Ledger(layout.ledger(run.state_dir), readonly=True) as ledger:
        counts = ledger.counts()
        assert counts.get("verified") == counts.total == N == len(dumps)
        assert sorted(h.sample_id for h in headers) == sorted(
            s.id for s in ledger.samples("verified"))
        once = Counter(sid for _, _, sid in ledger.db.execute(
            "SELECT seq, kind, sample FROM events WHERE kind = 'extracted'"))
    assert set(once.values()) == {1}, once  # nothing extracted twice across the switches


def final_states(model_path, dumps: list[dict]) -> list[torch.Tensor]:
    model = loading.load_model(model_path, "float32", "cpu")
    with torch.no_grad():
        return [model(d["input_ids"].long()[None], output_hidden_states=True).hidden_states[-1][0]
                for d in dumps]


def check_forwards(run: runs.Run, own, other) -> None:
    """Two of the run's dumps are its own target's forward, not the other target's."""
    with Ledger(layout.ledger(run.state_dir), readonly=True) as ledger:
        dumps = [load_file(str(run.dataset_dir / s.path)) for s in ledger.samples("verified",
                                                                                   limit=2)]
    for model, wanted in ((own, True), (other, False)):
        for dump, state in zip(dumps, final_states(model, dumps)):
            cosine = torch.nn.functional.cosine_similarity(
                state.float(), dump["last_hidden_state"].float(), dim=-1).min()
            assert (cosine > 0.98) == wanted, (run.id, model, float(cosine))


@pytest.mark.slow
def test_switch_targets_and_back_across_a_kill_9(config_factory, tmp_path):
    config = messages_config(config_factory, tmp_path, N, extract={"batch_tokens": 256})
    other = perturbed_model(tmp_path / "other-target")  # the same shape, other weights
    with DaemonProcess(config) as d:
        st = d.status_until(lambda s: extracted(s) >= 2 and s["run"], 600, "A extracting")
        a = st["run"]["id"]
        edit_config(config, "target", model=str(other))
        d.proc.send_signal(signal.SIGHUP)
        st = d.status_until(lambda s: s["run"]["id"] != a and extracted(s) >= 1, 600,
                            "B extracting in its own run")
        b = st["run"]["id"]
        assert st["run"]["switched"] == f"{a} set aside, {b} started"
        assert [r["id"] for r in st["run"]["set_aside"]] == [a]
        shown = ctl(config, "status").stdout
        assert f"run       {b} ({a} set aside, {b} started) · 1 set aside (" in shown
        d.proc.kill()  # kill -9, in the middle of B
        d.proc.wait()
    reg = runs.read(load_config(config).paths.state_dir)
    run_a, run_b = reg.runs[a], reg.runs[b]
    assert run_a.in_place and run_b.dataset_dir == run_a.dataset_dir / "runs" / b
    with Ledger(layout.ledger(run_a.state_dir), readonly=True) as ledger:
        assert ledger.events_of(("run_set_aside",))
        a_before = {s.id for s in ledger.samples("verified")} | {
            s.id for s in ledger.samples("extracted")}
    assert a_before
    edit_config(config, "target", model=SMOLLM)  # back to A: a restart resumes it
    with DaemonProcess(config, "--until", "train") as d:
        assert d.wait(600) == 0, d.output()[-4000:]
    assert f"run {a} (resumed)" in d.output()
    check_run(run_a)
    text = ctl(config, "runs").stdout
    assert f"* {a}" in text and f"  {b}" in text
    edit_config(config, "target", model=str(other))  # and B finishes what the kill left
    with DaemonProcess(config, "--until", "train") as d:
        assert d.wait(600) == 0, d.output()[-4000:]
    check_run(run_b)
    assert status(config)["run"]["id"] == b
    check_forwards(run_a, SMOLLM_FILE, other)
    check_forwards(run_b, other, SMOLLM_FILE)
