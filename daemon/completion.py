"""`--print-completion {bash,zsh,tcsh}` on both programs: the shell completion script, drawn by
shtab from the program's own argparse parser, so it never lists a subcommand or option the
program lacks."""

from __future__ import annotations

import argparse
import sys
from typing import Any, NoReturn

SHELLS = ("bash", "zsh", "tcsh")


class _PrintCompletion(argparse.Action):
    """Prints the script and exits as soon as argparse meets the option, like --version: the
    subcommand the programs otherwise require is not asked for."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 shell: Any, option_string: str | None = None) -> NoReturn:
        # shtab imports importlib.metadata and email: ~0.1 s that every `eagle3ctl status`
        # would pay if it were imported with the parser.
        import shtab
        sys.stdout.write(shtab.complete(parser, shell=shell))
        parser.exit(0)


def add_completion_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--print-completion", choices=SHELLS, action=_PrintCompletion,
                        help="print the shell's completion script and exit (`make install` "
                        "installs bash's)")
