"""The train stage: the drafter trainer (its ranks started by drafter.launch on one node, by
torchrun on several), restarted from its last checkpoint when it dies (bounded), then the
acceptance-length evaluation, then the `done.json` marker that ties the drafter to the manifest
it was trained on.

The manifest's fingerprint is taken when a child starts, and `done.json` is written only if it
is still the current one when the evaluation exits: an exclude meanwhile trains again. Leaving
the stage (`eagle3ctl verify --full`, an exclude) stops the trainer at a checkpoint (SIGTERM,
then [train] stop_grace_s), so that no engine shares its GPUs and no file it reads is removed.
"""

from __future__ import annotations

import logging
import sys
import time
from pathlib import Path
from typing import Any, Callable

from eagle3d.daemon.ages import Ages
from eagle3d.daemon.children import Child, Silence, Supervisor, remaining, stage_failed
from eagle3d.dataset import readrate
from eagle3d.statemachine import entry, layout, train_files
from eagle3d.statemachine.config_in_force import in_force_check
from eagle3d.statemachine.config_schema import Config
from eagle3d.statemachine.ledger import Ledger
from eagle3d.statemachine.stages import Decision, Seen, Stage, TrainFacts

log = logging.getLogger("eagle3d")

# The ledger's record of which [train] settings made the drafter in the train folder.
HELD_KEY = "train.key"


def trainer_argv(cfg: Config, config_path: Path) -> list[str]:
    """The trainer's command for this node's share of its processes, reading `config_path`.

    One node listens on no network address: one process runs the trainer alone (it needs no
    process group: drafter.train.init_runtime), several are started by drafter.launch, whose
    ranks meet in a private FileStore and keep their sockets on loopback. torchrun's agent would
    open its TCPStore on every interface, which no flag of torch 2.13 binds to loopback. Several
    nodes meet at node 0's [train] rendezvous through torchrun's static rendezvous: it makes node
    k's processes ranks k·nproc … k·nproc + nproc - 1, so rank 0 (which checks the ledger,
    checkpoints and exports) is always on node 0, beside the daemon. (The c10d rendezvous orders
    nodes by host name and pid instead and ignores --node_rank.)"""
    t = cfg.train
    config = ["-c", str(config_path)]
    if t.nnodes == 1:
        module = "eagle3d.drafter.train" if t.nproc == 1 else "eagle3d.drafter.launch"
        return [sys.executable, "-m", module, *config]
    return [sys.executable, "-m", "torch.distributed.run", f"--nnodes={t.nnodes}",
            f"--node_rank={t.node_rank}", "--rdzv_backend=static",
            f"--rdzv_endpoint={t.rendezvous}", f"--nproc_per_node={t.nproc}",
            "-m", "eagle3d.drafter.train", *config]


def eval_argv(cfg: Config) -> list[str]:
    return entry.module_argv(cfg, "eagle3d.drafter.evaluate",
                             "--out", str(layout.eval_file(cfg.paths.train_dir)))


