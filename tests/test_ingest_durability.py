"""Group durability on real ext4 file systems: ingest does not wait for the disk, a group sync
puts what it wrote on disk, and a disk that loses writes is reported and marks nothing verified.

The failing disk is a thin-provisioned one, as in real life: ext4 on a loop device whose sparse
backing file lives on a tmpfs smaller than the ext4, so write-back fails with EIO once it fills.
"""

from __future__ import annotations

import logging
import os
import subprocess
import uuid
from pathlib import Path

import pytest

from eagle3d.capture import dumpformat
from eagle3d.daemon import verify_stage
from eagle3d.daemon.durability import GroupSync, SyncFs
from eagle3d.daemon.ingest import Ingestor
from eagle3d.daemon.verify_stage import VerifyRunner
from eagle3d.statemachine.config import load_config
from eagle3d.statemachine.ledger import Ledger, PlannedSample
from tests.conftest import make_config
from tests.test_ingest import CONTRACT, sample_ids, write

NEVER = 1 << 62
DUMP_TOKENS = 60_000  # ~8 MB each at hidden size 16


def plan(ledger: Ledger, n: int, tokens: int) -> list[PlannedSample]:
    samples = []
    for i in range(n):
        ids = sample_ids(i, tokens)
        samples.append(PlannedSample(f"{i:032x}", i, tokens, tokens, dumpformat.ids_hash(ids),
                                     ids, b"\1" * tokens))
    ledger.add_planned(samples, [], {})
    ledger.claim(n, NEVER)
    return samples


def ingest_all(ingestor: Ingestor, samples: list[PlannedSample]) -> list[str]:
    return [ingestor.ingest(write(ingestor.spool, s.id, s.input_ids).name).kind for s in samples]


def delalloc(path: Path) -> bool:
    """True while some of the file exists only in the page cache (ext4 allocates at write-back)."""
    return "delalloc" in subprocess.run(["filefrag", "-v", str(path)], capture_output=True,
                                        text=True, check=True).stdout


@pytest.fixture
def spool():
    folder = Path("/dev/shm") / f"eagle3d-test-{uuid.uuid4().hex[:8]}"
    folder.mkdir()
    yield folder
    subprocess.run(["rm", "-rf", str(folder)], check=False)


def mount_ext4(tmp_path: Path, backing_mb: int) -> Path:
    """A 128 MB ext4 whose blocks can hold only `backing_mb` MB; torn down by `unmount`."""
    if os.geteuid() != 0:
        pytest.skip("needs root: mounts a tmpfs and a loop device")
    backing, mount = tmp_path / "backing", tmp_path / "ext4"
    backing.mkdir()
    mount.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={backing_mb}m", "tmpfs", str(backing)],
                   check=True)
    image = backing / "disk.img"
    image.touch()
    os.truncate(image, 128 << 20)
    subprocess.run(["mkfs.ext4", "-q", "-E", "nodiscard,lazy_itable_init=1,lazy_journal_init=1",
                    str(image)], check=True)
    subprocess.run(["mount", "-o", "loop,errors=continue", str(image), str(mount)], check=True)
    return mount


def unmount(mount: Path) -> None:
    subprocess.run(["umount", str(mount)], check=False)
    subprocess.run(["umount", str(mount.parent / "backing")], check=False)


@pytest.mark.parametrize("every_bytes,every_s", [(1, float("inf")), (NEVER, 0.0)],
                         ids=["bytes", "seconds"])
