"""How every child of the daemon starts and ends: its arguments, its log lines (journald
priorities under systemd), its config (the config in force the daemon wrote) and its exit code.

Exit codes are the protocol between a child and the daemon; both ends use these names.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path
from typing import Callable, Sequence

from eagle3d.statemachine import layout
from eagle3d.statemachine.config_in_force import IN_FORCE_OPTION, check_in_force, in_force_check
from eagle3d.statemachine.config_schema import Config
from eagle3d.statemachine.config_validation import ConfigError, load_config
from eagle3d.statemachine.logs import setup_logging

OK = 0
# The evaluation measured, and speculative decoding did not reproduce greedy decoding exactly.
DIVERGED = 1
# A config or input that retrying will not fix; the log says why.
REFUSED = 2
# The target or the config does not match the dataset's capture contract.
CONTRACT_MISMATCH = 3
# A dataset file is not what verify recorded (its size, time or checksum): the daemon sends its
# sample back to verify, which re-reads it and has it extracted again if it is damaged.
DATASET_CHANGED = 4
# The daemon's start met what may mend by itself: a ledger another process holds, a disk full,
# read-only or failing for now (sysexits' EX_TEMPFAIL). The unit restarts it; REFUSED it does not.
RETRY = 75
# Exits a restart cannot change: the same input meets the same refusal (a changed dataset file
# too, where the daemon could not send its sample back: another node's).
FINAL = (REFUSED, CONTRACT_MISMATCH, DATASET_CHANGED)


class Refusal(Exception):
    """A child's reason to stop that the operator must act on; the message says what to do."""

    code = REFUSED
    samples: tuple[str, ...] = ()  # the dataset samples the daemon sends back to verify


class ContractMismatch(Refusal):
    code = CONTRACT_MISMATCH


class DatasetChanged(Refusal):
    """Dataset files that differ from what verify recorded: the daemon, not the operator, acts
    on it."""

    code = DATASET_CHANGED

    def __init__(self, message: str, samples: Sequence[str] = ()) -> None:
        super().__init__(message)
        self.samples = tuple(samples)


def module_argv(cfg: Config, module: str, *args: str) -> list[str]:
    """`python -m MODULE -c CONFIG ARGS…` for a child of the daemon, where CONFIG is the config
    in force (the daemon writes it into the state folder), never the operator's editable file."""
    return [sys.executable, "-m", module, "-c", str(layout.config_in_force(cfg.paths.state_dir)),
            *in_force_check(cfg), *args]


def child_main(process: str, description: str, run: Callable[[Config, argparse.Namespace], int],
               argv: list[str] | None = None,
               add_arguments: Callable[[argparse.ArgumentParser], None] | None = None) -> int:
    """Parse `-c CONFIG` (and the child's own arguments), log as `process`, load the config
    and run; a bad config or a Refusal is one error line and its exit code, not a traceback."""
    parser = argparse.ArgumentParser(prog=f"eagle3d {process}", description=description)
    parser.add_argument("-c", "--config", required=True, help="the eagle3d TOML config")
    parser.add_argument(IN_FORCE_OPTION, help="the digest of the config in force, from the "
                        "daemon: refuse a config edited by hand since it was written")
    if add_arguments is not None:
        add_arguments(parser)
    args = parser.parse_args(argv)
    setup_logging(process)
    log = logging.getLogger(f"eagle3d.{process}")
    try:
        check_in_force(Path(args.config), args.in_force)
        return run(load_config(args.config), args)
    except ConfigError as exc:
        log.error("%s", exc)
        return REFUSED
    except Refusal as exc:
        log.error("%s", exc)
        return exc.code
