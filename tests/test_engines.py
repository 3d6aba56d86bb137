"""The engine seam (capture/engines): the engines the config accepts are the ones registered,
and no module outside the registry and the engines' own folders names an engine.

No `from __future__ import annotations`: ToySettings' converters are read from its annotations.
"""

import ast
import re
from pathlib import Path
from typing import Annotated, NamedTuple

import pytest

from eagle3d.capture import engines
from eagle3d.ctl.main import load_for_command
from eagle3d.statemachine.config_schema import STR, section_classes, typed
from eagle3d.statemachine.config_validation import ConfigError
from tests.conftest import make_config

REPO = Path(__file__).resolve().parents[1]
BRANCH = re.compile(r"\.engine\s*(==|!=)\s*[\"']")  # `cfg.target.engine == "sglang"`


def test_each_registered_engine_has_its_settings_in_its_own_section():
    for name in engines.names():
        spec = engines.get(name)
        assert spec.name == name
        # Its settings are a section of its own, no schema's (or [target] alone).
        assert spec.settings is None or spec.settings.name not in section_classes()


class ToySettings(NamedTuple):
    """A third engine's section, as its folder's settings.py would declare it."""
    url: Annotated[str, STR] = "http://127.0.0.1:8000"
    slots: Annotated[int, typed(int, minimum=1, maximum=64)] = 4


@pytest.fixture
def toy_engine(monkeypatch) -> engines.EngineSpec:
    """An engine registered as a new folder's spec.py registers one: nothing else edited."""
    monkeypatch.setattr(engines, "_SPECS", dict(engines._SPECS))
    return engines.register(engines.get("transformers")._replace(
        name="toy", title="Toy",
        settings=engines.Settings("toy", ToySettings)))


def test_a_new_engine_brings_its_own_section_without_a_schema_edit(toy_engine, tmp_path):
    """check-config (as the daemon's start and reload) reads the new engine's section with the
    schema's machinery and words: its values typed, its defaults where left out, a bad value
    named by its key, an unknown key refused."""
    path = make_config(tmp_path, {"target": {"engine": "toy"}, "toy": {"slots": 8}})
    cfg = load_for_command(str(path), "check-config")
    assert engines.get(cfg.target.engine) is toy_engine
    assert toy_engine.settings.of(cfg) == ToySettings(slots=8)
    for table, message in (({"slots": 99}, "[toy.slots] must be at most 64, got 99"),
                           ({"slots": "8"}, "[toy.slots] expected int, got str '8'"),
                           ({"slot": 8}, "[toy.slot] unknown key (known keys: slots, url)")):
        path = make_config(tmp_path, {"toy": table})
        with pytest.raises(ConfigError) as caught:
            load_for_command(str(path), "check-config")
        assert str(caught.value) == f"{path}: {message}"


def test_a_section_no_engine_reads_is_refused_naming_the_engines_sections(toy_engine, tmp_path):
    path = make_config(tmp_path, {"trian": {"nproc": 2}})
    with pytest.raises(ConfigError) as caught:
        load_for_command(str(path), "check-config")
    assert str(caught.value) == (f"{path}: unknown section or key [trian] (known sections: "
                                 f"{', '.join(sorted([*section_classes(), 'sglang', 'toy']))})")


def test_an_engine_left_out_is_the_registrys_default(tmp_path):
    """The schema names no engine: [target] engine left out is the first one registered, as
    check-config shows it and as a reload compares it."""
    path = make_config(tmp_path)
    text = path.read_text().replace('engine = "transformers"\n', "")
    path.write_text(text)
    cfg = load_for_command(str(path), "check-config")
    assert cfg.target.engine == engines.names()[0] == "transformers"


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
