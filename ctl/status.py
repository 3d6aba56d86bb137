"""`eagle3ctl status`: everything it shows, collected as one JSON-able dict from the state file,
the ledger and the daemon's pointer, its exit code, and the lines it prints. Nothing heavy is
imported here (see tests/test_ctl.py's cost test): status answers in a blink on a loaded box."""

from __future__ import annotations

import os
import sqlite3
import time
from typing import Any

from eagle3d.ctl import stage_views
from eagle3d.ctl.exit_codes import (EDIT_NOT_APPLIED, FAILED, LOOP_CONDITION, NOT_RUNNING,
                                    SHARD_DOWN, WAITS_FOR_OPERATOR)
from eagle3d.daemon.progress import human_s
from eagle3d.statemachine import layout, ledger as ledger_file
from eagle3d.statemachine.config_schema import Config, human_bytes
from eagle3d.statemachine.ledger import STATUSES, Ledger, LedgerError
from eagle3d.statemachine.stages import gate
from eagle3d.statemachine.statefile import read_state

HEARTBEAT_STALE_S = 15.0
# Another shard's heartbeat, written on its host: that host's clock and the shared file
# system's caching come on top of the daemon's own stale bound.
SHARD_STALE_S = 60.0


def _clock(t: float) -> str:
    """A wall-clock time of today, as status shows every "since"."""
    return time.strftime('%H:%M:%S', time.localtime(t))


def _aged(node: Any, since_write: float) -> Any:
    """`node` with every `age_s` the daemon published (as of its write, on its monotonic clock)
    brought to now by the time since that write alone: a wall-clock step skews an age for one
    tick at most, where an age taken from a wall-clock "since" stays off by the step."""
    if isinstance(node, dict):
        return {k: round(v + since_write, 1) if k == "age_s" and isinstance(v, (int, float))
                else _aged(v, since_write) for k, v in node.items()}
    if isinstance(node, list):
        return [_aged(v, since_write) for v in node]
    return node


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def collect_status(cfg: Config, running: dict[str, Any] | None) -> dict[str, Any]:
    """Everything `status` shows, as one JSON-able dict, for the config in force `cfg` and the
    daemon's pointer `running` (pointer.read's, None where none runs). Counts come from the
    ledger (the truth) when it can be read, else from the state file."""
    state, problem = read_state(cfg.paths.state_dir)
    state = state or {}
    out: dict[str, Any] = {"config": str(cfg.path), "state_problem": problem}
    out["stage"] = state.get("stage", "not started")
    out["reason"] = state.get("reason", problem or "")
    out["since"] = state.get("since")
    samples = dict(state.get("samples", {}))
    tokens = dict(state.get("tokens", {"done": 0, "total": 0}))
    blocking: list[dict[str, Any]] = []
    ledger_problem = None
    try:
        with Ledger(layout.ledger(cfg.paths.state_dir), readonly=True, timeout=2.0) as ledger:
            counts = ledger.counts()
            samples.update({s: counts.get(s) for s in STATUSES})
            samples["total"] = counts.total
            samples["skipped"] = ledger.skipped_count()
            tokens = {"done": counts.done_tokens, "total": counts.wanted_tokens}
            g = gate(counts, cfg.shard.count > 1)
            out["gate"] = {"open": g.open, "describe": g.describe(),
                           "waits_for_operator": g.waits_for_operator}
            for s in ledger.samples("failed", limit=5):
                blocking.append({"id": s.id, "status": s.status, "attempts": s.attempts,
                                 "error": s.error})
            out["skipped_reasons"] = ledger.skipped_reasons()
    except LedgerError as exc:  # none yet, or of a newer eagle3d
        if state:
            ledger_problem = f"ledger not readable ({exc}); counts are from state.toml"
        out["gate"] = state.get("gate", {})
    except sqlite3.Error as exc:  # locked, or damaged: said whether or not the daemon ran
        what, passing = ledger_file.problem(layout.ledger(cfg.paths.state_dir), exc)
        ledger_problem = (f"ledger not readable{' right now' if passing else ''} ({what})"
                          + ("; counts are from state.toml" if state else ""))
        out["gate"] = state.get("gate", {})
    out["ledger_problem"] = ledger_problem
    for s in STATUSES + ("total", "skipped"):
        samples.setdefault(s, 0)
    out["samples"] = samples
    out["tokens"] = tokens
    out["blocking"] = blocking
    out["rate"] = state.get("rate", {})
    out["eta_s"] = state.get("eta_s")
    out["bytes"] = state.get("bytes", {})
    out["disk"] = state.get("disk", [])
    out["state_reserve"] = state.get("state_reserve")
    since_write = time.time() - state.get("updated", time.time())
    out.update({view.key: _aged(state.get(view.key, view.empty), since_write)
                for view in stage_views.VIEWS})
    out["config_problem"] = state.get("config", {}).get("problem")
    out["run"] = state.get("run", {})
    out["config_problem_since"] = state.get("config", {}).get("problem_since")
    out["metrics_problem"] = state.get("metrics", {}).get("problem")
    out["paused_by"] = state.get("paused_by")
    out["condition"] = state.get("condition")
    d, out["state_stale"] = _heartbeat(state, running)
    age = time.time() - d["heartbeat"] if "heartbeat" in d else None
    alive = bool(d.get("alive") and d.get("pid") and age is not None and age < HEARTBEAT_STALE_S
                 and _pid_alive(int(d["pid"])))
    out["daemon"] = {"pid": d.get("pid"), "alive": alive,
                     "heartbeat_age_s": None if age is None else round(age, 2)}
    if cfg.shard.count > 1:
        from eagle3d.ctl import shard_view  # only a sharded dataset has shards to show
        # Every shard is expected from the moment this node's run began (runs.toml's created):
        # a restart of this node's daemon starts no new clock for a shard missing for days.
        since = out["run"].get("created")
        out["shards"] = [{**sh, "problem": None if sh["name"] == cfg.shard.name else
                          shard_problem(sh, since)} for sh in shard_view.collect(cfg)]
        # The training node answers for every shard: operations.md pages on its exit code.
        out["shards_down"] = [f"{sh['name']}: {sh['problem']}" for sh in out["shards"]
                              if sh["problem"] and cfg.shard.trains]
    return out


