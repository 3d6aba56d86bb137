"""A hostile local user on a shared server, and a second daemon on the same state folder: what
another account on the machine can and cannot do to a running service."""

from __future__ import annotations

import os
import pwd
import shutil
import socket
import subprocess
import time
import uuid
from pathlib import Path
from typing import NamedTuple

import psutil
import pytest

from eagle3d.statemachine import layout
from eagle3d.statemachine.config_validation import load_config
from eagle3d.statemachine.ledger import Ledger
from tests.conftest import venv_bin
from tests.pipeline import DaemonProcess, ctl, messages_config
from tests.test_ingest import env  # noqa: F401 (a fixture)

INTRUDER = "eagle3d-intruder"
USERADD_EXISTS = 9  # useradd's status for a name taken (another test made it first)


class Intruder(NamedTuple):
    """A real unprivileged local user, as on a shared server: its own uid, no groups."""
    uid: int
    gid: int

    def run(self, argv: list[str]) -> subprocess.CompletedProcess:
        return subprocess.run(["setpriv", f"--reuid={self.uid}", f"--regid={self.gid}",
                               "--clear-groups", *argv], capture_output=True, text=True,
                              timeout=60)


@pytest.fixture
def intruder() -> Intruder:
    if os.geteuid() != 0:
        pytest.skip("acting as another local user needs root")
    made = subprocess.run(["useradd", "--system", "--no-create-home", "--shell",
                           "/usr/sbin/nologin", INTRUDER], capture_output=True, text=True)
    assert made.returncode in (0, USERADD_EXISTS), made.stderr
    entry = pwd.getpwnam(INTRUDER)
    return Intruder(entry.pw_uid, entry.pw_gid)


def test_a_second_daemon_on_the_same_state_folder_is_refused_naming_the_first(
        tmp_path, config_factory):
    """`eagle3d run` twice on one config: the second exits 2 and names the first (pid, host);
    the first runs on with its engine untouched, and the ledger records one daemon only."""
    config = messages_config(config_factory, tmp_path, 20)
    with DaemonProcess(config) as first:
        st = first.status_until(lambda s: s.get("engine", {}).get("status") == "ready", 300,
                                "the engine")
        assert ctl(config, "pause", "--reason", "hold the engine").returncode == 0
        engine = psutil.Process(st["engine"]["pid"])
        second = subprocess.run([venv_bin("eagle3d"), "run", "-c", str(config)],
                                capture_output=True, text=True, timeout=120)
        out = second.stdout + second.stderr
        assert second.returncode == 2, out
        assert f"another eagle3d daemon holds {tmp_path / 'state'} " \
               f"(pid {first.proc.pid} on {socket.gethostname()}, since " in out, out
        assert engine.is_running() and engine.status() != psutil.STATUS_ZOMBIE
        assert first.proc.poll() is None
        first.status_until(lambda s: s["daemon"]["alive"] and s["engine"]["pid"] == engine.pid,
                           60, "the first daemon's heartbeat, same engine")
        assert first.stop() == 0, first.output()[-4000:]
    state = load_config(config).paths.state_dir
    with Ledger(layout.ledger(state), readonly=True) as ledger:
        assert len(ledger.events_of(("daemon_started",))) == 1
        assert not ledger.events_of(("orphans_ended",))


def test_sglang_answers_a_local_user_without_the_start_key_with_401_only(
        tmp_path, monkeypatch, intruder):
    """Any local user reaches the server's loopback port: without this start's API key every
    endpoint but /health answers 401, so no one swaps the weights, aborts or pauses. The key
    is in no command line the user can read, and the server's environment is closed to them;
    the daemon's own client gets through with it."""
    from eagle3d.capture.engines.sglang.client import check_serves
    from tests.test_sglang_engine import engine, wait
    monkeypatch.setenv("FAKE_SGLANG", "ok")
    eng = engine(tmp_path)
    try:
        wait(eng, 60)
        assert eng.ready, eng.problem
        url = eng.client.base_url

        def code(path: str, *curl: str) -> str:
            return intruder.run(["curl", "-s", "-o", "/dev/null", "-w", "%{http_code}",
                                 *curl, url + path]).stdout
        assert code("/health") == "200"
        assert code("/get_model_info") == "401"
        assert code("/generate", "-d", '{"input_ids": [1, 2], "sampling_params": '
                    '{"max_new_tokens": 0}}') == "401"
        assert code("/update_weights_from_disk", "-d", '{"model_path": "/tmp/x"}') == "401"
        key = eng.client.api_key
        check_serves(url, str(tmp_path / "model"), key)
        shown = intruder.run(["cat", f"/proc/{eng.pid}/cmdline"])
        assert shown.returncode == 0 and "sglang" in shown.stdout and key not in shown.stdout
        assert intruder.run(["cat", f"/proc/{eng.pid}/environ"]).returncode != 0
    finally:
        eng.stop(5)


