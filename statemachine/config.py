"""The operator's desired state: one TOML file, validated strictly.

Every problem names the file and the key. Unknown keys are errors, because a misspelt key that is
silently ignored is a setting the operator believes is in force and is not.
"""

from __future__ import annotations

import importlib.util
import math
import os
import stat
import re
import sys
from pathlib import Path
from typing import Any, Callable, NamedTuple

from eagle3d.statemachine import digests, layout, shards
from eagle3d.statemachine.atomic import atomic_write_bytes

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


class ConfigError(ValueError):
    """A config that must not be run. The message is meant for the operator, as is."""


DTYPES = ("float32", "bfloat16", "float16")
FP8 = "float8_e4m3fn"
# How a dump stores the hidden states: a float type, or fp8 with a scale per token row.
DUMP_DTYPES = (*DTYPES, FP8)
ENGINES = ("transformers", "sglang")
FORMATS = ("auto", "sharegpt", "messages")
RESPONSES = ("dataset", "target")
# Where the drafter learns the target's next token: after answer tokens only, or everywhere.
LOSS_ON = ("answers", "all")
REPORT_TO = ("", "tensorboard")
# The daemon's whole stop (every child's grace) fits in this, inside the unit's TimeoutStopSec=3min
# with room for systemd's own SIGKILL to never be needed (tests/test_systemd_unit.py holds them).
STOP_BUDGET_S = 150.0
PLANNER_STOP_GRACE_S = 10.0  # the planner commits each batch in one transaction: nothing to save

# Every number of a config fits where it goes: an integer in SQLite's (and numpy's) int64.
INT64_MAX = 2**63 - 1
# A config file is a page of text; anything larger (or not a regular file: a FIFO, a device) is
# refused before it is read, so a reload of any file whatever cannot stall or flood the daemon.
MAX_CONFIG_BYTES = 1 << 20

_SIZE_UNITS = {"": 1, "B": 1, "K": 1000, "KB": 1000, "M": 1000**2, "MB": 1000**2, "G": 1000**3,
               "GB": 1000**3, "T": 1000**4, "TB": 1000**4, "KIB": 1024, "MIB": 1024**2,
               "GIB": 1024**3, "TIB": 1024**4}


