"""systemd/eagle3d.service as systemd reads it (`systemd-analyze verify`; systemd itself is never
booted here), what the unit promises the daemon and the operator, and `make install` /
`make uninstall` staged under DESTDIR."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from eagle3d.statemachine.config_schema import STOP_BUDGET_S
from tests.test_local_users import intruder  # noqa: F401 (a fixture)

REPO = Path(__file__).resolve().parents[1]
UNIT = REPO / "systemd" / "eagle3d.service"
TEMPLATE = REPO / "etc" / "eagle3d.toml"
TMPFILES = REPO / "systemd" / "eagle3d-tmpfiles.conf"
INSTALLED_DAEMON = "/opt/eagle3d/bin/eagle3d"


def directives(path: Path) -> dict[str, dict[str, list[str]]]:
    """[Section] -> key -> values, in order (systemd allows a key more than once)."""
    sections: dict[str, dict[str, list[str]]] = {}
    current: dict[str, list[str]] = {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            current = sections.setdefault(line.strip("[]"), {})
        else:
            key, _, value = line.partition("=")
            current.setdefault(key.strip(), []).append(value.strip())
    return sections


def seconds(value: str) -> float:
    units = {"s": 1, "sec": 1, "min": 60, "h": 3600}
    number = value.rstrip("abcdefghijklmnopqrstuvwxyz")
    return float(number) * units[value[len(number):] or "s"]


def verify(unit_text: str, folder: Path) -> subprocess.CompletedProcess:
    """`systemd-analyze verify` on the unit, its daemon path pointed at this checkout's console
    script (verify insists that ExecStart exists; /opt/eagle3d exists only once installed)."""
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze is not installed; CI setup needs: "
                    "apt-get update && apt-get install -y systemd")
    daemon = Path(sys.executable).parent / "eagle3d"
    assert daemon.exists(), f"the dev install's console script {daemon} is missing"
    unit = folder / "eagle3d.service"
    unit.write_text(unit_text.replace(INSTALLED_DAEMON, str(daemon)))
    return subprocess.run([analyze, "verify", str(unit)], capture_output=True, text=True,
                          timeout=60)


def problems(result: subprocess.CompletedProcess) -> list[str]:
    # verify exits 0 on unknown keys and unparsable values: its messages are the verdict.
    lines = (result.stdout + result.stderr).splitlines()
    return [line for line in lines if "eagle3d.service" in line] + \
        ([f"exit status {result.returncode}"] if result.returncode else [])


def test_systemd_analyze_verify_accepts_the_unit(tmp_path):
    assert UNIT.read_text().count(INSTALLED_DAEMON) == 1
    assert problems(verify(UNIT.read_text(), tmp_path)) == []


def test_systemd_analyze_verify_would_catch_a_mistake(tmp_path):
    broken = UNIT.read_text().replace("Type=notify", "Type=notfy").replace("KillMode=", "KilMode=")
    found = problems(verify(broken, tmp_path))
    assert any("notfy" in line for line in found) and any("KilMode" in line for line in found)


def test_the_unit_runs_the_daemon_as_the_issue_specifies():
    unit = directives(UNIT)
    svc = {key: values[-1] for key, values in unit["Service"].items()}
    assert svc["Type"] == "notify" and svc["NotifyAccess"] == "main"
    assert svc["ExecStart"] == f"{INSTALLED_DAEMON} run -c /etc/eagle3d/eagle3d.toml"
    assert svc["ExecReload"] == "/bin/kill -HUP $MAINPID"
    # The daemon pings at half the interval; a tick is 1-2 s, so anything under ~10 s is a hair
    # trigger and anything over a few minutes leaves a hung loop unnoticed too long.
    assert 10 <= seconds(svc["WatchdogSec"]) <= 300
    assert svc["Restart"] == "on-failure"
    assert int(unit["Unit"]["StartLimitBurst"][-1]) >= 2
    assert seconds(unit["Unit"]["StartLimitIntervalSec"][-1]) >= 60 * 5
    assert svc["User"] not in ("root", "0")
    # The daemon's own stop budget (every child's grace) ends before systemd's SIGKILL.
    assert svc["KillMode"] == "mixed" and seconds(svc["TimeoutStopSec"]) >= STOP_BUDGET_S + 20
    assert int(svc["LimitNOFILE"]) >= 65536
    # Hardening that keeps the GPUs visible.
    assert svc["NoNewPrivileges"] == svc["ProtectHome"] == svc["PrivateTmp"] == "yes"
    assert svc["ProtectSystem"] == "strict"
    assert "PrivateDevices" not in svc and "RemoveIPC" not in svc


def test_the_unit_lets_the_production_config_write_where_it_must():
    unit = directives(UNIT)["Service"]
    paths = tomllib.loads(TEMPLATE.read_text())["paths"]
    assert Path("/var/lib") / unit["StateDirectory"][-1] == Path(paths["state_dir"])
    writable = [Path(p.lstrip("-")) for line in unit["ReadWritePaths"] for p in line.split()]
    for key in ("dataset_dir", "train_dir", "spool_dir"):
        assert any(Path(paths[key]).is_relative_to(w) for w in writable), \
            f"[paths] {key} = {paths[key]} is read-only for the service"


def test_the_spool_is_the_services_before_the_daemon_starts_whoever_made_it_first(intruder):
    """/dev/shm is every local user's: the unit has systemd-tmpfiles make the production spool
    the service's, mode 0700, before each start. Run for real (on a test folder, for root) after
    another user made the folder first, world-writable: it is root's and 0700 afterwards."""
    svc = directives(UNIT)["Service"]
    assert svc["ExecStartPre"] == ["+/usr/bin/systemd-tmpfiles --create eagle3d.conf"]
    lines = [line.split() for line in TMPFILES.read_text().splitlines()
             if line.strip() and not line.startswith("#")]
    spool = tomllib.loads(TEMPLATE.read_text())["paths"]["spool_dir"]
    assert lines == [["d", spool, "0700", svc["User"][-1], svc["Group"][-1], "-"]]
    taken = Path("/dev/shm") / f"eagle3d-tmpfiles-test-{os.getpid()}"
    assert intruder.run(["mkdir", "-m", "0777", str(taken)]).returncode == 0
    try:
        conf = taken.with_name(taken.name + ".conf")
        conf.write_text(TMPFILES.read_text().replace(spool, str(taken))
                        .replace("eagle3d eagle3d", "root root"))
        done = subprocess.run(["systemd-tmpfiles", "--create", str(conf)], capture_output=True,
                              text=True, timeout=60)
        conf.unlink()
        assert done.returncode == 0, done.stderr
        st = taken.lstat()
        assert (st.st_uid, st.st_gid, st.st_mode & 0o7777) == (0, 0, 0o700)
    finally:
        shutil.rmtree(taken)


