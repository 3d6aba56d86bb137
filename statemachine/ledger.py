"""The ledger: one SQLite row per sample, the single source of truth about progress.

Every state change of a sample is one UPDATE guarded by the state it comes from, inside one
transaction, so a sample is never in two states and never counted twice. Per-status counts are
kept by triggers in a tiny table, so `eagle3ctl status` costs the same at 1k and at 1M samples.
"""

from __future__ import annotations

import os
import sqlite3
import sys
import time
from pathlib import Path
from typing import Iterable, Iterator, NamedTuple, Sequence

from eagle3d.statemachine import digests

# 2: events are indexed by kind. 3: the target writes the answers ([data] responses = "target"):
# prompts, generated conversations, and the two states before pending. A ledger of an older
# version is brought up to this one when it is opened for writing: the schema below only creates
# what is missing.
SCHEMA_VERSION = 3

# `ungenerated` and `generating` come first only where the target writes the answers: a sample
# has no tokens until its conversation is generated, then it is pending like any other.
STATUSES = ("ungenerated", "generating", "pending", "inflight", "extracted", "verified", "failed",
            "excluded")

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
CREATE TABLE IF NOT EXISTS prompts (id TEXT PRIMARY KEY, messages TEXT NOT NULL) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS generated (
    id TEXT PRIMARY KEY, messages TEXT NOT NULL, checksum TEXT NOT NULL, settings TEXT NOT NULL
) WITHOUT ROWID;
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


# What another process or the disk does for a while: a lock held (an sqlite3 shell, a backup),
# a disk full or failing.
_PASSING = (sqlite3.SQLITE_BUSY, sqlite3.SQLITE_LOCKED, sqlite3.SQLITE_FULL, sqlite3.SQLITE_IOERR)


def problem(path: Path, exc: sqlite3.Error) -> tuple[str, bool]:
    """What `exc`, raised on the ledger at `path`, says is wrong with it, in words an operator
    acts on, and whether it may mend by itself (True) or takes the operator (False): a file that
    is no SQLite database or is damaged, a folder in its place, one the service may not write."""
    code = (exc.sqlite_errorcode or 0) & 0xFF  # the primary code of an extended one
    if path.is_dir():  # read-only, SQLite calls it an I/O error
        return (f"{path} is a folder where the ledger file belongs: move it away, and the "
                "ledger back"), False
    if code in _PASSING:
        return f"{path}: {exc}", True
    try:  # a read-only remount after an I/O error: a disk event, not the file's fault
        if os.statvfs(path.parent).f_flag & os.ST_RDONLY:
            return f"{path}: its file system is read-only ({exc})", True
    except OSError:
        pass
    if code in (sqlite3.SQLITE_NOTADB, sqlite3.SQLITE_CORRUPT):
        return (f"{path} is damaged ({exc}): restore it from a backup, or salvage its rows "
                f"(sqlite3 {path.name} .recover | sqlite3 recovered.sqlite) and put them in its "
                "place"), False
    return (f"{path} cannot be opened ({exc}): it must be a file that the service's user can "
            "read and write, in a folder it can write"), False


def _first_prompt_chars(messages: str) -> int:
    """The length of a conversation's first prompt (its turns up to the first user turn), in
    characters: the order of prompts by it is close to their order by tokens."""
    import json  # here and below, not at the top: `eagle3ctl status` imports this module
    total = 0
    for turn in json.loads(messages):
        total += len(turn.get("content") or "")
        if turn.get("role") == "user":
            break
    return total


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


def token_ids(raw: bytes) -> list[int]:
    """A planned sample's token ids, from the little-endian int32 bytes the ledger keeps."""
    import array
    ids = array.array("i")
    ids.frombytes(raw)
    if sys.byteorder == "big":
        ids.byteswap()
    return ids.tolist()


class Prompt(NamedTuple):
    """A conversation whose assistant turns the target is to write."""
    id: str
    idx: int
    messages: str  # JSON: the turns kept from the source (system and user), in order


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


