"""Extraction end to end with the real daemon, the real SmolLM2 engine and real files: exact
counts, tensors equal to an independent forward, a killed engine and a full disk survived."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
import uuid
from pathlib import Path

import numpy as np
import pytest
import torch

from eagle3d.statemachine import manifest
from eagle3d.statemachine.config_validation import load_config
from eagle3d.statemachine.ledger import Ledger
from eagle3d.statemachine.safepath import HeldDir
from tests.conftest import write_conversations
from tests.pipeline import DaemonProcess, fill_file_system, run_until, status

pytestmark = pytest.mark.slow


def small_config(config_factory, tmp_path: Path, n: int = 10, **sections) -> Path:
    source = write_conversations(tmp_path / "conv.jsonl", n)
    merged = {"data": {"source": str(source), "format": "messages", "limit": n}}
    for k, v in sections.items():
        merged.setdefault(k, {}).update(v)
    return config_factory(merged)


def bf16_to_f32(raw: torch.Tensor) -> np.ndarray:
    return raw.float().numpy()


def test_every_sample_extracted_once_and_equal_to_an_independent_forward(config_factory, tmp_path):
    config = small_config(config_factory, tmp_path, verify={"spot_checks": 2})
    out = run_until(config, "train")
    assert "spot check passed" in out
    st = status(config)
    assert st["samples"]["verified"] == st["samples"]["total"] == 10
    assert st["tokens"]["done"] == st["tokens"]["total"] > 0
    cfg = load_config(config)
    with Ledger(cfg.paths.state_dir / "ledger.sqlite", readonly=True) as ledger:
        manifest.check(manifest.read(cfg.paths.dataset_dir), ledger)
        rows = ledger.samples("verified")
        files = sorted(cfg.paths.dataset_dir.rglob("*.safetensors"))
        assert len(files) == 10 and all(not p.name.startswith(".") for p in files)
        assert not [p for p in Path(cfg.paths.spool_dir).iterdir() if p.name != "rejected"]

        from safetensors.torch import load_file

        from eagle3d.target.loading import load_model
        model = load_model(cfg.target.model_path, cfg.target.dtype, "cpu")
        for row in rows[:3]:
            dump = load_file(str(cfg.paths.dataset_dir / row.path))
            ids = dump["input_ids"].long()[None]
            assert ids.shape[1] == row.tokens
            with torch.no_grad():
                ref = model.model(ids, output_hidden_states=True).hidden_states
            aux = torch.cat([ref[i] for i in (2, 15, 27)], dim=-1)[0]
            for got, want in ((dump["aux_hidden_states"], aux), (dump["last_hidden_state"], ref[-1][0])):
                rel = (got.float() - want.float()).norm() / want.float().norm()
                assert rel < 0.02, f"{row.id}: relative error {rel:.4f}"
            planned = dump["loss_mask"].sum().item()
            assert planned == row.loss_tokens


def test_engine_killed_mid_batch_loses_nothing(config_factory, tmp_path):
    config = config_factory({"data": {"limit": 40, "max_tokens": 600},
                             "extract": {"batch_tokens": 1024, "max_inflight_tokens": 2048},
                             "verify": {"spot_checks": 0}})
    with DaemonProcess(config, "--until", "train") as d:
        st = d.status_until(lambda s: s["engine"].get("status") == "ready"
                            and s["samples"]["inflight"] > 0 and s["samples"]["extracted"] >= 1,
                            300, "the engine mid-extraction")
        os.killpg(st["engine"]["pid"], signal.SIGKILL)
        assert d.wait(600) == 0, d.output()[-4000:]
        out = d.output()
    st = status(config)
    assert st["engine"]["restarts"] >= 1 or "the engine exited" in out
    assert st["samples"]["verified"] == st["samples"]["total"] > 0
    assert st["samples"]["failed"] == 0


@pytest.fixture
def small_tmpfs(tmpfs):
    return tmpfs("small-disk", "24m")


def small_disk_config(config_factory, tmp_path: Path, small_tmpfs: Path) -> Path:
    """30 samples whose dataset lies on the small tmpfs, dispatched a few at a time."""
    return small_config(config_factory, tmp_path, n=30,
                        paths={"dataset_dir": str(small_tmpfs / "dataset")},
                        budget={"reserve": "2MiB"}, verify={"spot_checks": 0},
                        extract={"max_inflight_tokens": 1024, "batch_tokens": 512})


def first_samples(d: DaemonProcess) -> None:
    d.status_until(lambda s: s["samples"]["extracted"] + s["samples"]["verified"] >= 3, 300,
                   "the first samples")


def test_full_dataset_disk_pauses_then_finishes_after_space_is_freed(config_factory, tmp_path,
                                                                     small_tmpfs):
    config = small_disk_config(config_factory, tmp_path, small_tmpfs)
    with DaemonProcess(config, "--until", "train") as d:
        first_samples(d)
        # Someone else fills the disk: the run must pause with the figures, lose nothing.
        fill_file_system(small_tmpfs)
        st = d.status_until(lambda s: s["stage"] == "paused", 120, "a disk-budget pause")
        assert "dataset file system" in st["reason"]
        done_before = st["samples"]["extracted"] + st["samples"]["verified"]
        (small_tmpfs / "ballast").unlink()
        assert d.wait(600) == 0, d.output()[-4000:]
    st = status(config)
    assert st["samples"]["verified"] == st["samples"]["total"] == 30
    assert done_before < 30
    cfg = load_config(config)
    for p in cfg.paths.dataset_dir.rglob("*"):
        assert not p.name.startswith("."), f"partial file left: {p}"


def test_a_read_only_dataset_disk_pauses_without_charging_attempts(config_factory, tmp_path,
                                                                  small_tmpfs):
    """A dataset disk that turns read-only after an error (the kernel's errors=remount-ro):
    ingest cannot write, dispatch pauses as for a full disk, and no sample is charged for it;
    once it is writable again the run finishes."""
    config = small_disk_config(config_factory, tmp_path, small_tmpfs)
    with DaemonProcess(config, "--until", "train") as d:
        first_samples(d)
        subprocess.run(["mount", "-o", "remount,ro", str(small_tmpfs)], check=True)
        try:
            st = d.status_until(lambda s: s["stage"] == "paused", 120, "a read-only pause")
            assert "read-only" in st["reason"] and st["paused_by"] == "budget", st["reason"]
            time.sleep(10)  # paused, not burning attempts: nothing fails meanwhile
            assert status(config)["samples"]["failed"] == 0
        finally:
            subprocess.run(["mount", "-o", "remount,rw", str(small_tmpfs)], check=True)
        assert d.wait(600) == 0, d.output()[-4000:]
    st = status(config)
    assert st["samples"]["verified"] == st["samples"]["total"] == 30
    with Ledger(load_config(config).paths.state_dir / "ledger.sqlite", readonly=True) as ledger:
        charged = {s.id: s.attempts for s in ledger.iter_samples("verified") if s.attempts != 1}
    assert not charged, f"attempts charged for a read-only disk: {charged}"


def test_full_dataset_disk_mid_copy_leaves_the_dump_in_the_spool(tmp_path, small_tmpfs):
    """ENOSPC inside a copy: no partial file in the dataset, the dump stays to be ingested."""
    from eagle3d.daemon.ingest import DiskUnwritable, Ingestor
    from eagle3d.statemachine.ledger import PlannedSample
    from tests.test_ingest import CONTRACT, sample_ids, write
    spool = Path("/dev/shm") / f"eagle3d-test-{uuid.uuid4().hex[:8]}"
    spool.mkdir()
    try:
        ledger = Ledger(tmp_path / "l.sqlite")
        tokens = 40_000  # ~6 MB of bf16 at hidden 16: larger than what is left on the disk
        ids = sample_ids(0, tokens)
        from eagle3d.dataset.dumpformat import ids_hash
        ledger.add_planned([PlannedSample("a" * 32, 0, tokens, tokens, ids_hash(ids), ids, b"")],
                           [], {})
        ledger.claim(1, 10**9)
        path = write(spool, "a" * 32, ids)
        (small_tmpfs / "fill").write_bytes(b"\0" * (20 << 20))
        ing = Ingestor(ledger, HeldDir.open(spool), small_tmpfs / "dataset", CONTRACT, 3)
        with pytest.raises(DiskUnwritable):
            ing.ingest(path.name)
        assert path.exists()
        assert not [p for p in (small_tmpfs / "dataset").rglob("*") if p.is_file()]
        assert ledger.sample("a" * 32).status == "inflight"
        (small_tmpfs / "fill").unlink()
        assert ing.ingest(path.name).kind == "ingested"
        ledger.close()
    finally:
        shutil.rmtree(spool, ignore_errors=True)
