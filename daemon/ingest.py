"""Ingest: one dump from the spool into the dataset, or rejected with a reason.

validate (header, ledger, contract) → copy to the shard folder while checksumming and scanning →
rename → commit the ledger row → unlink the spool file. No fsync per file: "extracted" means
copied, checksummed and scanned, and durability comes from group syncs (see durability.py);
ENOSPC still shows at write time, since the file system reserves the space then.

The spool is worked through its held folder (safepath.HeldDir): a dump is opened once, by name
in that folder and never through a link, and every check, the copy and its removal use that
open file or that folder, whatever the spool's path names meanwhile.

Every step is safe to repeat, so a crash between any two repairs itself at the next start: a
dataset temp file is removed, a renamed file whose ledger row was not committed is written again
from the spool (or removed as an orphan), and a spool file whose sample is already committed is
recognised by its checksum and dropped.
"""

from __future__ import annotations

import errno
import logging
import os
import stat
from dataclasses import dataclass
from pathlib import Path

from eagle3d.dataset import contract as capture_contract
from eagle3d.dataset import dumpformat
from eagle3d.dataset.dumpformat import DumpError
from eagle3d.dataset import checksum
from eagle3d.daemon.dump_checks import Expected, scan
from eagle3d.daemon.durability import GroupSync
from eagle3d.statemachine import layout, safepath
from eagle3d.statemachine.ledger import Ledger

log = logging.getLogger("eagle3d")

KEEP_REJECTED_DATA = 16  # rejected dumps kept whole for inspection; later ones keep the reason


class DiskUnwritable(OSError):
    """The dataset file system cannot take the dump now (full, read-only after an error, or
    failing with I/O errors): not the dump's fault, so it stays in the spool, its sample is not
    charged, and dispatch waits as for a full disk."""


_UNWRITABLE = {errno.ENOSPC: "full", errno.EDQUOT: "over its quota", errno.EROFS: "read-only",
               errno.EIO: "failing with I/O errors"}


def _unwritable(exc: OSError, name: str) -> OSError:
    """`exc` as DiskUnwritable where the disk is at fault, else as it is."""
    if exc.errno not in _UNWRITABLE:
        return exc
    return DiskUnwritable(exc.errno, f"the dataset file system is {_UNWRITABLE[exc.errno]} "
                          f"while writing {name}")


@dataclass(frozen=True)
class Outcome:
    kind: str  # "ingested" | "rejected" | "dropped" (already ingested) | "ignored"
    sample: str | None
    detail: str = ""
    tokens: int = 0
    nbytes: int = 0


def shard_path(dataset_dir: Path, idx: int, sample_id: str) -> tuple[Path, str]:
    rel = f"{layout.sample_folder(idx)}/{dumpformat.dump_name(sample_id)}"
    return dataset_dir / rel, rel


