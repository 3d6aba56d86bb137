"""The daemon's SGLang engine, started for real (its Child, launch command, start watcher and
client) on a stand-in server (tests/fake_sglang) that answers /health as slowly as SGLang does
and runs the capture plugin's real load-model step: ready only once /health answers and the
plugin's ready file of this start is there; a server without the plugin, or whose plugin
refused, never is."""

from __future__ import annotations

import socket
import sys
import time
from pathlib import Path

import pytest

from eagle3d.capture.engines import EngineUnavailable
from eagle3d.capture.engines.sglang import client as sglang_client
from eagle3d.capture.engines.sglang.handle import SGLangEngine
from eagle3d.daemon.engine import start_engine
from eagle3d.statemachine.config_validation import parse_config
from eagle3d.target.loading import fingerprint_file_or_folder
from test_sglang_plugin import CONTRACT, REQUESTS, plan

TESTS = Path(__file__).resolve().parent
LAYERS = [2, 16, 29]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def fake_sglang_python(tmp_path: Path) -> Path:
    """An interpreter that sees the stand-in SGLang (version 0.5.17) and eagle3d."""
    fake = tmp_path / "site"
    info = fake / "sglang-0.5.17.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: sglang\nVersion: 0.5.17\n")
    python = tmp_path / "python"
    # The caller's PYTHONPATH last: a checkout that lends its code through it stays the one run.
    paths = f"{fake}:{TESTS / 'fake_sglang'}:{TESTS}${{PYTHONPATH:+:$PYTHONPATH}}"
    python.write_text(f"#!/bin/sh\nPYTHONPATH={paths} exec {sys.executable} \"$@\"\n")
    python.chmod(0o755)
    return python


def weights(folder: Path, content: bytes) -> Path:
    """A model folder whose one weights file holds `content`."""
    folder.mkdir()
    (folder / "model.safetensors").write_bytes(content)
    return folder


def engine(tmp_path: Path, port: int | None = None,
           served: bytes = b"the captured model") -> SGLangEngine:
    """An engine whose [sglang] python is fake_sglang_python, for a capture contract of the
    model folder `captured/`, serving the model folder `model/` (with `served` weights)."""
    python = fake_sglang_python(tmp_path)
    weights(tmp_path / "model", served)
    captured = weights(tmp_path / "captured", b"the captured model")
    (tmp_path / "data.json").write_text("[]")
    (tmp_path / "state").mkdir()
    plan(tmp_path / "state", REQUESTS)
    cfg = parse_config({
        "target": {"model": "model", "engine": "sglang", "dtype": "bfloat16"},
        "data": {"source": "data.json", "max_tokens": 512},
        "paths": {"state_dir": "state", "spool_dir": "spool", "dataset_dir": "dataset",
                  "train_dir": "train"},
        "sglang": {"python": str(python), "port": port or free_port(),
                   "startup_timeout_s": 60.0}},
        tmp_path / "eagle3d.toml")
    return start_engine(cfg, tmp_path / "pids", {
        "fingerprint": CONTRACT, "layer_ids": LAYERS, "dtype": "bfloat16",
        "dump_dtype": "bfloat16", "target_fingerprint": fingerprint_file_or_folder(captured)})


def wait(eng: SGLangEngine, seconds: float) -> list[dict]:
    events: list[dict] = []
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and not eng.ready and eng.problem is None \
            and eng.poll() is None:
        events += eng.events()
        time.sleep(0.1)
    return events


def test_ready_after_a_slow_health_and_the_plugins_ready_file(tmp_path, monkeypatch):
    monkeypatch.setenv("FAKE_SGLANG", "ok")
    eng = engine(tmp_path)
    try:
        events = wait(eng, 60)
        assert eng.ready, eng.problem
        assert events == [{"event": "ready", "device": "sglang 0.5.17 tp=1"}]
    finally:
        eng.stop(5)


def test_a_server_of_another_model_of_the_same_shape_is_refused_before_any_request(tmp_path,
                                                                                   monkeypatch):
    """The server loads a model whose weights differ from the captured one (same file, same
    size): the plugin reports the fingerprint of the weights it loaded, and the engine never
    becomes ready, so no request is sent and no dump reaches the spool; it is ended, with the
    reason, which the extract stage shows without restarting it."""
    monkeypatch.setenv("FAKE_SGLANG", "ok")
    eng = engine(tmp_path, served=b"another model here")
    try:
        assert wait(eng, 60) == []
        assert not eng.ready
        assert f"the target {tmp_path / 'model'} (as SGLang loaded it) is not the model this " \
               "dataset was captured with" in eng.problem
        deadline = time.monotonic() + 10
        while eng.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert eng.poll() is not None
    finally:
        eng.stop(5)
    dumps = [p for p in (tmp_path / "spool").rglob("*") if p.is_file()
             and p.name != "ready.json"]
    assert dumps == []


def test_a_server_without_the_plugin_is_never_ready(tmp_path, monkeypatch):
    monkeypatch.setenv("FAKE_SGLANG", "no-plugin")
    monkeypatch.setattr(sglang_client, "HANDSHAKE_GRACE_S", 2.0)
    eng = engine(tmp_path)
    try:
        assert wait(eng, 60) == []
        assert not eng.ready
        assert "capture plugin did not report ready" in eng.problem
        deadline = time.monotonic() + 10
        while eng.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert eng.poll() is not None  # ended: it must not take samples it cannot capture
    finally:
        eng.stop(5)


def test_a_refusal_in_the_load_model_hook_stops_the_server(tmp_path, monkeypatch):
    monkeypatch.setenv("FAKE_SGLANG", "dp-attention")
    eng = engine(tmp_path)
    try:
        assert wait(eng, 60) == []
        assert not eng.ready and eng.poll() == 1
    finally:
        eng.stop(5)


def test_a_port_another_server_listens_on_is_refused_before_starting(tmp_path):
    """Another server there would answer the new one's /health in its place (the H200 run's
    capture engine once started beside the generation server it followed)."""
    with socket.socket() as other:
        other.bind(("127.0.0.1", 0))
        other.listen()
        port = other.getsockname()[1]
        with pytest.raises(EngineUnavailable, match=f"port {port} on 127.0.0.1 is taken"):
            engine(tmp_path, port)
    assert not list((tmp_path / "pids").glob("*.json"))  # nothing was started