def _heartbeat(state: dict[str, Any], running: dict[str, Any] | None
               ) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """The daemon's part of the state file, and None; or, where the running daemon's pointer
    holds a newer heartbeat because the state file cannot be written (its disk read-only or
    full), that heartbeat, and why the state file is stale, since when and from when the state
    shown is."""
    d = state.get("daemon", {})
    stale = (running or {}).get("stale_state")
    if not stale or stale["heartbeat"] <= d.get("heartbeat", float("-inf")):
        return d, None
    return ({"pid": running["pid"], "alive": True, "heartbeat": stale["heartbeat"]},
            {"problem": stale["problem"], "since": stale["since"],
             "shown_from": state.get("updated")})


def shard_problem(sh: dict[str, Any], expected_since: float | None) -> str | None:
    """Why another shard needs a person, from the state it published (shard_view.collect), or
    from its silence where it never published and this node's run has expected it (since
    `expected_since`, the run's beginning) past the stale bound; None while it works, once it
    is done, and before the bound."""
    if not sh["published"]:
        expected_s = None if expected_since is None else time.time() - expected_since
        if expected_s is None or expected_s <= SHARD_STALE_S:
            return None
        began = time.strftime("%Y-%m-%d %H:%M", time.localtime(expected_since))
        return (f"never heard from: expected since {began} ({human_s(expected_s)}, when this "
                f"node's run began), nothing published in {sh['folder']} (its daemon never "
                "started, or writes another folder or cannot reach this one)")
    if sh["underlying"] in (None, "done"):
        return None
    age = sh["heartbeat_age_s"]
    if not sh["alive"]:
        return f"not running: stopped {human_s(age)} ago before it was done"
    if age is None or age > SHARD_STALE_S:
        return f"stale: no heartbeat for {human_s(age)} (its daemon is dead or hung)"
    if sh["stage"] == "failed":
        return "failed: " + sh["reason"]
    if waits_for_operator(sh):
        return "waiting for an operator: " + sh["reason"]
    if sh["config_problem"]:
        return "its last config edit was not applied: " + sh["config_problem"]
    return None


def waits_for_operator(st: dict[str, Any]) -> bool:
    """At the training gate with failed samples, or behind a disk budget: a person is needed."""
    return bool(st.get("gate", {}).get("waits_for_operator") or st.get("paused_by") == "budget")