def test_a_group_sync_puts_what_ingest_wrote_on_disk(tmp_path, spool, every_bytes, every_s):
    mount = mount_ext4(tmp_path, 256)
    try:
        with Ledger(tmp_path / "ledger.sqlite") as ledger:
            samples = plan(ledger, 2, 4000)
            (mount / "dataset").mkdir()
            group = GroupSync(mount / "dataset", every_bytes=NEVER, every_s=float("inf"))
            lazy = Ingestor(ledger, spool, mount / "dataset", CONTRACT, 3, group)
            assert ingest_all(lazy, samples[:1]) == ["ingested"]
            first = mount / "dataset" / ledger.sample(samples[0].id).path
            assert group.syncs == 0 and delalloc(first)  # ingest did not wait for the disk
            del lazy, group  # closes its handle, so the file system can be unmounted

            group = GroupSync(mount / "dataset", every_bytes=every_bytes, every_s=every_s)
            eager = Ingestor(ledger, spool, mount / "dataset", CONTRACT, 3, group)
            assert ingest_all(eager, samples[1:]) == ["ingested"]
            second = mount / "dataset" / ledger.sample(samples[1].id).path
            assert group.syncs == 1
            assert not delalloc(first) and not delalloc(second)  # the whole file system synced
            del eager, group
    finally:
        unmount(mount)


@pytest.mark.parametrize("backing_mb,verified", [(256, 4), (24, 0)], ids=["healthy", "thin"])
def test_verify_marks_verified_only_what_reached_the_disk(tmp_path, spool, monkeypatch, caplog,
                                                          backing_mb, verified):
    monkeypatch.setattr(verify_stage, "SYNC_RETRY_S", 0.0)
    mount = mount_ext4(tmp_path, backing_mb)
    try:
        cfg = load_config(make_config(tmp_path, {"paths": {"dataset_dir": str(mount / "dataset"),
                                                           "spool_dir": str(spool)}}))
        ledger_path = cfg.paths.state_dir / "ledger.sqlite"
        cfg.paths.state_dir.mkdir(parents=True)
        with Ledger(ledger_path) as ledger:
            samples = plan(ledger, 4, DUMP_TOKENS)  # ~32 MB: more than the thin disk holds
            cfg.paths.dataset_dir.mkdir()
            verify_sync = SyncFs(cfg.paths.dataset_dir)  # opened at start, as the daemon does
            ingestor = Ingestor(ledger, spool, cfg.paths.dataset_dir, CONTRACT, 3)
            assert ingest_all(ingestor, samples) == ["ingested"] * 4  # the page cache took it all
            with caplog.at_level(logging.ERROR, logger="eagle3d"):
                VerifyRunner(cfg, ledger_path, CONTRACT, verify_sync)._run()
            del verify_sync
            counts = ledger.counts()
            assert counts.get("verified") == verified
            assert counts.get("extracted") == 4 - verified  # kept, for a pass on a sound disk
            failures = [e for e in ledger.recent_events() if e[1] == "syncfs_failed"]
        if verified:
            assert not failures
        else:
            # EIO or ENOSPC, as the loop device passes the backing file's error on.
            assert failures and str(cfg.paths.dataset_dir) in failures[0][3]
            assert "DATASET NOT ON DISK" in caplog.text
    finally:
        unmount(mount)


def test_a_failed_group_sync_during_ingest_is_reported_and_ingest_goes_on(tmp_path, spool,
                                                                          caplog):
    mount = mount_ext4(tmp_path, 24)
    try:
        with Ledger(tmp_path / "ledger.sqlite") as ledger:
            samples = plan(ledger, 4, DUMP_TOKENS)
            (mount / "dataset").mkdir()
            # Synced once, after the fourth dump: more than the thin disk holds.
            group = GroupSync(mount / "dataset", every_bytes=30_000_000, every_s=float("inf"))
            ingestor = Ingestor(ledger, spool, mount / "dataset", CONTRACT, 3, group)
            with caplog.at_level(logging.ERROR, logger="eagle3d"):
                assert ingest_all(ingestor, samples) == ["ingested"] * 4
            assert group.syncs == 1
            assert [e[1] for e in ledger.recent_events()].count("syncfs_failed") == 1
            assert "DATASET NOT ON DISK" in caplog.text
            del ingestor, group
    finally:
        unmount(mount)
