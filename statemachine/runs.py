"""Runs: the samples bound by one capture contract, each in its own folders.

A run's key is the target's name and a short fingerprint of every contract key of the config
(statemachine/config.Config.contract_keys) and of the target's weights, e.g.
`smollm2-135m-instruct-3f9a2c1d`: an operator recognises it, and two configs share a run exactly
when their dumps could share a dataset. `[data] limit` is not a contract key: raising it extends
the run.

The first run lives in the configured folders themselves (folders written before runs existed
are that run, in place: no file moves, the contract keeps its fingerprint); every further run
lives in `<root>/runs/<run id>/` under each configured root (statemachine/layout.py). The
registry, `<state root>/runs.toml`, lists them and names the current one; only this module reads
or writes it, under a lock, atomically.

A forgotten run's data is deleted and its entry kept, marked: a later config with its contract
starts a fresh run in a new folder (`<key>-2`, ...), never the deleted one's remains.
"""

from __future__ import annotations

import fcntl
import os
import re
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, NamedTuple

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

from eagle3d.statemachine import digests, layout
from eagle3d.statemachine.atomic import atomic_write_bytes
from eagle3d.statemachine.config_schema import Config
from eagle3d.statemachine.config_validation import ConfigError

FOLDERS = ("state_dir", "dataset_dir", "train_dir")  # each run's own; the spool is shared


class Run(NamedTuple):
    id: str  # its folders' name; the key, or the key and a number after a forgotten run
    key: str
    model: str
    weights: str  # the target's weights fingerprint (target/loading.py)
    contract: dict[str, Any]  # Config.contract_keys() of the config that made it
    state_dir: Path
    dataset_dir: Path
    train_dir: Path
    in_place: bool  # lives in the configured folders themselves
    created: float
    last_active: float
    forgotten: str = ""  # the operator's reason, once its data is deleted


class Registry(NamedTuple):
    current: str | None
    runs: dict[str, Run]


class Selected(NamedTuple):
    run: Run
    set_aside: Run | None  # the run that was current before, where another
    new: bool


def slug(model: str) -> str:
    """The target's name as a folder name: `pkg:x/SmolLM2-135M-Instruct.Q4_1.gguf` ->
    `smollm2-135m-instruct-q4-1`."""
    name = re.split(r"[/:]", model.rstrip("/"))[-1]
    name = re.sub(r"\.(gguf|safetensors|bin)$", "", name, flags=re.I)
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")[:48] or "target"


def run_key(contract_keys: dict[str, Any], weights: str) -> str:
    digest = digests.json_digest({**contract_keys, "weights": weights}, digests.KEY_SIZE)
    return f"{slug(str(contract_keys['model']))}-{digest}"


# ---- the registry -------------------------------------------------------------------------------

def read(state_root: Path) -> Registry:
    path = layout.runs_registry(state_root)
    try:
        doc = tomllib.loads(path.read_text())
        runs = {rid: Run(id=rid, key=r["key"], model=r["model"], weights=r["weights"],
                         contract=r["contract"], **{k: Path(r[k]) for k in FOLDERS},
                         in_place=r["in_place"], created=r["created"],
                         last_active=r["last_active"], forgotten=r["forgotten"])
                for rid, r in doc.get("runs", {}).items()}
    except FileNotFoundError:
        return Registry(None, {})
    # A run's key missing, or a value of the wrong type: as damaged as a TOML error.
    except (OSError, tomllib.TOMLDecodeError, KeyError, TypeError, AttributeError) as exc:
        raise ConfigError(f"{path} is unreadable ({type(exc).__name__}: {exc}); the daemon "
                          "writes it whole, so it was edited by hand: put it back") from None
    return Registry(doc.get("current") or None, runs)


def write(state_root: Path, registry: Registry) -> None:
    import tomli_w  # only the daemon and `eagle3ctl forget` write: status stays light
    runs = {rid: {k: str(v) if isinstance(v, Path) else v for k, v in r._asdict().items()
                  if k != "id"} for rid, r in registry.runs.items()}
    doc = {"current": registry.current or "", "runs": runs}
    atomic_write_bytes(layout.runs_registry(state_root),
                       ("# The runs of this eagle3d install, written by the daemon and by "
                        "`eagle3ctl forget`; read it with `eagle3ctl runs`.\n"
                        + tomli_w.dumps(doc)).encode())


