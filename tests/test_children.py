"""A child's stop: SIGTERM, then the whole configured grace before SIGKILL, waited for (`stop`)
or not (`terminate`, then `stopped` at each tick). Real processes that take their time."""

from __future__ import annotations

import signal
import sys
import time

from eagle3d.daemon.children import Child
from tests.pipeline import wait_for

# Takes `delay` seconds to exit after SIGTERM (a checkpoint being written); forever for -1.
SLOW_TO_STOP = """
import signal, sys, time
delay = float(sys.argv[1])
def later(*_):
    if delay < 0:
        return
    time.sleep(delay)
    sys.exit(0)
signal.signal(signal.SIGTERM, later)
print("up", flush=True)
while True:
    time.sleep(0.05)
"""


def started(tmp_path, delay: float) -> Child:
    import subprocess
    child = Child("slow", [sys.executable, "-c", SLOW_TO_STOP, str(delay)], tmp_path,
                  stdout=subprocess.PIPE)
    assert child.proc.stdout.readline().strip() == b"up"  # its SIGTERM handler is in place
    return child


def test_a_stop_waits_the_grace_for_a_child_that_needs_it(tmp_path):
    child = started(tmp_path, 1.0)
    began = time.monotonic()
    assert child.stop(10.0) == 0
    assert 1.0 <= time.monotonic() - began < 5.0


def test_a_child_that_ignores_sigterm_is_killed_once_the_grace_is_over(tmp_path, caplog):
    child = started(tmp_path, -1)
    began = time.monotonic()
    assert child.stop(1.5) == -signal.SIGKILL
    assert time.monotonic() - began >= 1.5
    assert "did not stop within 2 s of SIGTERM" in caplog.text  # 1.5 s, rounded
    assert not (tmp_path / "slow.json").exists()


def test_terminate_returns_at_once_and_stopped_ends_it_after_the_grace(tmp_path):
    child = started(tmp_path, -1)
    began = time.monotonic()
    child.terminate(1.5)
    assert time.monotonic() - began < 0.5 and not child.stopped()
    wait_for(child.stopped, 10, "the end of the grace", poll=0.05)
    assert time.monotonic() - began >= 1.5 and child.proc.returncode == -signal.SIGKILL


def test_a_stop_after_terminate_keeps_the_first_sigkill_time(tmp_path):
    child = started(tmp_path, 1.0)
    child.terminate(10.0)
    began = time.monotonic()
    assert child.stop(10.0) == 0  # it waits for the checkpoint begun at the first SIGTERM
    assert 0.5 <= time.monotonic() - began < 5.0


def test_children_stopped_side_by_side_share_one_grace(tmp_path):
    """The generator and its SGLang server: one grace for both, not one after the other."""
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    children = [started(tmp_path / "a", 1.0), started(tmp_path / "b", 1.0)]
    began = time.monotonic()
    for child in children:
        child.terminate(10.0)
    assert [child.stop(10.0) for child in children] == [0, 0]
    assert time.monotonic() - began < 1.9