# Where a retried sample goes back to: extraction, or generation when it has no tokens yet.
_BACK = "CASE WHEN tokens = 0 THEN 'ungenerated' ELSE 'pending' END"

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
            # as_uri, not an f-string: a path with "#" or "?" is a fragment or a query in a URI
            uri = f"{self.path.absolute().as_uri()}?mode=ro"
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

    def clear_meta(self, key: str) -> None:
        self.db.execute("DELETE FROM meta WHERE key = ?", (key,))

    def last_event_seq(self) -> int:
        """The sequence number of the newest event (0 for none): it grows with every change."""
        return self.db.execute("SELECT max(seq) FROM events").fetchone()[0] or 0

    def events_of(self, kinds: Sequence[str], after: int = 0,
                  upto: int | None = None) -> list[tuple[int, str, str]]:
        """(seq, kind, detail) of the events of these kinds with after < seq <= upto, oldest
        first."""
        marks = ", ".join("?" * len(kinds))
        return self.db.execute(
            f"SELECT seq, kind, detail FROM events WHERE seq > ? AND seq <= ? AND kind IN ({marks})"
            " ORDER BY seq", (after, self.last_event_seq() if upto is None else upto, *kinds)
        ).fetchall()

    def last_event_of(self, kinds: Sequence[str], before: int) -> tuple[int, str, str] | None:
        """The newest event of these kinds with seq < before."""
        marks = ", ".join("?" * len(kinds))
        return self.db.execute(
            f"SELECT seq, kind, detail FROM events WHERE seq < ? AND kind IN ({marks}) "
            "ORDER BY seq DESC LIMIT 1", (before, *kinds)).fetchone()

    def extractions(self) -> list[tuple[float, int]]:
        """(time, tokens) of every sample's extraction, oldest first: a run's pace over time."""
        return self.db.execute(
            "SELECT e.t, s.tokens FROM events e JOIN samples s ON s.id = e.sample "
            "WHERE e.kind = 'extracted' ORDER BY e.seq").fetchall()

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
        return self._add([(s.id, s.idx, s.tokens, s.loss_tokens, s.ids_hash) for s in samples],
                         "pending", "INSERT OR REPLACE INTO plan_tokens VALUES (?, ?, ?)",
                         [(s.id, s.input_ids, s.loss_mask) for s in samples], skipped, meta)

    def add_prompts(self, prompts: Sequence[Prompt], skipped: Sequence[tuple[int, str]],
                    meta: dict[str, str]) -> int:
        """The planner's output where the target writes the answers: conversations without
        tokens yet, `ungenerated`, each with the turns the target is to answer."""
        return self._add([(p.id, p.idx, 0, 0, "") for p in prompts], "ungenerated",
                         "INSERT OR REPLACE INTO prompts VALUES (?, ?)",
                         [(p.id, p.messages) for p in prompts], skipped, meta)

    def _add(self, rows: Sequence[tuple[str, int, int, int, str]], status: str, detail_sql: str,
             details: Sequence[tuple], skipped: Sequence[tuple[int, str]],
             meta: dict[str, str]) -> int:
        now = time.time()
        added = 0
        with self.transaction() as db:
            for (sid, idx, tokens, loss_tokens, ids_hash), detail in zip(rows, details):
                cur = db.execute(
                    "INSERT OR IGNORE INTO samples (id, idx, tokens, loss_tokens, ids_hash, status,"
                    " updated_at) VALUES (?, ?, ?, ?, ?, ?, ?)",
                    (sid, idx, tokens, loss_tokens, ids_hash, status, now))
                if cur.rowcount:
                    db.execute(detail_sql, detail)
                    added += 1
                else:
                    db.execute("INSERT OR IGNORE INTO skipped VALUES (?, ?)",
                               (idx, f"duplicate of sample {sid}"))
            db.executemany("INSERT OR IGNORE INTO skipped VALUES (?, ?)", skipped)
            for k, v in meta.items():
                self.set_meta(k, v, db)
        return added

    def skipped_reasons(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for reason, n in self.db.execute(
                "SELECT CASE WHEN reason LIKE 'duplicate of%' THEN 'duplicate'"
                # One key per reason, not per token count: "over max_tokens (812 tokens)".
                " WHEN reason LIKE '%over max_tokens (%'"
                " THEN substr(reason, 1, instr(reason, ' (') - 1)"
                # One key for the damaged records, each row naming its own line.
                " WHEN reason LIKE '% is not valid JSON%' THEN 'not valid JSON'"
                " ELSE reason END r,"
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
              guard: dict[str, object] | None = None, **fields: object) -> bool:
        """One transition, where the row is in one of `frm` and its `guard` columns hold the
        given values."""
        guard = guard or {}
        sets = ", ".join([f"{k} = ?" for k in fields] + ["status = ?", "updated_at = ?"])
        marks = ", ".join("?" * len(frm))
        holds = "".join(f" AND {k} IS ?" for k in guard)
        with self.transaction() as db:
            cur = db.execute(f"UPDATE samples SET {sets} WHERE id = ? AND status IN ({marks})"
                             f"{holds}", (*fields.values(), to, time.time(), sid, *frm,
                                          *guard.values()))
            if cur.rowcount:
                self.event(event, detail, sid, db)
        return bool(cur.rowcount)

    def mark_extracted(self, sid: str, path: str, nbytes: int, checksum: str) -> bool:
        """The sample's dump is in the dataset. A dump can still come for a sample released
        without its attempt counted (its spool was removed, its engine went silent): that
        attempt made it after all, so an extracted sample counts at least one. The attempts read
        are the move's guard: a dispatch in between leaves the sample to its new attempt."""
        row = self.db.execute("SELECT attempts FROM samples WHERE id = ?", (sid,)).fetchone()
        if row is None:
            return False
        return self._move(sid, ("inflight", "pending", "failed"), "extracted", "extracted",
                          f"{nbytes} bytes", guard={"attempts": row[0]},
                          attempts=max(row[0], 1), path=path, bytes=nbytes, checksum=checksum,
                          error=None, verified_stat=None)

    def mark_retry(self, sid: str, error: str, max_attempts: int,
                   frm: Sequence[str] = ("inflight",)) -> str | None:
        """A failed attempt: back to pending (ungenerated when its conversation is still to be
        generated), or to failed once the attempts are used up.
        Returns the new status, or None when the sample was not in a state to fail from."""
        row = self.db.execute("SELECT attempts, tokens FROM samples WHERE id = ?",
                              (sid,)).fetchone()
        if row is None:
            return None
        to = "failed" if row[0] >= max_attempts else "pending" if row[1] else "ungenerated"
        moved = self._move(sid, frm, to, "attempt_failed" if to == "pending" else "failed",
                           error, error=error, path=None, bytes=0, checksum=None,
                           verified_stat=None)
        return to if moved else None

    def mark_verified(self, checked: Sample, stat: str) -> bool:
        """Verified, if the row still holds the extraction that was checked (`checked`, read
        when the pass listed it): an exclude and a retry during a long pass can put a newer
        file under the same id, one that is not yet synced to disk."""
        return self._move(checked.id, ("extracted", "verified"), "verified", "verified",
                          guard={"path": checked.path, "checksum": checked.checksum,
                                 "dispatched_at": checked.dispatched_at}, verified_stat=stat)

    def unverify_all(self, reason: str) -> int:
        """Every verified sample back to extracted, to be verified again."""
        return self.unverify(None, reason)

    def unverify(self, ids: Sequence[str] | None, reason: str) -> int:
        """These verified samples (all, for None) back to extracted, to be verified again: a
        transition guarded by the state it comes from and one event per sample, in one
        transaction (a million samples must not cost a million commits)."""
        now = time.time()
        with self.transaction() as db:
            listed = db.execute("SELECT id FROM samples WHERE status = 'verified'").fetchall() \
                if ids is None else [(sid,) for sid in ids]
            moved = [sid for sid, in listed
                     if db.execute("UPDATE samples SET status = 'extracted', updated_at = ? "
                                   "WHERE id = ? AND status = 'verified'", (now, sid)).rowcount]
            db.executemany("INSERT INTO events (t, kind, sample, detail) VALUES (?, ?, ?, ?)",
                           [(now, "unverified", sid, reason) for sid in moved])
        return len(moved)

    def requeue_inflight(self, reason: str) -> int:
        """Back to pending (or ungenerated) for what no engine or generator is working on (after
        a restart); the attempt it had is not counted against the sample."""
        n = 0
        with self.transaction() as db:
            for frm, to in (("inflight", "pending"), ("generating", "ungenerated")):
                cur = db.execute(f"UPDATE samples SET status = '{to}', attempts = "
                                 f"max(attempts - 1, 0), updated_at = ? WHERE status = '{frm}'",
                                 (time.time(),))
                if cur.rowcount:
                    self.event("requeued", f"{cur.rowcount} {frm} samples: {reason}", None, db)
                n += cur.rowcount
        return n

    def release(self, ids: Sequence[str], reason: str, frm: str = "inflight") -> int:
        """In-flight samples back to pending (`frm` "generating": back to ungenerated) without
        counting the attempt: the child could not finish them through no fault of theirs (a
        full spool, a hung engine)."""
        to = {"inflight": "pending", "generating": "ungenerated"}[frm]
        with self.transaction() as db:
            n = 0
            for sid in ids:
                n += db.execute(f"UPDATE samples SET status = '{to}', attempts = max(attempts - 1, 0),"
                                " updated_at = ? WHERE id = ? AND status = ?",
                                (time.time(), sid, frm)).rowcount
            if n:
                self.event("released", f"{n} samples: {reason}", None, db)
        return n

    def inflight(self) -> dict[str, float]:
        """The samples in flight and the wall-clock time each was dispatched at."""
        return dict(self.db.execute(
            "SELECT id, dispatched_at FROM samples WHERE status = 'inflight'").fetchall())

    def retry(self, ids: Sequence[str] | None) -> int:
        """Operator: failed (or the given) samples get a fresh set of attempts."""
        now = time.time()
        with self.transaction() as db:
            if ids is None:
                cur = db.execute(f"UPDATE samples SET status = {_BACK}, attempts = 0, "
                                 "reason = NULL, updated_at = ? WHERE status = 'failed'", (now,))
                n = cur.rowcount
            else:
                n = 0
                for sid in ids:
                    n += db.execute(f"UPDATE samples SET status = {_BACK}, attempts = 0, "
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

    # ---- generation ([data] responses = "target") ----------------------------------------------

    def claim_prompts(self, n: int, window: int = 0) -> list[tuple[Sample, list[dict]]]:
        """Move up to n ungenerated samples to generating, with their prompts: the n shortest
        prompts among the oldest `window` (at least n), so that a batch decoded together is
        padded to a length close to its own."""
        import json
        now = time.time()
        with self.transaction() as db:
            rows = db.execute(f"SELECT {_COLUMNS}, messages FROM samples JOIN prompts USING (id) "
                              "WHERE status = 'ungenerated' ORDER BY idx LIMIT ?",
                              (max(n, window),)).fetchall()
            rows = sorted(rows, key=lambda r: (_first_prompt_chars(r[-1]), r[1]))[:n]
            db.executemany("UPDATE samples SET status = 'generating', attempts = attempts + 1, "
                           "dispatched_at = ?, updated_at = ? WHERE id = ? AND "
                           "status = 'ungenerated'", [(now, now, r[0]) for r in rows])
        return [(Sample(*r[:-1]), json.loads(r[-1])) for r in rows]

    def mark_generated(self, planned: PlannedSample, messages: list[dict],
                       settings: dict[str, object]) -> bool:
        """The target wrote the conversation: it is kept (checksummed) with the settings it was
        written with, and the sample, now with its tokens, is pending extraction."""
        import json
        text = json.dumps(messages, ensure_ascii=False)
        with self.transaction() as db:
            cur = db.execute("UPDATE samples SET status = 'pending', tokens = ?, loss_tokens = ?, "
                             "ids_hash = ?, attempts = 0, error = NULL, updated_at = ? WHERE id = ? "
                             "AND status = 'generating'", (planned.tokens, planned.loss_tokens,
                                                           planned.ids_hash, time.time(),
                                                           planned.id))
            if cur.rowcount:
                db.execute("INSERT OR REPLACE INTO generated VALUES (?, ?, ?, ?)",
                           (planned.id, text, digests.hex_digest(text.encode()),
                            json.dumps(settings)))
                db.execute("INSERT OR REPLACE INTO plan_tokens VALUES (?, ?, ?)",
                           (planned.id, planned.input_ids, planned.loss_mask))
                self.event("generated", f"{planned.tokens} tokens", planned.id, db)
        return bool(cur.rowcount)

    def generated(self, sid: str) -> tuple[list[dict], dict[str, object]] | None:
        """The conversation the target wrote for a sample and the settings it used, or None;
        a stored text that no longer matches its checksum is an error, never returned."""
        import json
        row = self.db.execute("SELECT messages, checksum, settings FROM generated WHERE id = ?",
                              (sid,)).fetchone()
        if row is None:
            return None
        if digests.hex_digest(row[0].encode()) != row[1]:
            raise LedgerError(f"the generated conversation of {sid} does not match its checksum")
        return json.loads(row[0]), json.loads(row[2])

    def verified_fingerprint_rows(self) -> Iterator[tuple[str, str]]:
        yield from self.db.execute("SELECT id, checksum FROM samples WHERE status = 'verified' "
                                   "ORDER BY id")