def test_a_dump_another_user_put_in_the_spool_is_rejected_without_charging_the_sample(
        env, tmp_path, intruder):
    """A well-formed dump of a planned sample, written by another local user and slipped into
    the spool: rejected with its owner named, never ingested, and the sample keeps its attempts
    (the engine did nothing wrong)."""
    from tests.test_ingest import reason_of, write
    ing, ledger, spool, samples = env
    s = samples[0]
    staging = Path("/dev/shm") / f"eagle3d-intruder-{os.getpid()}"
    staging.mkdir(mode=0o755)
    try:
        genuine = write(staging, s.id, s.input_ids)
        genuine.chmod(0o644)
        os.chown(staging, intruder.uid, intruder.gid)
        copied = intruder.run(["cp", str(genuine), str(staging / "planted")])
        assert copied.returncode == 0, copied.stderr
        # Into the spool, as a looser spool would have let them.
        os.replace(staging / "planted", spool / genuine.name)
    finally:
        shutil.rmtree(staging)
    before = ledger.sample(s.id)
    out = ing.ingest(genuine.name)
    assert out.kind == "rejected", out
    assert f"owned by {INTRUDER} (uid {intruder.uid}), not the service's user" in out.detail
    assert INTRUDER in reason_of(spool, genuine.name)
    after = ledger.sample(s.id)
    assert after.status == before.status == "inflight" and after.attempts == before.attempts
    assert not (ing.dataset_dir / layout.sample_folder(0)).exists()


@pytest.mark.parametrize("shards", [1, 2])
def test_a_spool_folder_another_user_made_first_is_refused_naming_its_owner(
        config_factory, tmp_path, intruder, shards):
    """The "create the spool's name first" attack: the daemon exits 2 (no restart loop) naming
    the folder and its owner, and creates nothing in it. With shards the intruder's folder is
    the root above the shard's spool: it is checked like the spool itself."""
    sections = {"data": {"shards": 2, "shard": 1}} if shards > 1 else {}
    config = config_factory(sections)
    spool = Path(load_config(config).paths.spool_dir)
    root = spool.parent if shards > 1 else spool
    made = intruder.run(["mkdir", "-m", "0755", str(root)])
    assert made.returncode == 0, made.stderr
    try:
        run = subprocess.run([venv_bin("eagle3d"), "run", "-c", str(config), "--until", "plan"],
                             capture_output=True, text=True, timeout=120)
        out = run.stdout + run.stderr
        assert run.returncode == 2, out
        assert str(root) in out and f"{INTRUDER} (uid {intruder.uid})" in out, out
        assert "Traceback" not in out
        assert list(root.iterdir()) == []
    finally:
        shutil.rmtree(root)


@pytest.fixture
def sticky_spool(config_factory):
    """A config whose spool lies in a folder like /dev/shm itself: root's, mode 1777, where
    every local user may create names (and rename only their own)."""
    parent = Path("/dev/shm") / f"eagle3d-sticky-{uuid.uuid4().hex[:8]}"
    parent.mkdir()
    parent.chmod(0o1777)
    config = config_factory({"paths": {"spool_dir": str(parent / "spool")},
                             "extract": {"max_inflight_samples": 4, "rescan_interval_s": 0.1},
                             "verify": {"spot_checks": 0}})
    yield config
    shutil.rmtree(parent)


def _swap(intruder: Intruder, spool: Path, swap: str, victim: Path, forged: Path) -> None:
    """The spool goes (an operator's rm, a tmpfs cleaner: in a sticky folder no one else can
    rename it), and another user puts their own thing under its name before the daemon looks
    again: a link to a folder of the daemon's user, or a folder of theirs with forged dumps."""
    os.rename(spool, spool.with_name("spool.gone"))
    if swap == "link":
        made = intruder.run(["ln", "-s", str(victim), str(spool)])
    else:
        made = intruder.run(["cp", "-r", str(forged), str(spool)])
    assert made.returncode == 0, made.stderr


def extracted_ids(ledger: Ledger) -> set[str]:
    return {s.id for s in ledger.samples() if s.status in ("extracted", "verified")}


