"""The chaos suite's knobs and figures.

EAGLE3D_CHAOS_SCALE (default 1, the CI size) multiplies the number of conversations and of
faults injected. Every fault the suite injects, and every bad input it tries, is counted here and
printed at the end of the run, in the normal pytest output and with -s.
"""

from __future__ import annotations

import os
import subprocess
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

import pytest

SCALE = max(1, int(os.environ.get("EAGLE3D_CHAOS_SCALE", "1")))
SEED = int(os.environ.get("EAGLE3D_CHAOS_SEED", "8"))


@dataclass
class Figures:
    """What the session measured. A figure is printed only when the check behind it ran: "0
    samples lost" from a run whose audit never ran would be a default, not a measurement."""
    crashes: int = 0      # kill -9 of the daemon, the engine or a trainer rank
    faults: int = 0       # faults survived: crashes, full disks, locks, damaged files, edits
    bad_inputs: int = 0   # hostile dumps, broken configs, bad requests, bad conversations
    lost: int = 0         # samples planned but neither verified nor excluded, over the audits
    audits: int = 0       # end-of-run audits that ran to their end
    notes: list[str] = field(default_factory=list)  # what a campaign did, failed or not
    ran: bool = False

    def audited(self, lost: int) -> int:
        self.audits += 1
        self.lost += lost
        return lost

    def line(self) -> str:
        lost = (f"{self.lost} samples lost ({self.audits} audits)" if self.audits else
                "samples lost not measured (no audit ran)")
        return (f"chaos (scale {SCALE}, seed {SEED}): {self.crashes} crashes injected, "
                f"{self.faults} faults survived, {self.bad_inputs} bad inputs tried, {lost}")


FIGURES = Figures()


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "chaos: the reliability suite (tests/chaos); "
                                       "EAGLE3D_CHAOS_SCALE sets its size")


def pytest_terminal_summary(terminalreporter, exitstatus, config) -> None:
    if FIGURES.ran:
        terminalreporter.write_sep("=", "chaos figures")
        terminalreporter.write_line(FIGURES.line())
        for note in FIGURES.notes:
            terminalreporter.write_line(f"  {note}")


@pytest.fixture
def figures() -> Figures:
    FIGURES.ran = True
    return FIGURES


@pytest.fixture
def tmpfs(tmp_path) -> Iterator[Callable[[str, str], Path]]:
    """A real, small file system: tmpfs("name", "24m") mounts one and returns its folder."""
    mounted: list[Path] = []

    def mount(name: str, size: str) -> Path:
        where = tmp_path / f"{name}-{uuid.uuid4().hex[:6]}"
        where.mkdir()
        subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0750", "tmpfs",
                        str(where)], check=True)
        mounted.append(where)
        return where

    yield mount
    for where in mounted:
        subprocess.run(["umount", "-l", str(where)], check=False)
