"""The ledger: one SQLite row per sample, the single source of truth about progress.

Every state change of a sample is one UPDATE guarded by the state it comes from, inside one
transaction, so a sample is never in two states and never counted twice. Per-status counts are
kept by triggers in a tiny table, so `eagle3ctl status` costs the same at 1k and at 1M samples.
"""

from __future__ import annotations

import sqlite3
import time
from pathlib import Path
from typing import Iterable, Iterator, NamedTuple, Sequence

# 2: events are indexed by kind. A ledger of an older version is brought up to this one when
# it is opened for writing: the schema below only creates what is missing.
SCHEMA_VERSION = 2

STATUSES = ("pending", "inflight", "extracted", "verified", "failed", "excluded")

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS samples (
    id TEXT PRIMARY KEY,
    idx INTEGER NOT NULL UNIQUE,
    tokens INTEGER NOT NULL,
    loss_tokens INTEGER NOT NULL,
    ids_hash TEXT NOT NULL,
    status TEXT NOT NULL,
    attempts INTEGER NOT NULL DEFAULT 0,
    error TEXT,
    path TEXT,
    bytes INTEGER NOT NULL DEFAULT 0,
    checksum TEXT,
    verified_stat TEXT,
    reason TEXT,
    dispatched_at REAL,
    updated_at REAL NOT NULL
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS samples_by_status ON samples (status, idx);
CREATE TABLE IF NOT EXISTS plan_tokens (
    id TEXT PRIMARY KEY, input_ids BLOB NOT NULL, loss_mask BLOB NOT NULL) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS skipped (idx INTEGER PRIMARY KEY, reason TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS events (
    seq INTEGER PRIMARY KEY, t REAL NOT NULL, kind TEXT NOT NULL, sample TEXT, detail TEXT);
-- Verify weighs the few life and sync events among one event per sample and state change: by
-- kind it reads those few (1 ms at a million events, where the table scan took 0.5 s).
CREATE INDEX IF NOT EXISTS events_by_kind ON events (kind);
CREATE TABLE IF NOT EXISTS counts (
    status TEXT PRIMARY KEY, n INTEGER NOT NULL, tokens INTEGER NOT NULL, bytes INTEGER NOT NULL);
CREATE TRIGGER IF NOT EXISTS samples_ins AFTER INSERT ON samples BEGIN
    UPDATE counts SET n = n + 1, tokens = tokens + NEW.tokens, bytes = bytes + NEW.bytes
     WHERE status = NEW.status;
END;
CREATE TRIGGER IF NOT EXISTS samples_upd AFTER UPDATE OF status, tokens, bytes ON samples BEGIN
    UPDATE counts SET n = n - 1, tokens = tokens - OLD.tokens, bytes = bytes - OLD.bytes
     WHERE status = OLD.status;
    UPDATE counts SET n = n + 1, tokens = tokens + NEW.tokens, bytes = bytes + NEW.bytes
     WHERE status = NEW.status;
END;
CREATE TRIGGER IF NOT EXISTS skipped_ins AFTER INSERT ON skipped BEGIN
    UPDATE counts SET n = n + 1 WHERE status = 'skipped';
END;
CREATE TRIGGER IF NOT EXISTS samples_del AFTER DELETE ON samples BEGIN
    UPDATE counts SET n = n - 1, tokens = tokens - OLD.tokens, bytes = bytes - OLD.bytes
     WHERE status = OLD.status;
END;
"""


class LedgerError(RuntimeError):
    pass


class Sample(NamedTuple):
    id: str
    idx: int
    tokens: int
    loss_tokens: int
    ids_hash: str
    status: str
    attempts: int
    error: str | None
    path: str | None
    bytes: int
    checksum: str | None
    verified_stat: str | None
    reason: str | None
    dispatched_at: float | None
    updated_at: float


class PlannedSample(NamedTuple):
    id: str
    idx: int
    tokens: int
    loss_tokens: int
    ids_hash: str
    input_ids: bytes  # little-endian int32
    loss_mask: bytes  # one byte per token


class Counts(NamedTuple):
    n: dict[str, int]
    tokens: dict[str, int]
    bytes: dict[str, int]

    @property
    def total(self) -> int:
        return sum(self.n.get(s, 0) for s in STATUSES)

    @property
    def total_tokens(self) -> int:
        return sum(self.tokens.get(s, 0) for s in STATUSES)

    @property
    def done_tokens(self) -> int:
        """Tokens whose hidden states are in the dataset."""
        return self.tokens.get("extracted", 0) + self.tokens.get("verified", 0)

    @property
    def wanted_tokens(self) -> int:
        """Tokens the dataset is meant to hold: everything planned but what was excluded."""
        return self.total_tokens - self.tokens.get("excluded", 0)

    def get(self, status: str) -> int:
        return self.n.get(status, 0)


_COLUMNS = ("id, idx, tokens, loss_tokens, ids_hash, status, attempts, error, path, bytes, "
            "checksum, verified_stat, reason, dispatched_at, updated_at")


class Ledger:
    """A connection to the ledger. One per thread; readers open it read-only."""

    def __init__(self, path: str | Path, readonly: bool = False, timeout: float = 30.0) -> None:
        self.path = Path(path)
        self.readonly = readonly
        if readonly:
            if not self.path.exists():
                raise LedgerError(f"no ledger at {self.path}")
            uri = f"file:{self.path}?mode=ro"
            self.db = sqlite3.connect(uri, uri=True, timeout=timeout, isolation_level=None,
                                      check_same_thread=False)
        else:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.db = sqlite3.connect(str(self.path), timeout=timeout, isolation_level=None,
                                      check_same_thread=False)
            self.db.execute("PRAGMA journal_mode=WAL")
            # NORMAL in WAL mode survives any process crash; a power cut can lose the last
            # commits, which the daemon's start-up reconciliation repairs from the files.
            self.db.execute("PRAGMA synchronous=NORMAL")
            self._migrate()
        self.db.execute(f"PRAGMA busy_timeout={int(timeout * 1000)}")

    def close(self) -> None:
        self.db.close()

    def __enter__(self) -> "Ledger":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _migrate(self) -> None:
        version = self.db.execute("PRAGMA user_version").fetchone()[0]
        if version > SCHEMA_VERSION:
            raise LedgerError(f"{self.path} has schema {version}, newer than this eagle3d "
                              f"({SCHEMA_VERSION}); upgrade eagle3d")
        if version < SCHEMA_VERSION:
            counts = "".join(f"INSERT OR IGNORE INTO counts VALUES ('{s}', 0, 0, 0);"
                             for s in STATUSES + ("skipped",))
            self.db.executescript(f"BEGIN IMMEDIATE;{_SCHEMA}{counts}"
                                  f"PRAGMA user_version={SCHEMA_VERSION};COMMIT;")

    # ---- transactions ---------------------------------------------------------------------

    class _Tx:
        def __init__(self, db: sqlite3.Connection) -> None:
            self.db = db

        def __enter__(self) -> sqlite3.Connection:
            self.db.execute("BEGIN IMMEDIATE")
            return self.db

        def __exit__(self, exc_type: object, *rest: object) -> None:
            self.db.execute("ROLLBACK" if exc_type else "COMMIT")

    def transaction(self) -> "Ledger._Tx":
        return Ledger._Tx(self.db)

    # ---- meta and events ----------------------------------------------------------------------

    def meta(self, key: str, default: str | None = None) -> str | None:
        row = self.db.execute("SELECT value FROM meta WHERE key = ?", (key,)).fetchone()
        return row[0] if row else default

    def set_meta(self, key: str, value: str, db: sqlite3.Connection | None = None) -> None:
        (db or self.db).execute("INSERT INTO meta VALUES (?, ?) ON CONFLICT(key) DO UPDATE "
                                "SET value = excluded.value", (key, value))

    def event(self, kind: str, detail: str = "", sample: str | None = None,
              db: sqlite3.Connection | None = None) -> None:
        (db or self.db).execute("INSERT INTO events (t, kind, sample, detail) VALUES (?, ?, ?, ?)",
                                (time.time(), kind, sample, detail))

    def recent_events(self, limit: int = 20) -> list[tuple[float, str, str | None, str]]:
        rows = self.db.execute("SELECT t, kind, sample, detail FROM events ORDER BY seq DESC "
                               "LIMIT ?", (limit,)).fetchall()
        return list(reversed(rows))

    # ---- plan ---------------------------------------------------------------------------------

    def add_planned(self, samples: Sequence[PlannedSample], skipped: Sequence[tuple[int, str]],
                    meta: dict[str, str]) -> int:
        """Record one batch of the planner's output atomically; returns how many were new.
        A conversation seen twice (same content hash) is recorded once, and skipped once more
        as a duplicate, so the counts of the source add up."""
        now = time.time()
        added = 0
        with self.transaction() as db:
            for s in samples:
                cur = db.execute(
                    "INSERT OR IGNORE INTO samples (id, idx, tokens, loss_tokens, ids_hash, status,"
                    " updated_at) VALUES (?, ?, ?, ?, ?, 'pending', ?)",
                    (s.id, s.idx, s.tokens, s.loss_tokens, s.ids_hash, now))
                if cur.rowcount:
                    db.execute("INSERT OR REPLACE INTO plan_tokens VALUES (?, ?, ?)",
                               (s.id, s.input_ids, s.loss_mask))
                    added += 1
                else:
                    db.execute("INSERT OR IGNORE INTO skipped VALUES (?, ?)",
                               (s.idx, f"duplicate of sample {s.id}"))
            db.executemany("INSERT OR IGNORE INTO skipped VALUES (?, ?)", skipped)
            for k, v in meta.items():
                self.set_meta(k, v, db)
        return added

    def skipped_reasons(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for reason, n in self.db.execute(
                "SELECT CASE WHEN reason LIKE 'duplicate of%' THEN 'duplicate' ELSE reason END r,"
                " count(*) FROM skipped GROUP BY r"):
            out[reason] = n
        return out

    def plan_tokens(self, ids: Iterable[str]) -> dict[str, tuple[bytes, bytes]]:
        out = {}
        for sid in ids:
            row = self.db.execute("SELECT input_ids, loss_mask FROM plan_tokens WHERE id = ?",
                                  (sid,)).fetchone()
            if row:
                out[sid] = (bytes(row[0]), bytes(row[1]))
        return out

    # ---- reading ------------------------------------------------------------------------------

    def counts(self) -> Counts:
        rows = self.db.execute("SELECT status, n, tokens, bytes FROM counts").fetchall()
        return Counts({r[0]: r[1] for r in rows}, {r[0]: r[2] for r in rows},
                      {r[0]: r[3] for r in rows})

    def sample(self, sid: str) -> Sample | None:
        row = self.db.execute(f"SELECT {_COLUMNS} FROM samples WHERE id = ?", (sid,)).fetchone()
        return Sample(*row) if row else None

    def samples(self, status: str | None = None, limit: int | None = None,
                after_idx: int = -1) -> list[Sample]:
        sql = f"SELECT {_COLUMNS} FROM samples WHERE idx > ?"
        args: list = [after_idx]
        if status:
            sql += " AND status = ?"
            args.append(status)
        sql += " ORDER BY idx"
        if limit is not None:
            sql += " LIMIT ?"
            args.append(limit)
        return [Sample(*r) for r in self.db.execute(sql, args)]

    def iter_samples(self, status: str | None = None, page: int = 5000) -> Iterator[Sample]:
        after = -1
        while True:
            batch = self.samples(status, page, after)
            yield from batch
            if len(batch) < page:
                return
            after = batch[-1].idx

    def max_idx(self) -> int:
        row = self.db.execute("SELECT max(idx) FROM (SELECT max(idx) idx FROM samples "
                              "UNION ALL SELECT max(idx) FROM skipped)").fetchone()
        return -1 if row[0] is None else row[0]

    def skipped_count(self) -> int:
        return self.counts().get("skipped")

    # ---- transitions --------------------------------------------------------------------------

    def claim(self, max_samples: int, max_tokens: int) -> list[Sample]:
        """Move pending samples to inflight, oldest first, within the given bounds.
        A sample longer than the token bound is still claimed alone, so nothing starves."""
        now = time.time()
        with self.transaction() as db:
            rows = db.execute(f"SELECT {_COLUMNS} FROM samples WHERE status = 'pending' "
                              "ORDER BY idx LIMIT ?", (max_samples,)).fetchall()
            chosen, budget = [], max_tokens
            for r in rows:
                s = Sample(*r)
                if chosen and s.tokens > budget:
                    break
                chosen.append(s)
                budget -= s.tokens
            db.executemany("UPDATE samples SET status = 'inflight', attempts = attempts + 1, "
                           "dispatched_at = ?, updated_at = ? WHERE id = ? AND status = 'pending'",
                           [(now, now, s.id) for s in chosen])
        return chosen

    def _move(self, sid: str, frm: Sequence[str], to: str, event: str, detail: str = "",
              **fields: object) -> bool:
        sets = ", ".join([f"{k} = ?" for k in fields] + ["status = ?", "updated_at = ?"])
        marks = ", ".join("?" * len(frm))
        with self.transaction() as db:
            cur = db.execute(f"UPDATE samples SET {sets} WHERE id = ? AND status IN ({marks})",
                             (*fields.values(), to, time.time(), sid, *frm))
            if cur.rowcount:
                self.event(event, detail, sid, db)
        return bool(cur.rowcount)

    def mark_extracted(self, sid: str, path: str, nbytes: int, checksum: str) -> bool:
        return self._move(sid, ("inflight", "pending", "failed"), "extracted", "extracted",
                          f"{nbytes} bytes", path=path, bytes=nbytes, checksum=checksum,
                          error=None, verified_stat=None)

    def mark_retry(self, sid: str, error: str, max_attempts: int,
                   frm: Sequence[str] = ("inflight",)) -> str | None:
        """A failed attempt: back to pending, or to failed once the attempts are used up.
        Returns the new status, or None when the sample was not in a state to fail from."""
        row = self.db.execute("SELECT attempts FROM samples WHERE id = ?", (sid,)).fetchone()
        if row is None:
            return None
        to = "failed" if row[0] >= max_attempts else "pending"
        moved = self._move(sid, frm, to, "attempt_failed" if to == "pending" else "failed",
                           error, error=error, path=None, bytes=0, checksum=None,
                           verified_stat=None)
        return to if moved else None

    def mark_verified(self, sid: str, stat: str) -> bool:
        return self._move(sid, ("extracted", "verified"), "verified", "verified",
                          verified_stat=stat)

    def requeue_inflight(self, reason: str) -> int:
        """Back to pending for what no engine is working on (after a restart); the attempt it
        had is not counted against the sample."""
        with self.transaction() as db:
            cur = db.execute("UPDATE samples SET status = 'pending', attempts = max(attempts - 1, 0),"
                             " updated_at = ? WHERE status = 'inflight'", (time.time(),))
            if cur.rowcount:
                self.event("requeued", f"{cur.rowcount} in-flight samples: {reason}", None, db)
        return cur.rowcount

    def release(self, ids: Sequence[str], reason: str) -> int:
        """In-flight samples back to pending without counting the attempt: the engine could not
        finish them through no fault of theirs (a full spool, say)."""
        with self.transaction() as db:
            n = 0
            for sid in ids:
                n += db.execute("UPDATE samples SET status = 'pending', attempts = max(attempts - 1, 0),"
                                " updated_at = ? WHERE id = ? AND status = 'inflight'",
                                (time.time(), sid)).rowcount
            if n:
                self.event("released", f"{n} samples: {reason}", None, db)
        return n

    def expired_inflight(self, older_than: float) -> list[str]:
        return [r[0] for r in self.db.execute(
            "SELECT id FROM samples WHERE status = 'inflight' AND dispatched_at < ?",
            (older_than,))]

    def retry(self, ids: Sequence[str] | None) -> int:
        """Operator: failed (or the given) samples get a fresh set of attempts."""
        now = time.time()
        with self.transaction() as db:
            if ids is None:
                cur = db.execute("UPDATE samples SET status = 'pending', attempts = 0, reason = NULL,"
                                 " updated_at = ? WHERE status = 'failed'", (now,))
                n = cur.rowcount
            else:
                n = 0
                for sid in ids:
                    n += db.execute("UPDATE samples SET status = 'pending', attempts = 0, "
                                    "reason = NULL, path = NULL, bytes = 0, checksum = NULL, "
                                    "verified_stat = NULL, updated_at = ? WHERE id = ? AND "
                                    "status IN ('failed', 'excluded')", (now, sid)).rowcount
            self.event("retry", f"{n} samples back to pending", None, db)
        return n

    def exclude(self, ids: Sequence[str], reason: str) -> int:
        if not reason.strip():
            raise LedgerError("an exclusion needs a written reason")
        now = time.time()
        with self.transaction() as db:
            n = 0
            for sid in ids:
                cur = db.execute("UPDATE samples SET status = 'excluded', reason = ?, "
                                 "updated_at = ? WHERE id = ? AND status != 'excluded'",
                                 (reason, now, sid))
                if cur.rowcount:
                    n += 1
                    self.event("excluded", reason, sid, db)
        return n

    def verified_fingerprint_rows(self) -> Iterator[tuple[str, str]]:
        yield from self.db.execute("SELECT id, checksum FROM samples WHERE status = 'verified' "
                                   "ORDER BY id")
