"""Loading the target: a GGUF file converted once into a model folder."""

from __future__ import annotations

import pytest

from eagle3d.statemachine.config_validation import load_config
from eagle3d.target import loading
from tests.conftest import make_config, modes


@pytest.mark.slow
def test_a_converted_gguf_target_is_the_service_groups_to_read(tmp_path, monkeypatch,
                                                                unit_umask):
    """The folder a GGUF target is converted into is the one SGLang serves it from (README,
    "Serve the drafter"): under the unit's UMask an operator of the service's group reads it,
    nobody else does (mkdtemp makes a folder for its owner alone, safetensors such files)."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    gguf = load_config(make_config(tmp_path)).target.model_path
    folder = loading.converted_gguf(gguf)
    found = modes(folder)
    assert found.pop(folder.name) == "drwxr-x---" and "model.safetensors" in found
    assert set(found.values()) == {"-rw-r-----"}, found
