"""Where every file of eagle3d lives: the one module that spells a file or folder name.

Four folders, each from `[paths]`: the state folder (the daemon's own), the spool (tmpfs, the
engine's dumps), the dataset and the train folder. A module that reads or writes one of these
files asks here for its path; the formats are owned by the modules named beside each name.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from pathlib import Path

# ---- the state folder ---------------------------------------------------------------------------


def ledger(state_dir: Path) -> Path:
    """One row per sample (statemachine/ledger.py)."""
    return Path(state_dir) / "ledger.sqlite"


def state_file(state_dir: Path) -> Path:
    """Where the pipeline is, for humans (statemachine/statefile.py)."""
    return Path(state_dir) / "state.toml"


def config_in_force(state_dir: Path) -> Path:
    """The config the daemon holds, written by it; every child starts from this file, never from
    the operator's editable one (statemachine/config_validation.py)."""
    return Path(state_dir) / "config.toml"


def state_reserve(state_root: Path) -> Path:
    """Space the daemon holds on the state folder's disk, given up when that disk fills so the
    ledger and the state file can still be written (daemon/budgets.py)."""
    return Path(state_root) / "reserve"


def daemon_lock(state_root: Path) -> Path:
    """Held by the one daemon of this state folder for its whole life; says which process that
    is (statemachine/daemon_lock.py)."""
    return Path(state_root) / "daemon.lock"


def children_dir(state_dir: Path) -> Path:
    """A pid file per child, to find orphans after a crash (daemon/children.py)."""
    return Path(state_dir) / "children"


def control_dir(state_dir: Path) -> Path:
    """The operator's requests and the daemon's answers (daemon/control.py)."""
    return Path(state_dir) / "control"


def spot_check_dir(state_dir: Path) -> Path:
    """Fresh dumps of the numerical spot check (daemon/stages/verify.py)."""
    return Path(state_dir) / "spotcheck"


def daemon_pointer(config: Path) -> Path:
    """Where the daemon started with this (editable) config says which daemon it is and what it
    holds (statemachine/pointer.py): fixed by the config's path alone, so that `eagle3ctl status`
    finds the running daemon wherever the file's [paths] now point. In the unit's
    RuntimeDirectory (/run/eagle3d), else the user's runtime folder, else the temp folder."""
    runtime = os.environ.get("RUNTIME_DIRECTORY", "/run/eagle3d").split(":")[0]
    if not os.path.isdir(runtime):  # the unit's, where it is installed: its readers look there
        runtime = os.path.join(os.environ.get("XDG_RUNTIME_DIR") or "/tmp",
                               f"eagle3d-{os.getuid()}")
    # Named after the config's path, as systemd-escape names units: readable, and one per file.
    key = str(Path(config).resolve()).strip("/").replace("-", "--").replace("/", "-")
    return Path(runtime) / f"daemon-{key}"


# ---- the spool ----------------------------------------------------------------------------------


def rejected_dir(spool_dir: Path) -> Path:
    """Dumps that ingest refused, each with a reason file (daemon/ingest.py)."""
    return Path(spool_dir) / "rejected"


# An engine's plugin keeps its own files in a folder of the spool named after the engine
# (capture/engines/<name>/): the spool scan offers files to ingest and moves stray dot-named
# files to rejected/, but leaves folders alone. Relative to the spool: the plugin and the
# daemon each join them to the spool they hold.


def engine_handshake(engine: str) -> str:
    """The plugin's ready file: written once capture is set up; the engine is ready only after
    the daemon reads it (capture/engines/sglang/plugin.py)."""
    return f"{engine}/ready.json"


def engine_spot_folder(engine: str) -> str:
    """The dumps of the spot check's re-extractions, out of ingest's sight."""
    return f"{engine}/spot"


def engine_failed_folder(engine: str) -> str:
    """An empty `<sample id>.<kind>` per dump the plugin could not write."""
    return f"{engine}/failed"


# ---- the dataset --------------------------------------------------------------------------------


def contract_file(dataset_dir: Path) -> Path:
    """The capture contract (dataset/contract.py)."""
    return Path(dataset_dir) / "capture.toml"


# Dumps sit in folders of SAMPLES_PER_FOLDER by ledger index, `samples-00042/`. Earlier installs
# named them `shard-00042/`, beside the shard folders of several nodes
# (`shard-1-of-3/`): those are read as they are (each ledger row holds its sample's path), and
# `shard` now means a node's share only. Five digits at least, more from index 100,000,000 on
# (reached with [generate] answers = K), so a folder is told by its digits alone.
SAMPLES_PER_FOLDER = 1000
_SAMPLE_FOLDER = re.compile(r"(samples|shard)-[0-9]{5,}")


def sample_folder(idx: int) -> str:
    """The dataset folder, relative to the dataset's, of the sample with this ledger index."""
    return f"samples-{idx // SAMPLES_PER_FOLDER:05d}"


def sample_folders(dataset_dir: Path) -> Iterator[Path]:
    """Every sample folder in a dataset folder, of any width and either name (`shard-00042/` in
    an earlier install's dataset); never a node's shard folder."""
    return (p for p in Path(dataset_dir).glob("*-[0-9]*")
            if _SAMPLE_FOLDER.fullmatch(p.name) and p.is_dir())


