"""What the chaos tests share: a small real pipeline config, quick looks at its state, real
kill -9, the orphan hunt, and the end-of-run audit that says whether anything was lost."""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import time
from pathlib import Path
from typing import Any, Callable

import psutil

from eagle3d.dataset import contract as capture_contract
from eagle3d.daemon.dump_checks import Expected, verify_many
from eagle3d.statemachine import layout, manifest
from eagle3d.statemachine.config_in_force import load_in_force
from eagle3d.statemachine.config_schema import Config
from eagle3d.statemachine.ledger import STATUSES, Ledger
from eagle3d.statemachine.statefile import read_state
from tests.conftest import write_conversations
from tests.pipeline import DaemonProcess

# Small enough that training takes seconds on two cores; the daemon's restarts are the test.
TRAIN = {"device": "cpu", "nproc": 1, "draft_vocab": 512, "ttt_steps": 2, "batch_tokens": 512,
         "warmup_steps": 2, "checkpoint_every": 3, "max_restarts": 10, "threads": 1}
EVAL = {"limit": 2, "max_new_tokens": 8, "steps": 2}


def chaos_config(config_factory: Callable, tmp_path: Path, n: int,
                 **sections: dict[str, Any]) -> Path:
    """A config over n tiny distinct conversations, with the given sections merged in."""
    source = write_conversations(tmp_path / "conv.jsonl", n)
    merged: dict[str, dict[str, Any]] = {
        "data": {"source": str(source), "format": "messages", "limit": n},
        "verify": {"spot_checks": 0},
        "extract": {"batch_tokens": 512, "max_inflight_tokens": 1024},
        "train": dict(TRAIN), "eval": dict(EVAL)}
    for k, v in sections.items():
        merged.setdefault(k, {}).update(v)
    return config_factory(merged)


# ---- looking --------------------------------------------------------------------------------

def counts(cfg: Config) -> dict[str, int]:
    """The ledger's per-status counts, read directly (cheaper than eagle3ctl in a tight poll)."""
    path = layout.ledger(cfg.paths.state_dir)
    if not path.exists():
        return {}
    try:
        with Ledger(path, readonly=True, timeout=5) as ledger:
            c = ledger.counts()
            return {s: c.get(s) for s in STATUSES}
    except sqlite3.Error:
        return {}


def state(cfg: Config) -> dict[str, Any]:
    return read_state(cfg.paths.state_dir)[0] or {}


def progress(cfg: Config) -> dict[str, Any]:
    try:
        return json.loads((cfg.paths.train_dir / "progress.json").read_text())
    except (OSError, ValueError):
        return {}


# A killed daemon leaves its state.toml, its children's pid files and the trainer's
# progress.json behind. A campaign that waits on those kills the next life before it has done
# anything (issue 19: plan lives killed before they logged a line, train lives killed before
# their trainer started). These read only what the given life wrote.

def life_state(cfg: Config, d: DaemonProcess) -> dict[str, Any]:
    """state.toml, once this life has written it."""
    st = state(cfg)
    return st if st.get("daemon", {}).get("pid") == d.proc.pid else {}


def life_child(cfg: Config, d: DaemonProcess, name: str) -> psutil.Process | None:
    """This life's child `name` (planner, engine, trainer, evaluate), running."""
    try:
        rec = json.loads((layout.children_dir(cfg.paths.state_dir) / f"{name}.json").read_text())
        child = psutil.Process(int(rec["pid"]))
        alive = child.status() != psutil.STATUS_ZOMBIE
        return child if alive and child.ppid() == d.proc.pid else None
    except (OSError, ValueError, KeyError, psutil.Error):
        return None


def trainer_progress(cfg: Config, d: DaemonProcess) -> dict[str, Any]:
    """progress.json, once this life's running trainer has rewritten it."""
    trainer = life_child(cfg, d, "trainer")
    try:
        fresh = trainer is not None and \
            (cfg.paths.train_dir / "progress.json").stat().st_mtime >= trainer.create_time()
    except (OSError, psutil.Error):
        fresh = False
    return progress(cfg) if fresh else {}


