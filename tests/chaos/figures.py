"""The chaos suite's knobs and figures.

EAGLE3D_CHAOS_SCALE (default 1, the CI size) multiplies the number of conversations and of
faults injected. Every fault the suite injects, and every bad input it tries, is counted here and
printed at the end of the run (tests/conftest.py), in the normal pytest output and with -s; a
parallel run's test processes each hand theirs to the main one.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

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

    def add(self, other: "Figures") -> None:
        for name in ("crashes", "faults", "bad_inputs", "lost", "audits"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self.notes += other.notes
        self.ran = True

    def line(self) -> str:
        lost = (f"{self.lost} samples lost ({self.audits} audits)" if self.audits else
                "samples lost not measured (no audit ran)")
        return (f"chaos (scale {SCALE}, seed {SEED}): {self.crashes} crashes injected, "
                f"{self.faults} faults survived, {self.bad_inputs} bad inputs tried, {lost}")


FIGURES = Figures()
