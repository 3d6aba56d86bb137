"""The operator's view of a running daemon: what check-config says a reload would do, status
following the daemon whatever the editable file now says, and the exit codes of every wait
that needs a person."""

from __future__ import annotations

import signal
import subprocess
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from eagle3d.ctl import exit_codes
from eagle3d.ctl.exit_codes import (BAD_CONFIG, EDIT_NOT_APPLIED, NEEDS_RESTART_CODE,
                                    RELOAD_REFUSED, WAITS_FOR_OPERATOR)
from eagle3d.daemon import control
from eagle3d.daemon.reconcile import Daemon
from eagle3d.statemachine import layout
from eagle3d.statemachine.config_validation import load_config
from eagle3d.statemachine.ledger import Ledger
from eagle3d.statemachine.stages import Stage
from tests.conftest import venv_bin, write_conversations
from tests.test_extract_stage import FakeEngine, plan
from tests.test_ingest import H, write
from tests.test_stage_lifecycle import pipeline  # noqa: F401 (a fixture)
from tests.pipeline import ctl, edit_config as edit, status, stop_cleanly, wait_for


def test_a_budget_pause_then_a_refused_reload_under_a_running_daemon(tmp_path, config_factory):
    """A reserve the disk does not hold pauses extraction (rc 4, the key named, no model loaded to
    wait); check-config says what a reload of each edit would do; after a refused [paths]
    edit, status still finds the running daemon and says the edit was not applied (rc 5)."""
    source = write_conversations(tmp_path / "conv.jsonl", 6)
    import psutil
    almost_all = psutil.disk_usage(str(tmp_path)).total - 2**20  # a disk never that empty
    config = config_factory({"data": {"source": str(source), "format": "messages", "limit": 6},
                             "budget": {"reserve": almost_all}})
    daemon = subprocess.Popen([venv_bin("eagle3d"), "run", "-c", str(config)],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        st = wait_for(lambda: (s := status(config))["stage"] == "paused" and s, 120, "paused")
        assert "[budget] reserve" in st["reason"] and st["engine"]["status"] != "ready"
        shown = ctl(config, "status")
        assert shown.returncode == WAITS_FOR_OPERATOR, shown.stdout

        edit(config, "budget", reserve="100MiB")
        edit(config, "train", epochs=3.0)
        fixed = config.read_text()
        live = ctl(config, "check-config")
        assert live.returncode == 0 and "applied live" in live.stdout, live
        assert "[budget] reserve, [train] epochs" in live.stdout
        edit(config, "target", dtype="bfloat16")  # another capture contract: another run
        switch = ctl(config, "check-config")
        assert switch.returncode == 0 and "switches runs on reload" in switch.stdout, switch
        assert "starts a new run" in switch.stdout, switch
        config.write_text(fixed)
        edit(config, "train", node_rank=1, nnodes=2, rendezvous="127.0.0.1:29400")
        refused = ctl(config, "check-config")
        assert refused.returncode == RELOAD_REFUSED and "node_rank" in refused.stderr, refused

        config.write_text(fixed)
        edit(config, "paths", state_dir=str(tmp_path / "state2"),
             dataset_dir=str(tmp_path / "dataset2"))
        restart = ctl(config, "check-config")
        assert restart.returncode == NEEDS_RESTART_CODE, restart
        assert "needs a restart: [paths] state_dir, dataset_dir changed" in restart.stderr

        daemon.send_signal(signal.SIGHUP)
        wait_for(lambda: status(config).get("config_problem"), 60, "the refusal")
        shown = ctl(config, "status")
        assert shown.returncode == EDIT_NOT_APPLIED, shown.stdout
        assert f"running, pid {daemon.pid}" in shown.stdout
        assert "reload refused" in shown.stdout and "[paths] state_dir, dataset_dir" in shown.stdout
        assert "since " in shown.stdout
    finally:
        stop_cleanly(daemon, config)


def test_check_config_refuses_a_reserve_larger_than_the_file_system(config_factory):
    config = config_factory({"budget": {"reserve": "500TiB"}})
    out = ctl(config, "check-config")
    assert out.returncode == 2 and "[budget] reserve" in out.stderr, out


def test_check_config_without_a_daemon_judges_a_start(config_factory):
    """No daemon: a start begins the file's run, unless a dataset of another contract already
    holds the configured folders, where its first run would live."""
    from eagle3d.dataset import contract
    from tests.conftest import smollm_contract
    config = config_factory()
    fresh = ctl(config, "check-config")
    assert fresh.returncode == 0 and "a start starts a new run" in fresh.stdout, fresh
    cfg = load_config(config)
    cfg.paths.dataset_dir.mkdir(parents=True)
    contract.write(cfg.paths.dataset_dir, smollm_contract(cfg, dtype="bfloat16"))
    refused = ctl(config, "check-config")
    assert refused.returncode == RELOAD_REFUSED, refused
    assert "[target] dtype is 'float32', the contract says 'bfloat16'" in refused.stderr


class NoisyEngine(FakeEngine):
    """Captures the spot check's samples with a small difference, as bf16 rounding in another
    batch would: relative error about 0.01 per token row."""

    def submit(self, batch: list[dict[str, Any]], out: Path) -> None:
        spot = out.name == layout.spot_check_dir(out.parent).name
        ids = [item["id"] for item in batch]
        planned = self.ledger.plan_tokens(ids)
        for sid in ids:
            t = len(planned[sid][0]) // 4
            states = np.random.default_rng(0).standard_normal((t, 3 * H))
            if spot:
                states += 0.01 * np.random.default_rng(1).standard_normal((t, 3 * H))
            write(out, sid, planned[sid][0], contract=self.fingerprint, values=states)
        self._events.append({"event": "done", "ids": ids})


def test_a_failed_spot_check_is_cleared_by_a_reloaded_tolerance(config_factory):
    """The check names the sample, its error and the tolerance, and the key to change; a
    reload of [verify] spot_tolerance runs it again, and it passes."""
    config = config_factory({"verify": {"spot_checks": 2, "spot_tolerance": 0.001}})
    cfg = load_config(config)
    for folder in (cfg.paths.state_dir, cfg.paths.dataset_dir, cfg.paths.spool_dir):
        folder.mkdir(parents=True, exist_ok=True)
    plan(cfg, 6)
    ledger = Ledger(layout.ledger(cfg.paths.state_dir))
    daemon = Daemon(cfg, until="train", engine_factory=lambda cfg, pid_dir, doc: NoisyEngine(
        doc["fingerprint"], ledger))
    daemon.recover()

    def tick_until(predicate, what: str) -> None:
        wait_for(lambda: daemon.tick() or predicate(daemon.decision), 120, what, poll=0.05)
    try:
        tick_until(lambda d: d.stage == Stage.FAILED, "the spot check's failure")
        reason = daemon.decision.reason
        assert "spot check failed" in reason and "sample 0000" in reason, reason
        assert "> tolerance 0.001" in reason and "[verify] spot_tolerance" in reason
        # `eagle3ctl verify --full`: every sample read again, and the check run again (it
        # fails again: the tolerance is what it was).
        control.submit(cfg.paths.state_dir, "verify-full", {})
        checks = lambda: len(ledger.events_of(("spotcheck",)))  # noqa: E731
        tick_until(lambda d: checks() == 2 and d.stage == Stage.FAILED, "a second check")
        edit(config, "verify", spot_tolerance=0.1)
        daemon.reload()
        assert daemon.config_problem is None
        tick_until(lambda d: d.stage == Stage.TRAIN, "the check passed under the new tolerance")
        assert ledger.meta("spotcheck.ok") == "1"
    finally:
        daemon.shutdown()
        ledger.close()


def test_a_train_edit_trains_a_new_drafter_and_keeps_the_old_one(pipeline):
    """After done, a changed [train] trains again into the train folder and keeps the first
    drafter, with its evaluation, in versions/<its settings key>; status lists both."""
    from eagle3d.statemachine import train_files
    cfg, daemon, engines, stops, children, tick_until, lines, seen, go = pipeline
    children(trainer_runs=False)
    go.touch()
    tick_until(lambda: daemon.decision.stage == Stage.DONE, "the first drafter")
    first = train_files.train_key(cfg)
    (layout.export_dir(cfg.paths.train_dir) / "model.safetensors").write_text("first")
    edit(cfg.path, "train", epochs=3.0)
    daemon.reload()
    assert daemon.cfg.train.epochs == 3.0
    tick_until(lambda: daemon.decision.stage == Stage.DONE, "the second drafter")
    kept = layout.versions_dir(cfg.paths.train_dir) / first
    assert (layout.export_dir(kept) / "model.safetensors").read_text() == "first"
    assert not (layout.export_dir(cfg.paths.train_dir) / "model.safetensors").exists()
    assert train_files.read_eval(kept)["acceptance_length"] == 1.5
    assert lines().count("evaluate") == 2
    trainer = daemon.stages[-1].status()
    assert trainer["version"] == train_files.train_key(daemon.cfg) != first
    assert [v["key"] for v in trainer["versions"]] == [first]


def test_help_and_the_operations_guide_list_every_exit_code(config_factory):
    shown = subprocess.run([venv_bin("eagle3ctl"), "--help"], capture_output=True, text=True,
                           timeout=60).stdout
    guide = (Path(__file__).resolve().parents[1] / "docs" / "operations.md").read_text()
    # Every code of ctl/exit_codes.py: status's and check-config's in the guide's table, the
    # requests' "not now" in the paragraph after it.
    codes = {0, *(v for k, v in vars(exit_codes).items() if k.isupper())}
    for code in codes - {exit_codes.NOT_NOW}:
        assert f"\n  {code}  " in shown and f"\n| {code} |" in guide, code
    assert f"\n  {exit_codes.NOT_NOW} pause, resume" in shown
    assert f"and {exit_codes.NOT_NOW} when the daemon runs" in " ".join(guide.split())
    until = subprocess.run([venv_bin("eagle3d"), "run", "--help"], capture_output=True,
                           text=True, timeout=60).stdout
    assert "before any of its work" in " ".join(until.split())


def test_status_of_a_failed_stage_and_of_an_evaluation(config_factory):
    """No `gate open` beside a failed stage (nothing goes through it); an evaluation shows as
    evaluating, not as a rate of 0 tokens/s with an ETA of 0 s."""
    from eagle3d.statemachine.statefile import write_state
    config = config_factory()
    state_dir = load_config(config).paths.state_dir
    state_dir.mkdir(parents=True)
    gate = {"open": True, "describe": "open", "waits_for_operator": False}
    write_state(state_dir, {"stage": "failed", "reason": "spot check failed", "gate": gate})
    assert "gate      open" not in ctl(config, "status").stdout
    write_state(state_dir, {"stage": "train", "reason": "training the drafter", "gate": gate,
                            "eta_s": 0.0, "trainer": {"status": "evaluating", "step": 40,
                                                      "total_steps": 40}})
    shown = ctl(config, "status").stdout
    assert "rate      evaluating the drafter" in shown and "ETA 0s" not in shown, shown
    assert "gate      open" in shown


def test_skipped_reasons_group_the_token_counts(tmp_path):
    from eagle3d.statemachine.ledger import PlannedSample
    with Ledger(tmp_path / "ledger.sqlite") as ledger:
        ledger.add_planned([PlannedSample("a" * 32, 0, 10, 5, "h", b"", b"")],
                           [(1, "over max_tokens (812 tokens)"),
                            (2, "over max_tokens (900 tokens)"),
                            (3, "first prompt over max_tokens (600 tokens)"),
                            (4, "no loss tokens")], {})
        assert ledger.skipped_reasons() == {"over max_tokens": 2, "no loss tokens": 1,
                                            "first prompt over max_tokens": 1}


def test_a_spool_cap_below_one_batch_pauses_extraction_with_its_key(config_factory):
    """`spool_max = "1KiB"` used to do nothing: the spool is nearly always empty when dispatch
    looks (ingest drains it within a tick). A cap no batch fits in pauses, naming the keys."""
    from eagle3d.daemon.stages.extract import ExtractStage
    from eagle3d.statemachine import plan_meta
    from eagle3d.statemachine.stages import Seen
    cfg = load_config(config_factory({"budget": {"spool_max": "1KiB"}}))
    for folder in (cfg.paths.state_dir, cfg.paths.dataset_dir, cfg.paths.spool_dir):
        folder.mkdir(parents=True, exist_ok=True)
    plan(cfg, 4)
    with Ledger(layout.ledger(cfg.paths.state_dir)) as ledger:
        seen = Seen(ledger.counts(), None, plan_meta.read(ledger))
        pause = ExtractStage(cfg, ledger, cfg.paths.state_dir).budget_pause(seen)
    assert pause and "[budget] spool_max (1.0 KiB) is smaller than one batch" in pause, pause
    assert "[extract] batch_tokens" in pause


UNKNOWN_ENGINE = "[target.engine] must be one of 'transformers', 'sglang', got 'vllm'"
# An edit, and what both check-config and then the reload itself make of it.
RELOAD_CASES = {
    "dataset_dir moved": ({}, ("paths", {"dataset_dir": "elsewhere"}), NEEDS_RESTART_CODE,
                          "[paths] dataset_dir changed"),
    "a shard's contract edited": ({"data": {"shards": 2, "shard": 0}},
                                  ("target", {"dtype": "bfloat16"}), RELOAD_REFUSED,
                                  "a sharded extraction keeps one run per set of roots"),
    # The schema reads any name; the engines' registry refuses one it does not hold.
    "an unknown engine": ({}, ("target", {"engine": "vllm"}), BAD_CONFIG, UNKNOWN_ENGINE),
}


@pytest.mark.parametrize("case", list(RELOAD_CASES))
def test_check_config_says_what_the_reload_then_does(config_factory, tmp_path, case):
    """check-config judges an edit exactly as the running daemon's reload then does: a moved
    [paths] folder needs a restart (never "no change"), and a sharded node's contract edit is
    refused (never "switches runs")."""
    overrides, (section, values), code, why = RELOAD_CASES[case]
    config = config_factory(overrides)
    daemon = Daemon(load_config(config))
    try:
        first = daemon.current
        edit(config, section, **{k: str(tmp_path / v) if section == "paths" else v
                                 for k, v in values.items()})
        checked = ctl(config, "check-config")
        assert checked.returncode == code and why in checked.stderr, checked
        daemon.reload()
        assert daemon.switching is None and daemon.current == first
        assert why in daemon.config_problem, daemon.config_problem  # status: exit 5
    finally:
        daemon.ledger.close()


def test_check_config_says_a_raised_limit_retrains_from_step_0(config_factory):
    """A checkpoint is of one manifest: raising [data] limit trains the grown dataset from its
    first step, and check-config says so rather than promising to keep the training done."""
    config = config_factory()
    daemon = Daemon(load_config(config))
    try:
        edit(config, "data", limit=daemon.cfg.data.limit * 2)
        checked = ctl(config, "check-config")
        assert checked.returncode == 0 and "applied live" in checked.stdout, checked
        assert "[data] limit raised" in checked.stdout and "retrains from step 0" in checked.stdout
    finally:
        daemon.ledger.close()
