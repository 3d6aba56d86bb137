"""How long things have stayed as they are, on the monotonic clock (issue 59 rule 4).

A file's mtime or a child's `since` is a wall-clock stamp, and NTP steps the wall clock by
hours: `time.time() - stamp` would make a live writer's file or a child's new status look hours
old, or younger than nothing. The wall clock is read once, at a thing's first sight (what was
left before the daemon started is as old as its stamp says), and not at all for what is first
seen just after a step; from then on only the monotonic clock counts.
"""

from __future__ import annotations

import time
from typing import Hashable

# The wall clock less the monotonic one moves by a slew's 0.5 ms/s at most: more between two
# looks is a step.
STEP_S = 5.0


class Ages:
    """How long each of a set of things has stayed as it is."""

    def __init__(self) -> None:
        self._seen: dict[Hashable, tuple[Hashable, float]] = {}  # key -> (as it was, since)
        self._offset: float | None = None

    def update(self, found: dict[Hashable, tuple[Hashable, float]]) -> dict[Hashable, float]:
        """The age (s) of each thing `found`, given as key -> (the thing as it is now, its
        wall-clock stamp); the things not found are forgotten. A thing seen to change changed
        now, whatever its stamp says."""
        now = time.monotonic()
        offset = time.time() - now
        stepped = self._offset is not None and abs(offset - self._offset) > STEP_S
        self._offset = offset
        seen = {}
        for key, (state, stamp) in found.items():
            was = self._seen.get(key)
            if was is not None and was[0] == state:
                seen[key] = was
            elif was is not None or stepped:
                seen[key] = (state, now)
            else:
                seen[key] = (state, now - max(0.0, now + offset - stamp))
        self._seen = seen
        return {key: now - since for key, (_, since) in seen.items()}