def until(d: DaemonProcess | None, predicate: Callable[[], Any], timeout: float, what: str,
          poll: float = 0.05) -> Any:
    """Poll until predicate() is truthy; a daemon that exits meanwhile fails with its log."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        if d is not None and d.proc.poll() is not None:
            raise AssertionError(f"the daemon exited ({d.proc.returncode}) while waiting for "
                                 f"{what}:\n{d.output()[-4000:]}")
        value = predicate()
        if value:
            return value
        time.sleep(poll)
    log = d.output()[-4000:] if d is not None else ""
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}\n{log}")


def events_after(cfg: Config, seq: int) -> list[tuple[int, str, str]]:
    """The ledger's events after sequence number `seq`: (seq, kind, detail)."""
    with Ledger(layout.ledger(cfg.paths.state_dir), readonly=True, timeout=5) as ledger:
        return ledger.db.execute("SELECT seq, kind, detail FROM events WHERE seq > ? "
                                 "ORDER BY seq", (seq,)).fetchall()


def last_event(cfg: Config) -> int:
    with Ledger(layout.ledger(cfg.paths.state_dir), readonly=True, timeout=5) as ledger:
        return ledger.db.execute("SELECT max(seq) FROM events").fetchone()[0] or 0


# ---- processes ------------------------------------------------------------------------------

def kill9(d: DaemonProcess) -> None:
    """kill -9 of the daemon alone (not its group): what the OOM killer or a crash does."""
    d.proc.send_signal(signal.SIGKILL)
    d.proc.wait()
    d.log.close()


def processes_of(config: Path) -> list[psutil.Process]:
    """Every live process working for this config: the daemon, engine, planner, trainer ranks
    and evaluation all carry a path of the test's folder on their command line (the config,
    or a copy of it that the daemon keeps in its state folder)."""
    me = os.getpid()
    folder = f"{config.parent}/"
    found = []
    for p in psutil.process_iter(["pid", "cmdline", "status"]):
        try:
            if p.pid != me and p.info["status"] != psutil.STATUS_ZOMBIE and \
                    folder in " ".join(p.info["cmdline"] or []):
                found.append(p)
        except psutil.Error:
            continue
    return found


def describe(procs: list[psutil.Process]) -> str:
    out = []
    for p in procs:
        try:
            out.append(f"pid {p.pid} ({' '.join(p.cmdline())[:160]})")
        except psutil.Error:
            out.append(f"pid {p.pid} (gone)")
    return "; ".join(out)


def orphans_after_kill(config: Path, grace: float = 30.0) -> list[psutil.Process]:
    """What is still working for the config `grace` seconds after the daemon was killed:
    children must die with the daemon (PR_SET_PDEATHSIG, process groups). Trainer ranks first
    finish their step and write a checkpoint, by design; two ranks on a busy 2-core machine
    took more than 3 s for it. 30 s is the unit's RestartSec: the soonest systemd starts the
    next life."""
    deadline = time.time() + grace
    while (left := processes_of(config)) and time.time() < deadline:
        time.sleep(0.1)
    return left


def end(procs: list[psutil.Process]) -> None:
    """End processes this test found orphaned, by their pid, so that the next life and the next
    test are not disturbed by them."""
    for p in procs:
        try:
            p.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(procs, timeout=10)


def rank_processes(trainer_pid: int) -> list[psutil.Process]:
    """The trainer ranks under the daemon's trainer child (our launcher's on one node,
    torchrun's workers on several)."""
    try:
        kids = psutil.Process(trainer_pid).children(recursive=True)
    except psutil.Error:
        return []
    return [k for k in kids if "eagle3d.drafter.train" in " ".join(_cmd(k))
            and "torch.distributed.run" not in " ".join(_cmd(k))]


def _cmd(p: psutil.Process) -> list[str]:
    try:
        return p.cmdline()
    except psutil.Error:
        return []


# ---- the audit ------------------------------------------------------------------------------

