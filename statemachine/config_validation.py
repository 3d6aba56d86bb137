"""The operator's desired state, read and validated strictly: one TOML file against the schema
(statemachine/config_schema.py). Every problem names the file and the key. Unknown keys are
errors, because a misspelt key that is silently ignored is a setting the operator believes is in
force and is not.
"""

import importlib.util
import os
import re
import stat
import sys
from pathlib import Path
from types import MappingProxyType
from typing import Any, Collection, Mapping, TypeVar

from eagle3d.statemachine import shards
from eagle3d.statemachine.config_schema import (PLANNER_STOP_GRACE_S, STOP_BUDGET_S, Config,
                                                DataConfig, ExtractConfig, GenerateConfig,
                                                PathsConfig, TargetConfig, TrainConfig,
                                                keys_of, resolve_location, section_classes)

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


class ConfigError(ValueError):
    """A config that must not be run. The message is meant for the operator, as is."""


# A config file is a page of text; anything larger (or not a regular file: a FIFO, a device) is
# refused before it is read, so a reload of any file whatever cannot stall or flood the daemon.
MAX_CONFIG_BYTES = 1 << 20


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

    def build(self, raw: dict, section: str, base: Path, cls: type) -> Any:
        """The section as its class declares it (keys_of): every key converted, the missing
        ones their defaults."""
        keys = keys_of(cls)
        values = self.section(raw, section, any(k.required for k in keys.values()))
        kwargs: dict[str, Any] = {}
        for name, value in values.items():
            if name not in keys:
                known = ", ".join(sorted(keys))
                raise self.fail(f"{section}.{name}", f"unknown key (known keys: {known})")
            try:
                kwargs[name] = keys[name].convert(value, base)
            except (TypeError, ValueError, OverflowError, OSError) as exc:
                raise self.fail(f"{section}.{name}", str(exc)) from None
        missing = [k.name for k in keys.values() if k.required and k.name not in kwargs]
        if missing:
            raise self.fail(f"{section}.{missing[0]}", "is required")
        return cls(**kwargs)


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
    """The config of a TOML document read from `path`: each section as the schema reads it,
    in order, each followed by its locations resolved and the checks that span keys (the first
    problem met is the one named)."""
    chk = _Checker(path)
    base = path.parent

    def build(section: str) -> Any:
        return chk.build(raw, section, base, section_classes()[section])

    target = build("target")
    model_path = _existing(chk, "target.model", target.model, base, remote_ok=True)
    target = target._replace(model=_spelled(target.model, model_path), model_path=model_path)
    data = build("data")
    source_path = _existing(chk, "data.source", data.source, base)
    data = data._replace(source=_spelled(data.source, source_path), source_path=source_path)
    paths = build("paths")
    _check_paths_apart(chk, paths)
    data, paths = _shard(chk, data, paths, "shard" in chk.section(raw, "data"))
    budget = build("budget")
    if budget.spool_max == 0:
        raise chk.fail("budget.spool_max", "must be larger than 0")
    extract = _extract(chk, build("extract"), "dump_dtype" in chk.section(raw, "extract"),
                       target, data)
    verify, generate = build("verify"), build("generate")
    _check_answers(chk, data, generate)
    train = build("train")
    _check_train(chk, train, extract)
    ev = build("eval")
    eval_path = _existing(chk, "eval.source", ev.source or data.source, base)
    ev = ev._replace(source=_spelled(ev.source or data.source, eval_path), source_path=eval_path)
    others = {key: MappingProxyType(dict(value)) if isinstance(value, dict) else value
              for key, value in raw.items() if key not in section_classes()}
    return Config(path, target, data, paths, budget, extract, verify, generate, train, ev,
                  build("metrics"), MappingProxyType(others))


S = TypeVar("S")


def read_section(cfg: Config, name: str, cls: type[S]) -> S:
    """Config.engine_sections[name], read by `cls` as the schema reads its own sections (the
    same converters, the same words); its defaults where the file has no such section."""
    value = cfg.engine_sections.get(name)
    raw = {} if value is None else {name: dict(value) if isinstance(value, Mapping) else value}
    return _Checker(cfg.path).build(raw, name, cfg.path.parent, cls)


def refuse_unknown_sections(cfg: Config, known: Collection[str]) -> None:
    """ConfigError for the first top-level key of the file that is neither a schema's section
    nor one of `known` (the engines' sections): a misspelt section is a setting believed in
    force."""
    names = sorted({*section_classes(), *known})
    for key in cfg.engine_sections:
        if key not in known:
            raise ConfigError(f"{cfg.path}: unknown section or key [{key}] "
                              f"(known sections: {', '.join(names)})")


def _extract(chk: _Checker, extract: ExtractConfig, dump_dtype_written: bool,
             target: TargetConfig, data: DataConfig) -> ExtractConfig:
    if not dump_dtype_written:
        # Left out, the states are stored as the target computes them (etc/eagle3d.toml).
        extract = extract._replace(dump_dtype=target.dtype)
    if extract.max_inflight_tokens < data.max_tokens:
        raise chk.fail("extract.max_inflight_tokens",
                       f"must be at least [data] max_tokens ({data.max_tokens}), or the longest "
                       "samples could never be dispatched")
    return extract


def _check_train(chk: _Checker, train: TrainConfig, extract: ExtractConfig) -> None:
    if train.report_to == "tensorboard" and importlib.util.find_spec("tensorboard") is None:
        raise chk.fail("train.report_to", "needs the tensorboard package in eagle3d's "
                       "environment: pip install 'eagle3d[tensorboard]'")
    _check_nodes(chk, train)
    _check_stop_graces(chk, extract, train)


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
