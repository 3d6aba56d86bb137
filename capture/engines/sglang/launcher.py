"""How the daemon starts its SGLang servers: the one that captures (the command line with the
flags that make capture correct, the environment that tells the capture plugin where to write),
the one the generate stage writes answers with, and the check that the SGLang installed in the
chosen interpreter is one the plugin was written for.

Light on purpose (stdlib, the config and the contract only): the daemon imports it.
"""

from __future__ import annotations

import json
import os
import secrets
import socket
import subprocess
from typing import Any

from eagle3d.capture.engines.sglang.plugin import CaptureSettings
from eagle3d.capture.engines.sglang.serve import API_KEY_ENV
from eagle3d.capture.engines.sglang.spec import ENTRY_POINT_GROUP, PLUGIN_NAME, SETTINGS
from eagle3d.dataset import contract as capture_contract
from eagle3d.statemachine import layout
from eagle3d.statemachine.config_schema import Config

# The versions whose source the plugin was checked against: the `sglang.srt.plugins` hook
# registry exists from 0.5.11, DeepSeek's current layer-id rule from 0.5.13, and the per-phase
# `--cuda-graph-backend-{prefill,decode}` flags from 0.5.14. Read: 0.5.14 and 0.5.23. Internals
# the plugin hooks change between patch releases, so the top is the newest one read.
MIN_VERSION = (0, 5, 14)
MAX_VERSION = (0, 5, 23)
SUPPORTED = "sglang>=0.5.14,<0.5.24"

# Flags eagle3d sets for capture to be correct; an operator's extra_args must not undo them.
# - no radix cache: a request whose prefix is cached is prefilled only past the prefix;
# - no chunked prefill: a chunk is a part of a prompt, and chunks mix with decode (MIXED);
# - no CUDA graphs: a graph replays kernels and bypasses the Python hook on the prefill path,
#   and the decode graphs would be captured for nothing (no request decodes a token);
# - no warm-up: its request is not a sample (the plugin would ignore it anyway).
CAPTURE_FLAGS = ["--disable-radix-cache", "--chunked-prefill-size", "-1",
                 "--cuda-graph-backend-prefill", "disabled",
                 "--cuda-graph-backend-decode", "disabled", "--skip-server-warmup"]
# What extra_args may not name: capture-critical settings, those taken from the config, the
# server's API keys (eagle3d's own, per start), and layouts in which one request's rows are not
# whole on tensor-parallel rank 0.
RESERVED = ("--api-key", "--admin-api-key",
            "--model-path", "--model", "--tp-size", "--tensor-parallel-size", "--tp", "--dtype",
            "--host", "--port", "--mem-fraction-static", "--max-prefill-tokens",
            "--disable-radix-cache", "--chunked-prefill-size", "--cuda-graph-backend-prefill",
            "--cuda-graph-backend-decode", "--disable-cuda-graph", "--enable-piecewise-cuda-graph",
            "--enforce-piecewise-cuda-graph", "--enable-mixed-chunk", "--enable-dp-attention",
            "--attn-dp-size", "--attention-data-parallel-size", "--enable-prefill-cp",
            "--attn-cp-size", "--attention-context-parallel-size", "--enable-layernorm-sp",
            "--enable-attn-tp-input-scattered", "--enable-return-aux-hidden-states",
            "--return-aux-hidden-state-layer-ids", "--cuda-graph-config", "--pp-size",
            "--pipeline-parallel-size", "--enable-two-batch-overlap", "--skip-server-warmup")
# SGLang's /health runs a one-token generation by default, which takes a second or more and
# competes with the daemon's prefills; off, it answers 200 as soon as the server is up.
SERVER_ENV = {"SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION": "0", "PYTHONUNBUFFERED": "1"}


def _reserved_flag(arg: str) -> str | None:
    name = arg.split("=", 1)[0]
    if name in RESERVED or name.startswith("--speculative-"):
        return name
    return None


def _server_argv(cfg: Config, dtype: str, own: list[str]) -> list[str]:
    """What both of eagle3d's servers take from the config, computing in `dtype`, then `own`
    flags, then the operator's extra_args. SGLang starts through serve.py, which adds the
    start's API key (_server_env) to these out of sight of other users."""
    server = SETTINGS.of(cfg)
    for arg in server.extra_args:
        flag = _reserved_flag(arg)
        if flag:
            raise ValueError(f"{cfg.path}: [{SETTINGS.name}.extra_args] {flag} is set by eagle3d "
                             "for capture to be correct; remove it")
    return [server.python, "-m", "eagle3d.capture.engines.sglang.serve",
            "--model-path", str(cfg.target.model_path),
            "--tp-size", str(server.tp),
            "--dtype", dtype,
            "--host", server.host, "--port", str(server.port),
            "--mem-fraction-static", str(server.mem_fraction), *own, *server.extra_args]


