"""The operator's desired state, as a schema: each section of the TOML file a NamedTuple whose
fields are its keys, each annotated with the converter that reads its value, and the derived
views of it (section_classes, keys_of, contract_fields). Reading and checking a file against it
is statemachine/config_validation.py; the config in force the daemon writes for its children,
statemachine/config_in_force.py; what a reload may take on the fly, statemachine/reload_policy.py.

The schema's annotations are evaluated as the classes are made (no `from __future__ import
annotations`): the converters are read from them, and compiling them as strings at each start
of eagle3ctl would cost more than all its other work.
"""

import functools
import importlib.util
import math
import os
import re
from pathlib import Path
from types import MappingProxyType
from typing import Annotated, Any, Callable, Mapping, NamedTuple, get_origin

from eagle3d.statemachine import shards


DTYPES = ("float32", "bfloat16", "float16")
FP8 = "float8_e4m3fn"
# How a dump stores the hidden states: a float type, or fp8 with a scale per token row.
DUMP_DTYPES = (*DTYPES, FP8)
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


# ---- how one value is read ----------------------------------------------------------------
# typed, STR, SECONDS and str_list are public: an engine's settings (capture/engines/*/
# settings.py) declare their keys in the same vocabulary.

def typed(kind: type, *, minimum: float | None = None, maximum: float | None = None,
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


def str_list(value: Any) -> tuple[str, ...]:
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


def _dir(value: Any, base: Path) -> Path:
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


_POS_INT = typed(int, minimum=1)
_NONNEG_INT = typed(int, minimum=0)
_POS_FLOAT = typed(float, minimum=1e-9)
STR = typed(str)
_DEVICE = typed(str, choices=("auto", "cpu", "cuda"))
_GRACE = typed(float, minimum=1.0, maximum=STOP_BUDGET_S)
# Sane maxima where a number feeds arithmetic: a ledger row's index is a source index times
# [generate] answers (at most 64) and stays an SQLite integer; token ids and counts are int32;
# a wait longer than a week is a typo (and past ~2^31 s time.sleep raises); numpy seeds are
# 32-bit.
_INDEX = typed(int, minimum=0, maximum=2**48)
_COUNT = typed(int, minimum=1, maximum=2**48)
_TOKENS = typed(int, minimum=1, maximum=2**31 - 1)
SECONDS = typed(float, minimum=1e-9, maximum=7 * 86400.0)
_SEED = typed(int, minimum=0, maximum=2**32 - 1)


# ---- the schema: each key once, with how its value is read ----------------------------------
#
# A section's fields are the keys an operator writes, each annotated with the converter that reads
# its value (Annotated[type, converter]); a field without one is derived while validating (a
# location resolved). parse_config, the config in force, the template's documentation check
# (tests/test_prod_config.py) and the capture contract's keys all read this.

class Binds(NamedTuple):
    """Marks a key of the capture contract (Config.contract_keys): a dataset captured under one
    value does not fit another, so an edit switches runs (statemachine/runs.py)."""
    generated: bool = False  # only where the target writes the answers ([data] responses)
    left_out_at: int | None = None  # a value left out of the keys: those from before it stay


BINDS, GENERATED = Binds(), Binds(generated=True)


class InFolder(NamedTuple):
    """A converter of a location, read relative to the config file's folder."""
    convert: Callable[[Any, Path], Any]


class Key(NamedTuple):
    """One key an operator can write: how its value is read, its default, whether it binds."""
    name: str
    convert: Callable[[Any, Path], Any]
    default: Any
    required: bool
    binds: Binds | None


class TargetConfig(NamedTuple):
    model: Annotated[str, STR, BINDS]
    # one of the registered engines (capture/engines.checked); empty: the registry's default
    engine: Annotated[str, STR] = ""
    dtype: Annotated[str, typed(str, choices=DTYPES), BINDS] = "bfloat16"
    # None: the EAGLE-3 default for the model's depth
    aux_layers: Annotated[tuple[int, ...] | None, _aux_layers, BINDS] = None
    device: Annotated[str, _DEVICE] = "auto"
    model_path: Path = Path()


class DataConfig(NamedTuple):
    source: Annotated[str, STR, BINDS]
    format: Annotated[str, typed(str, choices=FORMATS)] = "auto"
    first: Annotated[int, _INDEX, BINDS] = 0
    limit: Annotated[int, _COUNT] = 1000
    max_tokens: Annotated[int, typed(int, minimum=8, maximum=2**31 - 1), BINDS] = 2048
    # "target": the target writes every assistant turn itself
    responses: Annotated[str, typed(str, choices=RESPONSES), BINDS] = "dataset"
    planner_max_restarts: Annotated[int, _NONNEG_INT] = 2
    # extraction over this many nodes (statemachine/shards.py)
    shards: Annotated[int, typed(int, minimum=1, maximum=4096)] = 1
    shard: Annotated[int, _NONNEG_INT] = 0  # this node's share, or from the variable named below
    shard_from_env: Annotated[str, STR] = ""  # e.g. "SLURM_ARRAY_TASK_ID", "JOB_COMPLETION_INDEX"
    source_path: Path = Path()


class GenerateConfig(NamedTuple):
    max_new_tokens: Annotated[int, _TOKENS, GENERATED] = 512  # per assistant turn
    # assistant turns per conversation; 0: one per user turn
    max_turns: Annotated[int, _NONNEG_INT, GENERATED] = 0
    temperature: Annotated[float, typed(float, minimum=0.0), GENERATED] = 0.0  # 0: greedy
    top_p: Annotated[float, typed(float, minimum=1e-6, maximum=1.0), GENERATED] = 1.0
    seed: Annotated[int, _SEED, GENERATED] = 0
    # answers written per conversation (sampled: temperature above 0); left out of the contract
    # at 1, so the datasets written before it keep their key
    answers: Annotated[int, typed(int, minimum=1, maximum=64),
                       Binds(generated=True, left_out_at=1)] = 1
    batch_size: Annotated[int, typed(int, minimum=1, maximum=4096)] = 32  # generated together
    max_attempts: Annotated[int, _POS_INT] = 3
    max_restarts: Annotated[int, _NONNEG_INT] = 5  # of the generator (and its SGLang server)


class PathsConfig(NamedTuple):
    state_dir: Annotated[Path, InFolder(_dir)]
    spool_dir: Annotated[Path, InFolder(_dir)]
    dataset_dir: Annotated[Path, InFolder(_dir)]
    train_dir: Annotated[Path, InFolder(_dir)]


class BudgetConfig(NamedTuple):
    reserve: Annotated[int, parse_size] = 10 * 1024**3
    spool_max: Annotated[int, parse_size] = 8 * 1024**3


class ExtractConfig(NamedTuple):
    # left out of a config: the [target] dtype (see parse_config)
    dump_dtype: Annotated[str, typed(str, choices=DUMP_DTYPES), BINDS] = "bfloat16"
    batch_tokens: Annotated[int, _TOKENS] = 8192
    max_inflight_tokens: Annotated[int, _TOKENS] = 65536
    max_inflight_samples: Annotated[int, _POS_INT] = 256
    inflight_timeout_s: Annotated[float, SECONDS] = 900.0
    max_attempts: Annotated[int, _POS_INT] = 3
    engine_max_restarts: Annotated[int, _NONNEG_INT] = 5
    # SIGTERM to SIGKILL, for every child holding the target
    engine_stop_grace_s: Annotated[float, _GRACE] = 30.0
    # no progress from a running engine or generator: restarted
    engine_silence_s: Annotated[float, SECONDS] = 900.0
    ingest_threads: Annotated[int, typed(int, minimum=1, maximum=64)] = 4
    rescan_interval_s: Annotated[float, SECONDS] = 5.0


class VerifyConfig(NamedTuple):
    workers: Annotated[int, typed(int, minimum=1, maximum=256)] = 2
    spot_checks: Annotated[int, _NONNEG_INT] = 3
    spot_tolerance: Annotated[float, _POS_FLOAT] = 0.05  # docs/operations.md: how it was measured


class TrainConfig(NamedTuple):
    nproc: Annotated[int, typed(int, minimum=1, maximum=1024)] = 1  # per node
    nnodes: Annotated[int, typed(int, minimum=1, maximum=1024)] = 1
    # node 0 runs the daemon; nodes 1.. run `eagle3d train-node`
    node_rank: Annotated[int, _NONNEG_INT] = 0
    # node 0's HOST:PORT, where torchrun's nodes meet; nnodes > 1 only
    rendezvous: Annotated[str, _rendezvous] = ""
    device: Annotated[str, _DEVICE] = "auto"
    draft_vocab: Annotated[int, _POS_INT] = 32000
    intermediate_size: Annotated[int, _NONNEG_INT] = 0  # the drafter's MLP width; 0: the target's
    ttt_steps: Annotated[int, typed(int, minimum=1, maximum=32)] = 7
    loss_on: Annotated[str, typed(str, choices=LOSS_ON)] = "answers"
    epochs: Annotated[float, typed(float, minimum=1e-9, maximum=1e6)] = 1.0
    max_steps: Annotated[int, _NONNEG_INT] = 0  # 0: as many as the epochs need
    batch_tokens: Annotated[int, _TOKENS] = 4096
    lr: Annotated[float, _POS_FLOAT] = 1e-4
    warmup_steps: Annotated[int, _NONNEG_INT] = 50
    weight_decay: Annotated[float, typed(float, minimum=0.0)] = 0.0
    grad_clip: Annotated[float, typed(float, minimum=0.0)] = 0.5
    checkpoint_every: Annotated[int, _POS_INT] = 200
    max_restarts: Annotated[int, _NONNEG_INT] = 3
    # SIGTERM to SIGKILL: the trainer checkpoints in between
    stop_grace_s: Annotated[float, _GRACE] = 60.0
    # no progress from a training trainer (a checkpoint fits): restarted
    silence_s: Annotated[float, SECONDS] = 1800.0
    seed: Annotated[int, _SEED] = 0
    threads: Annotated[int, _NONNEG_INT] = 0  # torch intra-op threads per rank on CPU; 0 = cores / nproc
    # where the curves go besides metrics.jsonl and metrics.png
    report_to: Annotated[str, typed(str, choices=REPORT_TO)] = ""


class EvalConfig(NamedTuple):
    source: Annotated[str, STR] = ""  # empty: the data source
    first: Annotated[int, _INDEX] = 0
    limit: Annotated[int, _COUNT] = 20
    steps: Annotated[int, typed(int, minimum=1, maximum=16)] = 5
    max_new_tokens: Annotated[int, _TOKENS] = 64
    batch_size: Annotated[int, _POS_INT] = 32  # prompts decoded together
    source_path: Path = Path()


class MetricsConfig(NamedTuple):
    # node_exporter's textfile collector reads it; empty: none written
    textfile: Annotated[str, InFolder(_textfile)] = ""


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
    metrics: MetricsConfig = MetricsConfig()
    # Every other top-level key of the file, as written (each table read-only): the engines'
    # own sections, which capture/engines reads with their settings classes and the same
    # machinery (config_validation.read_section), and refuses where no engine reads one. The
    # schema, on the lowest floor, cannot know the engines; the drafter's children, which read
    # the config and never import capture, still load a file that has them.
    engine_sections: Mapping[str, Any] = MappingProxyType({})

    @property
    def shard(self) -> shards.Shard:
        return shards.Shard(self.data.shard, self.data.shards)

    def contract_keys(self) -> dict[str, Any]:
        """What a dataset is bound to: change one of these and the old dumps no longer fit. The
        keys the schema marks (Binds), by their bare names; the generated ones only where the
        target writes the answers, for what it writes depends on them too."""
        keys = {}
        for section, key in contract_fields():
            if key.binds.generated and self.data.responses != "target":
                continue
            value = getattr(getattr(self, section), key.name)
            if value != key.binds.left_out_at:
                keys[key.name] = as_written(value)
        return keys

    def generate_keys(self) -> dict[str, Any]:
        """The [generate] settings that decide what the target writes, as the contract keys
        name them; empty where the dataset's answers are used."""
        generated = {key.name for _, key in contract_fields() if key.binds.generated}
        return {k: v for k, v in self.contract_keys().items() if k in generated}


@functools.cache
def section_classes() -> dict[str, type]:
    """Section name -> its class, in the order of Config: the sections the schema holds (not
    the engines', Config.engine_sections)."""
    return {name: hint for name, hint in Config.__annotations__.items()
            if isinstance(hint, type) and issubclass(hint, tuple)}


@functools.cache
def keys_of(cls: type) -> dict[str, Key]:
    """The keys an operator can write in a section: its fields that name a converter."""
    keys = {}
    for name, hint in cls.__annotations__.items():
        if get_origin(hint) is not Annotated:
            continue  # derived while validating
        meta = hint.__metadata__
        convert = meta[0].convert if isinstance(meta[0], InFolder) else \
            (lambda value, base, read=meta[0]: read(value))
        binds = next((m for m in meta[1:] if isinstance(m, Binds)), None)
        keys[name] = Key(name, convert, cls._field_defaults.get(name),
                         name not in cls._field_defaults, binds)
    return keys


@functools.cache
def contract_fields() -> tuple[tuple[str, Key], ...]:
    """(section, key) of every key the capture contract binds."""
    return tuple((section, key) for section, cls in section_classes().items()
                 for key in keys_of(cls).values() if key.binds is not None)


def written(section: Any) -> dict[str, Any]:
    """A section (a schema's class, or an engine's settings) as its keys are written."""
    return {k: as_written(getattr(section, k)) for k in keys_of(type(section))}


def tables(cfg: Config) -> dict[str, Mapping[str, Any]]:
    """The config as sections of keys, as an operator writes them: the schema's, then the
    engines' as the file has them (capture/engines.checked has written each in full)."""
    return {**{name: written(getattr(cfg, name)) for name in section_classes()},
            **cfg.engine_sections}


def as_written(value: Any) -> Any:
    """A value as TOML and JSON write it: a path as text, a tuple as a list, and None (only
    [target] aux_layers may be None) as its spelling, "default"."""
    if value is None:
        return "default"
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, tuple):
        return list(value)
    return value
