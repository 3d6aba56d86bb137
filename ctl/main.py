"""`eagle3ctl`: read the truth, and ask the daemon for actions.

It reads state.toml and the ledger read-only, works while the daemon is down, and imports
nothing heavy (no torch, transformers or numpy), so it answers in a blink on a loaded box.
Exit codes (a monitor or a script branches on them):
  0  status: running and healthy · check-config: valid; a reload applies it live or switches runs
  1  status: the pipeline failed (the reason says what to do)
  2  the config does not validate, or the command line is wrong; status: the run registry
     (runs.toml) is damaged, the one line says so (the daemon refuses to start with it too)
  3  status: the daemon is not running
  4  status: running, but waiting for an operator: the training gate (failed samples), or a
     disk budget's pause (the message names the [budget] key)
  5  status: running, but the last edit of the config was not applied (its reload was refused)
  6  check-config: valid, but it takes a restart of the daemon (the keys are named)
  7  check-config: valid, but the daemon would refuse it (why is named)
  8  status on the training node of a sharded dataset: another shard is stale (its heartbeat
     older than a minute), never heard from (nothing published a minute after this node's
     run began, whatever restarts of its daemon since), stopped before it was done, failed or waiting for an operator (its line says
     which: "stale: no heartbeat for 3d 00h", "never heard from: ...", "failed: ...")
  9  status: running, but its loop fails and retries by itself: a condition, with its reason
     and since when ("ledger locked since 10:41:07", a full state disk); or it cannot write its
     state file (the state disk read-only): since when, and from when the state shown is
  75 pause, resume, retry, exclude, verify: the daemon runs, but its state disk cannot be
     written (read-only or full), so the request was not delivered: send it again once status
     no longer shows its 'state not written' line
"""

from __future__ import annotations

import argparse
import functools
import os
import sqlite3
import sys
import time
from pathlib import Path
from typing import Any, Callable

from eagle3d.capture import engines
from eagle3d.ctl import stage_views
from eagle3d.daemon.completion import add_completion_option
from eagle3d.daemon.progress import human_s
from eagle3d.statemachine import layout, ledger as ledger_file, pointer
from eagle3d.statemachine.config_in_force import load_in_force
from eagle3d.statemachine.config_schema import Config, human_bytes, tables
from eagle3d.statemachine.config_validation import ConfigError, load_config
from eagle3d.statemachine.ledger import STATUSES, Ledger, LedgerError
from eagle3d.statemachine.stages import gate
from eagle3d.statemachine.statefile import read_state
from eagle3d.statemachine.version import VERSION

DEFAULT_CONFIG = "/etc/eagle3d/eagle3d.toml"
HEARTBEAT_STALE_S = 15.0
# Another shard's heartbeat, written on its host: that host's clock and the shared file
# system's caching come on top of the daemon's own stale bound.
SHARD_STALE_S = 60.0
ACK_TIMEOUT_S = 10.0


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


# ---- status ---------------------------------------------------------------------------------

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


FAILED, BAD_CONFIG, NOT_RUNNING = 1, 2, 3
WAITS_FOR_OPERATOR = 4
EDIT_NOT_APPLIED = 5
NEEDS_RESTART_CODE, RELOAD_REFUSED = 6, 7
SHARD_DOWN = 8
LOOP_CONDITION = 9
NOT_NOW = 75  # a request not delivered for now (EX_TEMPFAIL, as `eagle3d run`'s "not now")


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


def results_summary(config_path: str) -> str:
    """Where the results are, for the end of `eagle3d run --until`: the current run's (after a
    switch, under `runs/<run>/`), never the configured roots' first run."""
    try:
        cfg = load_in_force(config_path)
    except ConfigError as exc:
        return str(exc)
    lines = [f"state:    {cfg.paths.state_dir}  (eagle3ctl -c {config_path} status)",
             f"dataset:  {cfg.paths.dataset_dir}"]
    from eagle3d.statemachine import train_files
    export = layout.export_dir(cfg.paths.train_dir)
    if export.exists():
        lines.append(f"drafter:  {export}  (SGLang: --speculative-algorithm EAGLE3 "
                     f"--speculative-draft-model-path {export})")
    result = train_files.read_eval(cfg.paths.train_dir)
    if result is not None:
        low, high = result.get("acceptance_length_ci95") or (float("nan"), float("nan"))
        lines.append(f"acceptance length: {result['acceptance_length']:.3f} tokens per target "
                     f"forward (95% interval {low:.3f}-{high:.3f}) over {result.get('prompts')} "
                     f"held-out prompts ({layout.eval_file(cfg.paths.train_dir)})")
    return "\n".join(lines)


