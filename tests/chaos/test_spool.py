"""Hostile and broken dumps dropped into the spool of a running daemon, and a spool whose file
system fills up under the engine: every bad dump is rejected with a reason (or, for values that
only verify reads, failed at verify and extracted again), none reaches the training set, and the
run ends exact."""

from __future__ import annotations

import os
import re
import shutil
import struct
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Iterator

import pytest

from eagle3d.dataset import contract as capture_contract
from eagle3d.dataset import dumpformat
from eagle3d.dataset import checksum
from eagle3d.statemachine.config_validation import load_config
from eagle3d.statemachine.ledger import Ledger
from tests.chaos.harness import audit, chaos_config, counts, until
from tests.pipeline import DaemonProcess, ctl, fill_file_system

pytestmark = [pytest.mark.slow, pytest.mark.chaos]

BF16_NAN, BF16_INF = 0x7FC0, 0x7F80
SMALL = {"data": {"max_tokens": 256},
         "extract": {"batch_tokens": 128, "max_inflight_tokens": 256}}


class Forger:
    """Dumps that look as real as asked: the planned token ids of a real sample, the dataset's
    contract, and whatever is wrong on purpose."""

    def __init__(self, cfg, staging: Path) -> None:
        self.contract = capture_contract.read(cfg.paths.dataset_dir)
        self.spool = cfg.paths.spool_dir
        self.staging = staging
        with Ledger(cfg.paths.state_dir / "ledger.sqlite", readonly=True) as ledger:
            self.samples = ledger.samples("pending", limit=1000)
            self.tokens = ledger.plan_tokens([s.id for s in self.samples])

    def dump(self, sid: str, *, tokens: int | None = None, dtype: str = "BF16",
             aux_width: int = 3, poison: int | None = None, meta_id: str | None = None) -> bytes:
        h = self.contract["hidden_size"]
        ids, mask = self.tokens.get(sid, (struct.pack("<8i", *range(8)), b"\1" * 8))
        t = tokens or len(ids) // 4
        size = 2 if dtype in ("BF16", "F16") else 4
        aux = bytearray(t * aux_width * h * size)
        if poison is not None:
            struct.pack_into("<H", aux, size * (t * aux_width * h // 2), poison)
        tensors = {"input_ids": ("I32", (t,), ids[:4 * t].ljust(4 * t, b"\0")),
                   "loss_mask": ("U8", (t,), mask[:t].ljust(t, b"\1")),
                   "aux_hidden_states": (dtype, (t, aux_width * h), bytes(aux)),
                   "last_hidden_state": (dtype, (t, h), bytes(t * h * size))}
        folder = self.staging / uuid.uuid4().hex
        folder.mkdir()
        path = dumpformat.write_dump(folder, sid, self.contract["fingerprint"], tensors)
        data = path.read_bytes()
        if meta_id is not None:  # a name that passes, a sample id inside that does not
            n = struct.unpack("<Q", data[:8])[0]
            header = data[8:8 + n].replace(f'"sample_id":"{sid}"'.encode(),
                                           f'"sample_id":"{meta_id}"'.encode())
            data = struct.pack("<Q", len(header)) + header + data[8 + n:]
        return data

    def drop(self, name: str, data: bytes) -> str:
        """Into the spool the way an engine does it: a whole file renamed into place."""
        tmp = self.staging / f"{uuid.uuid4().hex}.tmp"
        tmp.write_bytes(data)
        os.rename(tmp, self.spool / name)
        return name


def rejections(cfg) -> dict[str, str]:
    with Ledger(cfg.paths.state_dir / "ledger.sqlite", readonly=True) as ledger:
        rows = ledger.db.execute("SELECT detail FROM events WHERE kind = 'rejected'").fetchall()
    out = {}
    for (detail,) in rows:
        name, _, reason = detail.partition(": ")
        out[name] = reason
    return out


def grow_after_rename(forger: Forger, sid: str, stop: threading.Event) -> None:
    """A writer that renames its dump into the spool and then keeps appending to it."""
    tmp = forger.staging / f"{sid}.growing"
    with open(tmp, "wb") as f:
        f.write(forger.dump(sid))
        f.flush()
        os.rename(tmp, forger.spool / dumpformat.dump_name(sid))
        while not stop.is_set():
            f.write(b"\0" * 4096)
            f.flush()
            time.sleep(0.01)


@pytest.fixture
def staging() -> Iterator[Path]:
    """Where dumps are made before their rename into the spool: the spool's file system."""
    folder = Path(tempfile.mkdtemp(prefix="eagle3d-chaos-staging-", dir="/dev/shm"))
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


def test_hostile_dumps_in_a_live_spool_never_reach_the_training_set(config_factory, tmp_path,
                                                                    staging, figures):
    n = 16
    config = chaos_config(config_factory, tmp_path, n, **SMALL)
    cfg = load_config(config)
    stop = threading.Event()
    with DaemonProcess(config, "--until", "train") as d:
        until(d, lambda: counts(cfg).get("pending") == n, 120, "the plan")
        # Paused: the engine loads but gets no work, and ingest keeps watching the spool.
        assert ctl(config, "pause", "--reason", "chaos: hostile dumps").returncode == 0
        f = Forger(cfg, staging)
        s = iter(x.id for x in f.samples)
        nm = dumpformat.dump_name
        cases: dict[str, tuple[str | None, bytes | None, str, str]] = {}

        def case(what: str, sid: str | None, name: str, data: bytes | None, reason: str) -> None:
            if data is not None:
                f.drop(name, data)
            cases[what] = (sid, data, name, reason)

        a = next(s)
        case("empty", a, nm(a), b"", "file too short")
        b = next(s)
        case("truncated", b, nm(b), f.dump(b)[:-7], "header describes")
        c = next(s)
        case("header length beyond the file", c, nm(c), struct.pack("<Q", 10**6) + b"{}",
             "does not fit")
        e = next(s)
        case("invalid header JSON", e, nm(e), struct.pack("<Q", 8) + b"{not js}" + b"\0" * 64,
             "not valid JSON")
        g = next(s)
        case("wrong dtype", g, nm(g), f.dump(g, dtype="F16"), "dtype F16")
        h = next(s)
        case("wrong shape", h, nm(h), f.dump(h, aux_width=2), "aux_hidden_states")
        i = next(s)
        case("wrong T (a decode step)", i, nm(i), f.dump(i, tokens=1), "decode step")
        unknown = uuid.uuid4().hex
        case("unknown sample id", None, nm(unknown), f.dump(unknown), "unknown sample id")
        case("malformed sample id", None, "NOT-A-SAMPLE.safetensors", f.dump(unknown),
             "is not <sample id>.safetensors")
        case("path traversal in a name", None, "a..%2F..%2Fetc%2Fpasswd.safetensors",
             f.dump(unknown), "is not <sample id>.safetensors")
        stray = ".notes-left-by-an-operator"
        (f.spool / stray).write_bytes(b"not a dump\n" * 400)
        an_hour_ago = time.time() - 3600
        os.utime(f.spool / stray, (an_hour_ago, an_hour_ago))
        case("a dot-named file, no writer's temp file, untouched for an hour", None, stray, None,
             "is not <sample id>.safetensors")
        j = next(s)
        case("path traversal in the metadata id", j, nm(j), f.dump(j, meta_id="../../../etc/passwd"),
             "malformed sample id")
        k = next(s)
        outside = tmp_path / "not-a-dump"
        outside.write_bytes(b"secret")
        (f.spool / nm(k)).symlink_to(outside)
        case("a symlink in place of a file", k, nm(k), None, "not a regular file")
        m = next(s)
        os.mkfifo(f.spool / nm(m))
        case("a FIFO in place of a file", m, nm(m), None, "not a regular file")
        grower_sid = next(s)
        grower = threading.Thread(target=grow_after_rename, args=(f, grower_sid, stop))
        grower.start()
        case("a file that keeps growing after its rename", grower_sid, nm(grower_sid), None,
             "header describes|changed while it was being ingested")
        nan_sid, inf_sid = next(s), next(s)
        poisoned = {nan_sid: f.dump(nan_sid, poison=BF16_NAN),
                    inf_sid: f.dump(inf_sid, poison=BF16_INF)}
        for sid, data in poisoned.items():
            f.drop(nm(sid), data)

        rejected_names = {v[2] for v in cases.values()}
        try:
            got = until(d, lambda: (lambda r: r if rejected_names <= set(r) else None)(
                rejections(cfg)), 60, "every hostile dump to be rejected", poll=0.2)
        finally:
            stop.set()
            grower.join()
        for what, (sid, data, name, reason) in cases.items():
            assert re.search(reason, got[name]), f"{what}: rejected for {got[name]!r}, not {reason!r}"
        assert outside.read_bytes() == b"secret"
        figures.bad_inputs += len(cases) + len(poisoned)

        # A duplicate for a sample the engine has extracted.
        assert ctl(config, "resume").returncode == 0
        extracted = until(d, lambda: _one_extracted(cfg), 300, "a first extracted sample")
        dup = f.drop(nm(extracted), f.dump(extracted))
        until(d, lambda: "duplicate" in rejections(cfg).get(dup, ""), 60, "the duplicate")
        figures.bad_inputs += 1
        assert d.wait(600) == 0, d.output()[-4000:]

    with Ledger(cfg.paths.state_dir / "ledger.sqlite", readonly=True) as ledger:
        # The values ingest does not read: caught at ingest or by verify, then extracted again.
        for sid, data in poisoned.items():
            row = ledger.sample(sid)
            assert row.status == "verified" and row.checksum != checksum_of(data), \
                f"a poisoned dump of {sid} reached the training set"
            said = " | ".join(str(x) for x in ledger.db.execute(
                "SELECT detail FROM events WHERE sample = ? OR detail LIKE ?",
                (sid, f"%{sid}%")).fetchall())
            assert re.search(r"NaN|Inf", said), f"{sid}: no NaN/Inf rejection: {said}"
        for what, (sid, data, name, reason) in cases.items():
            if sid and data:
                assert ledger.sample(sid).checksum != checksum_of(data), what
    assert figures.audited(audit(config, n, trained=False)) == 0


def checksum_of(data: bytes) -> str:
    h = checksum.hasher()
    h.update(data)
    return checksum.digest(h)


def _no_space_events(cfg) -> int:
    with Ledger(cfg.paths.state_dir / "ledger.sqlite", readonly=True) as ledger:
        return ledger.db.execute("SELECT count(*) FROM events WHERE detail LIKE "
                                 "'%No space left%'").fetchone()[0]


def _one_extracted(cfg) -> str | None:
    with Ledger(cfg.paths.state_dir / "ledger.sqlite", readonly=True) as ledger:
        rows = ledger.samples("extracted", limit=1) or ledger.samples("verified", limit=1)
    return rows[0].id if rows else None


def test_a_full_spool_pauses_extraction_and_fails_no_sample(config_factory, tmp_path, tmpfs,
                                                            figures):
    n = 16
    spool_fs = tmpfs("spool", "4m")
    config = chaos_config(config_factory, tmp_path, n, paths={"spool_dir": str(spool_fs / "spool")},
                          budget={"spool_max": "64MiB"}, **SMALL)
    cfg = load_config(config)
    with DaemonProcess(config, "--until", "train") as d:
        until(d, lambda: counts(cfg).get("extracted", 0) + counts(cfg).get("verified", 0) >= 2,
              300, "extraction")
        ballast = fill_file_system(spool_fs)
        # Held until the engine has hit the full disk at least once, and a few batches more.
        try:
            until(d, lambda: _no_space_events(cfg), 30, "a write into the full spool", poll=0.2)
        except AssertionError:
            pass  # dispatch held back by itself: what a full spool should cause
        time.sleep(5.0)
        ballast.unlink()
        figures.faults += 1
        c = until(d, lambda: (lambda c: c if not (c.get("pending") or c.get("inflight") or
                                                  c.get("extracted")) else None)(counts(cfg)),
                  300, "the end of extraction")
        if c.get("failed"):
            with Ledger(cfg.paths.state_dir / "ledger.sqlite", readonly=True) as ledger:
                errors = [s.error for s in ledger.samples("failed", limit=5)]
            raise AssertionError(f"{c['failed']} samples failed because the spool was full; "
                                 f"a full spool must pause dispatch, not use up attempts: {errors}")
        assert d.wait(300) == 0, d.output()[-4000:]
    assert figures.audited(audit(config, n, trained=False)) == 0
