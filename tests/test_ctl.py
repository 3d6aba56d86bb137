"""eagle3ctl against a real daemon process: status, control requests and their refusals."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest

from eagle3d.statemachine import layout
from eagle3d.statemachine.statefile import write_state
from tests.conftest import smollm_contract, venv_bin, write_conversations
from tests.pipeline import stop_cleanly


def ctl(config: Path, *args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([venv_bin("eagle3ctl"), "-c", str(config), *args], capture_output=True,
                          text=True, timeout=timeout)


def wait_for(predicate, timeout: float = 120, what: str = "condition"):
    deadline = time.time() + timeout
    while time.time() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def status(config: Path) -> dict:
    return json.loads(ctl(config, "status", "--json").stdout)


def test_status_imports_nothing_heavy():
    code = ("import sys; from eagle3d.ctl.main import main; "
            "import contextlib, io; sys.argv=['eagle3ctl','-c','etc/demo.toml','status','--json'];"
            "\nwith contextlib.redirect_stdout(io.StringIO()):\n    main(sys.argv[1:])\n"
            "heavy=[m for m in ('torch','transformers','numpy','safetensors') if m in sys.modules];"
            "print(heavy)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=Path(__file__).resolve().parents[1], timeout=60)
    assert out.stdout.strip() == "[]", out.stderr


def test_status_imports_only_what_it_shows():
    """Modules that cost milliseconds at import and that status never uses stay out of it:
    dataclasses (with inspect and ast), hashlib, json (only --json needs it), signal (its
    enums) and shtab (importlib.metadata: only --print-completion needs it)."""
    code = ("import sys; from eagle3d.ctl.main import main; "
            "import contextlib, io; sys.argv=['eagle3ctl','-c','etc/demo.toml','status'];"
            "\nwith contextlib.redirect_stdout(io.StringIO()):\n    main(sys.argv[1:])\n"
            "print([m for m in ('dataclasses', 'inspect', 'hashlib', 'json', 'signal', 'shtab') "
            "if m in sys.modules])")
    out = subprocess.run([sys.executable, "-X", "importtime", "-c", code], capture_output=True,
                         text=True, cwd=Path(__file__).resolve().parents[1], timeout=60)
    # Who imported what, for a failure: -X importtime lists every import, nested.
    assert out.stdout.strip() == "[]", out.stderr[-4000:]


def cpu_seconds(argv: list[str], env: dict[str, str]) -> float:
    import resource
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    subprocess.run(argv, env=env, stdout=subprocess.DEVNULL, check=False, timeout=60)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime


# What any command that parses its arguments and reads a TOML config and an SQLite ledger
# imports from the standard library: the floor under `eagle3ctl status`.
STDLIB_FLOOR = "import argparse, pathlib, sqlite3, tomllib, typing"


def test_status_costs_under_1_4_times_its_standard_library_floor(config_factory, tmp_path):
    """`eagle3ctl status` of an idle pipeline against a Python that imports only what status
    cannot do without (STDLIB_FLOOR), in processor time (what an idle machine turns into wall
    time; other load on a shared machine inflates the wall time of both), the best of many
    alternated runs, with bytecode caches as an installed package has them. eagle3d's own
    imports and work are what the ratio measures: torch, numpy or a slow scan would be whole
    multiples. On the loaded 2-core VM (2026-12-06): 1.26x (43 ms against 34 ms); against an
    empty `python -c pass` the same status was 1.9-2.05x, too close to that test's 2x bound
    to tell a regression from the machine's noise."""
    from eagle3d.statemachine.config_validation import load_config
    from eagle3d.statemachine.ledger import Ledger
    config = config_factory()
    state_dir = load_config(config).paths.state_dir
    state_dir.mkdir(parents=True, exist_ok=True)
    Ledger(layout.ledger(state_dir)).close()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    env["PYTHONPYCACHEPREFIX"] = str(tmp_path / "pycache")
    commands = {"floor": [sys.executable, "-c", STDLIB_FLOOR],
                "status": [venv_bin("eagle3ctl"), "-c", str(config), "status"]}
    best = {name: min(cpu_seconds(argv, env) for _ in range(2))  # the first writes the caches
            for name, argv in commands.items()}
    for _ in range(15):
        for name, argv in commands.items():
            best[name] = min(best[name], cpu_seconds(argv, env))
    assert best["status"] < 1.4 * best["floor"], best