# ---- check-config ---------------------------------------------------------------------------

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


def load_for_command(path: str, command: str) -> Config:
    """check-config: the operator's file; runs and forget: its folders, under which the runs
    live. Everything else is about what is in force: the running daemon's config in force (its
    current run's), found by the file's path whatever its [paths] say now (an edit refused until
    a restart must not hide the daemon), else the one its state folder's registry names. Each
    as the engines read it (engines.checked), as the daemon loads it."""
    if command in ("check-config", "runs", "forget"):
        cfg = load_config(path)
    else:
        running = pointer.read(Path(path))
        cfg = load_config(running["in_force"]) if running else load_in_force(path)
    return engines.checked(cfg)


# ---- commands -------------------------------------------------------------------------------

def cmd_status(cfg: Config, args: argparse.Namespace) -> int:
    while True:
        st = collect_status(cfg, pointer.read(Path(args.config)))
        if args.json:
            import json  # only --json needs it: status starts faster
            print(json.dumps(st, indent=None if args.watch else 2))
        else:
            if args.watch and sys.stdout.isatty():
                print("\033[2J\033[H", end="")
            print(render_status(st))
        if not args.watch:
            return status_code(st)
        sys.stdout.flush()
        try:
            time.sleep(args.interval)
        except KeyboardInterrupt:
            return status_code(st)


def _request(cfg: Config, config: Path, verb: str, payload: dict[str, Any]) -> int:
    from eagle3d.daemon import control  # only requests need it: status starts faster
    st = collect_status(cfg, pointer.read(config))
    if not st["daemon"]["alive"]:
        print(f"the daemon is not running (state in {cfg.paths.state_dir}); start it "
              "(systemctl start eagle3d, or eagle3d run -c FILE) and try again", file=sys.stderr)
        return NOT_RUNNING
    if st["state_stale"]:  # the control folder lies on that disk: nothing can reach the daemon
        print(f"the daemon runs (pid {st['daemon']['pid']}), but its state disk cannot be "
              f"written ({st['state_stale']['problem']}): the request was not delivered; "
              "send it again once eagle3ctl status no longer shows a 'state not written' line",
              file=sys.stderr)
        return NOT_NOW
    reply = control.send(cfg.paths.state_dir, verb, payload, ACK_TIMEOUT_S)
    if reply is None:
        print(f"the daemon did not answer within {ACK_TIMEOUT_S:.0f} s; the request was "
              "withdrawn", file=sys.stderr)
        return 1
    print(reply["message"], file=sys.stdout if reply["ok"] else sys.stderr)
    return 0 if reply["ok"] else 1


def cmd_samples(cfg: Config, args: argparse.Namespace) -> int:
    with Ledger(layout.ledger(cfg.paths.state_dir), readonly=True, timeout=2.0) as ledger:
        rows = ledger.samples(args.status, args.limit)
    if args.json:
        import json
        print(json.dumps([r._asdict() for r in rows], indent=2))
        return 0
    for r in rows:
        detail = r.error or r.reason or r.path or ""
        print(f"{r.id}  {r.status:9s} idx {r.idx:7d}  {r.tokens:6d} tokens  "
              f"attempts {r.attempts}  {detail}")
    return 0


def cmd_events(cfg: Config, args: argparse.Namespace) -> int:
    with Ledger(layout.ledger(cfg.paths.state_dir), readonly=True, timeout=2.0) as ledger:
        for t, kind, sample, detail in ledger.recent_events(args.limit):
            stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t))
            print(f"{stamp}  {kind:16s} {sample or '-':32s}  {detail or ''}")
    return 0


def cmd_eval(cfg: Config, args: argparse.Namespace) -> int:
    import subprocess
    argv = [sys.executable, "-m", "eagle3d.drafter.evaluate", "-c", str(cfg.path)]
    for flag in ("drafter", "source", "prompts", "first", "limit", "steps", "topk",
                 "num_draft_tokens", "max_new_tokens", "batch_size"):
        value = getattr(args, flag)
        if value is not None:
            argv += [f"--{flag.replace('_', '-')}", str(value)]
    argv += [f"--{flag.replace('_', '-')}" for flag in ("every_turn", "json")
             if getattr(args, flag)]
    return subprocess.call(argv)


def cmd_export(cfg: Config, args: argparse.Namespace) -> int:
    """In a child: the export needs torch (and speculators for its format), eagle3ctl none."""
    import subprocess
    argv = [sys.executable, "-m", "eagle3d.drafter.export", "-c", str(cfg.path),
            "--format", args.format]
    for flag in ("drafter", "out"):
        if getattr(args, flag) is not None:
            argv += [f"--{flag}", getattr(args, flag)]
    return subprocess.call(argv)