class TrainStage:
    name = Stage.TRAIN.value
    state_key = "trainer"
    ingests = False

    def __init__(self, cfg: Config, ledger: Ledger, pid_dir: Path,
                 fingerprint: Callable[[], str]) -> None:
        self.cfg = cfg
        self.ledger = ledger  # restarts, failures and the result go to its event log
        self.pid_dir = pid_dir
        self.fingerprint = fingerprint  # of the verified set the manifest must match
        self.child: Child | None = None
        self.leaving: Child | None = None  # stopping since the pipeline left train
        self.started_for = ""  # the manifest fingerprint current when the child started
        self.started_key = ""  # the [train] settings key the child trains with
        self.phase = "idle"  # idle | training | evaluating | stopping | done | failed
        self._record_failure = stage_failed(ledger, "train_failed", "%s")
        self.supervisor = Supervisor("[train] max_restarts", cfg.train.max_restarts,
                                     self._failed)
        # The trainer's progress: progress.json rewritten (children.Silence), as last seen.
        self.silence = Silence("trainer", cfg.train.silence_s)
        # How long the trainer has loaded or compiled: its progress file's `since` is its wall clock.
        self.before_first_step = Ages()
        self._progress_seen: int | None = None
        self.disk_probed = False  # the dataset's read rate, checked once per daemon
        self._set_aside: list[dict[str, Any]] | None = None  # the versions, read when asked
        self._keys(cfg)

    def _keys(self, cfg: Config) -> None:
        """The [train] and [eval] settings keys, hashed once per config, not at every tick."""
        self.key = train_files.train_key(cfg)
        self.eval_key = train_files.eval_key(cfg)

    @property
    def dir(self) -> Path:
        return self.cfg.paths.train_dir

    def holds_gpus(self) -> bool:
        """A trainer or an evaluation is running, or still stopping."""
        return self.child is not None or self.leaving is not None

    @property
    def failure(self) -> str | None:
        return self.supervisor.fatal

    def observe(self, seen: Seen) -> TrainFacts:
        held = self.ledger.meta(HELD_KEY)
        return TrainFacts(
            train_done=held in (None, self.key) and
            train_files.done_for(self.dir, seen.fingerprint and self.fingerprint(), self.eval_key),
            train_failed=self.failure)

    def _version(self) -> str:
        """The [train] settings key in force; the train folder's drafter is set aside when it
        was trained with others (and one trained with these comes back)."""
        key, held = self.key, self.ledger.meta(HELD_KEY)
        if held is not None and held != key:
            back = train_files.switch_version(self.dir, held, key)
            self._set_aside = None  # one drafter set aside, another maybe back
            detail = (f"[train] settings {key} differ from the drafter's ({held}): it is kept in "
                      f"{layout.versions_dir(self.dir) / held}; " + (
                          f"the drafter of {key} is back" if back else f"training {key}"))
            log.info("%s", detail)
            self.ledger.event("train_version", detail)
        if held != key:
            self.ledger.set_meta(HELD_KEY, key)
        return key

    def step(self, decision: Decision) -> None:
        """One idempotent step towards a trained, exported and evaluated drafter."""
        if self.child is not None and (decision.underlying != Stage.TRAIN or
                                       decision.stage == Stage.FAILED):
            self._leave(decision)
        if self.leaving is not None:
            if not self.leaving.stopped():
                return
            self.leaving = None
            self.phase = "failed" if self.failure else "idle"
        if decision.stage != Stage.TRAIN:
            return
        fingerprint = self.fingerprint()
        if self.child is not None and self.started_key != self.key:
            self._leave(decision)  # a reload changed what the trainer would make: start over
            return
        if self.child is not None:
            code = self.child.poll()
            if code is not None:
                self._finished(code, fingerprint)
            elif self.phase == "training":
                self._end_if_silent()
            return
        if not self.supervisor.may_start:
            return
        self.started_for = fingerprint
        self.dir.mkdir(parents=True, exist_ok=True, mode=0o750)
        self.started_key = self._version()
        if train_files.trained_for(self.dir, fingerprint):
            self.phase = "evaluating"
            layout.eval_file(self.dir).unlink(missing_ok=True)  # only this result counts
            self.child = Child("evaluate", eval_argv(self.cfg), self.pid_dir)
        else:
            self.phase = "training"
            self._probe_disk()
            train_files.clear_refusal(self.dir)
            self.silence.reset()
            self._progress_seen = self._progress_stamp()  # an earlier trainer's is no sign
            self.child = Child("trainer", [*trainer_argv(
                self.cfg, layout.config_in_force(self.cfg.paths.state_dir)),
                *in_force_check(self.cfg)], self.pid_dir)

    def _leave(self, decision: Decision) -> None:
        """The pipeline left train: the trainer checkpoints and exits on SIGTERM (an evaluation
        simply ends); it resumes from that checkpoint when the pipeline comes back. Nothing
        starts in its place until it is gone."""
        assert self.child is not None
        log.info("stopping the %s: stage %s (%s)", self.child.name, decision.stage.value,
                 decision.reason)
        self.child.terminate(self.cfg.train.stop_grace_s)
        self.leaving, self.child = self.child, None
        self.phase = "stopping"

    def _progress_stamp(self) -> int | None:
        try:
            return layout.progress_file(self.dir).stat().st_mtime_ns
        except OSError:
            return None

    def _end_if_silent(self) -> None:
        """A trainer that has not rewritten progress.json past its bound ([train] silence_s once
        it trains; hours while it loads or compiles) is hung, though it has not exited: it is
        stopped (SIGTERM, SIGKILL after [train] stop_grace_s) and restarted from its last
        checkpoint, a restart counted against [train] max_restarts."""
        stamp = self._progress_stamp()
        if stamp != self._progress_seen:
            self._progress_seen = stamp
            status = train_files.read_progress(self.dir).get("status")
            self.silence.sign(running=status == train_files.TRAINING)
        why = self.silence.overdue()
        if why is None:
            return
        assert self.child is not None
        log.error("%s: stopping it", why)
        self.ledger.event("train_silent", why)
        self.child.terminate(self.cfg.train.stop_grace_s)
        self.leaving, self.child = self.child, None
        self.phase = "stopping"
        if self.supervisor.exited(None, why) is None:
            log.warning("restarting the trainer from its last checkpoint in %.0f s",
                        self.supervisor.retry_at - time.monotonic())

    def _probe_disk(self) -> None:
        """Warn, once, where the dataset's disk is projected to read slower than the GPUs
        consume (a short probe: half a second at most)."""
        if self.disk_probed:
            return
        self.disk_probed = True
        warning = readrate.check(self.cfg.paths.dataset_dir, self.cfg.train.nproc)
        if warning:
            log.warning("%s", warning)
            self.ledger.event("slow_dataset_disk", warning)

    def _finished(self, code: int, fingerprint: str) -> None:
        name = self.child.name if self.child else "trainer"
        self.child = None
        result = train_files.read_eval(self.dir) if name == "evaluate" else None
        if result is not None and fingerprint != self.started_for:
            # The manifest changed while the evaluation ran (an exclude): the drafter it
            # measured was trained on samples that are no longer the dataset. Train again.
            self.phase = "idle"
            detail = (f"the dataset changed during the evaluation (manifest {self.started_for} "
                      f"then {fingerprint}): training again, done.json not written")
            log.warning("%s", detail)
            self.ledger.event("train_stale", detail)
            return
        if result is not None:
            if code == entry.DIVERGED or not result.get("identical_to_greedy"):
                # A measurement was made that only flags that speculative and greedy decoding
                # disagreed somewhere: worth an operator's look, not a retry loop.
                log.warning("evaluation: speculative decoding did not reproduce greedy decoding "
                            "exactly (see %s)", layout.eval_file(self.dir))
                self.ledger.event("eval_not_greedy", f"see {layout.eval_file(self.dir)}")
            train_files.write_done(self.dir, fingerprint, result, self.started_key,
                                   self.eval_key)
            self.phase = "done"
            said = f"acceptance length {result.get('acceptance_length', 0):.3f}"
            log.info("drafter %s done: %s", self.started_key, said)
            self.ledger.event("drafter_done", f"{self.started_key}: {said}")
            return
        if code == entry.OK and name == "trainer":
            return  # trained and exported: the next step evaluates
        refused = self._refusal(name, code)
        if refused is not None and refused.code == entry.DATASET_CHANGED and \
                self._send_back(refused):
            return
        if refused is not None:
            code = refused.code
        said = f"{name} exited with code {code}" + (f": {refused.reason}" if refused else "")
        if name == "trainer" and self.cfg.train.nnodes > 1 and refused is None:
            said += (f" (all {self.cfg.train.nnodes} nodes must take part: is "
                     "`eagle3d train-node` running on every other node?)")
        supervisor = self.supervisor
        if supervisor.exited(code, said) is not None:
            return
        detail = (f"{said}: restarting from its last checkpoint in "
                  f"{supervisor.retry_at - time.monotonic():.0f} s (restart "
                  f"{supervisor.restarts} of {supervisor.limit})")
        log.warning("%s", detail)
        self.ledger.event("train_restart", detail)

    def _send_back(self, refused: train_files.Refused) -> bool:
        """The trainer found files changed since verify passed them: their samples go back to
        verify (which re-reads each, and has a damaged one extracted again), and the manifest
        that lists them goes until verify writes it again. No restart is charged. False where
        none of them is this ledger's to send back (another shard's): a refusal like any other."""
        n = self.ledger.unverify(refused.samples, f"the trainer: {refused.reason}")
        if not n:
            return False
        layout.manifest_file(self.cfg.paths.dataset_dir).unlink(missing_ok=True)
        self.phase = "idle"
        log.warning("%s: %d samples back to verify", refused.reason, n)
        return True

    def _failed(self, reason: str) -> None:
        self.phase = "failed"
        self._record_failure(reason)

    def _refusal(self, name: str, code: int) -> train_files.Refused | None:
        """Why the child refused to run, if it did: what the trainer's refusing rank wrote down
        (torchrun exits 1 whatever its ranks exit with), or what a contract mismatch means."""
        refused = train_files.read_refusal(self.dir) if name == "trainer" else None
        if refused is None and code == entry.CONTRACT_MISMATCH:
            return train_files.Refused(code, "the target is not the dataset's model")
        return refused

    def unblock(self, all_failed: bool) -> None:
        """Only `eagle3ctl retry --failed` retries a failed training (a retry of some samples
        leaves it as it is)."""
        if all_failed:
            self.supervisor.clear()

    def reconfigure(self, cfg: Config) -> None:
        """A new config may mend what stopped the trainer (its [train] settings): it tries
        again."""
        self.cfg = cfg
        self.silence.bound_s = cfg.train.silence_s
        self._keys(cfg)
        self.supervisor.reconfigure(cfg.train.max_restarts, mended=True)

    def status(self) -> dict[str, Any]:
        progress = train_files.read_progress(self.dir)
        out: dict[str, Any] = {"status": self.phase, "restarts": self.supervisor.restarts,
                               "restarts_total": self.supervisor.exits_total,
                               "eta_s": None, "blocked": self.failure}
        if self.child is not None:
            out["pid"] = self.child.pid
            if self.phase == "training":
                out.update(self.silence.status())
            if self.phase == "training" and progress.get("status") in (train_files.LOADING,
                                                                        train_files.STARTING):
                since = progress.get("since") or 0.0
                age = self.before_first_step.update({"": (progress["status"], since)})[""]
                out["before_first_step"] = {"status": progress["status"], "since": since,
                                            "age_s": round(age, 1)}
            if progress.get("status") in train_files.TRAINS and progress.get("started_over"):
                # Step 0 beside a trained drafter reads as lost progress unless it says why.
                out["started_over"] = progress["started_over"]
        # The training's rate and ETA are over once it evaluates (the evaluation has none).
        rates = ("tokens_per_s", "eta_s", "data_wait") if self.phase != "evaluating" else ()
        for key in ("step", "total_steps", "epoch", "loss", "acc", *rates):
            if key in progress:
                out[key] = progress[key]
        result = train_files.read_eval(self.dir)
        if result is not None:
            out["acceptance_length"] = result["acceptance_length"]
        out["version"] = self.ledger.meta(HELD_KEY) or self.key
        out["versions"] = self._versions()
        return out

    def _versions(self) -> list[dict[str, Any]]:
        """The drafters set aside, listed again only after this stage moved one."""
        if self._set_aside is None:
            self._set_aside = train_files.versions(self.dir)
        return self._set_aside

    def stop(self, deadline: float) -> None:
        """The trainer checkpoints on SIGTERM; then it, or the evaluation, is ended."""
        for child in (self.leaving, self.child):
            if child is not None:
                child.stop(remaining(deadline, self.cfg.train.stop_grace_s))
        self.leaving = self.child = None
        if self.phase in ("training", "evaluating", "stopping"):
            self.phase = "idle"
