"""The engine seam (capture/engines): the engines the config accepts are the ones registered,
and no module outside an engine's own folder branches on the engine's name."""

from __future__ import annotations

import re
from pathlib import Path

from eagle3d.capture import engines
from eagle3d.statemachine.config import ENGINES, Config

REPO = Path(__file__).resolve().parents[1]
BRANCH = re.compile(r"\.engine\s*(==|!=)\s*[\"']")  # `cfg.target.engine == "sglang"`


def test_the_config_accepts_exactly_the_registered_engines():
    assert set(engines.names()) == set(ENGINES)
    for name in engines.names():
        spec = engines.get(name)
        assert spec.name == name
        # Its settings are a section of the config (or [target] alone).
        assert spec.section is None or spec.section in Config._fields


def test_no_module_branches_on_the_engines_name():
    """`engines.get(cfg.target.engine)` is the one place an engine is chosen: a branch on
    its name elsewhere is a place a new engine would have to be added by hand."""
    wrong = [f"{path.relative_to(REPO)}:{n}: {line.strip()}"
             for package in ("statemachine", "dataset", "target", "capture", "daemon", "drafter")
             for path in sorted((REPO / package).rglob("*.py"))
             for n, line in enumerate(path.read_text().splitlines(), 1) if BRANCH.search(line)]
    assert not wrong, "\n".join(wrong)