def cmd_engine_command(cfg: Config, args: argparse.Namespace) -> int:
    """The command of each process that runs the target: where the target writes the answers,
    the generate stage's first, each under a comment naming it."""
    spec = engines.get(cfg.target.engine)
    try:
        commands = [spec.generate_command(cfg)] if cfg.data.responses == "target" else []
        commands.append(spec.capture_command(cfg))
    except engines.EngineUnavailable as exc:
        print(exc, file=sys.stderr)
        return 1
    for what, argv, env in commands:
        if len(commands) > 1:
            print(f"# {what}")
        print(engines.shell_line(argv, env))
    return 0


def _formatter(prog: str) -> argparse.HelpFormatter:
    # Left to itself, argparse imports shutil (and with it bz2, lzma, zlib: ~2 ms) to ask for
    # the terminal width every time it builds a parser, help printed or not.
    try:
        width = os.get_terminal_size().columns
    except OSError:
        width = 80
    return argparse.RawDescriptionHelpFormatter(prog, width=width - 2)


def _status_args(s: argparse.ArgumentParser) -> None:
    s.add_argument("--json", action="store_true")
    s.add_argument("--watch", action="store_true", help="refresh until Ctrl-C")
    s.add_argument("--interval", type=float, default=2.0)


def _pause_args(s: argparse.ArgumentParser) -> None:
    s.add_argument("--reason", default="")


def _retry_args(s: argparse.ArgumentParser) -> None:
    s.add_argument("ids", nargs="*")
    s.add_argument("--failed", action="store_true", help="every failed sample")


def _exclude_args(s: argparse.ArgumentParser) -> None:
    s.add_argument("ids", nargs="+")
    s.add_argument("--reason", required=True)


def _verify_args(s: argparse.ArgumentParser) -> None:
    s.add_argument("--full", action="store_true", required=True,
                   help="re-read every verified sample too, not only new ones")


def _samples_args(s: argparse.ArgumentParser) -> None:
    s.add_argument("--status", choices=STATUSES)
    s.add_argument("--limit", type=int, default=50)
    s.add_argument("--json", action="store_true")


def _events_args(s: argparse.ArgumentParser) -> None:
    s.add_argument("--limit", type=int, default=30)


def _forget_args(s: argparse.ArgumentParser) -> None:
    s.add_argument("run", help="the run's id (eagle3ctl runs), or a unique prefix of it")
    s.add_argument("--reason", required=True)


def _eval_args(s: argparse.ArgumentParser) -> None:
    s.add_argument("--drafter", help="export folder (default: the current run's export)")
    where = s.add_mutually_exclusive_group()
    where.add_argument("--source", help="conversations (default [eval] source)")
    where.add_argument("--prompts", help="a file of prompts: MT-bench questions, OpenAI-style "
                                         "messages or ShareGPT (detected)")
    s.add_argument("--every-turn", action="store_true",
                   help="every user turn, after the target's own earlier answers")
    s.add_argument("--first", type=int)
    s.add_argument("--limit", type=int)
    s.add_argument("--steps", type=int, help="SGLang's --speculative-num-steps")
    s.add_argument("--topk", type=int, help="SGLang's --speculative-eagle-topk (1: a chain)")
    s.add_argument("--num-draft-tokens", type=int,
                   help="SGLang's --speculative-num-draft-tokens (a tree's size)")
    s.add_argument("--max-new-tokens", dest="max_new_tokens", type=int)
    s.add_argument("--batch-size", dest="batch_size", type=int)
    s.add_argument("--json", action="store_true")


def _export_args(s: argparse.ArgumentParser) -> None:
    s.add_argument("--format", choices=layout.EXPORT_FORMATS, required=True,
                   help="SGLang's layout (what training writes) or speculators' (vLLM's)")
    s.add_argument("--drafter", help="SGLang export to read (default: the current run's)")
    s.add_argument("--out", help="folder to write (default: the current run's export, or "
                                 "export-speculators beside it)")


