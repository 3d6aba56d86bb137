"""The config in force: the config the daemon holds, written into its state folder, from which
every child starts (and that eagle3ctl and train-node read), with the digest by which a child
makes sure it is the one the daemon holds."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from eagle3d.statemachine import digests, layout, shards
from eagle3d.statemachine.atomic import atomic_write_bytes
from eagle3d.statemachine.config_schema import Config, tables
from eagle3d.statemachine.config_validation import ConfigError, load_config

# A daemon's child gets the config in force's digest with this option (entry.child_main).
IN_FORCE_OPTION = "--in-force"


def to_toml(cfg: Config) -> str:
    """The config as a TOML document that loads back to the same Config from any folder."""
    import tomli_w  # only the daemon writes it; eagle3ctl must start in a blink
    doc: dict[str, Any] = {name: dict(keys) for name, keys in tables(cfg).items()}
    if cfg.data.shards > 1:  # the configured roots and the index in force, wherever it came from
        doc["data"]["shard_from_env"] = ""
        doc["paths"].update({k: str(shards.root_of(getattr(cfg.paths, k)))
                             for k in shards.SHARDED_PATHS})
    return ("# The config in force, written by the eagle3d daemon: every child starts from this\n"
            f"# file. Edit {cfg.path} instead, then reload (systemctl reload eagle3d).\n"
            + tomli_w.dumps(doc))


def write_in_force(cfg: Config) -> Path:
    """Write the config the daemon holds where every child reads it; returns the path."""
    path = layout.config_in_force(cfg.paths.state_dir)
    atomic_write_bytes(path, to_toml(cfg).encode())
    return path


def in_force_check(cfg: Config) -> list[str]:
    """The arguments by which a child of the daemon makes sure that the config in force it
    reads is the one the daemon holds (entry.child_main checks them): the daemon holds what it
    wrote; eagle3ctl, the config in force it loaded, that file as it read it (the file's header
    names the daemon's own config, which a config loaded from the file does not know)."""
    in_force = layout.config_in_force(cfg.paths.state_dir)
    held = in_force.read_bytes() if cfg.path == in_force else to_toml(cfg).encode()
    return [IN_FORCE_OPTION, digests.hex_digest(held)]


def check_in_force(path: Path, digest: str | None) -> None:
    """Refuse a config in force edited (or replaced) by hand since the daemon wrote it: its
    children must start from the config it holds, which passed every check a reload makes."""
    if digest is None:  # not a child of the daemon: a command an operator typed
        return
    try:
        found = digests.hex_digest(path.read_bytes())
    except OSError:
        return  # load_config says what is wrong with it
    if found != digest:
        raise ConfigError(f"{path} is not the config in force the daemon holds: edited by hand "
                          "after the daemon wrote it? Edit the config named at the top of the "
                          "file and reload the daemon instead (systemctl reload eagle3d), which "
                          "writes this one again")


def load_in_force(path: str | os.PathLike) -> Config:
    """For processes beside the daemon (eagle3ctl, train-node): the config in force where the
    daemon has written one for the config at `path` (its state folder), else that config. An
    edit the daemon refused must not show a command, or start a trainer, it would not run.
    That of the current run (statemachine/runs.py): its folders are the run's; ConfigError
    where runs.toml is damaged, as at the daemon's start."""
    from eagle3d.statemachine import runs  # lazily: eagle3ctl status answers in a blink
    cfg = load_config(path)
    in_force = layout.config_in_force(runs.current_state_dir(cfg.paths.state_dir))
    return load_config(in_force) if in_force.is_file() else cfg
