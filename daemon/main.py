"""`eagle3d run`: the daemon in the foreground (systemd runs it exactly so). `eagle3d train-node`:
on the other nodes of a multi-node training, this node's share of node 0's trainings."""

from __future__ import annotations

import argparse
import os
import sys

from eagle3d.daemon.completion import add_completion_option
from eagle3d.statemachine.logs import setup_logging
from eagle3d.statemachine.stages import ORDER
from eagle3d.statemachine.version import VERSION

DEFAULT_CONFIG = "/etc/eagle3d/eagle3d.toml"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="eagle3d", description=__doc__)
    parser.add_argument("--version", action="version", version=f"eagle3d {VERSION}")
    add_completion_option(parser)
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run the pipeline daemon in the foreground")
    run.add_argument("--until", choices=ORDER,
                     help="run until the pipeline reaches STAGE, before any of its work, then "
                     "exit 0 (non-zero if it fails): `--until verify` stops once every sample "
                     "is extracted, `--until train` once the dataset is verified, `--until "
                     "done` runs everything")
    node = sub.add_parser("train-node", help="on node k > 0 of a multi-node training ([train] "
                          "node_rank), take part in node 0's trainings until stopped")
    for command in (run, node):
        command.add_argument("-c", "--config",
                             default=os.environ.get("EAGLE3D_CONFIG", DEFAULT_CONFIG),
                             help=f"config file (default {DEFAULT_CONFIG} or $EAGLE3D_CONFIG)")
    args = parser.parse_args(argv)
    if args.command == "train-node":
        setup_logging("train-node")
        from eagle3d.daemon.train_node import run as run_node
        return run_node(args.config)
    setup_logging("daemon")
    from eagle3d.daemon.reconcile import run as run_daemon
    code = run_daemon(args.config, args.until)
    if args.until and code == 0:
        from eagle3d.ctl.main import results_summary
        print(results_summary(args.config))
    return code


if __name__ == "__main__":
    sys.exit(main())