def parse_size(value: Any) -> int:
    """Bytes from an integer or a string such as "20GiB" or "500 MB"."""
    if isinstance(value, bool):
        raise ValueError("expected a size such as 20GiB or a number of bytes")
    if isinstance(value, int):
        return _bounded_size(value)
    if isinstance(value, str):
        m = re.fullmatch(r"\s*(\d{1,30}(?:\.\d{1,30})?)\s*([A-Za-z]*)\s*", value)
        if m and m.group(2).upper() in _SIZE_UNITS:  # exact: no float to overflow or round
            whole, _, frac = m.group(1).partition(".")
            unit = _SIZE_UNITS[m.group(2).upper()]
            return _bounded_size(int(whole) * unit + int(frac or "0") * unit // 10 ** len(frac))
        if value.strip().startswith("-"):
            raise ValueError("a size cannot be negative")
    raise ValueError(f"expected a size such as 20GiB or a number of bytes, got {value!r}")


def _bounded_size(n: int) -> int:
    if n < 0:
        raise ValueError("a size cannot be negative")
    if n > INT64_MAX:
        raise ValueError(f"{n} bytes is more than any disk holds (at most {INT64_MAX})")
    return n


def human_bytes(n: float) -> str:
    """The inverse of parse_size, for messages: 1536 -> "1.5 KiB"."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{int(n)} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def resolve_location(value: str, base: Path) -> Path:
    """A path from the config: `pkg:PACKAGE/PATH` (a file inside an installed package, found
    without importing the package), absolute, or relative to the config file's folder."""
    if value.startswith("pkg:"):
        package, _, inner = value[4:].partition("/")
        # A top-level name only: find_spec imports the parents of a dotted one.
        spec = importlib.util.find_spec(package) if package.isidentifier() else None
        if spec is None or not spec.submodule_search_locations:
            raise ValueError(f"package {package!r} is not installed (from {value!r})")
        return Path(list(spec.submodule_search_locations)[0]) / inner
    path = Path(os.path.expanduser(value))
    return path if path.is_absolute() else (base / path)


class TargetConfig(NamedTuple):
    model: str
    engine: str = "transformers"
    dtype: str = "bfloat16"
    aux_layers: tuple[int, ...] | None = None  # None: the EAGLE-3 default for the model's depth
    device: str = "auto"
    model_path: Path = Path()


class DataConfig(NamedTuple):
    source: str
    format: str = "auto"
    first: int = 0
    limit: int = 1000
    max_tokens: int = 2048
    responses: str = "dataset"  # "target": the target writes every assistant turn itself
    planner_max_restarts: int = 2
    shards: int = 1  # extraction over this many nodes (statemachine/shards.py)
    shard: int = 0  # this node's share, or from the environment variable named below
    shard_from_env: str = ""  # e.g. "SLURM_ARRAY_TASK_ID", "JOB_COMPLETION_INDEX"
    source_path: Path = Path()


class GenerateConfig(NamedTuple):
    max_new_tokens: int = 512  # per assistant turn
    max_turns: int = 0  # assistant turns per conversation; 0: one per user turn
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    seed: int = 0
    answers: int = 1  # answers written per conversation (sampled: temperature above 0)
    batch_size: int = 32  # conversations generated together
    max_attempts: int = 3
    max_restarts: int = 5  # of the generator (and its SGLang server)


class PathsConfig(NamedTuple):
    state_dir: Path
    spool_dir: Path
    dataset_dir: Path
    train_dir: Path


class BudgetConfig(NamedTuple):
    reserve: int = 10 * 1024**3
    spool_max: int = 8 * 1024**3


class ExtractConfig(NamedTuple):
    dump_dtype: str = "bfloat16"  # left out of a config: the [target] dtype (see parse_config)
    batch_tokens: int = 8192
    max_inflight_tokens: int = 65536
    max_inflight_samples: int = 256
    inflight_timeout_s: float = 900.0
    max_attempts: int = 3
    engine_max_restarts: int = 5
    engine_stop_grace_s: float = 30.0  # SIGTERM to SIGKILL, for every child holding the target
    engine_silence_s: float = 900.0  # no progress from a running engine or generator: restarted
    ingest_threads: int = 4
    rescan_interval_s: float = 5.0


class VerifyConfig(NamedTuple):
    workers: int = 2
    spot_checks: int = 3
    spot_tolerance: float = 0.05  # docs/operations.md: how it was measured


class TrainConfig(NamedTuple):
    nproc: int = 1  # per node
    nnodes: int = 1
    node_rank: int = 0  # node 0 runs the daemon; nodes 1.. run `eagle3d train-node`
    rendezvous: str = ""  # node 0's HOST:PORT, where torchrun's nodes meet; nnodes > 1 only
    device: str = "auto"
    draft_vocab: int = 32000
    intermediate_size: int = 0  # the drafter's MLP width; 0: the target's
    ttt_steps: int = 7
    loss_on: str = "answers"  # LOSS_ON
    epochs: float = 1.0
    max_steps: int = 0  # 0: as many as the epochs need
    batch_tokens: int = 4096
    lr: float = 1e-4
    warmup_steps: int = 50
    weight_decay: float = 0.0
    grad_clip: float = 0.5
    checkpoint_every: int = 200
    max_restarts: int = 3
    stop_grace_s: float = 60.0  # SIGTERM to SIGKILL: the trainer checkpoints in between
    silence_s: float = 1800.0  # no progress from a training trainer (a checkpoint fits): restarted
    seed: int = 0
    threads: int = 0  # torch intra-op threads per rank on CPU; 0 = cores / nproc
    report_to: str = ""  # REPORT_TO: where the curves go besides metrics.jsonl and metrics.png


class EvalConfig(NamedTuple):
    source: str = ""  # empty: the data source
    first: int = 0
    limit: int = 20
    steps: int = 5
    max_new_tokens: int = 64
    batch_size: int = 32  # prompts decoded together
    source_path: Path = Path()


class SGLangConfig(NamedTuple):
    python: str = "python3"
    tp: int = 1
    host: str = "127.0.0.1"
    port: int = 30000
    mem_fraction: float = 0.85
    startup_timeout_s: float = 1800.0
    extra_args: tuple[str, ...] = ()


class MetricsConfig(NamedTuple):
    textfile: str = ""  # node_exporter's textfile collector reads it; empty: none written


class Config(NamedTuple):
    path: Path
    target: TargetConfig
    data: DataConfig
    paths: PathsConfig
    budget: BudgetConfig = BudgetConfig()
    extract: ExtractConfig = ExtractConfig()
    verify: VerifyConfig = VerifyConfig()
    generate: GenerateConfig = GenerateConfig()
    train: TrainConfig = TrainConfig()
    eval: EvalConfig = EvalConfig()
    sglang: SGLangConfig = SGLangConfig()
    metrics: MetricsConfig = MetricsConfig()

    @property
    def shard(self) -> shards.Shard:
        return shards.Shard(self.data.shard, self.data.shards)

    def contract_keys(self) -> dict[str, Any]:
        """What a dataset is bound to: change one of these and the old dumps no longer fit."""
        keys = {"model": self.target.model, "dtype": self.target.dtype,
                "dump_dtype": self.extract.dump_dtype,
                "aux_layers": list(self.target.aux_layers) if self.target.aux_layers else "default",
                "source": self.data.source, "first": self.data.first,
                "max_tokens": self.data.max_tokens, "responses": self.data.responses}
        if self.data.responses == "target":  # what the target writes depends on these too
            g = self.generate
            keys.update(max_new_tokens=g.max_new_tokens, max_turns=g.max_turns,
                        temperature=g.temperature, top_p=g.top_p, seed=g.seed)
            if g.answers > 1:  # left out at 1: the datasets written before it keep their key
                keys["answers"] = g.answers
        return keys


# ---- the config in force ---------------------------------------------------------------------

# Fields computed from others while validating: not part of what an operator writes.
DERIVED = ("model_path", "source_path")
# A daemon's child gets the config in force's digest with this option (entry.child_main).
IN_FORCE_OPTION = "--in-force"


def _plain(value: Any) -> Any:
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, tuple):
        return list(value)
    return value


