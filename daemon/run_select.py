"""Which run the daemon works on: the run whose capture contract the config's (with its target's
weights) matches, resumed, or a new one (statemachine/runs.py keeps the registry)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, NamedTuple

from eagle3d.daemon import budgets
from eagle3d.dataset import contract as capture_contract
from eagle3d.statemachine import layout, runs
from eagle3d.statemachine.config_schema import Config
from eagle3d.statemachine.config_validation import ConfigError, load_config
from eagle3d.statemachine.reload_policy import REFUSED, reload_verdict
from eagle3d.statemachine.ledger import Counts
from eagle3d.target import loading


def weights_of(cfg: Config) -> str:
    """The target's weights fingerprint, part of a run's key: other weights under the same model
    name are another run."""
    path = Path(cfg.target.model_path)
    return loading.fingerprint_file_or_folder(path) if path.exists() else ""


def in_place_contract(cfg: Config) -> tuple[dict[str, Any], str] | None:
    """The contract keys and weights of a pipeline written in the configured folders before runs
    existed, read from the config in force it left there and its capture contract; None where
    there is a registry already, or nothing was written."""
    root = cfg.paths.state_dir
    in_force = layout.config_in_force(root)
    if layout.runs_registry(root).exists() or not layout.ledger(root).exists() \
            or not in_force.is_file():
        return None
    try:
        before = load_config(in_force)
    except ConfigError:
        return None  # unreadable: the folders are the configured run's, the contract check judges
    doc = capture_contract.read(cfg.paths.dataset_dir)
    weights = doc.get("target_fingerprint", "") if doc else weights_of(before)
    return before.contract_keys(), weights


# A shard's folders, and the gate's and status's view of the others, are `shard-i-of-N` under
# the configured roots: a further run's `runs/<run>/` inside them is not yet laid out for that.
SHARDED_RUNS = ("a sharded extraction keeps one run per set of roots: point [paths] at new "
                "roots for another target (on every node), or put the edited keys back")


def sharded_switch_problem(cfg: Config, weights: str) -> str | None:
    """Why `cfg` may not move a sharded node to a run other than the one in its folders."""
    if cfg.data.shards == 1:
        return None
    registry = runs.read(cfg.paths.state_dir)
    found = runs.find(cfg, weights)
    if not registry.runs or (found is not None and found.in_place):
        return None
    return f"{cfg.path}: {SHARDED_RUNS}"


LIVE, SWITCH = "applied live", "switches runs"


class Verdict(NamedTuple):
    kind: str  # LIVE, SWITCH, or config.NEEDS_RESTART or REFUSED with `why`
    why: str = ""
    weights: str = ""  # the new config's target weights fingerprint, once read


def judge_reload(root: Config, current: runs.Run, new: Config, counts: Counts) -> Verdict:
    """What a reload does with `new`, for a daemon holding `root` (the configured roots) on
    `current` with the ledger's `counts`: the one judgement of the reload and of check-config."""
    verdict = reload_verdict(root, new)
    if verdict is not None:
        return Verdict(*verdict)
    never = budgets.never_met(new)
    if never:  # refused by check-config and at a start too: never a pause for good
        return Verdict(REFUSED, never)
    weights = weights_of(new)
    if runs.run_key(new.contract_keys(), weights) == current.key:
        return Verdict(LIVE, weights=weights)
    problem = (sharded_switch_problem(new, weights) or
               new_run_problem(runs.run_config(root, current), counts, new, weights))
    return Verdict(REFUSED, problem, weights) if problem else Verdict(SWITCH, weights=weights)


def new_run_problem(cfg: Config, counts: Counts, new: Config, weights: str) -> str | None:
    """Why a switch from the run of `cfg` to a new run must be refused: its bytes per sample,
    times the new run's samples, do not fit the dataset disk. A run to resume is always taken."""
    if runs.find(new, weights) is not None:
        return None
    done = counts.get("extracted") + counts.get("verified")
    if not done:
        return None
    projected = sum(counts.bytes.values()) // done * new.data.limit
    free = budgets.disks(cfg)[0].free
    return budgets.projection_pause(new, free, projected)


def select(cfg: Config, weights: str | None = None) -> runs.Selected:
    """Make the run of `cfg` (configured roots) current."""
    weights = weights_of(cfg) if weights is None else weights
    problem = sharded_switch_problem(cfg, weights)
    if problem:
        raise ConfigError(problem)
    return runs.select(cfg, weights, in_place_contract(cfg))
