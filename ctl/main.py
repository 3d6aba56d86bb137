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
from eagle3d.ctl.check_config import cmd_check_config
from eagle3d.ctl.exit_codes import BAD_CONFIG, NOT_NOW, NOT_RUNNING
from eagle3d.ctl.status import collect_status, render_status, status_code
from eagle3d.daemon.completion import add_completion_option
from eagle3d.statemachine import layout, pointer
from eagle3d.statemachine.config_in_force import load_in_force
from eagle3d.statemachine.config_schema import Config
from eagle3d.statemachine.config_validation import ConfigError, load_config
from eagle3d.statemachine.ledger import STATUSES, Ledger, LedgerError
from eagle3d.statemachine.version import VERSION

DEFAULT_CONFIG = "/etc/eagle3d/eagle3d.toml"
ACK_TIMEOUT_S = 10.0


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