def test_status_without_a_daemon_says_not_running(config_factory):
    config = config_factory()
    proc = ctl(config, "status")
    assert proc.returncode == 3
    assert "NOT RUNNING" in proc.stdout
    st = json.loads(ctl(config, "status", "--json").stdout)
    for key in ("stage", "reason", "samples", "tokens", "rate", "eta_s", "disk", "daemon"):
        assert key in st
    assert st["daemon"]["alive"] is False
    assert set(st["samples"]) >= {"total", "pending", "inflight", "extracted", "verified",
                                  "failed", "excluded"}
    assert "not running" in ctl(config, "pause").stderr


def test_status_says_how_long_the_trainer_has_waited_for_its_first_step(config_factory):
    """On a GPU the first training step waits a minute or more for the fused kernels to
    compile: status must say so, not show a trainer frozen at step 0."""
    import tomllib
    config = config_factory()
    state_dir = Path(tomllib.loads(config.read_text())["paths"]["state_dir"])
    state_dir.mkdir(parents=True, exist_ok=True)
    # 90 s as of the daemon's write, 5 s ago.
    write_state(state_dir, {"stage": "train", "reason": "training", "updated": time.time() - 5,
                            "trainer": {"status": "training", "step": 0, "total_steps": 900,
                                        "pid": os.getpid(), "before_first_step": {
                                            "status": "starting", "since": time.time() - 95,
                                            "age_s": 90.0}}})
    shown = ctl(config, "status").stdout
    assert "training step 0/900" in shown
    assert "trainer   training · starting for 1m 3" in shown, shown
    assert "fused kernels compile" in shown


