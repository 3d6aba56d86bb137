"""The operator's view of a running daemon: what check-config says a reload would do, status
following the daemon whatever the editable file now says, and the exit codes of every wait
that needs a person."""

from __future__ import annotations

import signal
import subprocess

import tomli_w
import tomllib

from eagle3d.daemon.ctl import (EDIT_NOT_APPLIED, NEEDS_RESTART_CODE, RELOAD_REFUSED,
                                WAITS_FOR_OPERATOR)
from tests.conftest import venv_bin, write_conversations
from tests.test_ctl import ctl, status, wait_for


def edit(config, section: str, **values) -> None:
    doc = tomllib.loads(config.read_text())
    doc.setdefault(section, {}).update(values)
    config.write_text(tomli_w.dumps(doc))


def test_a_budget_pause_then_a_refused_reload_under_a_running_daemon(tmp_path, config_factory):
    """A reserve no disk holds pauses extraction (rc 4, the key named, no model loaded to
    wait); check-config says what a reload of each edit would do; after a refused [paths]
    edit, status still finds the running daemon and says the edit was not applied (rc 5)."""
    source = write_conversations(tmp_path / "conv.jsonl", 6)
    config = config_factory({"data": {"source": str(source), "format": "messages", "limit": 6},
                             "budget": {"reserve": "500TiB"}})
    daemon = subprocess.Popen([venv_bin("eagle3d"), "run", "-c", str(config)],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        st = wait_for(lambda: (s := status(config))["stage"] == "paused" and s, what="paused")
        assert "[budget] reserve" in st["reason"] and st["engine"]["status"] != "ready"
        shown = ctl(config, "status")
        assert shown.returncode == WAITS_FOR_OPERATOR, shown.stdout

        edit(config, "budget", reserve="100MiB")
        edit(config, "train", epochs=3.0)
        fixed = config.read_text()
        live = ctl(config, "check-config")
        assert live.returncode == 0 and "applied live" in live.stdout, live
        assert "[budget] reserve, [train] epochs" in live.stdout
        edit(config, "target", dtype="bfloat16")
        refused = ctl(config, "check-config")
        assert refused.returncode == RELOAD_REFUSED and "dtype" in refused.stderr, refused

        config.write_text(fixed)
        edit(config, "paths", state_dir=str(tmp_path / "state2"),
             dataset_dir=str(tmp_path / "dataset2"))
        restart = ctl(config, "check-config")
        assert restart.returncode == NEEDS_RESTART_CODE, restart
        assert "needs a restart: [paths] changed" in restart.stderr

        daemon.send_signal(signal.SIGHUP)
        wait_for(lambda: status(config).get("config_problem"), what="the refusal")
        shown = ctl(config, "status")
        assert shown.returncode == EDIT_NOT_APPLIED, shown.stdout
        assert f"running, pid {daemon.pid}" in shown.stdout
        assert "reload refused" in shown.stdout and "[paths] changed" in shown.stdout
        assert "since " in shown.stdout
    finally:
        daemon.send_signal(signal.SIGTERM)
        out, _ = daemon.communicate(timeout=120)
    assert daemon.returncode == 0, out
    assert ctl(config, "status").returncode == 3


def test_check_config_refuses_a_reserve_larger_than_the_file_system(config_factory):
    config = config_factory({"budget": {"reserve": "500TiB"}})
    out = ctl(config, "check-config")
    assert out.returncode == 2 and "[budget] reserve" in out.stderr, out


def test_check_config_without_a_daemon_judges_a_start(config_factory):
    """No daemon: a start applies the file, unless the dataset's contract refuses it."""
    from eagle3d.dataset import contract
    from eagle3d.statemachine.config import load_config
    from tests.conftest import smollm_contract
    config = config_factory()
    fresh = ctl(config, "check-config")
    assert fresh.returncode == 0 and "a start applies it" in fresh.stdout, fresh
    cfg = load_config(config)
    cfg.paths.dataset_dir.mkdir(parents=True)
    contract.write(cfg.paths.dataset_dir, smollm_contract(cfg, dtype="bfloat16"))
    refused = ctl(config, "check-config")
    assert refused.returncode == RELOAD_REFUSED, refused
    assert "[target] dtype is 'float32', the contract says 'bfloat16'" in refused.stderr
