"""eagle3ctl against a real daemon process: status, control requests and their refusals."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from eagle3d.statemachine import layout
from eagle3d.statemachine.statefile import write_state
from tests.conftest import venv_bin, write_conversations


def ctl(config: Path, *args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([venv_bin("eagle3ctl"), "-c", str(config), *args], capture_output=True,
                          text=True, timeout=timeout)


def wait_for(predicate, timeout: float = 120, what: str = "condition"):
    deadline = time.time() + timeout
    while time.time() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def status(config: Path) -> dict:
    return json.loads(ctl(config, "status", "--json").stdout)


def test_status_imports_nothing_heavy():
    code = ("import sys; from eagle3d.daemon.ctl import main; "
            "import contextlib, io; sys.argv=['eagle3ctl','-c','etc/demo.toml','status','--json'];"
            "\nwith contextlib.redirect_stdout(io.StringIO()):\n    main(sys.argv[1:])\n"
            "heavy=[m for m in ('torch','transformers','numpy','safetensors') if m in sys.modules];"
            "print(heavy)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=Path(__file__).resolve().parents[1], timeout=60)
    assert out.stdout.strip() == "[]", out.stderr


def test_status_without_a_daemon_says_not_running(config_factory):
    config = config_factory()
    proc = ctl(config, "status")
    assert proc.returncode == 3
    assert "NOT RUNNING" in proc.stdout
    st = json.loads(ctl(config, "status", "--json").stdout)
    for key in ("stage", "reason", "samples", "tokens", "rate", "eta_s", "disk", "daemon"):
        assert key in st
    assert st["daemon"]["alive"] is False
    assert set(st["samples"]) >= {"total", "pending", "inflight", "extracted", "verified",
                                  "failed", "excluded"}
    assert "not running" in ctl(config, "pause").stderr


def test_status_says_how_long_the_trainer_has_waited_for_its_first_step(config_factory):
    """On a GPU the first training step waits a minute or more for the fused kernels to
    compile: status must say so, not show a trainer frozen at step 0."""
    import tomllib
    config = config_factory()
    state_dir = Path(tomllib.loads(config.read_text())["paths"]["state_dir"])
    state_dir.mkdir(parents=True, exist_ok=True)
    write_state(state_dir, {"stage": "train", "reason": "training", "trainer": {
        "status": "training", "step": 0, "total_steps": 900, "pid": os.getpid(),
        "before_first_step": {"status": "starting", "since": time.time() - 95}}})
    shown = ctl(config, "status").stdout
    assert "training step 0/900" in shown
    assert "trainer   training · starting for 1m 3" in shown, shown
    assert "fused kernels compile" in shown


def test_control_requests_against_a_running_daemon(tmp_path, config_factory):
    source = write_conversations(tmp_path / "conv.jsonl", 12)
    config = config_factory({"data": {"source": str(source), "format": "messages", "limit": 12}})
    daemon = subprocess.Popen([venv_bin("eagle3d"), "run", "-c", str(config)],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        wait_for(lambda: status(config)["daemon"]["alive"], what="the daemon's heartbeat")
        proc = ctl(config, "pause", "--reason", "disk maintenance")
        assert proc.returncode == 0 and "paused" in proc.stdout
        st = wait_for(lambda: (s := status(config))["stage"] == "paused" and s, what="paused")
        assert "disk maintenance" in st["reason"]
        assert ctl(config, "status").returncode == 0
        bad = ctl(config, "exclude", "0" * 32, "--reason", "test")
        assert bad.returncode == 1 and "unknown sample ids" in bad.stderr
        state_dir = tmp_path / "state"
        # A request of an unknown verb, and one from a file owned by someone else.
        ctl_dir = layout.control_dir(state_dir)
        (ctl_dir / "1-a.request.json").write_text(json.dumps({"verb": "format-disk"}))
        foreign = ctl_dir / "2-b.request.json"
        foreign.write_text(json.dumps({"verb": "resume"}))
        os.chown(foreign, 65534, 65534)
        acks = wait_for(lambda: sorted(ctl_dir.glob("*.ack.json")) if
                        len(list(ctl_dir.glob("*.ack.json"))) == 2 else None, what="acks")
        replies = [json.loads(p.read_text()) for p in acks]
        assert "unknown verb" in replies[0]["message"] and not replies[0]["ok"]
        assert "not the daemon's user" in replies[1]["message"] and not replies[1]["ok"]
        assert status(config)["stage"] == "paused"  # the foreign resume did nothing
        assert ctl(config, "resume").returncode == 0
        wait_for(lambda: status(config)["stage"] != "paused", what="resumed")
        events = ctl(config, "events").stdout
        assert "paused" in events and "resumed" in events
    finally:
        daemon.send_signal(signal.SIGTERM)
        out, _ = daemon.communicate(timeout=120)
    assert daemon.returncode == 0, out
    assert ctl(config, "status").returncode == 3


def test_engine_command_names_each_process_that_runs_the_target(config_factory):
    """With the target's own answers the generator runs it first, then the extract engine; with
    the dataset's answers only the engine does, on one line as before."""
    dataset = ctl(config_factory({"data": {"responses": "dataset"}}), "engine-command")
    assert dataset.returncode == 0, dataset.stderr
    assert dataset.stdout.count("\n") == 1 and "eagle3d.capture.worker -c" in dataset.stdout
    target = ctl(config_factory({"data": {"responses": "target"}}, name="target.toml"),
                 "engine-command")
    assert target.returncode == 0, target.stderr
    lines = target.stdout.splitlines()
    assert lines[0] == "# the generate stage's generator"
    assert "eagle3d.capture.generator -c" in lines[1] and "config.toml --in-force " in lines[1]
    assert lines[2] == "# the extract stage's engine" and "eagle3d.capture.worker -c" in lines[3]
