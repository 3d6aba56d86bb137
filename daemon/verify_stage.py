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
from typing import Any

from eagle3d.capture import dumpformat
from eagle3d.daemon.durability import SyncFs, doubt_settled, page_cache_doubt
from eagle3d.statemachine import manifest
from eagle3d.statemachine.config import Config
from eagle3d.statemachine.ledger import Ledger

log = logging.getLogger("eagle3d")

SPOT_DIR = "spotcheck"
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
        from eagle3d.daemon.verify import Expected, verify_many  # numpy: only when verifying
        ledger = Ledger(self.ledger_path)
        try:
            # Weighed before the listing: a reason recorded later is weighed again next pass.
            doubt, weighed_upto = page_cache_doubt(ledger)
            samples = {s.id: s for s in ledger.iter_samples("extracted")}
            self.total, self.done, self.bytes_done, self.started = len(samples), 0, 0, time.time()
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
                              dtype=self.contract["dtype"])
                     for s in samples.values()]
            for sid, problem, stat_key in verify_many(items, self.cfg.verify.workers,
                                                      from_disk=doubt is not None):
                s = samples[sid]
                if problem is None:
                    ledger.mark_verified(sid, stat_key or "")
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
        elapsed = time.time() - self.started
        return self.bytes_done / elapsed if self.running and elapsed > 0 else 0.0


class SpotCheck:
    """Re-extract a few verified samples with the engine and compare with the dataset."""

    def __init__(self, cfg: Config, ledger: Ledger) -> None:
        self.cfg = cfg
        self.ledger = ledger
        self.folder = cfg.paths.state_dir / SPOT_DIR
        self.fingerprint: str | None = None
        self.chosen: list[Any] = []
        self.deadline = 0.0

    def result(self, fingerprint: str) -> tuple[bool, str] | None:
        """(ok, detail) of the spot check recorded for this verified set, or None."""
        if self.cfg.verify.spot_checks == 0:
            return True, "spot checks disabled ([verify] spot_checks = 0)"
        if self.ledger.meta("spotcheck.fingerprint") != fingerprint:
            return None
        return self.ledger.meta("spotcheck.ok") == "1", self.ledger.meta("spotcheck.detail", "")

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
        self.deadline = time.time() + self.cfg.extract.inflight_timeout_s
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
            if time.time() > self.deadline:
                self._record(False, "the engine did not re-extract the spot-check samples in time")
            return
        from eagle3d.daemon.verify import compare_dumps
        problems = []
        for s, path in zip(self.chosen, fresh):
            problem = compare_dumps(self.cfg.paths.dataset_dir / s.path, path,
                                    self.cfg.verify.spot_tolerance)
            if problem:
                problems.append(f"{s.id}: {problem}")
        self._record(not problems, "; ".join(problems) or f"{len(fresh)} samples match")

    def _record(self, ok: bool, detail: str) -> None:
        with self.ledger.transaction() as db:
            self.ledger.set_meta("spotcheck.fingerprint", self.fingerprint or "", db)
            self.ledger.set_meta("spotcheck.ok", "1" if ok else "0", db)
            self.ledger.set_meta("spotcheck.detail", detail, db)
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


def plan_batch_item(sid: str, ids: bytes, mask: bytes) -> dict[str, Any]:
    """A sample as the engine protocol carries it, from the ledger's planned tokens."""
    import array
    a = array.array("i")
    a.frombytes(ids)
    return {"id": sid, "input_ids": a.tolist(), "loss_mask": list(mask)}
