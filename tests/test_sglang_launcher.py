"""The SGLang server's command line and environment, and the version check, run against real
interpreters whose installed packages are made up for the test (dist-info folders only)."""

from __future__ import annotations

import shlex
import sys
from pathlib import Path

import pytest

from eagle3d.capture.engines import shell_line
from eagle3d.capture.engines.sglang.launcher import (CAPTURE_FLAGS, SUPPORTED, check_version,
                                                     generation_command, launch_command)
from eagle3d.capture.engines.sglang.plugin import CaptureSettings
from eagle3d.capture.engines.sglang.spec import ENV_REQUEST_KEY, ENV_TOKEN
from eagle3d.capture.engines.sglang.serve import API_KEY_ENV
from eagle3d.statemachine.config_validation import parse_config

CONTRACT = {"fingerprint": "c" * 32, "layer_ids": [2, 30, 58], "dtype": "bfloat16",
            "dump_dtype": "float8_e4m3fn"}


def config(tmp_path: Path, **sglang) -> object:
    (tmp_path / "Kimi-K2.5").mkdir(exist_ok=True)
    (tmp_path / "data.json").write_text("[]")
    raw = {"target": {"model": "Kimi-K2.5", "engine": "sglang", "dtype": "bfloat16"},
           "data": {"source": "data.json", "max_tokens": 16384},
           "paths": {"state_dir": "state", "spool_dir": "spool", "dataset_dir": "dataset",
                     "train_dir": "train"},
           "extract": {"batch_tokens": 8192, "max_inflight_tokens": 65536},
           "sglang": {"python": "/opt/sglang/bin/python", "tp": 8, "port": 30123, **sglang}}
    return parse_config(raw, tmp_path / "eagle3d.toml")


def flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def test_command_starts_sglang_with_the_flags_capture_needs(tmp_path, monkeypatch):
    monkeypatch.delenv("SGLANG_PLUGINS", raising=False)
    argv, env = launch_command(config(tmp_path, extra_args=["--trust-remote-code"]), CONTRACT)
    # SGLang through sglang_serve, which adds this start's API key out of other users' sight.
    assert argv[:3] == ["/opt/sglang/bin/python", "-m", "eagle3d.capture.engines.sglang.serve"]
    assert flag(argv, "--model-path") == str(tmp_path / "Kimi-K2.5")
    assert (flag(argv, "--tp-size"), flag(argv, "--port"), flag(argv, "--dtype")) == \
        ("8", "30123", "bfloat16")
    assert "--disable-radix-cache" in argv and "--skip-server-warmup" in argv
    assert flag(argv, "--chunked-prefill-size") == "-1"
    assert flag(argv, "--cuda-graph-backend-prefill") == "disabled"
    assert flag(argv, "--cuda-graph-backend-decode") == "disabled"
    assert flag(argv, "--max-prefill-tokens") == "16384"  # the longest sample fits one prefill
    assert argv[-1] == "--trust-remote-code"
    settings = CaptureSettings.from_env(env)
    assert settings == CaptureSettings(tmp_path / "spool", "c" * 32, (2, 30, 58),
                                       tmp_path / "state" / "ledger.sqlite", "float8_e4m3fn",
                                       env[ENV_TOKEN], env[ENV_REQUEST_KEY])
    assert "SGLANG_PLUGINS" not in env  # unset: SGLang loads every installed plugin
    # /health answers at once instead of running a generation the daemon would wait on.
    assert env["SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION"] == "0"
    again = launch_command(config(tmp_path), CONTRACT)[1]
    assert settings.token and again[ENV_TOKEN] != settings.token  # each start its own: an
    # old ready file is not taken for this one
    # Each start's own request key, which no command line shows (a local user reads those).
    assert len(settings.request_key) == 32 and again[ENV_REQUEST_KEY] != settings.request_key
    assert settings.request_key not in " ".join(argv)
    # So is its API key (sglang_serve adds it to SGLang's arguments inside the process).
    assert len(env[API_KEY_ENV]) >= 32 and again[API_KEY_ENV] != env[API_KEY_ENV]
    assert env[API_KEY_ENV] not in " ".join(argv) and "--api-key" not in argv
    line = shell_line(argv, env)
    assert shlex.split(line)[-len(argv):] == argv and "EAGLE3D_LAYER_IDS=2,30,58" in line


def test_the_capturing_server_computes_in_the_contracts_dtype(tmp_path):
    """[target] dtype edited after the capture began, then a restart: the server still computes
    in the dtype every dump of the dataset was made with."""
    cfg = config(tmp_path)
    cfg = cfg._replace(target=cfg.target._replace(dtype="float16"))
    argv, _ = launch_command(cfg, CONTRACT)
    assert flag(argv, "--dtype") == CONTRACT["dtype"] == "bfloat16"


