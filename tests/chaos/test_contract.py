"""A restart under an edited capture contract: the daemon killed while it extracts, the [target]
dtype edited, the daemon restarted. It must block with the reason, start no engine and capture
nothing under the edit; with the edit undone it finishes the dataset, nothing lost."""

from __future__ import annotations

import time

import pytest

from eagle3d.dataset import contract as capture_contract, dumpformat
from eagle3d.statemachine import layout
from eagle3d.statemachine.config import load_config
from eagle3d.statemachine.ledger import Ledger
from tests.chaos.figures import SCALE
from tests.chaos.harness import (audit, chaos_config, counts, describe, end, kill9, last_event,
                                 life_child, life_state, orphans_after_kill, until)
from tests.pipeline import DaemonProcess, edit_config

pytestmark = [pytest.mark.slow, pytest.mark.chaos]


def extracted_after(cfg, seq: int) -> set[str]:
    with Ledger(layout.ledger(cfg.paths.state_dir), readonly=True) as ledger:
        return {sid for sid, in ledger.db.execute(
            "SELECT sample FROM events WHERE kind = 'extracted' AND seq > ?", (seq,))}


def test_a_restart_with_an_edited_contract_blocks_and_captures_nothing(config_factory, tmp_path,
                                                                       figures):
    n = 6 * SCALE
    config = chaos_config(config_factory, tmp_path, n)
    cfg = load_config(config)
    contract_file = layout.contract_file(cfg.paths.dataset_dir)
    with DaemonProcess(config) as d:
        until(d, lambda: counts(cfg).get("extracted", 0) + counts(cfg).get("verified", 0) >= 1,
              300, "the first extracted sample")
        kill9(d)
    left = orphans_after_kill(config)
    end(left)
    assert not left, f"children outlived the daemon: {describe(left)}"
    figures.crashes += 1
    before = capture_contract.read(cfg.paths.dataset_dir)
    # Whole dumps the killed engine left in the spool were captured under the contract: ingesting
    # them is right. Nothing else may be.
    leftover = {p.name[:-len(dumpformat.SUFFIX)] for p in cfg.paths.spool_dir.iterdir()
                if p.name.endswith(dumpformat.SUFFIX) and not p.name.startswith(".")}
    restart = last_event(cfg)

    edit_config(config, "target", dtype="bfloat16")
    with DaemonProcess(config) as d:
        st = until(d, lambda: (lambda s: s if s.get("stage") == "failed" else None)(
            life_state(cfg, d)), 120, "the block")
        assert "[target] dtype is 'bfloat16', the contract says 'float32'" in st["reason"], st
        assert str(contract_file) in st["reason"] and str(config) in st["reason"], st
        time.sleep(3.0)  # a dozen ticks: nothing may start
        for child in ("engine", "planner", "generator", "trainer"):
            assert life_child(cfg, d, child) is None, f"a {child} started under the edit"
        assert d.stop() == 0
    stray = extracted_after(cfg, restart) - leftover
    assert not stray, f"samples captured under the edited config: {sorted(stray)}"
    assert capture_contract.read(cfg.paths.dataset_dir) == before
    figures.faults += 1

    edit_config(config, "target", dtype="float32")  # undone: the dataset goes on
    with DaemonProcess(config, "--until", "train") as d:
        assert d.wait(600) == 0, d.output()[-4000:]
    assert figures.audited(audit(config, n, trained=False)) == 0
