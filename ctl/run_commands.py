"""`eagle3ctl runs` and `eagle3ctl forget`: the runs of an install (statemachine/runs.py), one
per capture contract, read without the daemon; forgetting deletes a set-aside run's data."""

from __future__ import annotations

import argparse
import sqlite3
import sys
import time
from typing import Any

from eagle3d.statemachine import layout, runs
from eagle3d.statemachine.config_schema import Config, human_bytes
from eagle3d.statemachine.config_validation import ConfigError
from eagle3d.statemachine.ledger import Ledger, LedgerError
from eagle3d.statemachine.statefile import read_state


def describe(cfg: Config, reg: runs.Registry, run: runs.Run) -> dict[str, Any]:
    """One run as `eagle3ctl runs` shows it on this node: its bytes are what this node owns of
    it (a shard that does not train shares the training node's train folder, never counted)."""
    current = run.id == reg.current
    state, _ = read_state(run.state_dir)
    out: dict[str, Any] = {
        "id": run.id, "current": current, "target": run.model, "fingerprint": run.key[-8:],
        "weights": run.weights, "contract": run.contract, "stage": (state or {}).get("underlying", "not started"),
        "samples": {}, "bytes": 0, "created": run.created,
        "last_active": time.time() if current else run.last_active,
        "drafter": None, "acceptance_length": None, "forgotten": run.forgotten,
        "folders": {k: str(getattr(run, k)) for k in runs.FOLDERS}}
    if run.forgotten:
        out["stage"] = "forgotten"
        return out
    out["bytes"] = runs.size(runs.node_owned(cfg, reg, run))
    try:
        with Ledger(layout.ledger(run.state_dir), readonly=True, timeout=2.0) as ledger:
            counts = ledger.counts()
            out["samples"] = {"total": counts.total, "verified": counts.get("verified"),
                              "extracted": counts.get("extracted"),
                              "pending": counts.get("pending"), "failed": counts.get("failed")}
    except (LedgerError, sqlite3.Error):
        pass  # not planned yet, or busy: the run's other figures still stand
    from eagle3d.statemachine import train_files  # runs only: status's run line needs none
    done = train_files.read_done(run.train_dir)
    if done:
        out["drafter"], out["acceptance_length"] = done.get("export"), done.get("acceptance_length")
    return out


def _row(r: dict[str, Any]) -> str:
    s = r["samples"]
    counts = f"{s.get('verified', 0)}/{s.get('total', 0)} verified" if s else "-"
    active = time.strftime("%Y-%m-%d %H:%M", time.localtime(r["last_active"]))
    drafter = (f"drafter {r['drafter']} (acceptance length {r['acceptance_length']:.2f})"
               if r["drafter"] and r["acceptance_length"] else
               f"drafter {r['drafter']}" if r["drafter"] else "no drafter yet")
    mark = "*" if r["current"] else " "
    c = r["contract"]  # what tells two runs of one target apart, most often
    target = (f"{r['target']} ({c.get('dtype')}, dumps {c.get('dump_dtype')}, layers "
              f"{c.get('aux_layers')}, {c.get('source')} from {c.get('first')})")
    if r["forgotten"]:
        return f"{mark} {r['id']}  {target}  forgotten: {r['forgotten']}"
    return (f"{mark} {r['id']}  {target}  {r['stage']}  {counts}  "
            f"{human_bytes(r['bytes'])}  last active {active}  {drafter}")


def cmd_runs(cfg: Config, args: argparse.Namespace) -> int:
    reg = runs.read(cfg.paths.state_dir)
    rows = [describe(cfg, reg, r) for r in reg.runs.values()]
    if args.json:
        import json
        print(json.dumps({"current": reg.current, "runs": rows}, indent=2))
    elif not rows:
        print(f"no runs yet under {cfg.paths.state_dir} (the daemon has not run with this config)")
    else:
        print("\n".join(_row(r) for r in rows) + "\n(* the current run)")
    return 0


def cmd_forget(cfg: Config, args: argparse.Namespace) -> int:
    try:
        run, freed = runs.forget(cfg, args.run, args.reason)
    except (ValueError, ConfigError, OSError) as exc:  # OSError: not the daemon's user, say
        print(f"eagle3ctl: {exc}", file=sys.stderr)
        return 1
    message = f"{run.id} forgotten, {human_bytes(freed)} freed: {args.reason}"
    reg = runs.read(cfg.paths.state_dir)
    current = reg.runs.get(reg.current or "")
    if current is not None and layout.ledger(current.state_dir).exists():
        with Ledger(layout.ledger(current.state_dir)) as ledger:
            ledger.event("run_forgotten", message)
    print(message)
    return 0


def run_line(published: dict[str, Any]) -> str:
    """`eagle3ctl status`'s line about runs: the current one, and the others in one line."""
    aside = published.get("set_aside", [])
    line = f"run       {published.get('id', '?')}"
    if published.get("switched"):
        line += f" ({published['switched']})"
    if aside:
        total = sum(r["bytes"] for r in aside)
        line += (f" · {len(aside)} set aside ({human_bytes(total)} on the dataset disk): "
                 "eagle3ctl runs")
    return line
