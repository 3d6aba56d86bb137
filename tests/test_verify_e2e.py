"""Verify and the training gate with the real daemon: every kind of damage to the dataset is
caught, named, re-extracted, and the run reaches train; a sample that keeps failing blocks the
gate until an operator excludes it with a reason."""

from __future__ import annotations

import os
import struct
import time

import pytest
import tomli_w

from eagle3d.dataset.dumpformat import read_header
from eagle3d.daemon import control
from eagle3d.statemachine import manifest, train_files
from eagle3d.statemachine.config_validation import load_config
from eagle3d.statemachine.ledger import Ledger
from tests.conftest import write_conversations
from tests.pipeline import DaemonProcess, ctl, run_until, status

pytestmark = pytest.mark.slow


def corrupt(path, how: str, other=None) -> None:
    if how == "delete":
        path.unlink()
    elif how == "flip":
        with open(path, "r+b") as f:
            f.seek(path.stat().st_size - 100)
            b = f.read(1)
            f.seek(-1, 1)
            f.write(bytes([b[0] ^ 0x40]))
    elif how == "truncate":
        os.truncate(path, path.stat().st_size // 2)
    elif how == "swap":
        tmp = path.with_name("swap.tmp")
        os.rename(path, tmp)
        os.rename(other, path)
        os.rename(tmp, other)
    elif how == "nan":
        info = read_header(path).tensors["aux_hidden_states"]
        with open(path, "r+b") as f:
            f.seek(info.begin + 2 * 7)
            f.write(struct.pack("<H", 0x7FC0))  # a bf16 NaN
    elif how == "contract":
        data = path.read_bytes()
        (n,) = struct.unpack("<Q", data[:8])
        header = data[8:8 + n].decode()
        start = header.index('"contract":"') + len('"contract":"')
        forged = header[:start] + "0" * 32 + header[start + 32:]
        path.write_bytes(data[:8] + forged.encode() + data[8 + n:])


def set_key(config, section, **values):
    import tomllib
    doc = tomllib.loads(config.read_text())
    doc.setdefault(section, {}).update(values)
    config.write_text(tomli_w.dumps(doc))


def test_damage_is_caught_reextracted_and_a_stubborn_sample_blocks_the_gate(config_factory,
                                                                              tmp_path):
    source = write_conversations(tmp_path / "conv.jsonl", 10)
    config = config_factory({"data": {"source": str(source), "format": "messages", "limit": 10},
                             "verify": {"spot_checks": 0}})
    run_until(config, "train")
    cfg = load_config(config)
    with Ledger(cfg.paths.state_dir / "ledger.sqlite", readonly=True) as ledger:
        rows = ledger.samples("verified")
    paths = [cfg.paths.dataset_dir / r.path for r in rows]
    damage = {"delete": 0, "flip": 1, "truncate": 2, "swap": 3, "nan": 5, "contract": 6}
    for how, i in damage.items():
        corrupt(paths[i], how, other=paths[4] if how == "swap" else None)
    damaged = {rows[i].id for i in damage.values()} | {rows[4].id}

    # Asked before the daemon starts: with everything verified it would reach train at once.
    control.submit(cfg.paths.state_dir, "verify-full", {})
    with DaemonProcess(config, "--until", "train") as d:
        assert d.wait(600) == 0, d.output()[-4000:]
    with Ledger(cfg.paths.state_dir / "ledger.sqlite", readonly=True) as ledger:
        failures = {sample: detail for _, kind, sample, detail in ledger.recent_events(500)
                    if kind == "attempt_failed"}
        assert set(failures) == damaged, failures
        reasons = " | ".join(failures.values())
        for word in ("missing", "checksum", "NaN", "sample id in file"):
            assert word in reasons, reasons
        assert all(ledger.sample(s).attempts == 2 for s in damaged)
        manifest.check(manifest.read(cfg.paths.dataset_dir), ledger)
    st = status(config)
    assert st["samples"]["verified"] == 10 and st["samples"]["failed"] == 0

    # One sample that keeps failing (no attempts left) blocks the gate: no training until an
    # operator excludes it with a written reason.
    set_key(config, "extract", max_attempts=1)
    corrupt(paths[8], "flip")
    stubborn = rows[8].id
    control.submit(cfg.paths.state_dir, "verify-full", {})
    with DaemonProcess(config, "--until", "train") as d:
        st = d.status_until(lambda s: s["samples"]["failed"] == 1 and
                            s["samples"]["extracted"] == 0 and s["samples"]["verified"] == 9
                            and "gate" in s["reason"], 300, "the failed sample")
        assert st["stage"] == "verify" and "gate" in st["reason"]
        assert st["blocking"][0]["id"] == stubborn and "checksum" in st["blocking"][0]["error"]
        waiting = ctl(config, "status")
        assert waiting.returncode == 4 and "1 failed" in waiting.stdout
        time.sleep(3)
        assert d.proc.poll() is None and status(config)["stage"] == "verify"
        assert stubborn in ctl(config, "samples", "--status", "failed").stdout
        refused = ctl(config, "exclude", stubborn, "--reason", " ")
        assert refused.returncode != 0
        assert ctl(config, "exclude", stubborn, "--reason", "corrupt source record").returncode == 0
        assert d.wait(300) == 0, d.output()[-4000:]
    st = status(config)
    assert st["samples"]["excluded"] == 1 and st["samples"]["verified"] == 9
    assert len(manifest.read(cfg.paths.dataset_dir)["samples"]) == 9


def test_a_bit_flipped_after_verify_is_refused_by_the_trainer_sent_back_and_trained_once_mended(
        config_factory, tmp_path):
    """Bit rot in a verified dump (its size and time unchanged, so only its checksum can tell):
    the real trainer refuses it as it reads it, naming the file; the daemon sends the sample
    back to verify, which finds the checksum wrong and has it extracted again; then the run
    trains and reaches done, the sample verified once more."""
    from tests.chaos.harness import chaos_config
    config = chaos_config(config_factory, tmp_path, 6)
    run_until(config, "train")
    cfg = load_config(config)
    with Ledger(cfg.paths.state_dir / "ledger.sqlite", readonly=True) as ledger:
        rot = ledger.samples("verified")[2]
    path = cfg.paths.dataset_dir / rot.path
    st = path.stat()
    corrupt(path, "flip")
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))

    with DaemonProcess(config, "--until", "done") as d:
        assert d.wait(900) == 0, d.output()[-4000:]
    with Ledger(cfg.paths.state_dir / "ledger.sqlite", readonly=True) as ledger:
        events = [(kind, detail) for _, kind, sample, detail in ledger.recent_events(500)
                  if sample == rot.id]
        sent_back = [detail for kind, detail in events if kind == "unverified"]
        assert len(sent_back) == 1 and str(path) in sent_back[0], events
        assert "changed since verify passed it" in sent_back[0]
        failed = [detail for kind, detail in events if kind == "attempt_failed"]
        assert len(failed) == 1 and "checksum mismatch" in failed[0], events
        assert ledger.sample(rot.id).status == "verified"
        manifest.check(manifest.read(cfg.paths.dataset_dir), ledger)
    done = train_files.read_done(cfg.paths.train_dir)
    assert done["manifest_fingerprint"] == manifest.read(cfg.paths.dataset_dir)["fingerprint"]
    assert status(config)["samples"]["verified"] == 6
