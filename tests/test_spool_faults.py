"""The spool's faults with the real daemon and the real engine: the folder removed under it."""

from __future__ import annotations

import shutil
import stat

import pytest

from eagle3d.statemachine import layout
from eagle3d.statemachine.config_validation import load_config
from eagle3d.statemachine.ledger import Ledger
from tests.pipeline import DaemonProcess, status

pytestmark = pytest.mark.slow


def test_a_spool_removed_under_the_daemon_is_made_again_and_no_attempt_is_charged(
        config_factory):
    config = config_factory({"data": {"limit": 40, "max_tokens": 600},
                             "extract": {"batch_tokens": 1024, "max_inflight_tokens": 2048},
                             "verify": {"spot_checks": 0}})
    cfg = load_config(config)
    with DaemonProcess(config, "--until", "train") as d:
        d.status_until(lambda s: s["engine"].get("status") == "ready"
                       and s["samples"]["inflight"] > 0 and s["samples"]["extracted"] >= 1,
                       300, "the engine mid-extraction")
        shutil.rmtree(cfg.paths.spool_dir)  # a cleanup script's rm -rf /dev/shm/eagle3d*
        assert d.wait(600) == 0, d.output()[-4000:]
    st = status(config)
    assert st["samples"]["verified"] == st["samples"]["total"] > 0
    assert st["samples"]["failed"] == 0
    mode = cfg.paths.spool_dir.lstat().st_mode
    assert stat.S_ISDIR(mode) and stat.S_IMODE(mode) == 0o700
    with Ledger(layout.ledger(cfg.paths.state_dir), readonly=True) as ledger:
        assert {s.attempts for s in ledger.samples("verified")} == {1}
        assert not ledger.events_of(("attempt_failed", "failed"))
        assert ledger.events_of(("spool_recreated",))
