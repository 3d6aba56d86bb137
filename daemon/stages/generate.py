"""The generate stage ([data] responses = "target"): the generator child has the target write
the assistant turns of every planned conversation (capture/generator.py), working through the
ledger itself. The stage starts it, follows its progress from the ledger's counts, and when it
dies returns what it held, counting an attempt for each, and starts it again (bounded).

Where the engine decodes through a server (its spec's generation_server: SGLang's, with no capture
in it), the stage also starts that server, beside the generator and for as long as it runs: a
server that dies ends the generator's round, and the next round starts both anew.
"""

from __future__ import annotations

import collections
import logging
import time
from pathlib import Path
from typing import Any, Callable

from eagle3d.capture import engines
from eagle3d.capture.engines import generator_argv
from eagle3d.daemon.children import Child, Silence, Supervisor, remaining, stage_failed
from eagle3d.statemachine import entry
from eagle3d.statemachine.config_schema import Config
from eagle3d.statemachine.ledger import Ledger
from eagle3d.statemachine.stages import Decision, GenerateFacts, Seen, Stage

log = logging.getLogger("eagle3d")

RATE_WINDOW_S = 120.0


class GenerateStage:
    name = Stage.GENERATE.value
    state_key = "generate"
    ingests = False

    def __init__(self, cfg: Config, ledger: Ledger, pid_dir: Path) -> None:
        self.cfg = cfg
        self.ledger = ledger
        self.pid_dir = pid_dir
        self.child: Child | None = None
        self.server: Child | None = None
        self.supervisor = Supervisor("[generate] max_restarts", cfg.generate.max_restarts,
                                     stage_failed(ledger, "generate_failed",
                                                  "the generate stage stopped: %s"))
        # Its progress: a conversation generated, as the ledger's counts show (children.Silence).
        self.silence = Silence("generator", cfg.extract.engine_silence_s)
        # (time, conversations left to generate): the rate is how fast that falls.
        self.left: collections.deque[tuple[float, int]] = collections.deque()

    @property
    def grace(self) -> float:
        return self.cfg.extract.engine_stop_grace_s  # the generator and its server hold the target

    def observe(self, seen: Seen) -> GenerateFacts:
        now = time.monotonic()
        left = seen.counts.get("ungenerated") + seen.counts.get("generating")
        if self.left and left < self.left[-1][1]:
            self.silence.sign()
        self.left.append((now, left))
        while self.left and self.left[0][0] < now - RATE_WINDOW_S:
            self.left.popleft()
        return GenerateFacts(blocked=self.supervisor.fatal)

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
            self._end_round(self.grace)
            self._exited(*ended)
        if decision.stage != Stage.GENERATE or not self.supervisor.may_start:
            return
        key: dict[str, str] = {}
        server = engines.get(self.cfg.target.engine).generation_server
        if server is not None:
            started = self._start_server(server)
            if started is None:
                return
            key = started
        self.silence.reset()
        self.child = Child("generator", generator_argv(self.cfg), self.pid_dir, env=key)

    def _round_end(self, decision: Decision) -> tuple[int | None, str, bool] | None:
        """How the running round (generator and server) ends, or None while it goes on: the
        generator's exit; its server's death (code None); the stage left (every answer
        written, a failure); or a generator silent past its bound (code None, its conversations
        not charged: False). Both are then ended at once, so that the server is down before the
        next stage starts one on the same port (on the H200 the capture engine once came up
        beside the generation server, which answered its /health)."""
        assert self.child is not None
        code = self.child.poll()
        if code is not None:
            return code, f"the generator exited with code {code}", True
        server_code = self.server.poll() if self.server is not None else None
        if server_code is not None:
            title = engines.get(self.cfg.target.engine).title
            return None, f"the {title} generation server exited with code {server_code}", True
        if decision.underlying != Stage.GENERATE or decision.stage == Stage.FAILED:
            return entry.OK, "generation is over", True
        silent = self.silence.overdue()
        if silent is not None:
            return None, silent, False
        return None

    def _start_server(self, server: Callable[[Config], engines.GenerationServer]
                      ) -> dict[str, str] | None:
        """Start the generation server; the environment that gives the generator its API key,
        or None where it cannot start (the stage is then failed with the reason)."""
        try:
            launch = server(self.cfg)
        except engines.EngineUnavailable as exc:
            self.supervisor.terminal(str(exc))
            return None
        self.server = Child("generation-server", launch.argv, self.pid_dir, env=launch.env)
        return launch.generator_env

    def _end_round(self, grace: float) -> None:
        """The generator and its server stop side by side: one grace for both, not one each."""
        children = [child for child in (self.child, self.server) if child is not None]
        for child in children:
            child.terminate(grace)
        for child in children:
            child.stop(grace)
        self.child = self.server = None

    def _exited(self, code: int | None, why: str, charged: bool) -> None:
        """Whatever the generator still held goes back, with an attempt counted where
        `charged`: a conversation that keeps killing the generator ends up failed, with the
        reason, not in a loop; a hung generator is its own fault, not theirs. `code` is None
        when the stage ended the generator (its server died, or it was silent)."""
        held = self.ledger.samples("generating")
        if not charged:
            self.ledger.release([sample.id for sample in held], why, frm="generating")
        else:
            for sample in held:
                self.ledger.mark_retry(sample.id, why, self.cfg.generate.max_attempts,
                                       frm=("generating",))
        if code == entry.OK:
            return
        self.ledger.event("generator_exit", f"{why}, {len(held)} conversations returned")
        if self.supervisor.exited(code, why) is None:
            log.warning("%s; %d conversations returned; restarting", why, len(held))

    def unblock(self, all_failed: bool) -> None:
        self.supervisor.clear()

    def reconfigure(self, cfg: Config) -> None:
        self.cfg = cfg
        self.silence.bound_s = cfg.extract.engine_silence_s
        # A generator that keeps dying stays stopped: its failures are the machine's or a
        # conversation's, which no reload mends (`eagle3ctl retry` does).
        self.supervisor.reconfigure(cfg.generate.max_restarts, mended=False)

    def status(self) -> dict[str, Any]:
        out: dict[str, Any] = {"status": "running" if self.child else self.supervisor.state,
                               "restarts": self.supervisor.restarts,
                               "restarts_total": self.supervisor.exits_total,
                               "rate_per_s": round(self.rate(), 3), "eta_s": self.eta(),
                               "blocked": self.supervisor.fatal}
        if self.child is not None:
            out["pid"] = self.child.pid
            out.update(self.silence.status())
        if self.server is not None:
            out["server_pid"] = self.server.pid
        return out

    def stop(self, deadline: float) -> None:
        """What it holds goes back to ungenerated with the daemon's own requeue at its stop."""
        self._end_round(remaining(deadline, self.grace))
