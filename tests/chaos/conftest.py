"""The chaos suite's fixtures: its figures (tests/chaos/figures.py) and small real file
systems."""

from __future__ import annotations

import subprocess
import uuid
from pathlib import Path
from typing import Callable, Iterator

import pytest

from tests.chaos.figures import FIGURES, Figures


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "chaos: the reliability suite (tests/chaos); "
                                       "EAGLE3D_CHAOS_SCALE sets its size")


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