def status_code(st: dict[str, Any]) -> int:
    """The module docstring's codes: a monitoring check pages on anything but 0 (a run stuck at
    the training gate, or behind a budget, is not lost time for nobody to notice)."""
    if not st["daemon"]["alive"]:
        return NOT_RUNNING
    if st["stage"] == "failed":
        return FAILED
    if st.get("condition") or st["state_stale"]:
        return LOOP_CONDITION
    if st.get("config_problem"):
        return EDIT_NOT_APPLIED
    if waits_for_operator(st):
        return WAITS_FOR_OPERATOR
    if st.get("shards_down"):
        return SHARD_DOWN
    return 0


def _daemon_line(d: dict[str, Any]) -> str:
    if d["alive"]:
        return f"daemon    running, pid {d['pid']}, heartbeat {d['heartbeat_age_s']:.1f}s ago"
    if d.get("pid"):
        return (f"daemon    NOT RUNNING (last pid {d['pid']}, last heartbeat "
                f"{human_s(d.get('heartbeat_age_s'))} ago)")
    return "daemon    NOT RUNNING"


def _problem_lines(st: dict[str, Any]) -> list[str]:
    """A state file the daemon cannot write and the loop's condition (while the daemon runs),
    and a config edit not applied."""
    lines = []
    stale = st["state_stale"]
    if stale and st["daemon"]["alive"]:
        shown = f"from {_clock(stale['shown_from'])}" if stale["shown_from"] else "none yet"
        lines.append(f"state     not written since {_clock(stale['since'])} ({stale['problem']}); "
                     f"the state shown is {shown}")
    condition = st.get("condition")
    if condition and st["daemon"]["alive"]:
        lines.append(f"condition {condition['reason']} since {_clock(condition['since'])}: "
                     f"{condition['retries']} failed ticks, the next try in "
                     f"{condition['retry_in_s']:.0f} s")
    if st.get("config_problem"):
        since = st.get("config_problem_since")
        lines.append("config    " + (f"since {_clock(since)}: "
                                     if since else "") + st["config_problem"])
    return lines


def _samples_line(s: dict[str, Any]) -> str:
    # The two states before pending exist only where the target writes the answers.
    shown = [k for k in STATUSES if s.get(k) or k not in ("ungenerated", "generating")]
    return ("samples   " + " · ".join(f"{k} {s.get(k, 0):,}" for k in ("total", *shown)) +
            f" · skipped {s['skipped']:,}")


def _disk_line(st: dict[str, Any]) -> str:
    b = st.get("bytes", {})
    parts = [f"{x['role'].replace('_dir', '')} {human_bytes(x['free'])} free"
             for x in st.get("disk", []) if x["role"] != "train_dir"]
    reserve = st.get("state_reserve")
    if reserve and parts:
        parts[-1] += (f" (its reserve of {human_bytes(reserve['bytes'])} "
                      f"{'held' if reserve['held'] else 'given up: the disk is full'})")
    return "disk      " + " · ".join(parts + [
        f"written {human_bytes(b.get('written', 0))} of {human_bytes(b.get('projected', 0))} "
        "projected"])


def render_status(st: dict[str, Any]) -> str:
    since = f" (since {_clock(st['since'])})" if st.get("since") else ""
    lines = [f"stage     {st['stage']}{since}: {st['reason']}", _daemon_line(st["daemon"]),
             *_problem_lines(st)]
    if st.get("run"):
        from eagle3d.ctl.run_commands import run_line  # only where the daemon published runs
        lines.append(run_line(st["run"]))
    lines += [stage_views.progress(st), _samples_line(st["samples"]), stage_views.rate(st),
              _disk_line(st)]
    for view in stage_views.VIEWS:
        lines += view.lines(st.get(view.key, view.empty))
    if st.get("shards"):
        from eagle3d.ctl import shard_view
        lines += shard_view.render(st["shards"])
    g = st.get("gate", {})
    if g and not (g.get("open") and st["stage"] == "failed"):  # open, but nothing goes through
        lines.append(f"gate      {g.get('describe', '?')}")
    for blk in st.get("blocking", []):
        lines.append(f"  failed  {blk['id']}  attempts {blk['attempts']}: {blk['error']}")
    lines += [f"note      {st[note]}" for note in ("ledger_problem", "metrics_problem")
              if st.get(note)]
    return "\n".join(lines)