COMMANDS: dict[str, tuple[str, Callable[[argparse.ArgumentParser], None] | None]] = {
    "status": ("where the pipeline is (exit codes below)", _status_args),
    "check-config": ("validate the config file and say what a reload would do with it", None),
    "pause": ("stop dispatching new work (in-flight work finishes)", _pause_args),
    "resume": ("undo pause", None),
    "retry": ("give failed samples (or the given ids) fresh attempts", _retry_args),
    "exclude": ("take samples out of the dataset, with a written reason", _exclude_args),
    "verify": ("ask for verification", _verify_args),
    "samples": ("list samples", _samples_args),
    "events": ("the ledger's event log, newest last", _events_args),
    "eval": ("measure a drafter's acceptance length with the real target", _eval_args),
    "export": ("write the trained drafter in SGLang's or speculators' (vLLM's) format",
               _export_args),
    "engine-command": ("print the exact command of each process that runs the target", None),
    "runs": ("every run (one per capture contract): target, stage, counts, bytes, drafter",
             lambda s: s.add_argument("--json", action="store_true")),
    "forget": ("delete a set-aside run's data, with a written reason", _forget_args),
}


def _command_word(argv: list[str]) -> str | None:
    """The subcommand argv names, found without argparse: the first word that is neither an
    option nor the value of -c. None when there is no known one (argparse then explains)."""
    words = iter(argv)
    for word in words:
        if word in ("-c", "--config"):
            next(words, None)
        elif not word.startswith("-"):
            return word if word in COMMANDS else None
    return None


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The whole parser, or only `command`'s subparser: building all eleven costs a few
    milliseconds of every `eagle3ctl status`."""
    p = argparse.ArgumentParser(prog="eagle3ctl", description=__doc__, formatter_class=_formatter)
    p.add_argument("--version", action="version", version=f"eagle3ctl {VERSION}")
    add_completion_option(p)
    p.add_argument("-c", "--config", default=os.environ.get("EAGLE3D_CONFIG", DEFAULT_CONFIG),
                   help=f"config file (default {DEFAULT_CONFIG} or $EAGLE3D_CONFIG)")
    sub = p.add_subparsers(dest="command", required=True, parser_class=functools.partial(
        argparse.ArgumentParser, formatter_class=_formatter))
    for name, (help_text, add_arguments) in COMMANDS.items():
        if command in (None, name):
            s = sub.add_parser(name, help=help_text)
            if add_arguments:
                add_arguments(s)
    return p


def main(argv: list[str] | None = None) -> int:
    """The eagle3ctl command (argv None: the command line), or one call of it."""
    if argv is not None:
        return run(argv)
    code = run(sys.argv[1:])
    # The command is done: ending the process here spares the interpreter's teardown (freeing
    # every module, 4 ms of the 20 ms status takes beyond an empty Python).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def run(argv: list[str]) -> int:
    # `eagle3ctl status | head` ends quietly. _signal, not signal: signal builds its enums at
    # import, 5 ms of every status.
    import _signal
    _signal.signal(_signal.SIGPIPE, _signal.SIG_DFL)
    args = build_parser(_command_word(argv)).parse_args(argv)
    try:
        cfg = load_for_command(args.config, args.command)
    except ConfigError as exc:
        print(f"eagle3ctl: {exc}", file=sys.stderr)
        return BAD_CONFIG
    if args.command == "check-config":
        return cmd_check_config(cfg)
    if args.command == "status":
        return cmd_status(cfg, args)
    if args.command in ("runs", "forget"):
        from eagle3d.ctl import run_commands
        return run_commands.cmd_runs(cfg, args) if args.command == "runs" else \
            run_commands.cmd_forget(cfg, args)
    config = Path(args.config)  # the requests find the running daemon through its pointer
    if args.command == "pause":
        return _request(cfg, config, "pause", {"reason": args.reason})
    if args.command == "resume":
        return _request(cfg, config, "resume", {})
    if args.command == "retry":
        if bool(args.ids) == args.failed:
            print("give sample ids or --failed", file=sys.stderr)
            return 2
        which = {"failed": True} if args.failed else {"ids": args.ids}
        return _request(cfg, config, "retry", which)
    if args.command == "exclude":
        return _request(cfg, config, "exclude", {"ids": args.ids, "reason": args.reason})
    if args.command == "verify":
        return _request(cfg, config, "verify-full", {})
    try:
        if args.command == "samples":
            return cmd_samples(cfg, args)
        if args.command == "events":
            return cmd_events(cfg, args)
    except LedgerError as exc:
        print(f"eagle3ctl: {exc}", file=sys.stderr)
        return 3
    except sqlite3.Error as exc:  # locked by a long write, say: say so, never a traceback
        print(f"eagle3ctl: the ledger cannot be read right now ({exc}); try again", file=sys.stderr)
        return 1
    if args.command == "eval":
        return cmd_eval(cfg, args)
    if args.command == "export":
        return cmd_export(cfg, args)
    return cmd_engine_command(cfg, args)


if __name__ == "__main__":
    sys.exit(main())
