"""The chaos suite's fixtures: its figures (tests/chaos/figures.py). Small real file systems
come from tests/conftest.py's `tmpfs`."""

from __future__ import annotations

import pytest

from tests.chaos.figures import FIGURES, Figures


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "chaos: the reliability suite (tests/chaos); "
                                       "EAGLE3D_CHAOS_SCALE sets its size")


@pytest.fixture
def figures() -> Figures:
    FIGURES.ran = True
    return FIGURES
