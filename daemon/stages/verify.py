"""The verify stage: passes over extracted samples in a background thread (so the reconcile loop
stays responsive), the numerical spot check, and the dataset manifest.

A sample that fails goes back to pending with the reason and its file removed: it is extracted
again, counting an attempt. The spot check re-runs the engine on a few verified samples and
compares with the stored tensors; a mismatch means the capture itself is wrong, so it fails the
stage loudly instead of blaming one sample.
"""

from __future__ import annotations

import logging
import random
import shutil
import threading
import time
from pathlib import Path
from typing import Any, Callable

from eagle3d.dataset import contract as capture_contract
from eagle3d.dataset import dumpformat
from eagle3d.daemon.durability import SyncFs, doubt_settled, page_cache_doubt
from eagle3d.daemon.engine import plan_batch_item
from eagle3d.statemachine import layout, manifest, stages
from eagle3d.statemachine.config_schema import Config
from eagle3d.statemachine.ledger import Ledger

log = logging.getLogger("eagle3d")

SYNC_RETRY_S = 30.0


class VerifyRunner:
    def __init__(self, cfg: Config, ledger_path: Path, contract: dict[str, Any],
                 dataset_sync: SyncFs) -> None:
        self.cfg = cfg
        self.dataset_sync = dataset_sync
        self.ledger_path = ledger_path
        self.contract = contract
        self.thread: threading.Thread | None = None
        self.done = 0
        self.total = 0
        self.bytes_done = 0
        self.started = 0.0
        self.failures = 0

    @property
    def running(self) -> bool:
        return self.thread is not None and self.thread.is_alive()

    def start(self) -> None:
        if self.running:
            return
        self.thread = threading.Thread(target=self._run, name="verify", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        from eagle3d.daemon.dump_checks import Expected, verify_many  # numpy: only when verifying
        ledger = Ledger(self.ledger_path)
        try:
            # Weighed before the listing: a reason recorded later is weighed again next pass.
            doubt, weighed_upto = page_cache_doubt(ledger)
            samples = {s.id: s for s in ledger.iter_samples("extracted")}
            self.total, self.done, self.bytes_done = len(samples), 0, 0
            self.started = time.monotonic()
            # Ingest does not fsync: only a file on disk may be marked verified. The sync comes
            # after the listing, so every file listed was written before it.
            if not self.dataset_sync.sync(ledger):
                time.sleep(SYNC_RETRY_S)  # a failing disk is retried every 30 s, not every tick
                return
            if doubt:
                log.warning("verify reads %d files from the disk, not the page cache: %s",
                            len(samples), doubt)
            items = [Expected(id=s.id, path=str(self.cfg.paths.dataset_dir / s.path),
                              tokens=s.tokens, loss_tokens=s.loss_tokens, ids_hash=s.ids_hash,
                              checksum=s.checksum or "",
                              contract_fingerprint=self.contract["fingerprint"],
                              hidden_size=self.contract["hidden_size"],
                              dtype=capture_contract.dump_dtype(self.contract))
                     for s in samples.values()]
            for sid, problem, stat_key in verify_many(items, self.cfg.verify.workers,
                                                      from_disk=doubt is not None):
                s = samples[sid]
                if problem is None:
                    ledger.mark_verified(s, stat_key or "")
                else:
                    self.failures += 1
                    log.warning("verify: sample %s failed: %s", sid, problem)
                    self._remove(s.path)
                    ledger.mark_retry(sid, f"verify: {problem}", self.cfg.extract.max_attempts,
                                      frm=("extracted",))
                self.done += 1
                self.bytes_done += s.bytes
            doubt_settled(ledger, weighed_upto)
        except Exception:  # a crash here must show in status, not kill the daemon
            log.exception("verify pass failed")
            ledger.event("verify_error", "the verify pass crashed; it will be retried")
        finally:
            ledger.close()

    def _remove(self, path: str) -> None:
        """Remove a failed sample's file. A file system that met write-back errors is often
        read-only by now (ext4 aborts its journal): the sample still goes back for extraction,
        and the next start removes the file (ingest.remove_dataset_debris)."""
        try:
            (self.cfg.paths.dataset_dir / path).unlink(missing_ok=True)
        except OSError as exc:
            log.warning("verify: cannot remove the failed file %s: %s", path, exc.strerror)

    def rate(self) -> float:
        elapsed = time.monotonic() - self.started
        return self.bytes_done / elapsed if self.running and elapsed > 0 else 0.0


def forget_failed_spot_check(ledger: Ledger) -> None:
    """`eagle3ctl verify --full` or `retry --failed`: a failed spot check runs again (a passed
    one stands for its verified set)."""
    if ledger.meta("spotcheck.ok") == "0":
        ledger.clear_meta("spotcheck.fingerprint")


class SpotCheck:
    """Re-extract a few verified samples with the engine and compare with the dataset."""

    def __init__(self, cfg: Config, ledger: Ledger) -> None:
        self.cfg = cfg
        self.ledger = ledger
        self.folder = layout.spot_check_dir(cfg.paths.state_dir)
        self.fingerprint: str | None = None
        self.chosen: list[Any] = []
        self.deadline = 0.0

    def result(self, fingerprint: str) -> tuple[bool, str] | None:
        """(ok, detail) of the spot check recorded for this verified set, or None."""
        if self.cfg.verify.spot_checks == 0:
            return True, "spot checks disabled ([verify] spot_checks = 0)"
        if fingerprint == manifest.EMPTY:  # an empty shard's: no engine to load for nothing
            return True, "no verified sample to check"
        if self.ledger.meta("spotcheck.fingerprint") != fingerprint:
            return None
        ok = self.ledger.meta("spotcheck.ok") == "1"
        judged_at = self.ledger.meta("spotcheck.tolerance")
        if not ok and judged_at != repr(self.cfg.verify.spot_tolerance):
            return None  # judged under another tolerance: a reloaded one checks again
        return ok, self.ledger.meta("spotcheck.detail", "")


    @property
    def waiting(self) -> bool:
        return self.fingerprint is not None

    def start(self, fingerprint: str, engine: Any) -> None:
        shutil.rmtree(self.folder, ignore_errors=True)
        self.folder.mkdir(mode=0o700, parents=True)
        verified = self.ledger.samples("verified")
        rng = random.Random(fingerprint)
        self.chosen = rng.sample(verified, min(self.cfg.verify.spot_checks, len(verified)))
        batch = []
        for s in self.chosen:
            ids, mask = self.ledger.plan_tokens([s.id])[s.id]
            batch.append(plan_batch_item(s.id, ids, mask))
        engine.submit(batch, self.folder)
        self.fingerprint = fingerprint
        self.deadline = time.monotonic() + self.cfg.extract.inflight_timeout_s
        log.info("spot check: re-extracting %d verified samples", len(batch))

    def abandon(self) -> None:
        """The engine died with the check in flight: it starts again with the next engine."""
        self.fingerprint = None

    def poll(self) -> None:
        """Once every fresh dump is there, compare and record the verdict."""
        if self.fingerprint is None:
            return
        fresh = [self.folder / dumpformat.dump_name(s.id) for s in self.chosen]
        if not all(p.exists() for p in fresh):
            if time.monotonic() > self.deadline:
                self._record(False, "the engine did not re-extract the spot-check samples in time")
            return
        from eagle3d.daemon.dump_checks import compare_dumps
        problems = []
        for s, path in zip(self.chosen, fresh):
            problem = compare_dumps(self.cfg.paths.dataset_dir / s.path, path,
                                    self.cfg.verify.spot_tolerance)
            if problem:
                source_idx = s.idx // self.cfg.generate.answers  # planner.row_index
                problems.append(f"sample {s.id} (source index {source_idx}): {problem}")
        self._record(not problems, "; ".join(problems) or f"{len(fresh)} samples match")

    def _record(self, ok: bool, detail: str) -> None:
        with self.ledger.transaction() as db:
            self.ledger.set_meta("spotcheck.fingerprint", self.fingerprint or "", db)
            self.ledger.set_meta("spotcheck.ok", "1" if ok else "0", db)
            self.ledger.set_meta("spotcheck.detail", detail, db)
            self.ledger.set_meta("spotcheck.tolerance", repr(self.cfg.verify.spot_tolerance), db)
            self.ledger.event("spotcheck", ("passed: " if ok else "FAILED: ") + detail, None, db)
        (log.info if ok else log.error)("spot check %s: %s", "passed" if ok else "FAILED", detail)
        shutil.rmtree(self.folder, ignore_errors=True)
        self.fingerprint = None


def write_manifest(cfg: Config, ledger: Ledger, contract: dict[str, Any]) -> str:
    doc = manifest.build(ledger, contract)
    manifest.write(cfg.paths.dataset_dir, doc)
    ledger.event("manifest", f"{len(doc['samples'])} verified samples, {doc['fingerprint']}")
    log.info("dataset manifest written: %d samples", len(doc["samples"]))
    return doc["fingerprint"]


class VerifyStage:
    """Verify passes until nothing is left extracted, then (with the gate open) the spot check,
    then the manifest that lets training start."""

    name = stages.Stage.VERIFY.value
    state_key = "verify"
    ingests = False

    def __init__(self, cfg: Config, ledger: Ledger, engine: Callable[[], Any]) -> None:
        self.cfg = cfg
        self.ledger = ledger
        self.engine = engine  # the extract stage's engine once ready, lent for the spot check
        # Opened before anything is written, to hear of every write-back error (durability.py).
        self.sync = SyncFs(cfg.paths.dataset_dir)
        self.runner: VerifyRunner | None = None
        self.contract: dict[str, Any] | None = None
        self.spot = SpotCheck(cfg, ledger)
        self.seen: stages.Seen | None = None
        self._fingerprint: tuple[int, str] = (-1, "")
        self._manifest: tuple[int, str | None] = (-1, None)

    def reconfigure(self, cfg: Config) -> None:
        """The spot check and the verify passes take the new config too."""
        self.cfg = self.spot.cfg = cfg
        if self.runner is not None:
            self.runner.cfg = cfg

    def verified_fingerprint(self) -> str:
        """The fingerprint of the verified set, recomputed only after ledger events (cheap)."""
        seq = self.ledger.last_event_seq()
        if seq != self._fingerprint[0]:
            self._fingerprint = (seq, manifest.ledger_fingerprint(self.ledger))
        return self._fingerprint[1]

    def manifest_fingerprint(self) -> str | None:
        """The manifest's fingerprint, re-read only when the file changes (it lists every
        sample: parsing it at every tick would cost more than the tick)."""
        try:
            mtime = layout.manifest_file(self.cfg.paths.dataset_dir).stat().st_mtime_ns
        except FileNotFoundError:
            return None
        if self._manifest[0] != mtime:
            doc = manifest.read(self.cfg.paths.dataset_dir)
            self._manifest = (mtime, doc.get("fingerprint") if doc else None)
        return self._manifest[1]

    def observe(self, seen: stages.Seen) -> stages.VerifyFacts:
        self.seen = seen
        fingerprint = seen.fingerprint
        spot = self.spot.result(fingerprint) if fingerprint else None
        return stages.VerifyFacts(
            verify_complete=bool(fingerprint and spot and spot[0]
                                 and self.manifest_fingerprint() == fingerprint),
            spot_check_failed=spot[1] if spot and not spot[0] else None)

    def step(self, decision: stages.Decision) -> None:
        self.spot.poll()
        if decision.stage != stages.Stage.VERIFY:
            return
        if self.contract is None:  # verify comes after the plan, which wrote it
            self.contract = capture_contract.read(self.cfg.paths.dataset_dir)
            assert self.contract is not None
        if self.runner is None:
            self.runner = VerifyRunner(self.cfg, layout.ledger(self.cfg.paths.state_dir),
                                       self.contract, self.sync)
        counts = self.ledger.counts()
        if counts.get("extracted"):
            self.runner.start()
            return
        if self.runner.running or not stages.gate(counts, self.cfg.shard.count > 1).open:
            return
        fingerprint = self.verified_fingerprint()
        if self.spot.result(fingerprint) is None:
            engine = self.engine()
            if not self.spot.waiting and engine is not None:
                self.spot.start(fingerprint, engine)
            return
        write_manifest(self.cfg, self.ledger, self.contract)

    def needs_engine(self) -> bool:
        """A spot check is due (or in flight): every sample is verified, and this verified set
        has no verdict yet. Not before: an engine loads its model for minutes, and a pass that
        ends with the verdict already recorded (`eagle3ctl verify --full`) needs none."""
        seen = self.seen
        if seen is None or seen.fingerprint is None or seen.counts.get("extracted") or (
                self.runner is not None and self.runner.running):
            return False
        return self.spot.waiting or self.spot.result(seen.fingerprint) is None

    def engine_exited(self) -> None:
        self.spot.abandon()

    def eta(self) -> float | None:
        rate = self.runner.rate() if self.runner else 0.0
        left = self.seen.counts.bytes.get("extracted", 0) if self.seen else 0
        return left / rate if rate > 0 else None

    def status(self) -> dict[str, Any]:
        runner = self.runner
        return {"done": runner.done if runner else 0, "total": runner.total if runner else 0,
                "running": bool(runner and runner.running),
                "failures": runner.failures if runner else 0, "eta_s": self.eta(),
                "blocked": None}

    def unblock(self, all_failed: bool) -> None:
        """`retry --failed` retries a failed spot check too."""
        if all_failed:
            forget_failed_spot_check(self.ledger)

    def stop(self, deadline: float) -> None:
        """A pass in flight is a thread that marks each sample in its own transaction: the
        daemon's exit ends it between two, and the next start verifies the rest."""