class Ingestor:
    """One per ingest thread, each with its own ledger connection. The daemon's threads share
    one `group_sync`; without it nothing is synced during ingest (verify still syncs before it
    trusts a file). `spool` is the spool's held folder (spool.Spool's): a dump is opened, read,
    set aside and removed through it, never through the spool's path."""

    def __init__(self, ledger: Ledger, spool: safepath.HeldDir, dataset_dir: Path, contract: dict,
                 max_attempts: int, group_sync: GroupSync | None = None) -> None:
        self.ledger = ledger
        self.spool = spool
        self.dataset_dir = dataset_dir
        self.contract = contract
        self.max_attempts = max_attempts
        self.group_sync = group_sync

    def ingest(self, name: str) -> Outcome:
        try:
            fd = self.spool.open_file(name, os.O_RDONLY)
        except FileNotFoundError:
            return Outcome("ignored", None, "gone")
        except OSError as exc:
            if exc.errno != errno.ELOOP:
                raise
            return self._reject(name, None, "not a regular file (symlink, FIFO or folder)")
        try:
            return self._ingest(name, fd)
        finally:
            os.close(fd)

    def _ingest(self, name: str, fd: int) -> Outcome:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            return self._reject(name, None, "not a regular file (symlink, FIFO or folder)")
        if st.st_uid != os.geteuid():  # the engine runs as the daemon's user: nobody else writes
            return self._reject(name, None, f"owned by {safepath.user_name(st.st_uid)}, not the "
                                "service's user: another user put it in the spool")
        sid = name[:-len(dumpformat.SUFFIX)] if name.endswith(dumpformat.SUFFIX) else ""
        if not dumpformat.SAMPLE_ID.fullmatch(sid):
            return self._reject(name, None, f"file name {name!r} is not <sample id>.safetensors")
        try:
            header = dumpformat.header_of(fd)
        except (DumpError, OSError) as exc:
            return self._reject(name, sid, f"bad dump: {exc}")
        sample = self.ledger.sample(sid)
        if sample is None:
            return self._reject(name, None, f"unknown sample id {sid}")
        if header.sample_id != sid:
            return self._reject(name, sid, f"file {name} holds sample {header.sample_id}")
        if sample.status in ("extracted", "verified"):
            return self._duplicate(name, fd, sample.checksum)
        if sample.status == "excluded":
            return self._reject(name, None, f"sample {sid} is excluded")
        dst, rel = shard_path(self.dataset_dir, sample.idx, sid)
        c = self.contract
        expected = Expected(id=sid, path=str(self.spool.path / name), tokens=sample.tokens,
                            loss_tokens=sample.loss_tokens, ids_hash=sample.ids_hash, checksum="",
                            contract_fingerprint=c["fingerprint"], hidden_size=c["hidden_size"],
                            dtype=capture_contract.dump_dtype(c))
        try:
            digest, nbytes = self._copy(fd, dst, expected)
        except DumpError as exc:
            return self._reject(name, sid, str(exc))
        if not self.ledger.mark_extracted(sid, rel, nbytes, digest):
            dst.unlink(missing_ok=True)
            return self._reject(name, None, f"sample {sid} changed state during ingest")
        self._remove(name)
        if self.group_sync is not None:
            self.group_sync.ingested(nbytes, self.ledger)
        return Outcome("ingested", sid, rel, header.tokens, nbytes)

    def _copy(self, fd_in: int, dst: Path, expected: Expected) -> tuple[str, int]:
        """Copy and check in one pass (the same checks verify makes: header against the plan and
        the contract, planned ids, loss mask, finite values); returns (checksum, bytes)."""
        try:
            dst.parent.mkdir(mode=0o750, parents=True, exist_ok=True)
        except OSError as exc:
            raise _unwritable(exc, dst.name) from None
        tmp = dst.with_name(f".{dst.name}.tmp")
        st = os.fstat(fd_in)
        try:
            fd_out = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o640)
            try:
                problem, digest = scan(fd_in, st.st_size, expected, sink=fd_out)
            finally:
                os.close(fd_out)
            after = os.fstat(fd_in)
        except OSError as exc:
            try:
                tmp.unlink(missing_ok=True)
            except OSError:
                pass  # a read-only disk keeps it: the next start's debris
            raise _unwritable(exc, dst.name) from None
        if problem is None and (after.st_size, after.st_mtime_ns) != (st.st_size, st.st_mtime_ns):
            problem = "the file changed while it was being ingested (still being written?)"
        if problem is not None:
            tmp.unlink(missing_ok=True)
            raise DumpError(problem)
        os.rename(tmp, dst)
        return digest, st.st_size

    def _duplicate(self, name: str, fd: int, committed: str | None) -> Outcome:
        """A dump for a sample already in the dataset: the leftover of a crash between commit
        and unlink when its checksum matches, else a real duplicate."""
        if committed and checksum.fd_checksum(fd) == committed:
            self._remove(name)
            return Outcome("dropped", None, "already ingested")
        return self._reject(name, None, "duplicate: this sample is already extracted")

    def _remove(self, name: str) -> None:
        try:
            self.spool.unlink(name)
        except FileNotFoundError:
            pass

    def _reject(self, name: str, retry_sid: str | None, reason: str) -> Outcome:
        """Move the dump aside with its reason; the sample (if any) gets another attempt."""
        try:
            self._set_aside(name, reason)
        except FileNotFoundError:
            pass
        except (OSError, safepath.Unsafe) as exc:  # never let a rejection stop ingest
            log.warning("could not move %s aside: %s", name, exc)
            self._remove(name)
        if retry_sid:
            self.ledger.mark_retry(retry_sid, f"rejected dump: {reason}", self.max_attempts,
                                   frm=("inflight", "pending"))
        self.ledger.event("rejected", f"{name}: {reason}", retry_sid)
        log.warning("rejected %s: %s", name, reason)
        return Outcome("rejected", retry_sid, reason)

    def _set_aside(self, name: str, reason: str) -> None:
        """Into rejected/ (the first few kept whole, later ones only their reason)."""
        rejected = self.spool.subdir(layout.rejected_dir(self.spool.path).name, 0o700)
        try:
            kept = sum(1 for n, _ in rejected.entries() if not n.endswith(".reason.txt"))
            if kept < KEEP_REJECTED_DATA:
                self.spool.rename(name, rejected, name)
            else:
                self.spool.unlink(name)
            fd = rejected.open_file(f"{name}.reason.txt", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
            with os.fdopen(fd, "w") as out:
                out.write(reason + "\n")
        finally:
            rejected.close()


def remove_dataset_debris(dataset_dir: Path, ledger: Ledger) -> list[str]:
    """At start: temp files of an interrupted copy, and dataset files whose ledger row says the
    sample is not extracted (renamed, but the commit never happened)."""
    removed = []
    if not dataset_dir.exists():
        return removed
    for shard in layout.sample_folders(dataset_dir):
        for entry in os.scandir(shard):
            name = entry.name
            if name.startswith("."):
                os.unlink(entry.path)
                removed.append(name)
            elif name.endswith(dumpformat.SUFFIX):
                sample = ledger.sample(name[:-len(dumpformat.SUFFIX)])
                if sample is None or sample.status not in ("extracted", "verified"):
                    os.unlink(entry.path)
                    removed.append(name)
    return removed