def test_control_requests_against_a_running_daemon(tmp_path, config_factory):
    source = write_conversations(tmp_path / "conv.jsonl", 12)
    config = config_factory({"data": {"source": str(source), "format": "messages", "limit": 12}})
    daemon = subprocess.Popen([venv_bin("eagle3d"), "run", "-c", str(config)],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        wait_for(lambda: status(config)["daemon"]["alive"], what="the daemon's heartbeat")
        proc = ctl(config, "pause", "--reason", "disk maintenance")
        assert proc.returncode == 0 and "paused" in proc.stdout
        st = wait_for(lambda: (s := status(config))["stage"] == "paused" and s, what="paused")
        assert "disk maintenance" in st["reason"]
        assert ctl(config, "status").returncode == 0
        bad = ctl(config, "exclude", "0" * 32, "--reason", "test")
        assert bad.returncode == 1 and "unknown sample ids" in bad.stderr
        state_dir = tmp_path / "state"
        # A request of an unknown verb, and one from a file owned by someone else.
        ctl_dir = layout.control_dir(state_dir)
        (ctl_dir / "1-a.request.json").write_text(json.dumps({"verb": "format-disk"}))
        foreign = ctl_dir / "2-b.request.json"
        foreign.write_text(json.dumps({"verb": "resume"}))
        os.chown(foreign, 65534, 65534)
        acks = wait_for(lambda: sorted(ctl_dir.glob("*.ack.json")) if
                        len(list(ctl_dir.glob("*.ack.json"))) == 2 else None, what="acks")
        replies = [json.loads(p.read_text()) for p in acks]
        assert "unknown verb" in replies[0]["message"] and not replies[0]["ok"]
        assert "not the daemon's user" in replies[1]["message"] and not replies[1]["ok"]
        assert status(config)["stage"] == "paused"  # the foreign resume did nothing
        assert ctl(config, "resume").returncode == 0
        wait_for(lambda: status(config)["stage"] != "paused", what="resumed")
        events = ctl(config, "events").stdout
        assert "paused" in events and "resumed" in events
    finally:
        stop_cleanly(daemon, config)


def test_engine_command_names_each_process_that_runs_the_target(config_factory):
    """With the target's own answers the generator runs it first, then the extract engine; with
    the dataset's answers only the engine does, on one line as before."""
    dataset = ctl(config_factory({"data": {"responses": "dataset"}}), "engine-command")
    assert dataset.returncode == 0, dataset.stderr
    assert dataset.stdout.count("\n") == 1 and "eagle3d.capture.engines.transformers.worker -c" in dataset.stdout
    target = ctl(config_factory({"data": {"responses": "target"}}, name="target.toml"),
                 "engine-command")
    assert target.returncode == 0, target.stderr
    lines = target.stdout.splitlines()
    assert lines[0] == "# the generate stage's generator"
    assert "eagle3d.capture.generator -c" in lines[1] and "config.toml --in-force " in lines[1]
    assert lines[2] == "# the extract stage's engine" and "eagle3d.capture.engines.transformers.worker -c" in lines[3]


@pytest.mark.slow
def test_the_engine_command_eagle3ctl_prints_runs(config_factory):
    """An operator can run what engine-command prints: its --in-force digest is the one the
    child checks, so the transformers engine loads the target, says it is ready and ends with
    its input."""
    from eagle3d.daemon.reconcile import prepare_dirs
    from eagle3d.dataset import contract
    from eagle3d.statemachine.config_in_force import write_in_force
    from eagle3d.statemachine.config_validation import load_config
    config = config_factory()
    cfg = load_config(config)
    prepare_dirs(cfg)
    contract.write(cfg.paths.dataset_dir, smollm_contract(cfg))
    write_in_force(cfg)
    shown = ctl(config, "engine-command")
    assert shown.returncode == 0, shown.stderr
    engine = subprocess.run(shlex.split(shown.stdout), stdin=subprocess.DEVNULL,
                            capture_output=True, text=True, timeout=300)
    assert engine.returncode == 0, engine.stderr
    assert json.loads(engine.stdout)["event"] == "ready"


def test_eagle3ctl_shows_the_config_in_force_not_an_edit_the_daemon_refused(config_factory):
    """The daemon holds its config in force (a reload it refused never reaches it): the SGLang
    command eagle3ctl shows is the one the daemon would run, while check-config still checks
    the operator's edited file."""
    from eagle3d.dataset import contract
    from eagle3d.statemachine.config_in_force import write_in_force
    from eagle3d.statemachine.config_validation import load_config
    config = config_factory({"target": {"engine": "sglang"}, "sglang": {"mem_fraction": 0.5}})
    cfg = load_config(config)
    cfg.paths.dataset_dir.mkdir(parents=True)
    contract.write(cfg.paths.dataset_dir, {"layer_ids": [2, 15, 27], "dtype": "float32",
                                           "dump_dtype": "bfloat16"})
    cfg.paths.state_dir.mkdir(parents=True)
    write_in_force(cfg)
    config.write_text(config.read_text().replace("mem_fraction = 0.5", "mem_fraction = 0.7"))
    shown = ctl(config, "engine-command")
    assert shown.returncode == 0, shown.stderr
    assert "--mem-fraction-static 0.5 " in shown.stdout
    checked = ctl(config, "check-config")
    assert "mem_fraction" not in checked.stderr and ": valid (" in checked.stdout, checked


def test_status_with_runs_imports_only_what_it_shows(config_factory):
    """The run line of a daemon that switched runs costs status no module it avoids."""
    from eagle3d.statemachine.config_validation import load_config
    cfg = load_config(config_factory())
    cfg.paths.state_dir.mkdir(parents=True)
    write_state(cfg.paths.state_dir, {"stage": "extract", "run": {
        "id": "b-1", "switched": "a-1 set aside, b-1 started",
        "set_aside": [{"id": "a-1", "bytes": 1 << 20}]}})
    code = ("import sys; from eagle3d.ctl.main import main; "
            f"import contextlib, io; sys.argv=['eagle3ctl','-c',{str(cfg.path)!r},'status'];"
            "\nout = io.StringIO()\nwith contextlib.redirect_stdout(out):\n    main(sys.argv[1:])\n"
            "print([m for m in ('dataclasses', 'inspect', 'hashlib', 'json', 'signal', 'torch') "
            "if m in sys.modules]); print(out.getvalue())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=Path(__file__).resolve().parents[1], timeout=60)
    assert out.stdout.startswith("[]\n"), out.stdout + out.stderr[-3000:]
    assert "run       b-1 (a-1 set aside, b-1 started) · 1 set aside (1.0 MiB on the dataset " \
           "disk): eagle3ctl runs" in out.stdout


def test_both_programs_say_their_version():
    """`--version` answers without a config, a daemon or a subcommand: what a bug report asks."""
    from eagle3d.statemachine.version import VERSION
    for program in ("eagle3d", "eagle3ctl"):
        out = subprocess.run([venv_bin(program), "--version"], capture_output=True, text=True,
                             timeout=60)
        assert (out.returncode, out.stdout.strip()) == (0, f"{program} {VERSION}"), out.stderr


def _write_drafter(train_dir: Path) -> Path:
    """A small random drafter exported where the trainer exports (SGLang's layout)."""
    import torch
    from eagle3d.drafter.export import export
    from eagle3d.drafter.model import DraftConfig, Eagle3Drafter
    from eagle3d.drafter.vocab import from_counts
    cfg = DraftConfig(hidden_size=64, target_hidden_size=64, intermediate_size=128,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                      rms_norm_eps=1e-5, max_position_embeddings=512, vocab_size=300,
                      draft_vocab_size=100)
    model = Eagle3Drafter(cfg, torch.zeros(300, 64))
    return export(model, from_counts(torch.arange(300), 100),
                  {"layer_ids": [2, 15, 27], "architecture": "LlamaForCausalLM"},
                  layout.export_dir(train_dir), 4)


def test_export_copies_the_drafter_and_refuses_without_one(config_factory, tmp_path):
    config = config_factory()
    refused = ctl(config, "export", "--format", "sglang", "--out", str(tmp_path / "copy"))
    assert refused.returncode == 2 and "no exported drafter in" in refused.stderr
    trained = _write_drafter(tmp_path / "train")
    copied = ctl(config, "export", "--format", "sglang", "--out", str(tmp_path / "copy"))
    assert copied.returncode == 0, copied.stderr
    assert "--speculative-draft-model-path" in copied.stdout
    from safetensors.torch import load_file
    copy = tmp_path / "copy"
    assert (copy / "config.json").read_text() == (trained / "config.json").read_text()
    want, got = (load_file(str(d / "model.safetensors")) for d in (trained, copy))
    assert want.keys() == got.keys() and all(want[k].equal(got[k]) for k in want)


def test_export_writes_the_speculators_format_beside_the_sglang_export(config_factory, tmp_path):
    """What a vLLM user runs: the export in speculators' format (proven against speculators'
    own model in test_drafter_export_speculators.py) and the option vLLM takes for it."""
    pytest.importorskip("speculators", reason="speculators is not installed")
    config = config_factory()
    _write_drafter(tmp_path / "train")
    done = ctl(config, "export", "--format", "speculators")
    assert done.returncode == 0, done.stderr
    out = layout.speculators_export_dir(tmp_path / "train")
    written = json.loads((out / "config.json").read_text())
    assert written["speculators_model_type"] == "eagle3"
    assert written["eagle_aux_hidden_state_layer_ids"] == [2, 15, 27]
    assert written["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 4
    assert str(out) in done.stdout and '"num_speculative_tokens": 4' in done.stdout


@pytest.mark.parametrize("shards", [{}, {"shards": 2, "shard": 1}])
def test_status_shows_the_stages_in_the_pipelines_order(config_factory, tmp_path, shards):
    """status and --json show each stage from its own section of state.toml, in the order the
    daemon's pipeline runs them: a stage added to the pipeline takes its place in both."""
    from eagle3d.ctl import stage_views
    from eagle3d.daemon import pipeline
    from eagle3d.statemachine.config_validation import load_config
    from eagle3d.statemachine.ledger import Ledger
    cfg = load_config(config_factory({"data": shards}))
    for folder in (cfg.paths.state_dir, cfg.paths.dataset_dir, cfg.paths.spool_dir):
        folder.mkdir(parents=True, exist_ok=True)
    with Ledger(layout.ledger(cfg.paths.state_dir)) as ledger:
        stages = pipeline.build(cfg, ledger, tmp_path, lambda *a: None, lambda: None).stages
    keys = [stage.state_key for stage in stages]
    shown = [view.key for view in stage_views.VIEWS]
    assert set(shown) <= set(keys)
    assert shown == [key for key in keys if key in shown]
    assert sum(stage.ingests for stage in stages) == 1  # state.toml's rate is one stage's