def to_toml(cfg: Config) -> str:
    """The config as a TOML document that loads back to the same Config from any folder."""
    import tomli_w  # only the daemon writes it; eagle3ctl must start in a blink
    doc: dict[str, Any] = {}
    for section in Config._fields[1:]:
        values = getattr(cfg, section)._asdict()
        doc[section] = {k: _plain(v) for k, v in values.items() if k not in DERIVED}
    doc["target"]["aux_layers"] = list(cfg.target.aux_layers or ()) or "default"
    if cfg.data.shards > 1:  # the configured roots and the index in force, wherever it came from
        doc["data"]["shard_from_env"] = ""
        doc["paths"].update({k: str(shards.root_of(getattr(cfg.paths, k)))
                             for k in shards.SHARDED_PATHS})
    return ("# The config in force, written by the eagle3d daemon: every child starts from this\n"
            f"# file. Edit {cfg.path} instead, then reload (systemctl reload eagle3d).\n"
            + tomli_w.dumps(doc))


def write_in_force(cfg: Config) -> Path:
    """Write the config the daemon holds where every child reads it; returns the path."""
    path = layout.config_in_force(cfg.paths.state_dir)
    atomic_write_bytes(path, to_toml(cfg).encode())
    return path


def in_force_check(cfg: Config) -> list[str]:
    """The arguments by which a child of the daemon makes sure that the config in force it
    reads is the one the daemon holds (entry.child_main checks them): the daemon holds what it
    wrote; eagle3ctl, the config in force it loaded, that file as it read it (the file's header
    names the daemon's own config, which a config loaded from the file does not know)."""
    in_force = layout.config_in_force(cfg.paths.state_dir)
    held = in_force.read_bytes() if cfg.path == in_force else to_toml(cfg).encode()
    return [IN_FORCE_OPTION, digests.hex_digest(held)]


def check_in_force(path: Path, digest: str | None) -> None:
    """Refuse a config in force edited (or replaced) by hand since the daemon wrote it: its
    children must start from the config it holds, which passed every check a reload makes."""
    if digest is None:  # not a child of the daemon: a command an operator typed
        return
    try:
        found = digests.hex_digest(path.read_bytes())
    except OSError:
        return  # load_config says what is wrong with it
    if found != digest:
        raise ConfigError(f"{path} is not the config in force the daemon holds: edited by hand "
                          "after the daemon wrote it? Edit the config named at the top of the "
                          "file and reload the daemon instead (systemctl reload eagle3d), which "
                          "writes this one again")


def load_in_force(path: str | os.PathLike) -> Config:
    """For processes beside the daemon (eagle3ctl, train-node): the config in force where the
    daemon has written one for the config at `path` (its state folder), else that config. An
    edit the daemon refused must not show a command, or start a trainer, it would not run.
    That of the current run (statemachine/runs.py): its folders are the run's."""
    from eagle3d.statemachine import runs  # it builds on this module
    cfg = load_config(path)
    in_force = layout.config_in_force(runs.current_state_dir(cfg.paths.state_dir))
    return load_config(in_force) if in_force.is_file() else cfg