def manifest_file(dataset_dir: Path) -> Path:
    """The verified samples training may read (statemachine/manifest.py)."""
    return Path(dataset_dir) / "manifest.json"


def published_state(dataset_dir: Path) -> Path:
    """A shard's state file, copied where the training node reads it (statemachine/statefile.py,
    statemachine/shards.py): the same name as the state folder's own."""
    return state_file(dataset_dir)


# ---- the train folder ---------------------------------------------------------------------------


def progress_file(train_dir: Path) -> Path:
    """Where training is (statemachine/train_files.py)."""
    return Path(train_dir) / "progress.json"


def eval_file(train_dir: Path) -> Path:
    """The acceptance-length evaluation's result (statemachine/train_files.py)."""
    return Path(train_dir) / "eval.json"


def refusal_file(train_dir: Path) -> Path:
    """Why the trainer refused to train (statemachine/train_files.py)."""
    return Path(train_dir) / "refusal.json"


def done_file(train_dir: Path) -> Path:
    """The marker tying the drafter to the manifest it was trained on (train_files.py)."""
    return Path(train_dir) / "done.json"


def versions_dir(train_dir: Path) -> Path:
    """Drafters trained with other [train] settings, one folder per settings key, each holding
    the train folder's own files of that drafter (statemachine/train_files.py)."""
    return Path(train_dir) / "versions"


# The formats `eagle3ctl export` writes the drafter in: SGLang's layout (export_dir, what training
# writes) or speculators' (speculators_export_dir, for vLLM). Formats, not engines: either serves
# whatever engine captured the dataset.
SGLANG_EXPORT, SPECULATORS_EXPORT = "sglang", "speculators"
EXPORT_FORMATS = (SGLANG_EXPORT, SPECULATORS_EXPORT)


def export_dir(train_dir: Path) -> Path:
    """The drafter in SGLang's layout (drafter/export.py)."""
    return Path(train_dir) / "export"


def speculators_export_dir(train_dir: Path) -> Path:
    """The drafter in speculators' format, for vLLM (drafter/export_speculators.py), written by
    `eagle3ctl export --format speculators`."""
    return Path(train_dir) / "export-speculators"


def checkpoint_dir(train_dir: Path) -> Path:
    """Training checkpoints (drafter/checkpoint.py)."""
    return Path(train_dir) / "checkpoints"


def metrics_file(train_dir: Path) -> Path:
    """One JSON line per training step."""
    return Path(train_dir) / "metrics.jsonl"


def metrics_plot(train_dir: Path) -> Path:
    """The training curves (drafter/plots.py)."""
    return Path(train_dir) / "metrics.png"


def tensorboard_dir(train_dir: Path) -> Path:
    """TensorBoard's event files, where `[train] report_to = "tensorboard"`."""
    return Path(train_dir) / "tensorboard"


def vocab_file(train_dir: Path) -> Path:
    """The draft vocabulary (drafter/vocab.py)."""
    return Path(train_dir) / "vocab.safetensors"


# The variable that hands the ranks of one node that file (drafter/launch.py sets it,
# drafter/train.py init_runtime reads it).
RENDEZVOUS_ENV = "EAGLE3D_RENDEZVOUS_FILE"


def rendezvous_file(train_dir: Path) -> Path:
    """Where the ranks of one node meet (drafter/launch.py): a FileStore in a folder of mode
    0700, so that no socket listens for them and no other user reads or writes it."""
    return Path(train_dir) / "rendezvous" / "store"


def compile_cache_dir(train_dir: Path) -> Path:
    """torch.compile's kernels for the trainer on CUDA (drafter/train.py): beside the checkpoints,
    so that a resumed trainer finds them where the service's private /tmp has been emptied."""
    return Path(train_dir) / "compile-cache"


# ---- runs ---------------------------------------------------------------------------------------
# A run is the samples bound by one capture contract (statemachine/runs.py). The first run lives
# in the configured folders themselves, so that folders written before runs existed are that run
# in place; every further run lives in `<root>/runs/<run id>/` under each configured root.


def runs_registry(state_root: Path) -> Path:
    """Every run, the current one named (statemachine/runs.py)."""
    return Path(state_root) / "runs.toml"


def runs_lock(state_root: Path) -> Path:
    """Held while the registry is read and rewritten (statemachine/runs.py)."""
    return Path(state_root) / "runs.lock"


def operator_pause(state_root: Path) -> Path:
    """`eagle3ctl pause`'s reason while the operator holds the daemon paused: beside the
    registry, so that it pauses whatever run is current, across switches (daemon/requests.py)."""
    return Path(state_root) / "pause.txt"


def run_folder(root: Path, run_id: str) -> Path:
    """A further run's folder under one configured root."""
    return Path(root) / "runs" / run_id


# The names in a configured root that are not the in-place run's own: forgetting that run
# keeps them. Taken from the functions that name them, so a rename cannot slip past `forget`.
ROOT_SHARED = tuple(f(Path()).name for f in (runs_registry, runs_lock, daemon_lock, operator_pause,
                                              children_dir)) + (
    run_folder(Path(), "-").parent.name,)