def test_a_single_node_unit_takes_no_packet_from_another_machine():
    """torchrun's agent listens on every interface whatever its flags (measured with --standalone
    on torch 2.13: two TCPStore ports on *), so the unit keeps the network out; operations.md
    gives the drop-in that lets a multi-node cluster in, as systemd reads drop-ins."""
    svc = directives(UNIT)["Service"]
    assert svc["IPAddressDeny"] == ["any"] and svc["IPAddressAllow"] == ["localhost"]
    docs = (REPO / "docs" / "operations.md").read_text()
    assert "## Shared servers" in docs
    assert "[Service]\nIPAddressAllow=10.0.0.0/8" in docs


def vendor_paths(root: Path) -> tuple[Path, Path, Path]:
    """The unit, tmpfiles entry and eagle3ctl's bash completion in the distribution's folders
    under `root` (paths.sh)."""
    out = subprocess.run(["bash", "-c", "source systemd/paths.sh; "
                          "echo $UNIT_DIR $TMPFILES_DIR $COMPLETION_DIR"],
                         cwd=REPO, capture_output=True, text=True, check=True).stdout.split()
    assert out[0].endswith("/systemd/system") and not out[0].startswith("/etc"), out
    return (root / out[0].lstrip("/") / "eagle3d.service",
            root / out[1].lstrip("/") / "eagle3d.conf", root / out[2].lstrip("/") / "eagle3ctl")


def make(target: str, destdir: Path) -> subprocess.CompletedProcess:
    return subprocess.run(["make", "-s", target, f"DESTDIR={destdir}"], cwd=REPO,
                          capture_output=True, text=True, timeout=120, check=True)


@pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")
def test_install_keeps_an_edited_config_and_uninstall_keeps_the_data(tmp_path):
    root = tmp_path / "root"
    legacy = root / "etc/systemd/system/eagle3d.service"  # an earlier install's, overriding
    legacy.parent.mkdir(parents=True)
    legacy.write_text(UNIT.read_text())
    make("install", root)
    assert not legacy.exists()
    unit, tmpfiles, completion = vendor_paths(root)
    assert unit.read_text() == UNIT.read_text() and tmpfiles.read_text() == TMPFILES.read_text()
    # bash-completion loads it at the first Tab on eagle3ctl: the installed program's own script.
    assert "/opt/eagle3d/bin/eagle3ctl --print-completion bash" in completion.read_text()
    assert subprocess.run(["bash", "-n", str(completion)]).returncode == 0
    config = root / "etc/eagle3d/eagle3d.toml"
    assert config.read_text() == TEMPLATE.read_text()
    assert config.stat().st_mode & 0o777 == 0o640  # the dataset's location is not world-readable
    for folder in ("data/eagle3d/dataset", "data/eagle3d/train"):
        assert (root / folder).is_dir()  # ReadWritePaths= must exist or the unit cannot start
    assert os.readlink(root / "usr/local/bin/eagle3ctl") == "/opt/eagle3d/bin/eagle3ctl"
    assert (root / "opt/eagle3d/share/doc/eagle3d/operations.md").exists()

    edited = config.read_text().replace('"/models/Kimi-K2.5"', '"/models/my-model"')
    config.write_text(edited)
    out = make("install", root).stdout
    assert config.read_text() == edited
    assert (root / "etc/eagle3d/eagle3d.toml.new").read_text() == TEMPLATE.read_text()
    assert "kept your /etc/eagle3d/eagle3d.toml" in out

    (root / "data/eagle3d/dataset/shard-000").mkdir()
    make("uninstall", root)
    assert not unit.exists() and not tmpfiles.exists() and not completion.exists()
    assert not (root / "opt/eagle3d").exists()
    assert not os.path.lexists(root / "usr/local/bin/eagle3ctl")
    assert config.read_text() == edited
    assert (root / "data/eagle3d/dataset/shard-000").is_dir()
