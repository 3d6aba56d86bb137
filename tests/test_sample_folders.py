"""The dataset's folders of 1,000 samples are `samples-NNNNN/`; `shard` means a node's share
(`shard-i-of-N/`) only. A dataset an earlier install wrote, in `shard-NNNNN/` folders, is read as
before: debris removal, the read-rate probe, verify and the trainer find its samples."""

from __future__ import annotations

import sqlite3

import pytest

from eagle3d.daemon.ingest import remove_dataset_debris
from eagle3d.dataset import readrate
from eagle3d.statemachine import layout, train_files
from eagle3d.statemachine.config_validation import load_config
from eagle3d.statemachine.ledger import Ledger
from tests.pipeline import DaemonProcess, ctl, run_until, status


def test_new_samples_go_to_samples_folders_and_earlier_shard_folders_still_count(tmp_path):
    assert layout.sample_folder(41_999) == "samples-00041"
    for name in ("samples-00000", "samples-100000", "shard-00001", "shard-1-of-3", "shard-0000",
                 "samples-x"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "a.safetensors").write_bytes(b"x")
        (tmp_path / name / ".a.safetensors.tmp").write_bytes(b"partial")
    (tmp_path / "samples-00002").write_bytes(b"a file, not a folder")
    found = sorted(p.name for p in layout.sample_folders(tmp_path))
    assert found == ["samples-00000", "samples-100000", "shard-00001"]
    assert sorted(p.parent.name for p in readrate.dumps(tmp_path)) == found
    with Ledger(tmp_path / "ledger.sqlite") as ledger:
        assert len(remove_dataset_debris(tmp_path, ledger)) == 2 * len(found)
    assert (tmp_path / "shard-1-of-3" / ".a.safetensors.tmp").exists()  # a node's, left alone


@pytest.mark.slow
def test_a_dataset_in_an_earlier_installs_shard_folders_verifies_and_trains(config_factory,
                                                                             tmp_path):
    """Extracted as today (samples-NNNNN), then turned into what an earlier install left (its
    folders `shard-NNNNN`, the ledger's paths with them): the daemon verifies and trains it."""
    from tests.chaos.harness import chaos_config
    config = chaos_config(config_factory, tmp_path, 6)
    run_until(config, "verify")
    cfg = load_config(config)
    dataset = cfg.paths.dataset_dir
    assert [p.name for p in layout.sample_folders(dataset)] == ["samples-00000"]
    (dataset / "samples-00000").rename(dataset / "shard-00000")
    with sqlite3.connect(layout.ledger(cfg.paths.state_dir)) as db:
        db.execute("UPDATE samples SET path = replace(path, 'samples-', 'shard-')")

    with DaemonProcess(config, "--until", "done") as d:
        assert d.wait(900) == 0, d.output()[-4000:]
    with Ledger(layout.ledger(cfg.paths.state_dir), readonly=True) as ledger:
        rows = ledger.samples("verified")
    assert len(rows) == 6 and all(r.path.startswith("shard-00000/") for r in rows)
    assert [p.name for p in layout.sample_folders(dataset)] == ["shard-00000"]
    assert train_files.read_done(cfg.paths.train_dir) is not None
    assert status(config)["samples"]["verified"] == 6
    assert ctl(config, "status").returncode == 3  # the daemon has finished
