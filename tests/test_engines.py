"""The engine seam (capture/engines): the engines the config accepts are the ones registered,
and no module outside the registry and the engines' own folders names an engine."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from eagle3d.capture import engines
from eagle3d.statemachine.config_schema import Config

REPO = Path(__file__).resolve().parents[1]
BRANCH = re.compile(r"\.engine\s*(==|!=)\s*[\"']")  # `cfg.target.engine == "sglang"`


def test_each_registered_engine_has_its_settings_in_the_config():
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


PACKAGES = ("statemachine", "dataset", "target", "capture", "daemon", "drafter", "ctl")
# Where an engine's name may stand outside capture/engines/, and why.
NAMED_OUTSIDE = {
    # The default [target] engine: the schema, on the lowest floor, cannot ask the registry.
    ("statemachine/config_schema.py", "transformers"),
    # The [sglang] section: every section is read, strictly, by the schema on the lowest floor
    # (the drafter's children read the config too, and cannot import capture); the engine's
    # spec names it (EngineSpec.section).
    ("statemachine/config_validation.py", "sglang"),
    # A format of the exported drafter (SGLang's layout), which serves whatever engine
    # captured the dataset: not the engine.
    ("statemachine/layout.py", "sglang"),
}


def test_the_engines_are_named_only_in_the_registry_and_their_folders():
    """An engine's name as a string, or an attribute of that name (`cfg.sglang`), outside
    capture/engines/ is a place a new engine would have to be added by hand."""
    outside = [path for package in PACKAGES for path in sorted((REPO / package).rglob("*.py"))
               if not path.is_relative_to(REPO / "capture" / "engines")]
    wrong = []
    for path in outside:
        where = str(path.relative_to(REPO))
        for node in ast.walk(ast.parse(path.read_text())):
            name = node.value if isinstance(node, ast.Constant) else \
                node.attr if isinstance(node, ast.Attribute) else None
            if name in engines.names() and (where, name) not in NAMED_OUTSIDE:
                wrong.append(f"{where}:{node.lineno}: {name!r}")
    assert not wrong, "engines named outside capture/engines/:\n" + "\n".join(wrong)
