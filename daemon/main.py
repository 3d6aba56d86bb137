"""`eagle3d run`: the daemon in the foreground (systemd runs it exactly so)."""

from __future__ import annotations

import argparse
import os
import sys

from eagle3d.statemachine.logs import setup_logging
from eagle3d.statemachine.stages import ORDER

DEFAULT_CONFIG = "/etc/eagle3d/eagle3d.toml"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="eagle3d", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run the pipeline daemon in the foreground")
    run.add_argument("-c", "--config", default=os.environ.get("EAGLE3D_CONFIG", DEFAULT_CONFIG),
                     help=f"config file (default {DEFAULT_CONFIG} or $EAGLE3D_CONFIG)")
    run.add_argument("--until", choices=ORDER,
                     help="exit 0 once this stage is reached, non-zero if the pipeline fails")
    args = parser.parse_args(argv)
    setup_logging("daemon")
    from eagle3d.daemon.reconcile import run as run_daemon
    code = run_daemon(args.config, args.until)
    if args.until and code == 0:
        from eagle3d.daemon.ctl import results_summary
        print(results_summary(args.config))
    return code


if __name__ == "__main__":
    sys.exit(main())
