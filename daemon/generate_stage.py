"""The generate stage ([data] responses = "target"): the generator child has the target write
the assistant turns of every planned conversation (capture/generator.py), working through the
ledger itself. The stage starts it, follows its progress from the ledger's counts, and when it
dies returns what it held, counting an attempt for each, and starts it again (bounded).

With [target] engine = "sglang" the stage also starts the SGLang server the generator decodes
with (sglang_launcher.generation_command: no capture in it), beside the generator and for as long
as it runs: a server that dies ends the generator's round, and the next round starts both anew.
"""

from __future__ import annotations

import collections
import logging
import time
from pathlib import Path
from typing import Any

from eagle3d.daemon.children import Child, module_argv, remaining
from eagle3d.statemachine import entry
from eagle3d.statemachine.config import Config
from eagle3d.statemachine.ledger import Counts, Ledger
from eagle3d.statemachine.stages import Decision, Stage

log = logging.getLogger("eagle3d")

RATE_WINDOW_S = 120.0
STOP_GRACE_S = 30.0  # SGLang ends its scheduler processes on SIGTERM within seconds


def generator_argv(cfg: Config) -> list[str]:
    return module_argv(cfg, "eagle3d.capture.generator")


class GenerateStage:
    def __init__(self, cfg: Config, ledger: Ledger, pid_dir: Path) -> None:
        self.cfg = cfg
        self.ledger = ledger
        self.pid_dir = pid_dir
        self.child: Child | None = None
        self.server: Child | None = None
        self.restarts = 0
        self.retry_at = 0.0
        self.problem: str | None = None
        # (time, conversations left to generate): the rate is how fast that falls.
        self.left: collections.deque[tuple[float, int]] = collections.deque()

    def observe(self, counts: Counts) -> dict[str, Any]:
        now = time.time()
        self.left.append((now, counts.get("ungenerated") + counts.get("generating")))
        while self.left and self.left[0][0] < now - RATE_WINDOW_S:
            self.left.popleft()
        return {"blocked": self.problem}

    def rate(self) -> float:
        """Conversations generated per second over the last two minutes."""
        if len(self.left) < 2:
            return 0.0
        (t0, n0), (t1, n1) = self.left[0], self.left[-1]
        return max(0, n0 - n1) / (t1 - t0) if t1 > t0 else 0.0

    def eta(self) -> float | None:
        rate = self.rate()
        return self.left[-1][1] / rate if rate > 0 and self.left else None

    def step(self, decision: Decision) -> None:
        if self.child is not None:
            ended = self._round_end(decision)
            if ended is None:
                return
            self.child = None
            self._stop_server()
            self._exited(*ended)
        if decision.stage != Stage.GENERATE or self.problem or time.time() < self.retry_at:
            return
        if self.cfg.target.engine == "sglang" and not self._start_server():
            return
        self.child = Child("generator", generator_argv(self.cfg), self.pid_dir)

    def _round_end(self, decision: Decision) -> tuple[int | None, str] | None:
        """How the running round (generator and server) ends, or None while it goes on: the
        generator's exit; its server's death (the generator is ended; code None); or the ledger
        holding every answer while the generator is still exiting: it is ended now, so that its
        server is down before the next stage starts one on the same port (on the H200 the
        capture engine once came up beside the generation server, which answered its /health)."""
        assert self.child is not None
        code = self.child.poll()
        if code is not None:
            return code, f"the generator exited with code {code}"
        server_code = self.server.poll() if self.server is not None else None
        if server_code is not None:
            self.child.stop(STOP_GRACE_S)
            return None, f"the SGLang generation server exited with code {server_code}"
        if decision.underlying != Stage.GENERATE:
            self.child.stop(STOP_GRACE_S)
            return entry.OK, "generation is over"
        return None

    def _start_server(self) -> bool:
        from eagle3d.capture.sglang_launcher import generation_command, launch_problem
        problem = launch_problem(self.cfg)
        if problem is None:
            try:
                argv, env = generation_command(self.cfg)
            except ValueError as exc:
                problem = f"[sglang] {exc}"
        if problem is not None:
            self.problem = problem
            log.error("cannot start the SGLang generation server: %s", problem)
            self.ledger.event("generate_failed", problem)
            return False
        self.server = Child("generation-server", argv, self.pid_dir, env=env)
        return True

    def _stop_server(self) -> None:
        if self.server is not None:
            self.server.stop(STOP_GRACE_S)
            self.server = None

    def _exited(self, code: int | None, why: str) -> None:
        """Whatever the generator still held goes back, with an attempt counted: a conversation
        that keeps killing the generator ends up failed, with the reason, not in a loop. `code`
        is None when the stage ended the generator because its server died."""
        held = self.ledger.samples("generating")
        for sample in held:
            self.ledger.mark_retry(sample.id, why, self.cfg.generate.max_attempts,
                                   frm=("generating",))
        if code == entry.OK:
            return
        self.restarts += 1
        self.ledger.event("generator_exit", f"{why}, {len(held)} conversations returned")
        limit = self.cfg.extract.engine_max_restarts
        if code in entry.FINAL:
            self.problem = f"the generator refused to run (exit {code}); see the log"
        elif self.restarts > limit:
            self.problem = (f"{why}, {self.restarts} times ([extract] "
                            f"engine_max_restarts = {limit}); see the log")
        else:
            self.retry_at = time.time() + min(60.0, 2.0 ** self.restarts)
            log.warning("%s; %d conversations returned; restarting", why, len(held))
            return
        log.error("%s", self.problem)
        self.ledger.event("generate_failed", self.problem)

    def unblock(self) -> None:
        self.problem = None
        self.restarts = 0

    def status(self) -> dict[str, Any]:
        out: dict[str, Any] = {"status": "running" if self.child else "stopped",
                               "restarts": self.restarts,
                               "rate_per_s": round(self.rate(), 3), "problem": self.problem}
        if self.child is not None:
            out["pid"] = self.child.pid
        if self.server is not None:
            out["server_pid"] = self.server.pid
        return out

    def stop(self, deadline: float) -> None:
        """What it holds goes back to ungenerated with the daemon's own requeue at its stop."""
        if self.child is not None:
            self.child.stop(remaining(deadline, 10.0))
            self.child = None
        if self.server is not None:
            self.server.stop(remaining(deadline, STOP_GRACE_S))
            self.server = None
