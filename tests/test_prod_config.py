"""etc/eagle3d.toml, the production template: it must load once its model and data exist, and
its comments must document every key of statemachine/config_schema.py and of the engines'
sections (capture/engines/*/settings.py) with the default that code uses, so the documentation
cannot fall behind the code."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest

from eagle3d.capture import engines
from eagle3d.capture.engines.sglang.spec import SETTINGS
from eagle3d.statemachine.config_schema import Key, keys_of, parse_size, section_classes
from eagle3d.statemachine.config_validation import load_config

TEMPLATE = Path(__file__).resolve().parents[1] / "etc" / "eagle3d.toml"


def settable_fields() -> dict[str, list[Key]]:
    """Section name -> the keys an operator can set, as the schema and the registered engines
    declare them (derived paths such as model_path are not)."""
    classes = {**section_classes(), **{n: s.cls for n, s in engines.sections().items()}}
    return {name: list(keys_of(cls).values()) for name, cls in classes.items()}


def key_docs(text: str) -> dict[tuple[str, str], str]:
    """(section, key) -> the comment block right above the key's line."""
    docs, section, comment = {}, "", []
    for line in text.splitlines():
        stripped = line.strip()
        if m := re.fullmatch(r"\[(\w+)\]", stripped):
            section, comment = m.group(1), []
        elif stripped.startswith("#"):
            comment.append(stripped.lstrip("# "))
        elif m := re.match(r"(\w+)\s*=", stripped):
            docs[(section, m.group(1))] = " ".join(comment)
            comment = []
        else:
            comment = []
    return docs


def documented_default(doc: str, field: Key, section: str) -> object:
    if m := re.search(r"Default: as \[(\w+)\] (\w+)\.(?:\s|$)", doc):
        # A default that follows another key: the code's default must equal that key's.
        other = {f.name: f for f in settable_fields()[m.group(1)]}[m.group(2)]
        return other.default
    m = re.search(r"Default (\S+)\.(?:\s|$)", doc)
    assert m, f"[{section}] {field.name}: the comment gives no 'Default X.'"
    value = tomllib.loads(f"v = {m.group(1)}")["v"]
    if section == "budget":
        return parse_size(value)
    if field.name == "aux_layers" and value == "default":
        return None
    if isinstance(value, list):
        return tuple(value)
    if isinstance(field.default, float):
        return float(value)
    return value


def test_every_key_is_set_and_documented_with_the_default_the_code_uses():
    text = TEMPLATE.read_text()
    raw = tomllib.loads(text)
    docs = key_docs(text)
    sections = settable_fields()
    assert set(raw) == set(sections), "the template has a section per config section, no other"
    for section, fields in sections.items():
        for field in fields:
            key = f"[{section}] {field.name}"
            assert field.name in raw[section], f"{key} is missing from the template"
            doc = docs[(section, field.name)]
            assert len(doc) > 30, f"{key} is not explained in a comment above it"
            if (section, field.name) == ("target", "engine"):
                default = engines.get(field.default).name  # empty: the registry's default
            elif not field.required:
                default = field.default
            else:
                assert "Required." in doc, f"{key}: the comment must say it is required"
                continue
            assert documented_default(doc, field, section) == default, \
                f"{key}: the documented default differs from statemachine/config_schema.py"


def test_the_template_names_the_contract_keys_the_schema_marks():
    """A key marked "Contract." in the template is one the schema binds (Binds): an edit of it
    starts a new run, and the operator reads so where the key is explained."""
    docs = key_docs(TEMPLATE.read_text())
    for section, fields in settable_fields().items():
        for field in fields:
            documented = bool(re.search(r"\bContract\b", docs[(section, field.name)]))
            assert documented == (field.binds is not None), \
                f"[{section}] {field.name}: 'Contract.' in the template and the schema disagree"


@pytest.fixture
def installed_template(tmp_path) -> Path:
    """The template as an operator installs it, with its model folder and conversation file
    replaced by ones that exist here."""
    text = TEMPLATE.read_text()
    raw = tomllib.loads(text)
    model = tmp_path / "Kimi-K2.5"
    model.mkdir()
    (model / "config.json").write_text("{}")
    conversations = tmp_path / "conversations.jsonl"
    conversations.write_text('{"messages": [{"role": "user", "content": "hi"}]}\n')
    for old, new in ((raw["target"]["model"], model), (raw["data"]["source"], conversations)):
        assert text.count(f'"{old}"') == 1
        text = text.replace(f'"{old}"', f'"{new}"')
    path = tmp_path / "etc" / "eagle3d.toml"
    path.parent.mkdir()
    path.write_text(text)
    return path


def test_the_template_loads_with_production_values(installed_template):
    cfg = engines.checked(load_config(installed_template))
    assert cfg.target.engine == "sglang" and SETTINGS.of(cfg).tp == 8
    assert cfg.train.nproc == 8
    assert cfg.paths.state_dir == Path("/var/lib/eagle3d")  # the unit's StateDirectory=eagle3d
    assert cfg.paths.spool_dir == Path("/dev/shm/eagle3d")
    assert cfg.paths.dataset_dir == Path("/data/eagle3d/dataset")
    assert cfg.paths.train_dir == Path("/data/eagle3d/train")
    assert cfg.budget.reserve == 200 * 1024**3
    assert cfg.budget.spool_max == 64 * 1024**3
    assert cfg.eval.source_path == cfg.data.source_path
    # The held-out slice does not overlap the training slice.
    assert cfg.eval.first >= cfg.data.first + cfg.data.limit