# What a reload does with a config it cannot take live (eagle3ctl check-config says which).
NEEDS_RESTART, REFUSED = "needs a restart", "refused"


def reload_verdict(old: Config, new: Config) -> tuple[str, str] | None:
    """(NEEDS_RESTART or REFUSED, why) where a new config cannot be taken on the fly, else None.
    An edit of the contract keys is taken: it switches runs (statemachine/runs.py,
    daemon/reconcile.py)."""
    if new.paths != old.paths:
        moved = ", ".join(k for k in PathsConfig._fields
                          if getattr(new.paths, k) != getattr(old.paths, k))
        return NEEDS_RESTART, (f"[paths] {moved} changed: restart the daemon to switch to other "
                               "folders (systemctl restart eagle3d)")
    if new.target.engine != old.target.engine:
        return NEEDS_RESTART, "[target] engine changed: restart the daemon to switch engines"
    problem = daemon_problem(new)
    return None if problem is None else (REFUSED, problem)


def reload_problem(old: Config, new: Config) -> str | None:
    """Why a new config cannot be taken on the fly, or None (reload_verdict's why)."""
    verdict = reload_verdict(old, new)
    return None if verdict is None else verdict[1]


def daemon_problem(cfg: Config) -> str | None:
    """Why the daemon must not run with this config, or None: only node 0 runs the pipeline
    (it owns the ledger and the train stage); the other nodes of a multi-node training only
    lend their GPUs to it."""
    if cfg.train.node_rank == 0:
        return None
    return (f"{cfg.path}: [train] node_rank = {cfg.train.node_rank}: the daemon runs on node 0 "
            f"only; on this node run `eagle3d train-node -c {cfg.path}`")


# ---- validation -------------------------------------------------------------------------------

class _Checker:
    def __init__(self, path: Path) -> None:
        self.path = path

    def fail(self, key: str, what: str) -> ConfigError:
        return ConfigError(f"{self.path}: [{key}] {what}")

    def section(self, raw: dict, name: str, required: bool = False) -> dict:
        value = raw.get(name, None)
        if value is None:
            if required:
                raise ConfigError(f"{self.path}: missing section [{name}]")
            return {}
        if not isinstance(value, dict):
            raise ConfigError(f"{self.path}: {name} must be a [{name}] table")
        return value

    def build(self, cls: type, section: str, values: dict, converters: dict[str, Callable]) -> Any:
        kwargs: dict[str, Any] = {}
        for key, value in values.items():
            if key not in converters:
                known = ", ".join(sorted(k for k in converters))
                raise self.fail(f"{section}.{key}", f"unknown key (known keys: {known})")
            try:
                kwargs[key] = converters[key](value)
            except (TypeError, ValueError, OverflowError, OSError) as exc:
                raise self.fail(f"{section}.{key}", str(exc)) from None
        missing = [name for name in cls._fields if name in converters and name not in kwargs
                   and name not in cls._field_defaults]
        if missing:
            raise self.fail(f"{section}.{missing[0]}", "is required")
        return cls(**kwargs)


def _typed(kind: type, *, minimum: float | None = None, maximum: float | None = None,
           choices: tuple | None = None) -> Callable[[Any], Any]:
    if kind is int and maximum is None:
        maximum = INT64_MAX

    def convert(value: Any) -> Any:
        if kind is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            raise TypeError(f"expected {kind.__name__}, got {type(value).__name__} {value!r}")
        if kind is float and not math.isfinite(value):  # nan passes every comparison below
            raise ValueError(f"must be a finite number, got {value!r}")
        if kind is str:
            _no_nul(value)
        if choices is not None and value not in choices:
            raise ValueError(f"must be one of {', '.join(map(repr, choices))}, got {value!r}")
        if minimum is not None and value < minimum:
            raise ValueError(f"must be at least {minimum}, got {value!r}")
        if maximum is not None and value > maximum:
            raise ValueError(f"must be at most {maximum}, got {value!r}")
        return value
    return convert


def _size(value: Any) -> int:
    return parse_size(value)


def _aux_layers(value: Any) -> tuple[int, ...] | None:
    if value == "default":
        return None
    if (isinstance(value, list) and len(value) == 3
            and all(isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 2**16
                    for v in value)):
        if sorted(set(value)) != list(value):
            raise ValueError("layer ids must be increasing and distinct")
        return tuple(value)
    raise ValueError(f'expected "default" or a list of three layer ids, got {value!r}')