@contextmanager
def locked(state_root: Path) -> Iterator[None]:
    """The registry read and rewritten by one process at a time (the daemon, eagle3ctl)."""
    Path(state_root).mkdir(parents=True, exist_ok=True, mode=0o750)
    with open(layout.runs_lock(state_root), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def current_state_dir(state_root: Path) -> Path:
    """The current run's state folder: where its config in force and its state file are.
    ConfigError where the registry is damaged: which run is current is then not known, and the
    root's is another run's as often as not."""
    reg = read(state_root)
    run = reg.runs.get(reg.current or "")
    return run.state_dir if run else Path(state_root)


def run_config(cfg: Config, run: Run) -> Config:
    """`cfg` with the run's folders: what the run's stages and children see."""
    return cfg._replace(paths=cfg.paths._replace(**{k: getattr(run, k) for k in FOLDERS}))


# ---- selecting the run a config belongs to ------------------------------------------------------

def _new_run(cfg: Config, key: str, weights: str, taken: dict[str, Run], in_place: bool,
             contract: dict[str, Any] | None = None) -> Run:
    rid, n = key, 1
    while rid in taken:
        n += 1
        rid = f"{key}-{n}"
    roots = {k: getattr(cfg.paths, k) for k in FOLDERS}
    folders = {k: root if in_place else layout.run_folder(root, rid) for k, root in roots.items()}
    contract = contract or cfg.contract_keys()
    now = time.time()
    return Run(rid, key, str(contract["model"]), weights, contract, **folders,
               in_place=in_place, created=now, last_active=now)


def select(cfg: Config, weights: str,
           in_place: tuple[dict[str, Any], str] | None = None) -> Selected:
    """The run `cfg` (its target's weights fingerprint `weights`) belongs to, made current: the
    one not forgotten whose key matches (resumed), else a new one. `in_place`: the contract keys
    and weights of folders written before runs existed (the daemon reads them from the config in
    force there), registered first as the run in place."""
    root = cfg.paths.state_dir
    key = run_key(cfg.contract_keys(), weights)
    with locked(root):
        reg = read(root)
        runs = dict(reg.runs)
        if not runs and in_place is not None:
            first = _new_run(cfg, run_key(*in_place), in_place[1], runs, True, in_place[0])
            runs[first.id] = first
        run = next((r for r in runs.values() if r.key == key and not r.forgotten), None)
        new = run is None
        if run is None:
            run = _new_run(cfg, key, weights, runs, in_place=not runs)
        run = run._replace(last_active=time.time())
        runs[run.id] = run
        before = runs.get(reg.current or "")
        if before is not None and before.id != run.id:
            runs[before.id] = before._replace(last_active=time.time())
        write(root, Registry(run.id, runs))
    return Selected(run, before if before is not None and before.id != run.id else None, new)


def find(cfg: Config, weights: str) -> Run | None:
    """The run a config would resume, without selecting it."""
    key = run_key(cfg.contract_keys(), weights)
    return next((r for r in read(cfg.paths.state_dir).runs.values()
                 if r.key == key and not r.forgotten), None)


# ---- sizes and forgetting -----------------------------------------------------------------------

def _real(path: Path) -> Path:
    return Path(os.path.realpath(path))


def _kept(reg: Registry, run: Run, roots: tuple[Path, ...]) -> set[Path]:
    """What a run's data must neither be nor hold, symlinks followed: the configured roots
    (`roots`, and the run in place's folders, which are the roots) and every other run's
    folders."""
    kept = set(roots)
    for other in reg.runs.values():
        if other.id != run.id or other.in_place:
            kept.update(getattr(other, k) for k in FOLDERS)
    return {_real(k) for k in kept}


def _holds(path: Path, kept: set[Path]) -> bool:
    """`path` is one of `kept` or holds one."""
    real = _real(path)
    return any(k == real or real in k.parents for k in kept)


def owned(reg: Registry, run: Run, folders: tuple[str, ...] = FOLDERS,
          roots: tuple[Path, ...] = ()) -> list[Path]:
    """What a run owns in its folders: each of them whole, or for the run in place everything
    in the configured roots but the install's own files. Never a path that is or holds a root
    or another run's folder, wherever [paths] nest (config_validation.py refuses nesting; a registry
    written before that, or a root moved since, may still hold it)."""
    kept = _kept(reg, run, roots)
    found = []
    for folder in (getattr(run, k) for k in folders):
        if not folder.is_dir():
            continue
        entries = ([p for p in folder.iterdir() if p.name not in layout.ROOT_SHARED]
                   if run.in_place else [folder])
        found += [p for p in entries if not _holds(p, kept)]
    return found


def _size(path: Path) -> int:
    if path.is_symlink() or not path.is_dir():
        try:
            return path.lstat().st_size
        except FileNotFoundError:
            return 0
    return sum(_size(Path(e.path)) for e in os.scandir(path))


def size(paths: list[Path]) -> int:
    """Bytes on disk under `paths` (owned's, node_owned's)."""
    return sum(_size(p) for p in paths)


def set_aside_runs(reg: Registry) -> list[Run]:
    """The runs not current and not forgotten: what `eagle3ctl forget` can reclaim."""
    return [r for r in reg.runs.values() if r.id != reg.current and not r.forgotten]


def set_aside(state_root: Path) -> list[tuple[Run, int]]:
    """The set-aside runs with their bytes on the dataset disk (a walk of their folders)."""
    reg = read(state_root)
    return [(r, size(owned(reg, r, ("dataset_dir",)))) for r in set_aside_runs(reg)]


def resolve(registry: Registry, name: str) -> Run:
    """A run named by its id or a unique prefix of it (ValueError otherwise)."""
    if name in registry.runs:
        return registry.runs[name]
    found = [r for r in registry.runs.values() if r.id.startswith(name)]
    if len(found) != 1:
        known = ", ".join(registry.runs) or "none"
        raise ValueError(f"no run {'is' if not found else 'is uniquely'} named {name!r} "
                         f"(runs: {known})")
    return found[0]


def node_folders(cfg: Config) -> tuple[str, ...]:
    """The folders a run of this node holds its own data in: on a shard that does not train,
    not the train folder, which every shard shares and only the training node writes."""
    return FOLDERS if cfg.shard.trains else tuple(k for k in FOLDERS if k != "train_dir")


def node_owned(cfg: Config, reg: Registry, run: Run) -> list[Path]:
    """What this node owns of a run: what `eagle3ctl forget` deletes and `eagle3ctl runs`
    counts, one and the same."""
    return owned(reg, run, node_folders(cfg), roots=tuple(cfg.paths))


def forget(cfg: Config, name: str, reason: str) -> tuple[Run, int]:
    """Delete a set-aside run's data and mark it forgotten; returns it and the bytes freed.
    Nothing that is or holds one of `cfg`'s [paths] (the spool included) or another run's
    folder is deleted, nor, on a shard that does not train, anything of the train folder.
    ValueError for the current run, an unknown one or one forgotten already."""
    if not reason.strip():
        raise ValueError("forgetting a run needs --reason")
    state_root = cfg.paths.state_dir
    with locked(state_root):
        reg = read(state_root)
        run = resolve(reg, name)
        if run.id == reg.current:
            raise ValueError(f"{run.id} is the current run: switch to another target first "
                             "(edit [target] and systemctl reload eagle3d)")
        if run.forgotten:
            raise ValueError(f"{run.id} was forgotten already: {run.forgotten}")
        import shutil
        doomed = node_owned(cfg, reg, run)
        freed = size(doomed)
        for path in doomed:
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
            else:
                path.unlink(missing_ok=True)
        gone = run._replace(forgotten=f"{reason.strip()} ({time.strftime('%Y-%m-%d %H:%M:%S')})")
        write(state_root, Registry(reg.current, {**reg.runs, run.id: gone}))
    return gone, freed
