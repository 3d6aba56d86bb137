"""The SGLang engine ([target] engine = "sglang"): an SGLang server with the eagle3d capture
plugin (plugin.py, which runs inside SGLang's processes), fed over HTTP (client.py), launched
by launcher.py through serve.py. This module is the daemon's whole view of it, and its
protocol names: those the launcher, the daemon and the plugin share.
"""

from __future__ import annotations

from typing import Any

from eagle3d.capture.engines import (Command, EngineSpec, EngineUnavailable, GenerationServer,
                                     Settings, Spawn, register)
from eagle3d.capture.engines.sglang.settings import SGLangSettings
from eagle3d.statemachine.config_schema import Config

NAME = "sglang"
# The [sglang] section: SETTINGS.of(cfg) is its settings, typed.
SETTINGS = Settings(NAME, SGLangSettings)

# What the launcher tells the plugin and the daemon reads back, through the server's
# environment (the plugin's other settings: plugin.CaptureSettings).
ENV_TOKEN = "EAGLE3D_START_TOKEN"    # names one server start: a ready file from an older one is stale
# A secret of one server start, which every request id the daemon sends carries: environments
# are private to their user, so another local user's request to the server is never dumped.
ENV_REQUEST_KEY = "EAGLE3D_REQUEST_KEY"
# A request id SPOT_PREFIX + sample id is the daemon's spot check re-extracting a verified
# sample: the plugin writes its dump to layout.engine_spot_folder, out of ingest's sight.
SPOT_PREFIX = "spot-"
PLUGIN_NAME = "eagle3d_capture"      # the entry point's name (pyproject.toml)
ENTRY_POINT_GROUP = "sglang.srt.plugins"


def _checked_launch(cfg: Config, command: Any) -> tuple[list[str], dict[str, str]]:
    """`command()` where a server of this config can start here; EngineUnavailable with the
    reason where it cannot (the SGLang of [sglang] python, the port, the settings)."""
    from eagle3d.capture.engines.sglang.launcher import launch_problem
    problem = launch_problem(cfg)
    if problem:
        raise EngineUnavailable(problem)
    try:
        return command()
    except ValueError as exc:
        raise EngineUnavailable(f"[{NAME}] {exc}") from None


def _capture_engine(cfg: Config, contract: dict[str, Any], spawn: Spawn) -> Any:
    from eagle3d.capture.engines.sglang.handle import SGLangEngine
    from eagle3d.capture.engines.sglang.launcher import launch_command
    argv, env = _checked_launch(cfg, lambda: launch_command(cfg, contract))
    return SGLangEngine(cfg, contract, spawn(argv, env, False), env)


def _generation_server(cfg: Config) -> GenerationServer:
    from eagle3d.capture.engines.sglang.launcher import generation_command
    from eagle3d.capture.engines.sglang.serve import API_KEY_ENV
    argv, env = _checked_launch(cfg, lambda: generation_command(cfg))
    return GenerationServer(argv, env, {API_KEY_ENV: env[API_KEY_ENV]})


def _decoder(cfg: Config, tokenizer: Any) -> tuple[Any, set[int]]:
    from eagle3d.capture.engines.sglang.decoder import connect
    return connect(cfg, tokenizer)


def _generate_command(cfg: Config) -> Command:
    from eagle3d.capture.engines.sglang.launcher import generation_command
    return ("the generate stage's SGLang server", *generation_command(cfg))


def _capture_command(cfg: Config) -> Command:
    """The extract stage's server: its command carries the contract's settings."""
    from eagle3d.capture.engines.sglang.launcher import launch_command
    from eagle3d.dataset import contract
    from eagle3d.statemachine import layout
    c = contract.read(cfg.paths.dataset_dir)
    if c is None:
        raise EngineUnavailable("no capture contract yet: the plan stage writes it "
                                f"({layout.contract_file(cfg.paths.dataset_dir)})")
    return ("the extract stage's SGLang server", *launch_command(cfg, c))


SPEC = register(EngineSpec(name=NAME, title="SGLang", settings=SETTINGS,
                           streaming=True,
                           capture_engine=_capture_engine, generation_server=_generation_server,
                           decoder=_decoder, generate_command=_generate_command,
                           capture_command=_capture_command))
