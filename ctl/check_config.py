"""`eagle3ctl check-config`: whether the operator's file validates, and what the daemon would do
with it (applied live on reload, a switch of runs, a restart, refused), each with its exit code.
It reads weights and disks, so nothing here is on status's path."""

from __future__ import annotations

import sys
from pathlib import Path

from eagle3d.ctl.exit_codes import BAD_CONFIG, NEEDS_RESTART_CODE, RELOAD_REFUSED
from eagle3d.statemachine import layout, pointer
from eagle3d.statemachine.config_schema import Config, tables
from eagle3d.statemachine.config_validation import ConfigError, load_config
from eagle3d.statemachine.ledger import Ledger

def changed_keys(old: Config, new: Config) -> list[str]:
    """`[section] key` of every setting that differs, for the operator to read (which of them a
    reload takes is reload_policy.reload_verdict's to say)."""
    before = tables(old)
    return [f"[{section}] {key}" for section, keys in tables(new).items()
            for key, value in keys.items() if before.get(section, {}).get(key) != value]


def what_a_reload_does(new: Config) -> tuple[int, str]:
    """(exit code, one line) for what the daemon would do with `new`: a running daemon's
    reload, judged as the reload judges it (run_select.judge_reload), or a start. A config of
    another capture contract is another run: a reload or a start resumes the run of that
    contract, or starts one."""
    # These read MiBs of weights and the disks: not status's path.
    from eagle3d.daemon import run_select
    from eagle3d.statemachine import runs
    from eagle3d.statemachine.config_schema import PathsConfig
    from eagle3d.statemachine.reload_policy import NEEDS_RESTART

    running = pointer.read(new.path)
    if not running:
        weights = run_select.weights_of(new)
        registry = runs.read(new.paths.state_dir)
        from eagle3d.dataset import contract
        # The first run lives in the configured folders: a dataset already there binds it.
        doc = None if registry.runs else contract.read(new.paths.dataset_dir)
        problem = (run_select.sharded_switch_problem(new, weights) or
                   doc and contract.config_problem(doc, new, weights))
        if problem:
            return RELOAD_REFUSED, f"refused: the daemon would not start on it: {problem}"
        return 0, f"no daemon runs for this file: a start {_run_words(new, weights)}"
    old = load_config(running["in_force"])
    # What the daemon holds: the config in force on the configured roots its runs live under.
    root = old._replace(paths=PathsConfig(**{k: Path(v) for k, v in running["roots"].items()}))
    registry = runs.read(root.paths.state_dir)
    current = next(r for r in registry.runs.values() if r.state_dir == old.paths.state_dir)
    with Ledger(layout.ledger(old.paths.state_dir), readonly=True, timeout=2.0) as ledger:
        verdict = run_select.judge_reload(root, current, new, ledger.counts())
    if verdict.kind == run_select.SWITCH:
        return 0, (f"switches runs on reload (systemctl reload eagle3d): sets {current.id} "
                   f"aside and {_run_words(new, verdict.weights)}")
    keys = changed_keys(root, new)
    if verdict.kind != run_select.LIVE:
        code = NEEDS_RESTART_CODE if verdict.kind == NEEDS_RESTART else RELOAD_REFUSED
        return code, (f"{verdict.kind}: {verdict.why} (running daemon pid {running['pid']}; the "
                      f"edit changes {', '.join(keys)})")
    if not keys:
        return 0, f"no change from the config in force ({running['in_force']})"
    # A checkpoint is of one manifest: a grown one is trained again, from its first step.
    grown = ("; [data] limit raised: the new samples are extracted and the drafter retrains "
             "from step 0" if new.data.limit > root.data.limit else "")
    return 0, "applied live on reload (systemctl reload eagle3d): " + ", ".join(keys) + grown


def _run_words(new: Config, weights: str) -> str:
    from eagle3d.statemachine import runs
    wanted = runs.find(new, weights)
    return (f"resumes run {wanted.id}" if wanted else
            f"starts a new run {runs.run_key(new.contract_keys(), weights)}")


def cmd_check_config(cfg: Config) -> int:
    print(f"{cfg.path}: valid ({cfg.target.engine} engine, target {cfg.target.model}, "
          f"{cfg.data.limit} conversations from {cfg.data.source})")
    from eagle3d.daemon import budgets  # psutil: not on status's path
    never = budgets.never_met(cfg)
    if never:
        print(f"eagle3ctl: {never}", file=sys.stderr)
        return BAD_CONFIG
    from eagle3d.dataset import readrate  # reads files: not on status's path
    slow = readrate.check(cfg.paths.dataset_dir, cfg.train.nproc)
    if slow:
        print(f"warning: {slow}")
    try:
        code, verdict = what_a_reload_does(cfg)
    except ConfigError as exc:  # the config in force itself, edited by hand
        code, verdict = BAD_CONFIG, str(exc)
    print(verdict, file=sys.stdout if code == 0 else sys.stderr)
    return code
