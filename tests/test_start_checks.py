"""What the daemon checks before any child starts: its folders, the dataset's capture contract
and the config in force that children read."""

from __future__ import annotations

import pytest

from eagle3d.daemon.reconcile import prepare_dirs
from eagle3d.statemachine.config import ConfigError, load_config


@pytest.mark.parametrize("bits, who", [(0o020, "group"), (0o002, "everyone")])
def test_a_state_folder_others_can_write_is_refused(config_factory, bits, who):
    cfg = load_config(config_factory())
    prepare_dirs(cfg)  # created 0o750 / 0o700 under any umask: accepted
    for folder in (cfg.paths.state_dir, cfg.paths.dataset_dir):
        folder.chmod(folder.stat().st_mode | bits)
        with pytest.raises(ConfigError, match=f"{folder} is writable by its group or by "
                                              f"everyone; run chmod go-w {folder}"):
            prepare_dirs(cfg)
        folder.chmod(0o750)
    prepare_dirs(cfg)
