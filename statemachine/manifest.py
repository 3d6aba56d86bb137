"""The dataset manifest (`<dataset>/manifest.json`): the verified samples the trainer may use.

Written atomically when verify completes. Its fingerprint covers (id, checksum) of every
verified sample, so the trainer can refuse a dataset that no longer matches the ledger. Each
sample also carries what verify saw of its file (`stat`: size, modification time, inode), which
the trainer compares with the file at every start, and the checksum its reader checks.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Iterable

from eagle3d.statemachine import digests, layout
from eagle3d.statemachine.atomic import atomic_write_bytes
from eagle3d.statemachine.ledger import Ledger



class ManifestMismatch(RuntimeError):
    pass


def fingerprint(rows: Iterable[tuple[str, str]]) -> str:
    h = digests.hasher()
    for sid, checksum in rows:
        h.update(f"{sid}:{checksum}\n".encode())
    return h.hexdigest()


# Of no sample at all: an empty shard's share (statemachine/shards.py).
EMPTY = fingerprint(())


def stat_key(st: os.stat_result) -> str:
    """What verify records of a file it passed: changes whenever the file is rewritten or
    replaced, so an unchanged key lets the daemon skip a file that already passed."""
    return f"{st.st_size}:{st.st_mtime_ns}:{st.st_ino}"


def file_changed(sample: dict[str, Any], st: os.stat_result) -> str | None:
    """How the file `st` differs from the one verify passed for `sample`, or None. Size and
    modification time only: a copy that keeps times (cp -p, rsync -t) is another inode with the
    same bytes. A manifest written before stats were recorded has none to compare (the reader's
    checksum still checks every byte)."""
    parts = str(sample.get("stat")).split(":")
    if len(parts) != 3:
        return None
    size, mtime_ns, _ = parts
    if str(st.st_size) != size:
        return f"{st.st_size} bytes, verify saw {size}"
    if str(st.st_mtime_ns) != mtime_ns:
        return f"modified at {st.st_mtime_ns} ns, verify saw {mtime_ns}"
    return None


def ledger_fingerprint(ledger: Ledger) -> str:
    return fingerprint(ledger.verified_fingerprint_rows())


def build(ledger: Ledger, contract: dict[str, Any]) -> dict[str, Any]:
    samples = [{"id": s.id, "path": s.path, "tokens": s.tokens, "loss_tokens": s.loss_tokens,
                "checksum": s.checksum, "stat": s.verified_stat}
               for s in ledger.iter_samples("verified")]
    samples.sort(key=lambda s: s["id"])
    return {"fingerprint": fingerprint((s["id"], s["checksum"]) for s in samples),
            "contract": contract, "counts": ledger.counts().n, "samples": samples}


def write(dataset_dir: Path, manifest: dict[str, Any]) -> None:
    atomic_write_bytes(layout.manifest_file(dataset_dir), json.dumps(manifest).encode())


def read(dataset_dir: Path) -> dict[str, Any] | None:
    try:
        return json.loads(layout.manifest_file(dataset_dir).read_bytes())
    except FileNotFoundError:
        return None
    except ValueError:
        return None  # damaged: verify writes it again


def intact(manifest: dict[str, Any]) -> bool:
    """Whether a manifest read from another node's folder lists the samples its fingerprint
    sums (the training node cannot ask that node's ledger)."""
    try:
        rows = [(s["id"], s["checksum"]) for s in manifest["samples"]]
    except (KeyError, TypeError):
        return False
    return manifest.get("fingerprint") == fingerprint(rows)


def check(manifest: dict[str, Any] | None, ledger: Ledger) -> None:
    """Raise unless the manifest names exactly the ledger's verified samples."""
    if manifest is None:
        raise ManifestMismatch("the dataset has no manifest: verify has not completed")
    current = ledger_fingerprint(ledger)
    if manifest.get("fingerprint") != current:
        raise ManifestMismatch(f"the manifest ({manifest.get('fingerprint')}) does not match the "
                               f"ledger's verified samples ({current}); let verify finish again")