def _str_list(value: Any) -> tuple[str, ...]:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise TypeError(f"expected a list of strings, got {value!r}")
    for v in value:
        _no_nul(v)
    return tuple(value)


def _no_nul(value: str) -> None:
    """A string the config hands to a path, a command line or a child's environment: a NUL
    would end it early there, or raise when the daemon starts the child."""
    if "\x00" in value:
        raise ValueError(f"contains a NUL character: {value!r}")


def _rendezvous(value: Any) -> str:
    if not isinstance(value, str):
        raise TypeError(f"expected a string such as \"10.0.0.1:29400\", got {value!r}")
    host, _, port = value.rpartition(":")
    if value and not (host.strip("[]") and port.isdigit() and 1 <= int(port) <= 65535):
        raise ValueError(f"expected node 0's HOST:PORT, such as \"10.0.0.1:29400\", "
                         f"got {value!r}")
    return value


def _check_nodes(chk: _Checker, train: TrainConfig) -> None:
    if train.node_rank >= train.nnodes:
        raise chk.fail("train.node_rank", f"must be below [train] nnodes ({train.nnodes}), "
                       f"got {train.node_rank}")
    if train.nnodes > 1 and not train.rendezvous:
        raise chk.fail("train.rendezvous", f"is required with [train] nnodes = {train.nnodes}: "
                       "node 0's address and a free port that every node reaches, such as "
                       "\"10.0.0.1:29400\"")
    if train.nnodes == 1 and train.rendezvous:
        raise chk.fail("train.rendezvous", "is for a training over several nodes; with "
                       "[train] nnodes = 1 the node trains alone: remove it")


def _shard(chk: _Checker, data: DataConfig, paths: PathsConfig,
           shard_written: bool) -> tuple[DataConfig, PathsConfig]:
    """This node's shard index (written, or from the environment variable the config names),
    and its own state, spool and dataset folders under the configured ones."""
    if data.shard_from_env:
        if shard_written:
            raise chk.fail("data.shard_from_env", "and [data] shard both name the shard index: "
                           "keep one")
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", data.shard_from_env):
            raise chk.fail("data.shard_from_env", f"{data.shard_from_env!r} is not an "
                           "environment variable's name")
        try:
            data = data._replace(shard=shards.index_from_env(data.shard_from_env, data.shards))
        except ValueError as exc:
            raise chk.fail("data.shard_from_env", str(exc)) from None
    if data.shard >= data.shards:
        raise chk.fail("data.shard", f"must be below [data] shards ({data.shards}), "
                       f"got {data.shard}")
    if data.shards > 1 and not (shard_written or data.shard_from_env):
        raise chk.fail("data.shard", f"is required with [data] shards = {data.shards}: this "
                       "node's index, or shard_from_env naming the variable that holds it")
    if data.shards == 1:
        return data, paths
    shard = shards.Shard(data.shard, data.shards)
    return data, paths._replace(**{k: shards.shard_folder(getattr(paths, k), shard)
                                   for k in shards.SHARDED_PATHS})


def _check_paths_apart(chk: _Checker, paths: PathsConfig) -> None:
    """No [paths] folder is another or inside another: each run's data is told apart by its
    folders, and `eagle3ctl forget` deletes a set-aside run's by them (statemachine/runs.py)."""
    real = [(k, Path(os.path.realpath(v))) for k, v in paths._asdict().items()]
    for i, (key, folder) in enumerate(real):
        for j, (other, other_folder) in enumerate(real):
            # An equal pair is named once, by its later key.
            if (folder == other_folder and j < i) or other_folder in folder.parents:
                where = "the same folder as" if folder == other_folder else "inside"
                raise chk.fail(f"paths.{key}", f"is {where} [paths] {other} "
                               f"({getattr(paths, key)}, {getattr(paths, other)}): give each of "
                               "state_dir, spool_dir, dataset_dir and train_dir a folder of its "
                               "own, none inside another")


def _check_answers(chk: _Checker, data: DataConfig, generate: GenerateConfig) -> None:
    """Several answers per conversation are the target's own, sampled: greedy decoding would
    write the same answer each time."""
    if generate.answers == 1:
        return
    if data.responses != "target":
        raise chk.fail("generate.answers", f"is {generate.answers}, but only the target writes "
                       "answers: set [data] responses = \"target\", or answers = 1")
    if generate.temperature == 0:
        raise chk.fail("generate.answers", f"is {generate.answers} at temperature 0: greedy "
                       "decoding writes the same answer every time; set [generate] temperature "
                       "(e.g. 0.7), or answers = 1")