def launch_command(cfg: Config, contract: dict[str, Any]) -> tuple[list[str], dict[str, str]]:
    """The capturing server's argv and the environment to add to the daemon's for it. It
    computes in the contract's dtype, whatever the config says now. The environment carries a
    new start token each call, which the ready file of this start carries back, a new
    request key, which only the daemon's requests carry, and the start's API key."""
    argv = _server_argv(cfg, contract["dtype"], [
        # One forward batch is copied to host memory whole: bound it like the other engine
        # does, but never below the longest sample, which must fit in one prefill.
        "--max-prefill-tokens", str(max(cfg.extract.batch_tokens, cfg.data.max_tokens)),
        *CAPTURE_FLAGS])
    settings = CaptureSettings(spool=cfg.paths.spool_dir, contract=contract["fingerprint"],
                               layer_ids=tuple(contract["layer_ids"]),
                               ledger=layout.ledger(cfg.paths.state_dir),
                               dump_dtype=capture_contract.dump_dtype(contract),
                               token=secrets.token_hex(8),
                               request_key=secrets.token_hex(16))
    env = settings.to_env()
    allowed = os.environ.get("SGLANG_PLUGINS", "")
    if allowed.strip():
        # SGLang loads only the plugins this names when it is set.
        env["SGLANG_PLUGINS"] = f"{allowed},{PLUGIN_NAME}"
    return argv, {**env, **_server_env()}


def _server_env() -> dict[str, str]:
    """What both servers take in their environment: SGLang's settings and a new API key per
    start. Every loopback port is open to every local user: without the key, a request is
    refused (401) on every endpoint but /health and /metrics. --admin-api-key is left unset on
    purpose: SGLang then refuses its admin-only endpoints (weight updates) to everyone, and the
    daemon needs none of them."""
    return {**SERVER_ENV, API_KEY_ENV: secrets.token_urlsafe(32)}


def generation_command(cfg: Config) -> tuple[list[str], dict[str, str]]:
    """The server the generate stage writes answers with: SGLang as it serves, radix cache and
    decode graphs on. No capture settings in its environment, so the plugin stays inert in it:
    a server never both generates and captures (capture needs the flags above, and a request it
    captures must be a prefill of a finished conversation)."""
    return _server_argv(cfg, cfg.target.dtype, []), _server_env()


def launch_problem(cfg: Config) -> str | None:
    """Why a server of this config cannot be started here, or None: the SGLang of [sglang]
    python (check_version), or its port taken. A process already listening there would answer
    the new server's /health in its place: the capture plugin's missing ready file would then
    be blamed, or a generation sent to a server that is not ours."""
    server = SETTINGS.of(cfg)
    return check_version(server.python) or port_problem(server.host, server.port)


def port_problem(host: str, port: int) -> str | None:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        # As a server binds: connections of an earlier server closing down do not count.
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as exc:
            return (f"[sglang] port {port} on {host} is taken ({exc.strerror}): another server "
                    "listens there; stop it or choose another [sglang] port")
    return None


def _release(version: str) -> tuple[int, ...]:
    parts = []
    for part in version.split("."):
        digits = ""
        for ch in part:
            if not ch.isdigit():
                break
            digits += ch
        if not digits:
            break
        parts.append(int(digits))
        if digits != part:
            break  # "23rc1": a pre-release of 23 still has the release number 23
    return tuple(parts)


def version_problem(version: str | None, plugin_found: bool, python: str) -> str | None:
    if version is None:
        return (f"SGLang is not installed for {python}; install it there with "
                f"pip install '{SUPPORTED}' (or set [sglang] python to an interpreter that has it)")
    release = _release(version)[:3]
    if not MIN_VERSION <= release <= MAX_VERSION:
        return (f"SGLang {version} is installed for {python}, but eagle3d's capture plugin "
                f"supports {SUPPORTED} only (it hooks SGLang internals that change between "
                f"releases); install one with pip install '{SUPPORTED}'")
    if not plugin_found:
        return (f"eagle3d is not installed for {python}: SGLang would start without the capture "
                f"plugin (entry point {PLUGIN_NAME} in group {ENTRY_POINT_GROUP}); install "
                "eagle3d into that environment (pip install 'eagle3d[sglang]')")
    return None


_PROBE = """
import json
from importlib import metadata
try:
    version = metadata.version("sglang")
except metadata.PackageNotFoundError:
    version = None
names = [ep.name for ep in metadata.entry_points(group=%r)]
print(json.dumps({"version": version, "plugin": %r in names}))
""" % (ENTRY_POINT_GROUP, PLUGIN_NAME)


def check_version(python: str) -> str | None:
    """A problem message when the SGLang of that interpreter is missing, outside the supported
    range, or would not load the capture plugin; else None. Reads package metadata only:
    importing SGLang takes long."""
    try:
        # From "/": what is installed, not what happens to lie in the daemon's folder.
        done = subprocess.run([python, "-c", _PROBE], capture_output=True, text=True,
                              timeout=60, cwd="/")
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"cannot run the SGLang interpreter {python!r}: {exc}"
    try:
        found = json.loads(done.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return (f"cannot ask {python!r} which SGLang it has (exit {done.returncode}): "
                f"{done.stderr.strip()[-500:]}")
    return version_problem(found["version"], found["plugin"], python)
