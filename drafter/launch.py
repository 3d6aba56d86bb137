"""Start one node's trainer ranks without torchrun: `python -m eagle3d.drafter.launch -c CONFIG`
runs [train] nproc processes of `eagle3d.drafter.train` and supervises them.

torchrun's agent and its TCPStore listen on every interface whatever its flags (torch 2.13), and
on a shared server any local user could reach them. Here the ranks meet in a FileStore of a
folder of mode 0700 in the train folder, and gloo and NCCL open their own sockets on the
loopback interface only: nothing listens beyond loopback. Several nodes keep torchrun
(daemon/stages/train.py trainer_argv): they must listen.

As torchrun's agent does for us: a rank that fails or dies stops the others (SIGTERM, SIGKILL
after [train] stop_grace_s) and its exit code is the launcher's, so the trainer's codes (2, 3, 4:
statemachine/entry.py) reach the daemon as they are; SIGTERM to the launcher reaches every rank,
which checkpoints, and the launcher waits for them. The launcher dies with its parent, and each
rank with the launcher.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil

from eagle3d.statemachine import layout, safepath
from eagle3d.statemachine.config_schema import Config
from eagle3d.statemachine.config_in_force import IN_FORCE_OPTION
from eagle3d.statemachine.entry import Refusal, child_main
from eagle3d.statemachine.lifecycle import die_with_parent

log = logging.getLogger("eagle3d.launcher")

POLL_S = 0.1


def loopback_interface() -> str:
    """The name of the interface that holds 127.0.0.1 (`lo` on Linux)."""
    for name, addresses in psutil.net_if_addrs().items():
        if any(a.address == "127.0.0.1" for a in addresses):
            return name
    raise Refusal("refusing to train: no network interface holds 127.0.0.1, where the ranks of "
                  "one node meet")


def fresh_rendezvous(train_dir: Path) -> Path:
    """The FileStore's path, in a folder of mode 0700, without the file an earlier start left
    (a FileStore counts the ranks that joined it)."""
    store = layout.rendezvous_file(train_dir)
    problem = safepath.folder_problem(store.parent, 0o700)
    if problem:
        raise Refusal(f"refusing to train: {problem}")
    os.chmod(store.parent, 0o700)  # folder_problem lets others read; the ranks alone may
    store.unlink(missing_ok=True)
    return store


def rank_env(rank: int, world: int, store: Path, loopback: str) -> dict[str, str]:
    """What torchrun gives a rank that the trainer reads, and loopback for gloo's and NCCL's own
    sockets (without it they bind the address of the host name, reachable from the network)."""
    env = dict(os.environ)
    env.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world),
                "LOCAL_WORLD_SIZE": str(world), layout.RENDEZVOUS_ENV: str(store),
                "GLOO_SOCKET_IFNAME": loopback, "NCCL_SOCKET_IFNAME": loopback})
    # torchrun's default for several processes: the ranks do not oversubscribe the CPU.
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def _rank_preexec() -> None:
    """A rank stops (checkpointing) when the launcher dies, even by kill -9."""
    die_with_parent(signal.SIGTERM)


class Ranks:
    """The node's rank processes: started together, ended together."""

    def __init__(self, argv: list[str], world: int, store: Path, grace_s: float) -> None:
        loopback = loopback_interface()
        self.grace_s = grace_s
        self.kill_at: float | None = None  # when what is left gets SIGKILL, once stopping
        self.code = 0  # the first failure's exit code
        self.procs = [subprocess.Popen(argv, env=rank_env(rank, world, store, loopback),
                                       preexec_fn=_rank_preexec, close_fds=True)
                      for rank in range(world)]

    def stop(self) -> None:
        """SIGTERM to every rank still running (they checkpoint); SIGKILL at the grace's end."""
        if self.kill_at is None:
            self.kill_at = time.monotonic() + self.grace_s
        self._send(signal.SIGTERM)

    def _send(self, sig: int) -> None:
        for p in self.procs:
            if p.poll() is None:
                try:
                    p.send_signal(sig)
                except ProcessLookupError:
                    pass

    def wait(self) -> int:
        """Until every rank has exited: 0, or the exit code of the first that failed (128 + the
        signal of one that was killed, as a shell says it)."""
        while True:
            running = False
            for rank, p in enumerate(self.procs):
                code = p.poll()
                if code is None:
                    running = True
                elif code != 0 and self.code == 0:
                    self.code = code if code > 0 else 128 - code
                    log.error("rank %d exited with code %d: stopping the others", rank, code)
                    self.stop()
            if not running:
                return self.code
            if self.kill_at is not None and time.monotonic() >= self.kill_at:
                self._send(signal.SIGKILL)
            time.sleep(POLL_S)


def _run(cfg: Config, args: argparse.Namespace) -> int:
    if cfg.train.nnodes != 1:
        raise Refusal("refusing to launch: [train] nnodes > 1 trains under torchrun")
    argv = [sys.executable, "-m", "eagle3d.drafter.train", "-c", args.config,
            *([IN_FORCE_OPTION, args.in_force] if args.in_force else [])]
    ranks = Ranks(argv, cfg.train.nproc, fresh_rendezvous(cfg.paths.train_dir),
                  cfg.train.stop_grace_s)
    signal.signal(signal.SIGTERM, lambda signum, frame: ranks.stop())
    return ranks.wait()


def main(argv: list[str] | None = None) -> int:
    # The daemon killed (kill -9): the ranks checkpoint and stop, within their grace.
    die_with_parent(signal.SIGTERM)
    return child_main("launcher", "Start and supervise one node's trainer ranks.", _run, argv)


if __name__ == "__main__":
    sys.exit(main())