@pytest.mark.parametrize("swap", ["link", "folder"])
def test_a_spool_another_user_swaps_under_the_daemon_is_never_followed(
        tmp_path, intruder, sticky_spool, swap):
    """The daemon holds the spool it checked: after the swap it deletes and moves nothing in
    the folder the link names (a dead temp's name, a dump's name), reads no forged dump, and
    status says the spool was replaced under it, without following it."""
    from eagle3d.daemon.reconcile import Daemon
    from eagle3d.statemachine.atomic import HOST
    from tests.pipeline import status, wait_for
    from tests.test_extract_stage import FakeEngine, plan
    from tests.test_ingest import write
    cfg = load_config(sticky_spool)
    spool = cfg.paths.spool_dir
    for folder in (cfg.paths.state_dir, cfg.paths.dataset_dir, spool):
        folder.mkdir(parents=True, mode=0o700)
    fingerprint = plan(cfg, 10)["fingerprint"]
    ledger = Ledger(layout.ledger(cfg.paths.state_dir))
    engines: list[FakeEngine] = []
    daemon = Daemon(cfg, engine_factory=lambda cfg, pid_dir, doc: engines.append(
        FakeEngine(fingerprint, ledger)) or engines[-1])
    gone = subprocess.Popen(["true"])
    gone.wait()
    victim = tmp_path / "victim"  # a folder of the daemon's own user, anywhere
    victim.mkdir()
    victims = [victim / f".notes.{HOST}.{gone.pid}.tmp", victim / f"{'f' * 32}.safetensors"]
    for path in victims:
        path.write_text("the daemon user's own file\n")
    forged = spool.with_name("forged")  # readable by the intruder, who copies it
    forged.mkdir(mode=0o755)
    for sid, (ids, *_) in ledger.plan_tokens([s.id for s in ledger.samples()]).items():
        write(forged, sid, ids, contract=fingerprint).chmod(0o644)
    daemon.recover()
    try:
        wait_for(lambda: daemon.tick() or ledger.counts().get("extracted") >= 4, 60,
                 "the first batch ingested")
        engines[0].hold = True  # a batch in flight, its dumps not yet written
        # What may still be ingested: the dumps the engine wrote into the spool held (listed
        # first: ingest moves a dump from there to the ledger's extracted).
        genuine = {p.name.removesuffix(".safetensors") for p in spool.glob("*.safetensors")}
        genuine |= extracted_ids(ledger)
        _swap(intruder, spool, swap, victim, forged)
        deadline = time.monotonic() + 1.0  # ten rescans: what the old code would have followed
        wait_for(lambda: daemon.tick() or time.monotonic() > deadline, 10, "ten rescans", 0.05)
        assert all(p.read_text() == "the daemon user's own file\n" for p in victims)
        assert sorted(p.name for p in victim.iterdir()) == sorted(p.name for p in victims)
        if swap == "folder":
            assert sorted(p.name for p in spool.iterdir()) == \
                sorted(p.name for p in forged.iterdir())
            assert all(p.stat().st_uid == intruder.uid for p in spool.iterdir())
        assert not ledger.events_of(("rejected",))
        st = wait_for(lambda: daemon.tick() or (lambda st: st["stage"] == "failed" and st)(
            status(sticky_spool)), 20, "a failed stage in status")
        assert f"the spool {spool} was replaced under the daemon" in st["reason"], st
    finally:
        daemon.shutdown()
    assert extracted_ids(ledger) <= genuine < {s.id for s in ledger.samples()}
    ledger.close()


def test_a_spool_another_user_replaced_before_its_first_use_is_never_opened(
        tmp_path, intruder, sticky_spool):
    """Between the start's checks and the spool's first use (the plan, minutes) the spool goes
    and another user's link takes its name: extraction stops, naming it, and the folder the
    link names is never listed, written or deleted in."""
    from eagle3d.daemon.stages.extract import ExtractStage
    from eagle3d.statemachine.atomic import HOST
    from eagle3d.statemachine.stages import Seen
    from tests.test_extract_stage import EXTRACT, plan
    cfg = load_config(sticky_spool)
    spool = cfg.paths.spool_dir
    for folder in (cfg.paths.state_dir, cfg.paths.dataset_dir, spool.parent):
        folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    plan(cfg, 2)
    victim = tmp_path / "victim"
    victim.mkdir()
    dead_temp = victim / f".notes.{HOST}.999999999.tmp"
    dead_temp.write_text("kept\n")
    made = intruder.run(["ln", "-s", str(victim), str(spool)])
    assert made.returncode == 0, made.stderr
    with Ledger(layout.ledger(cfg.paths.state_dir)) as ledger:
        stage = ExtractStage(cfg, ledger, cfg.paths.state_dir, lambda *a: pytest.fail("engine"))
        try:
            stage.step(EXTRACT)
            blocked = stage.observe(Seen(ledger.counts(), None)).blocked
            assert f"cannot open the folder {spool}" in blocked, blocked
            time.sleep(0.3)
        finally:
            stage.stop(time.monotonic() + 10)
    assert [p.name for p in victim.iterdir()] == [dead_temp.name]
