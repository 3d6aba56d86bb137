"""`eagle3d run`: the daemon in the foreground (systemd runs it exactly so)."""

from __future__ import annotations

import argparse
import logging
import os
import sys

from eagle3d.statemachine.stages import ORDER

DEFAULT_CONFIG = "/etc/eagle3d/eagle3d.toml"


def setup_logging() -> None:
    """One line per event. Under journald (JOURNAL_STREAM) the journal adds the time and takes
    the priority from a <N> prefix; in a terminal the line carries its own time."""
    if os.environ.get("JOURNAL_STREAM"):
        levels = {"DEBUG": 7, "INFO": 6, "WARNING": 4, "ERROR": 3, "CRITICAL": 2}

        class Journal(logging.Formatter):
            def format(self, record: logging.LogRecord) -> str:
                return f"<{levels.get(record.levelname, 6)}>{super().format(record)}"
        handler = logging.StreamHandler()
        handler.setFormatter(Journal("%(message)s"))
        logging.basicConfig(level=logging.INFO, handlers=[handler])
    else:
        logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                            format="%(asctime)s %(levelname)-7s %(message)s", datefmt="%H:%M:%S")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="eagle3d", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run the pipeline daemon in the foreground")
    run.add_argument("-c", "--config", default=os.environ.get("EAGLE3D_CONFIG", DEFAULT_CONFIG),
                     help=f"config file (default {DEFAULT_CONFIG} or $EAGLE3D_CONFIG)")
    run.add_argument("--until", choices=ORDER,
                     help="exit 0 once this stage is reached, non-zero if the pipeline fails")
    args = parser.parse_args(argv)
    setup_logging()
    from eagle3d.daemon.reconcile import run as run_daemon
    code = run_daemon(args.config, args.until)
    if args.until and code == 0:
        from eagle3d.daemon.ctl import results_summary
        print(results_summary(args.config))
    return code


if __name__ == "__main__":
    sys.exit(main())