def test_the_generation_server_serves_as_sglang_does_and_never_captures(tmp_path):
    """The generate stage's server: the same target, parallelism and operator flags, none of
    capture's (radix cache, decode graphs and warm-up stay SGLang's own), and no capture
    settings for the plugin to act on."""
    cfg = config(tmp_path, extra_args=["--trust-remote-code"])
    argv, env = generation_command(cfg)
    capture_argv, _ = launch_command(cfg, CONTRACT)
    assert argv[:3] == capture_argv[:3] and argv[-1] == "--trust-remote-code"
    for name in ("--model-path", "--tp-size", "--dtype", "--port", "--mem-fraction-static"):
        assert flag(argv, name) == flag(capture_argv, name)
    assert not {f for f in CAPTURE_FLAGS if f.startswith("--")} & set(argv)
    assert CaptureSettings.from_env(env) is None and env[API_KEY_ENV]
    with pytest.raises(ValueError, match="extra_args"):
        generation_command(config(tmp_path, extra_args=["--enable-dp-attention"]))


def test_an_operators_plugin_list_keeps_ours(tmp_path, monkeypatch):
    monkeypatch.setenv("SGLANG_PLUGINS", "vendor_hooks")
    _, env = launch_command(config(tmp_path), CONTRACT)
    assert env["SGLANG_PLUGINS"] == "vendor_hooks,eagle3d_capture"


@pytest.mark.parametrize("bad", [
    "--chunked-prefill-size=8192", "--speculative-algorithm", "--enable-mixed-chunk", "--pp-size",
    "--cuda-graph-config", "--attention-data-parallel-size", "--attn-dp-size",
    "--enable-dp-attention", "--enable-prefill-cp", "--attn-cp-size=2",
    "--attention-context-parallel-size", "--enable-layernorm-sp",
    "--enable-attn-tp-input-scattered", "--enable-return-aux-hidden-states",
    "--return-aux-hidden-state-layer-ids", "--api-key=mine", "--admin-api-key"])
def test_extra_args_cannot_undo_capture_flags(tmp_path, bad):
    with pytest.raises(ValueError, match=f"extra_args\\] {bad.split('=')[0]} is set by eagle3d"):
        launch_command(config(tmp_path, extra_args=[bad]), CONTRACT)


def fake_packages(root: Path, sglang: str | None, plugin: bool) -> Path:
    """A folder with dist-info metadata only: what importlib.metadata reads."""
    root.mkdir()
    if sglang:
        info = root / f"sglang-{sglang}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: sglang\nVersion: {sglang}\n")
    if plugin:
        info = root / "eagle3d-0.1.0.dist-info"
        info.mkdir()
        (info / "METADATA").write_text("Metadata-Version: 2.1\nName: eagle3d\nVersion: 0.1.0\n")
        (info / "entry_points.txt").write_text(
            "[sglang.srt.plugins]\neagle3d_capture = eagle3d.capture.engines.sglang.plugin:register\n")
    return root


def interpreter(tmp_path: Path, packages: Path) -> str:
    """A real Python that sees only the standard library and `packages` (no site-packages)."""
    script = tmp_path / "python"
    script.write_text(f"#!/bin/sh\nPYTHONPATH={shlex.quote(str(packages))} "
                      f"exec {shlex.quote(sys.executable)} -S \"$@\"\n")
    script.chmod(0o755)
    return str(script)


@pytest.mark.parametrize("sglang,plugin,problem", [
    ("0.5.14", True, None),
    ("0.5.23.post1", True, None),
    (None, True, "SGLang is not installed"),
    ("0.5.10", True, "SGLang 0.5.10 is installed"),
    ("0.5.24rc0", True, "SGLang 0.5.24rc0 is installed"),
    ("0.6.0", True, "SGLang 0.6.0 is installed"),
    ("0.5.20", False, "eagle3d is not installed"),
])
def test_version_check_names_the_problem(tmp_path, sglang, plugin, problem):
    python = interpreter(tmp_path, fake_packages(tmp_path / "pkgs", sglang, plugin))
    found = check_version(python)
    if problem is None:
        assert found is None
    else:
        assert problem in found and python in found
        assert SUPPORTED in found or "eagle3d[sglang]" in found


def test_version_check_of_a_missing_interpreter(tmp_path):
    missing = str(tmp_path / "no-such-python")
    assert "cannot run the SGLang interpreter" in check_version(missing)