def audit(config: Path, planned: int, trained: bool) -> int:
    """Everything the issue promises after chaos, checked from the files; returns the number of
    samples lost (planned, but neither verified nor excluded). Raises on any other breach. Of
    the current run: its folders are the config in force's."""
    cfg = load_in_force(config)
    problems: list[str] = []
    with Ledger(layout.ledger(cfg.paths.state_dir), readonly=True) as ledger:
        kept = dict(ledger.db.execute("SELECT status, n FROM counts").fetchall())
        real = dict(ledger.db.execute("SELECT status, count(*) FROM samples GROUP BY status"))
        for s in STATUSES:
            if kept.get(s, 0) != real.get(s, 0):
                problems.append(f"ledger count of {s} is {kept.get(s, 0)}, the rows say "
                                f"{real.get(s, 0)}")
        total = sum(real.values())
        skipped = ledger.skipped_count()
        if total + skipped != planned:
            problems.append(f"{planned} conversations, the ledger holds {total} samples and "
                            f"{skipped} skipped")
        unfinished = {s: real[s] for s in ("pending", "inflight", "extracted", "failed")
                      if real.get(s)}
        if unfinished:
            problems.append(f"samples not verified at the end: {unfinished}")
        lost = planned - real.get("verified", 0) - real.get("excluded", 0) - skipped
        rows = ledger.samples("verified", limit=10**9)
        try:
            manifest.check(manifest.read(cfg.paths.dataset_dir), ledger)
        except manifest.ManifestMismatch as exc:
            problems.append(str(exc))
    contract = capture_contract.read(cfg.paths.dataset_dir)
    paths = [r.path for r in rows]
    if len(set(paths)) != len(paths) or len({r.id for r in rows}) != len(rows):
        problems.append("two verified samples share a file or an id")
    items = [Expected(id=r.id, path=str(cfg.paths.dataset_dir / r.path), tokens=r.tokens,
                      loss_tokens=r.loss_tokens, ids_hash=r.ids_hash, checksum=r.checksum or "",
                      contract_fingerprint=contract["fingerprint"],
                      hidden_size=contract["hidden_size"],
                      dtype=capture_contract.dump_dtype(contract))
             for r in rows]
    for sid, problem, _ in verify_many(items, 2):
        if problem:
            problems.append(f"dataset file of {sid} does not verify: {problem}")
    expected = set(paths) | {layout.manifest_file(cfg.paths.dataset_dir).name,
                              layout.contract_file(cfg.paths.dataset_dir).name}
    if cfg.shard.count > 1:  # a shard publishes its state file beside its manifest
        expected.add(layout.published_state(cfg.paths.dataset_dir).name)
    # Other runs live under the first run's folders (statemachine/runs.py): not its files.
    on_disk = {str(p.relative_to(cfg.paths.dataset_dir)) for p in cfg.paths.dataset_dir.rglob("*")
               if not p.is_dir() and p.relative_to(cfg.paths.dataset_dir).parts[0] != "runs"}
    if on_disk - expected:
        problems.append(f"orphan files in the dataset: {sorted(on_disk - expected)[:10]}")
    spool = [p.name for p in Path(cfg.paths.spool_dir).iterdir() if p.name != "rejected"] \
        if Path(cfg.paths.spool_dir).exists() else []
    if spool:
        problems.append(f"orphan files in the spool: {sorted(spool)[:10]}")
    left = processes_of(config)
    if left:
        problems.append(f"orphan processes at the end: {describe(left)}")
        end(left)
    if trained:
        done = cfg.paths.train_dir / "done.json"
        if not done.exists() or not (cfg.paths.train_dir / "export" / "config.json").exists():
            problems.append("no drafter: done.json or export/config.json is missing")
        train = cfg.paths.train_dir
        debris = [str(p.relative_to(train)) for p in (*train.glob(".*"),
                                                        *(train / "checkpoints").glob(".*"))]
        if debris:
            problems.append(f"partial checkpoints, exports or files left in the train folder: "
                            f"{debris}")
    assert not problems, "after chaos:\n  " + "\n  ".join(problems)
    return lost