def _check_stop_graces(chk: _Checker, extract: ExtractConfig, train: TrainConfig) -> None:
    """A stop drains the engine and stops it (one grace each), then stops the trainer: all of it
    must fit the daemon's stop budget, or some child is killed before its grace is over."""
    need = 2 * extract.engine_stop_grace_s + train.stop_grace_s + PLANNER_STOP_GRACE_S
    if need > STOP_BUDGET_S:
        raise chk.fail("train.stop_grace_s", f"with [extract] engine_stop_grace_s, makes a stop "
                       f"of {need:.0f} s (twice the engine's grace, the trainer's and "
                       f"{PLANNER_STOP_GRACE_S:.0f} s for the planner), over the daemon's stop "
                       f"budget of {STOP_BUDGET_S:.0f} s inside the unit's TimeoutStopSec")


_POS_INT = _typed(int, minimum=1)
_NONNEG_INT = _typed(int, minimum=0)
_POS_FLOAT = _typed(float, minimum=1e-9)
_STR = _typed(str)
_GRACE = _typed(float, minimum=1.0, maximum=STOP_BUDGET_S)
# Sane maxima where a number feeds arithmetic: a ledger row's index is a source index times
# [generate] answers (at most 64) and stays an SQLite integer; token ids and counts are int32;
# a wait longer than a week is a typo (and past ~2^31 s time.sleep raises); numpy seeds are
# 32-bit.
_INDEX = _typed(int, minimum=0, maximum=2**48)
_COUNT = _typed(int, minimum=1, maximum=2**48)
_TOKENS = _typed(int, minimum=1, maximum=2**31 - 1)
_SECONDS = _typed(float, minimum=1e-9, maximum=7 * 86400.0)
_SEED = _typed(int, minimum=0, maximum=2**32 - 1)


def load_config(path: str | os.PathLike) -> Config:
    """Read and validate a config file. Raises ConfigError with one clear message."""
    path = Path(path).absolute()
    try:
        text = _read_config(path).decode("utf-8")
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such config file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path}: cannot read the config file: {exc}") from None
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: TOML syntax error: {exc}") from None
    except (ValueError, RecursionError) as exc:  # an integer of thousands of digits, [[[[…
        raise ConfigError(f"{path}: not a config tomllib can read: {exc}") from None
    return parse_config(raw, path)


