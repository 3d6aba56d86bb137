"""The transformers engine ([target] engine = "transformers", the default): the target loaded
by transformers in the daemon's children, the worker (worker.py) for capture and the generator
itself for generation. This module is the daemon's whole view of it.
"""

from __future__ import annotations

from typing import Any

from eagle3d.capture.engines import Command, EngineSpec, Spawn, generator_argv, register
from eagle3d.statemachine.config_schema import Config

NAME = "transformers"


def worker_argv(cfg: Config) -> list[str]:
    from eagle3d.statemachine import entry  # logging: not on status's path
    return entry.module_argv(cfg, "eagle3d.capture.engines.transformers.worker")


def _capture_engine(cfg: Config, contract: dict[str, Any], spawn: Spawn) -> Any:
    from eagle3d.capture.engines.transformers.handle import WorkerEngine
    return WorkerEngine(spawn(worker_argv(cfg), None, True))


def _decoder(cfg: Config, tokenizer: Any) -> tuple[Any, set[int]]:
    from eagle3d.capture.engines.transformers.decoder import load
    return load(cfg, tokenizer)


def _generate_command(cfg: Config) -> Command:
    return "the generate stage's generator", generator_argv(cfg), {}


def _capture_command(cfg: Config) -> Command:
    return "the extract stage's engine", worker_argv(cfg), {}


SPEC = register(EngineSpec(name=NAME, title="transformers", settings=None, streaming=False,
                           capture_engine=_capture_engine, generation_server=None,
                           decoder=_decoder, generate_command=_generate_command,
                           capture_command=_capture_command))
