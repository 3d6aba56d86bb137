"""Group durability on real ext4 file systems: ingest does not wait for the disk, a group sync
puts what it wrote on disk, a disk that loses writes is reported and marks nothing verified, and
once it works again verify reads from the disk, where the page cache still holds the lost bytes.

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

from eagle3d.dataset import dumpformat
from eagle3d.daemon.durability import GroupSync, SyncFs, doubt_settled, page_cache_doubt
from eagle3d.daemon.ingest import Ingestor
from eagle3d.daemon.stages import verify
from eagle3d.daemon.stages.verify import VerifyRunner
from eagle3d.statemachine.config_validation import load_config
from eagle3d.statemachine.ledger import Ledger, PlannedSample
from eagle3d.statemachine.safepath import HeldDir
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
    spool = ingestor.spool.path
    return [ingestor.ingest(write(spool, s.id, s.input_ids).name).kind for s in samples]


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
    # No journal and no lazy init: a journal write that fails aborts the file system (read-only
    # for good), and lazy init writes in the background; either would make what fails depend on
    # timing. Everything but data and a few metadata blocks is written here, at mkfs.
    subprocess.run(["mkfs.ext4", "-q", "-O", "^has_journal", "-N", "128", "-E",
                    "nodiscard,lazy_itable_init=0", str(image)], check=True)
    subprocess.run(["mount", "-o", "loop,errors=continue", str(image), str(mount)], check=True)
    return mount


def grow(mount: Path) -> None:
    """The thin pool gets room again: write-back works from now on."""
    subprocess.run(["mount", "-o", "remount,size=256m", str(mount.parent / "backing")],
                   check=True)


def unmount(mount: Path) -> None:
    # Lazy: a failed test's traceback may still hold a handle on the file system.
    subprocess.run(["umount", "--lazy", str(mount)], check=False)
    subprocess.run(["umount", "--lazy", str(mount.parent / "backing")], check=False)


@pytest.mark.parametrize("every_bytes,every_s", [(1, float("inf")), (NEVER, 0.0)],
                         ids=["bytes", "seconds"])
def test_a_group_sync_puts_what_ingest_wrote_on_disk(tmp_path, spool, every_bytes, every_s):
    mount = mount_ext4(tmp_path, 256)
    try:
        with Ledger(tmp_path / "ledger.sqlite") as ledger:
            samples = plan(ledger, 2, 4000)
            (mount / "dataset").mkdir()
            group = GroupSync(mount / "dataset", every_bytes=NEVER, every_s=float("inf"))
            lazy = Ingestor(ledger, HeldDir.open(spool), mount / "dataset", CONTRACT, 3, group)
            assert ingest_all(lazy, samples[:1]) == ["ingested"]
            first = mount / "dataset" / ledger.sample(samples[0].id).path
            assert group.syncs == 0 and delalloc(first)  # ingest did not wait for the disk
            del lazy, group  # closes its handle, so the file system can be unmounted

            group = GroupSync(mount / "dataset", every_bytes=every_bytes, every_s=every_s)
            eager = Ingestor(ledger, HeldDir.open(spool), mount / "dataset", CONTRACT, 3, group)
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
    monkeypatch.setattr(verify, "SYNC_RETRY_S", 0.0)
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
            ingestor = Ingestor(ledger, HeldDir.open(spool), cfg.paths.dataset_dir, CONTRACT, 3)
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
            ingestor = Ingestor(ledger, HeldDir.open(spool), mount / "dataset", CONTRACT, 3, group)
            with caplog.at_level(logging.ERROR, logger="eagle3d"):
                assert ingest_all(ingestor, samples) == ["ingested"] * 4
            assert group.syncs == 1
            assert [e[1] for e in ledger.recent_events()].count("syncfs_failed") == 1
            assert "DATASET NOT ON DISK" in caplog.text
            del ingestor, group
    finally:
        unmount(mount)


@pytest.mark.parametrize("reason", ["failed sync", "unclean stop"])
def test_after_a_lost_write_back_verify_reads_the_disk_not_the_page_cache(tmp_path, spool,
                                                                         monkeypatch, caplog,
                                                                         reason):
    monkeypatch.setattr(verify, "SYNC_RETRY_S", 0.0)
    mount = mount_ext4(tmp_path, 20)  # two dumps and half of a third
    try:
        cfg = load_config(make_config(tmp_path, {"paths": {"dataset_dir": str(mount / "dataset"),
                                                           "spool_dir": str(spool)}}))
        dataset, ledger_path = cfg.paths.dataset_dir, cfg.paths.state_dir / "ledger.sqlite"
        cfg.paths.state_dir.mkdir(parents=True)
        with Ledger(ledger_path) as ledger:
            samples = plan(ledger, 4, DUMP_TOKENS)
            dataset.mkdir()
            ledger.event("daemon_started", "pid 100")
            verify_sync = SyncFs(dataset)
            group = GroupSync(dataset, every_bytes=NEVER, every_s=float("inf"))
            ingestor = Ingestor(ledger, HeldDir.open(spool), dataset, CONTRACT, 3, group)
            assert ingest_all(ingestor, samples[:2]) == ["ingested"] * 2
            assert group.flush(ledger)  # these two are on the disk
            assert ingest_all(ingestor, samples[2:]) == ["ingested"] * 2  # more than it holds
            if reason == "failed sync":
                VerifyRunner(cfg, ledger_path, CONTRACT, verify_sync)._run()
                assert ledger.counts().get("extracted") == 4  # none verified
                assert "syncfs_failed" in [e[1] for e in ledger.recent_events()]
            else:
                # The daemon dies; another program's syncfs meets the write-back error, so the
                # handles of the next daemon, opened after that, are never told of it.
                del verify_sync, group, ingestor
                assert subprocess.run(["sync", "-f", str(dataset)]).returncode != 0
                verify_sync = SyncFs(dataset)
                ledger.event("daemon_started", "pid 200")
            grow(mount)
            with caplog.at_level(logging.WARNING, logger="eagle3d"):
                # On a busy machine the kernel may still be writing back (and failing) when the
                # disk grows, so a sync can fail once more: the daemon retries, so does the test.
                for _ in range(10):
                    VerifyRunner(cfg, ledger_path, CONTRACT, verify_sync)._run()
                    if not ledger.counts().get("extracted"):
                        break
            del verify_sync
            assert [ledger.sample(s.id).status for s in samples] == \
                ["verified", "verified", "pending", "pending"]
            # The disk holds zeros where the lost bytes should be: the checksum or, when they
            # include the header, the header check fails.
            assert all(ledger.sample(s.id).error.startswith("verify: ") for s in samples[2:])
            assert page_cache_doubt(ledger)[0] is None  # settled: the next pass trusts the cache
        why = {"failed sync": "1 dataset sync(s) failed", "unclean stop": "pid 100"}[reason]
        assert "verify reads 4 files from the disk" in caplog.text and why in caplog.text
    finally:
        unmount(mount)


def test_the_page_cache_is_doubted_only_until_a_pass_has_read_from_the_disk(tmp_path):
    with Ledger(tmp_path / "ledger.sqlite") as ledger:
        def doubt() -> str | None:
            return page_cache_doubt(ledger)[0]

        def settle() -> None:
            doubt_settled(ledger, page_cache_doubt(ledger)[1])

        assert doubt() is None  # a new ledger
        for life in (1, 2):  # a clean restart is no reason
            ledger.event("daemon_started", f"pid {life}")
            ledger.event("verified", "", "a" * 32)
            assert doubt() is None
            settle()
            ledger.event("daemon_stopped", f"pid {life}")
        ledger.event("daemon_started", "pid 3")
        assert doubt() is None
        settle()
        ledger.event("daemon_started", "pid 4")  # pid 3 crashed
        assert "pid 3" in doubt()
        ledger.event("verified", "", "a" * 32)
        assert "pid 3" in doubt()  # until a pass settles it
        settle()
        assert doubt() is None
        ledger.event("syncfs_failed", "/data: Input/output error")
        assert "Input/output error" in doubt()
        settle()
        assert doubt() is None