def _read_config(path: Path) -> bytes:
    """The file's bytes, where it is a regular file of a config's size: a FIFO would stall the
    daemon's reload, a device or a huge file flood its memory."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(f"{path} is not a regular file")
        data = os.read(fd, MAX_CONFIG_BYTES + 1)
    finally:
        os.close(fd)
    if len(data) > MAX_CONFIG_BYTES:
        raise OSError(f"larger than {MAX_CONFIG_BYTES} bytes: not a config")
    return data


def parse_config(raw: dict, path: Path) -> Config:
    chk = _Checker(path)
    base = path.parent
    known = {"target", "data", "paths", "budget", "extract", "verify", "generate", "train", "eval",
             "sglang", "metrics"}
    for key in raw:
        if key not in known:
            raise ConfigError(f"{path}: unknown section or key [{key}] "
                              f"(known sections: {', '.join(sorted(known))})")

    target = chk.build(TargetConfig, "target", chk.section(raw, "target", True), {
        "model": _STR, "engine": _typed(str, choices=ENGINES), "dtype": _typed(str, choices=DTYPES),
        "aux_layers": _aux_layers, "device": _typed(str, choices=("auto", "cpu", "cuda"))})
    model_path = _existing(chk, "target.model", target.model, base, remote_ok=True)
    target = target._replace(model=_spelled(target.model, model_path), model_path=model_path)

    data = chk.build(DataConfig, "data", chk.section(raw, "data", True), {
        "source": _STR, "format": _typed(str, choices=FORMATS), "first": _INDEX,
        "limit": _COUNT, "max_tokens": _typed(int, minimum=8, maximum=2**31 - 1),
        "responses": _typed(str, choices=RESPONSES), "planner_max_restarts": _NONNEG_INT,
        "shards": _typed(int, minimum=1, maximum=4096), "shard": _NONNEG_INT,
        "shard_from_env": _typed(str)})
    source_path = _existing(chk, "data.source", data.source, base)
    data = data._replace(source=_spelled(data.source, source_path), source_path=source_path)

    paths_raw = chk.section(raw, "paths", True)
    paths = chk.build(PathsConfig, "paths", paths_raw, {
        k: (lambda v, k=k: _dir(chk, f"paths.{k}", v, base))
        for k in ("state_dir", "spool_dir", "dataset_dir", "train_dir")})

    _check_paths_apart(chk, paths)
    data, paths = _shard(chk, data, paths, "shard" in chk.section(raw, "data", True))

    budget = chk.build(BudgetConfig, "budget", chk.section(raw, "budget"),
                       {"reserve": _size, "spool_max": _size})
    if budget.spool_max == 0:
        raise chk.fail("budget.spool_max", "must be larger than 0")

    extract_raw = chk.section(raw, "extract")
    extract = chk.build(ExtractConfig, "extract", extract_raw, {
        "dump_dtype": _typed(str, choices=DUMP_DTYPES), "batch_tokens": _TOKENS,
        "max_inflight_tokens": _TOKENS, "max_inflight_samples": _POS_INT,
        "inflight_timeout_s": _SECONDS, "max_attempts": _POS_INT,
        "engine_max_restarts": _NONNEG_INT, "engine_stop_grace_s": _GRACE,
        "engine_silence_s": _SECONDS, "ingest_threads": _typed(int, minimum=1, maximum=64),
        "rescan_interval_s": _SECONDS})
    if "dump_dtype" not in extract_raw:
        # Configs from before dump precisions: the states are stored as the target computes them.
        extract = extract._replace(dump_dtype=target.dtype)
    if extract.max_inflight_tokens < data.max_tokens:
        raise chk.fail("extract.max_inflight_tokens",
                       f"must be at least [data] max_tokens ({data.max_tokens}), or the longest "
                       "samples could never be dispatched")

    verify = chk.build(VerifyConfig, "verify", chk.section(raw, "verify"), {
        "workers": _typed(int, minimum=1, maximum=256), "spot_checks": _NONNEG_INT,
        "spot_tolerance": _POS_FLOAT})

    generate = chk.build(GenerateConfig, "generate", chk.section(raw, "generate"), {
        "max_new_tokens": _TOKENS, "max_turns": _NONNEG_INT, "temperature": _typed(float, minimum=0.0),
        "top_p": _typed(float, minimum=1e-6, maximum=1.0), "seed": _SEED,
        "answers": _typed(int, minimum=1, maximum=64),
        "batch_size": _typed(int, minimum=1, maximum=4096), "max_attempts": _POS_INT,
        "max_restarts": _NONNEG_INT})
    _check_answers(chk, data, generate)

    train = chk.build(TrainConfig, "train", chk.section(raw, "train"), {
        "nproc": _typed(int, minimum=1, maximum=1024),
        "nnodes": _typed(int, minimum=1, maximum=1024), "node_rank": _NONNEG_INT,
        "rendezvous": _rendezvous,
        "device": _typed(str, choices=("auto", "cpu", "cuda")), "draft_vocab": _POS_INT,
        "intermediate_size": _NONNEG_INT, "ttt_steps": _typed(int, minimum=1, maximum=32),
        "loss_on": _typed(str, choices=LOSS_ON), "epochs": _typed(float, minimum=1e-9, maximum=1e6),
        "max_steps": _NONNEG_INT, "batch_tokens": _TOKENS, "lr": _POS_FLOAT,
        "warmup_steps": _NONNEG_INT, "weight_decay": _typed(float, minimum=0.0),
        "grad_clip": _typed(float, minimum=0.0), "checkpoint_every": _POS_INT,
        "max_restarts": _NONNEG_INT, "stop_grace_s": _GRACE, "silence_s": _SECONDS, "seed": _SEED,
        "threads": _NONNEG_INT, "report_to": _typed(str, choices=REPORT_TO)})
    if train.report_to == "tensorboard" and importlib.util.find_spec("tensorboard") is None:
        raise chk.fail("train.report_to", "needs the tensorboard package in eagle3d's "
                       "environment: pip install 'eagle3d[tensorboard]'")
    _check_nodes(chk, train)
    _check_stop_graces(chk, extract, train)

    ev = chk.build(EvalConfig, "eval", chk.section(raw, "eval"), {
        "source": _STR, "first": _INDEX, "limit": _COUNT,
        "steps": _typed(int, minimum=1, maximum=16), "max_new_tokens": _TOKENS,
        "batch_size": _POS_INT})
    eval_path = _existing(chk, "eval.source", ev.source or data.source, base)
    ev = ev._replace(source=_spelled(ev.source or data.source, eval_path), source_path=eval_path)

    sglang = chk.build(SGLangConfig, "sglang", chk.section(raw, "sglang"), {
        "python": _STR, "tp": _typed(int, minimum=1, maximum=64), "host": _STR,
        "port": _typed(int, minimum=1, maximum=65535),
        "mem_fraction": _typed(float, minimum=0.05, maximum=0.99),
        "startup_timeout_s": _SECONDS, "extra_args": _str_list})

    metrics = chk.build(MetricsConfig, "metrics", chk.section(raw, "metrics"),
                        {"textfile": lambda v: _textfile(v, base)})

    return Config(path=path, target=target, data=data, paths=paths, budget=budget,
                  extract=extract, verify=verify, generate=generate, train=train, eval=ev,
                  sglang=sglang, metrics=metrics)


def _existing(chk: _Checker, key: str, value: str, base: Path, remote_ok: bool = False) -> Path:
    try:
        return _existing_path(chk, key, value, base, remote_ok)
    except ConfigError:
        raise
    except (ValueError, OSError) as exc:  # a name too long, a NUL byte: the path itself is bad
        raise chk.fail(key, str(exc)) from None


def _existing_path(chk: _Checker, key: str, value: str, base: Path, remote_ok: bool) -> Path:
    resolved = resolve_location(value, base)
    if not resolved.exists():
        if remote_ok and re.fullmatch(r"[\w.-]+/[\w.-]+", value) and not value.startswith("."):
            return _hub_snapshot(chk, key, value)
        raise chk.fail(key, f"{value!r} does not exist (resolved to {resolved})")
    return resolved.resolve()


def _hub_snapshot(chk: _Checker, key: str, name: str) -> Path:
    """A hub name (org/model) as the folder of its main revision in the local Hugging Face
    cache: the capture contract then names the revision and fingerprints its weights. A name
    the cache does not hold is refused: there are no weights to fingerprint, and every such
    name would fingerprint alike."""
    cache = Path(os.environ.get("HF_HUB_CACHE") or Path(
        os.environ.get("HF_HOME") or Path.home() / ".cache" / "huggingface") / "hub")
    repo = cache / f"models--{name.replace('/', '--')}"
    try:
        revision = (repo / "refs" / "main").read_text().strip()
    except OSError:
        revision = ""
    snapshot = repo / "snapshots" / revision
    if not revision or not snapshot.is_dir():
        raise chk.fail(key, f"{name!r} is no local path, and the Hugging Face cache ({cache}) "
                       f"holds no snapshot of it: download it first (huggingface-cli download "
                       f"{name}), or name the model's folder")
    return snapshot.resolve()


def _spelled(value: str, resolved: Path) -> str:
    """The spelling a location keeps in the config in force: a relative path or a hub name
    becomes absolute (a hub name its cached snapshot, which names the revision), so that the
    copy the daemon writes into its state folder names the same files; package (`pkg:`) names
    stay as written."""
    if value.startswith("pkg:") or Path(os.path.expanduser(value)).is_absolute() or \
            not resolved.is_absolute():
        return value
    return str(resolved)


def _textfile(value: Any, base: Path) -> str:
    """The metrics file: node_exporter's textfile collector reads only names ending in .prom,
    so any other name would be written and never scraped. Its folder is looked for at each
    write, not here: a host without node_exporter yet still runs (status says why nothing is
    written)."""
    if not isinstance(value, str):
        raise TypeError(f"expected a file path, got {value!r}")
    if value and not value.endswith(".prom"):
        raise ValueError(f"node_exporter reads only files named *.prom, got {value!r}")
    return str(resolve_location(value, base)) if value else ""


def _dir(chk: _Checker, key: str, value: Any, base: Path) -> Path:
    if not isinstance(value, str) or not value:
        raise TypeError(f"expected a folder path, got {value!r}")
    _no_nul(value)
    resolved = resolve_location(value, base)
    anchor = resolved
    while not anchor.exists():
        anchor = anchor.parent
    if not anchor.is_dir():
        raise ValueError(f"{value!r} cannot be created: {anchor} is not a folder")
    return Path(os.path.normpath(resolved.absolute()))
