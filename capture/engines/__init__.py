"""The engines that run the target, behind one seam (torchtitan's TrainSpec registry): each
engine is a folder, capture/engines/<name>/, whose `spec.py` registers an `EngineSpec` here,
and whose `settings.py` declares its own config section, if it has one ([sglang]). The rest of
eagle3d asks `get(cfg.target.engine)` and never tests an engine's name; the schema
(statemachine/config_schema.py) names none, not even the default, which is the first one
registered.

Specs are light (stdlib, the config, layout): the daemon and eagle3ctl import them, and must
never import torch; `eagle3ctl status` checks the config through checked() and stays fast, so
they are NamedTuples (dataclasses imports inspect). What a spec names is imported only when it
is called: the extract stage's capture engine, the generate stage's server, the generator's
decoder (in the generator child, where torch is), and the commands `eagle3ctl engine-command`
prints.
"""

from __future__ import annotations

from pathlib import Path
from types import MappingProxyType
from typing import Any, Callable, Generic, NamedTuple, Protocol, TypeVar

from eagle3d.statemachine.config_schema import Config, keys_of, written
from eagle3d.statemachine.config_validation import (ConfigError, read_section,
                                                    refuse_unknown_sections)

# (what it is, argv, environment): one process that runs the target, as eagle3ctl prints it.
Command = tuple[str, list[str], dict[str, str]]


class EngineUnavailable(RuntimeError):
    """The engine cannot be started as configured; the message tells the operator why."""


class Process(Protocol):
    """The daemon's handle on a child process (daemon/children.py's Child)."""

    pid: int
    proc: Any  # its subprocess.Popen

    def poll(self) -> int | None: ...

    def signal(self, sig: int) -> None: ...

    def stop(self, grace: float) -> int: ...


# Starts the engine's process as a child of the daemon: (argv, environment, pipes to its
# stdin and stdout) → the running child.
Spawn = Callable[[list[str], "dict[str, str] | None", bool], Process]


class CaptureEngine(Protocol):
    """What the extract stage holds of a running engine: submit batches, read events, stop.
    Events are hints; the dumps in the spool are the results."""

    kind: str
    ready: bool
    device: str
    pid: int  # and, optionally, `problem`: why it will never become ready

    def submit(self, batch: list[dict[str, Any]], out: Path) -> None: ...

    def events(self) -> list[dict]: ...

    def poll(self) -> int | None: ...

    def stop(self, grace: float) -> int: ...


class GenerationServer(NamedTuple):
    """A server the generate stage starts beside the generator, which decodes through it."""

    argv: list[str]
    env: dict[str, str]
    generator_env: dict[str, str]  # what the generator is told of it (its API key)


S = TypeVar("S")


class Settings(NamedTuple, Generic[S]):
    """An engine's own config section: its name and the NamedTuple that declares its keys in
    the schema's vocabulary (Annotated converters, statemachine/config_schema.py)."""

    name: str  # [name] in the config file
    cls: type[S]

    def of(self, cfg: Config) -> S:
        """The section of `cfg`, typed; its defaults where the file has none (checked() has
        refused a bad one where the daemon and eagle3ctl loaded the file)."""
        return read_section(cfg, self.name, self.cls)


class EngineSpec(NamedTuple):
    """One engine: everything the daemon, eagle3ctl and the generator need to know of it."""

    name: str  # [target] engine
    title: str  # as messages name it
    settings: Settings | None  # its own config section; None where [target] is all it reads
    # The generator keeps each conversation in flight on its own (a server that batches
    # whatever is in flight), or decodes a batch of them in lockstep (a model in its process).
    streaming: bool
    # The extract stage's engine, started as a child of the daemon; raises EngineUnavailable.
    capture_engine: Callable[[Config, dict[str, Any], Spawn], CaptureEngine]
    # The server the generate stage starts beside the generator, None where the generator
    # holds the target itself; raises EngineUnavailable.
    generation_server: Callable[[Config], GenerationServer] | None
    # In the generator child: (the decoder, the tokens that end an answer) from the tokenizer.
    decoder: Callable[[Config, Any], tuple[Callable[..., list[list[int]]], set[int]]]
    # As eagle3ctl prints them: the generate stage's process that runs the target, and the
    # extract stage's; either raises EngineUnavailable.
    generate_command: Callable[[Config], Command]
    capture_command: Callable[[Config], Command]


def generator_argv(cfg: Config) -> list[str]:
    from eagle3d.statemachine import entry  # logging: not on status's path
    return entry.module_argv(cfg, "eagle3d.capture.generator")


def shell_line(argv: list[str], env: dict[str, str]) -> str:
    """The command as an operator would type it (for `eagle3ctl engine-command`)."""
    import shlex
    return " ".join([*(f"{k}={shlex.quote(v)}" for k, v in sorted(env.items())),
                     *map(shlex.quote, argv)])


_SPECS: dict[str, EngineSpec] = {}


def register(spec: EngineSpec) -> EngineSpec:
    if spec.settings and not keys_of(spec.settings.cls):  # annotations as strings: no converters
        raise TypeError(f"{spec.settings.cls.__name__} declares no keys: a settings module must "
                        "not use `from __future__ import annotations`")
    _SPECS[spec.name] = spec
    return spec


def get(name: str) -> EngineSpec:
    """The spec of [target] engine `name`, the default's (the first registered) where it is
    empty: the one place the default is chosen (checked() has made sure `name` is one of
    names())."""
    return _SPECS[name or names()[0]]


def names() -> tuple[str, ...]:
    return tuple(_SPECS)


def sections() -> dict[str, Settings]:
    """Section name -> its settings, of every registered engine that has a section."""
    return {s.settings.name: s.settings for s in _SPECS.values() if s.settings}


def checked(cfg: Config) -> Config:
    """`cfg` as the engines read it, or ConfigError in the config's words: its [target] engine
    a registered one, by name (the default's where left out), and its engines' sections each
    read by its settings, then written in full (the config in force carries them, for the
    children); a section neither the schema nor an engine reads is refused. The schema reads
    the engine as any string and keeps the sections it does not know (statemachine, the lowest
    floor, cannot know the engines): the daemon's start and reload and eagle3ctl check this as
    they load."""
    if cfg.target.engine and cfg.target.engine not in _SPECS:
        raise ConfigError(f"{cfg.path}: [target.engine] must be one of "
                          f"{', '.join(map(repr, names()))}, got {cfg.target.engine!r}")
    held = sections()
    refuse_unknown_sections(cfg, held)
    tables = {name: MappingProxyType(written(s.of(cfg))) for name, s in held.items()}
    return cfg._replace(target=cfg.target._replace(engine=get(cfg.target.engine).name),
                        engine_sections=MappingProxyType(tables))


# The registrations: one line per engine. The first is the default [target] engine.
from eagle3d.capture.engines.transformers import spec as _transformers  # noqa: E402,F401
from eagle3d.capture.engines.sglang import spec as _sglang  # noqa: E402,F401
