"""The hostile campaign's clock steps (issue 59 rule 4: intervals run on the monotonic clock).

NTP steps CLOCK_REALTIME, forward or back, under a running daemon; CLOCK_MONOTONIC does not move.
This machine's clock is never touched: libfaketime is preloaded into the walk's daemon (and so
its children) and into every `eagle3ctl` the walk runs, as on a real machine where the step
affects everyone alike. Each reads the wall clock's offset from one file (FAKETIME_TIMESTAMP_FILE,
re-read at every call: FAKETIME_NO_CACHE), which `clock-step` rewrites; the monotonic clock is
left alone (FAKETIME_DONT_FAKE_MONOTONIC).

The library is the one the `libfaketime` PyPI package ships (the dev extra). Debian bookworm's
libfaketime 0.9.10 breaks Python 3.11's time.sleep once the monotonic clock is not faked (its
clock_nanosleep passes the kernel a negative absolute time: EINVAL, libfaketime issue 426), so
a candidate counts only once a tiny real process under it has slept and seen a step. Where no
library passes, `clock-step` is skipped and the walk prints one line saying why.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import time
import warnings
from functools import cache
from pathlib import Path
from typing import Any

from tests.chaos import operator_disks, operator_walk as ow
from tests.chaos.operator_walk import Violation, World

DEBIAN = Path("/usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1")
WATCH_S = 8            # status is polled this long after a step, once a second
ABSURD_S = 3600 / 2    # an age or an ETA a step of an hour or more would make of nothing

PROBE = """
import os, sys, time
t0 = time.time()
time.sleep(0.2)
open(sys.argv[1], "w").write("+2h")
time.sleep(0.2)
print(round((time.time() - t0) / 3600))
"""


def env(offset_file: Path, lib: Path) -> dict[str, str]:
    return {"LD_PRELOAD": str(lib), "FAKETIME_DONT_FAKE_MONOTONIC": "1",
            "FAKETIME_NO_CACHE": "1", "FAKETIME_TIMESTAMP_FILE": str(offset_file)}


def _candidates() -> list[Path]:
    spec = importlib.util.find_spec("libfaketime")
    shipped = [Path(spec.origin).parent / "vendor/libfaketime/src/libfaketime.so.1"] \
        if spec and spec.origin else []
    return [lib for lib in [*shipped, DEBIAN] if lib.exists()]


@cache
def library(scratch: Path = Path("/tmp")) -> tuple[Path | None, str]:
    """The first libfaketime that fakes a step for a real Python process and lets it sleep on
    the monotonic clock, and why none does where none does."""
    tried = []
    for lib in _candidates():
        rc = scratch / f"eagle3d-faketime-probe-{lib.stat().st_ino}"
        rc.write_text("+0")
        try:
            out = subprocess.run([sys.executable, "-c", PROBE, str(rc)], capture_output=True,
                                 text=True, timeout=30, env=env(rc, lib))
        finally:
            rc.unlink(missing_ok=True)
        if out.returncode == 0 and out.stdout.strip() == "2":
            return lib, ""
        tried.append(f"{lib} ({(out.stderr.strip().splitlines() or [out.stdout.strip()])[-1]})")
    return None, ("no libfaketime fakes a wall-clock step here: tried " + "; ".join(tried)
                  if tried else "no libfaketime installed (the `libfaketime` package of the dev "
                  "extra ships one)")


class Clock:
    """The wall clock of a world's daemon and of its eagle3ctl: real time plus `offset` s."""

    def __init__(self, root: Path) -> None:
        self.file = root / "faketime.rc"
        self.offset = 0
        self.lib, self.why = library()
        self.file.write_text("+0")

    def env(self) -> dict[str, str]:
        return env(self.file, self.lib) if self.lib else {}

    def step(self, seconds: int) -> None:
        self.offset += seconds
        self.file.write_text(f"{self.offset:+d}")


def act_clock_step(world: World, p: dict[str, Any]) -> str:
    """The wall clock stepped by hours, forward or back, at whatever the daemon is doing: it
    lives, keeps its heartbeat and pings, charges and fails no sample, and `eagle3ctl status`
    (under the same clock) calls it stale, or shows an age or ETA of hours, one tick at most."""
    if world.clock is None or not world.clock.lib:
        if world.clock is not None:  # pytest's warnings summary: never a silent pass
            warnings.warn(f"clock-step not walked: {world.clock.why}")
        return "skip"
    if not world.alive():
        return "skip"
    before = operator_disks._counts(world)
    world.clock.step(p["hours"] * 3600)
    bad: list[str] = []
    for _ in range(WATCH_S):
        time.sleep(1.0)
        problem = _status_problem(world)
        bad = bad + [problem] if problem else []
        if len(bad) > 1:
            raise Violation("a clock step is nothing to status (rule 4)",
                            f"{p['hours']:+d} h: two ticks in a row: {bad[-2:]}")
    _no_charge(world, before, f"the clock stepped {p['hours']:+d} h")
    return f"clock stepped {p['hours']:+d} h (offset now {world.clock.offset // 3600:+d} h)"


def _status_problem(world: World) -> str:
    if not world.alive():
        raise Violation("the loop never dies (rule 1)",
                        f"the daemon exited {world.daemon.proc.returncode} after a clock step: "
                        f"{world.daemon.output()[-800:]}")
    code, st = ow.status(world)
    beat = st.get("daemon", {}).get("heartbeat_age_s")
    if code == 3:
        return f"status NOT RUNNING (heartbeat {beat} s old)"
    ages = {k: v for k, v in _ages(st) if isinstance(v, (int, float)) and
            (v < -1.0 or v > ABSURD_S)}
    return f"status shows {ages}" if ages else ""


def _ages(node: Any, path: str = "") -> list[tuple[str, Any]]:
    """Every age, wait and ETA in status's JSON (keys ending _age_s, _in_s, eta_s, waited_s)."""
    if isinstance(node, dict):
        return [pair for k, v in node.items() for pair in _ages(v, f"{path}.{k}")]
    if isinstance(node, list):
        return [pair for i, v in enumerate(node) for pair in _ages(v, f"{path}[{i}]")]
    leaf = path.rsplit(".", 1)[-1]
    return [(path, node)] if leaf.endswith(("age_s", "_in_s", "eta_s", "waited_s")) else []


def _no_charge(world: World, before: dict[str, tuple[str, int]], what: str) -> None:
    """No sample failed, and none in flight was charged a second attempt (a pending one is
    charged its dispatch). A child the walk SIGSTOPped may time out meanwhile: not the step's."""
    after = operator_disks._counts(world)
    failed = [s for s, (st, _) in after.items() if st == "failed" and before.get(s, ("",))[0]
              != "failed"]
    charged = [s for s, (_, n) in after.items() if s in before and
               n > before[s][1] + (before[s][0] == "pending")]
    if failed or (charged and not world.stopped):
        raise Violation("no attempt is charged for a clock step",
                        f"{what}: failed {failed[:4]}, charged again {charged[:4]}: "
                        f"{[(before.get(s), after[s]) for s in (failed + charged)[:4]]}")


ACTIONS = {"clock-step": act_clock_step}
WEIGHTS = {"clock-step": 3}


def draw(rng: Any, name: str, p: dict[str, Any]) -> None:
    if name == "clock-step":
        p["hours"] = rng.choice([3, 26, -2, -25])
