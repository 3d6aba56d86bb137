"""Runs: one per capture contract, each in its own folders, the first in the configured ones; a
switch back resumes the same folders, and a forgotten run is never resumed."""

from __future__ import annotations

import json
import time

import pytest

from eagle3d.daemon import control, run_select
from eagle3d.ctl.main import results_summary
from eagle3d.daemon.reconcile import Daemon, prepare_dirs
from eagle3d.statemachine import layout, runs, train_files
from eagle3d.statemachine.config_in_force import load_in_force, write_in_force
from eagle3d.statemachine.config_schema import Config
from eagle3d.statemachine.config_validation import load_config
from eagle3d.statemachine.ledger import Ledger
from tests.pipeline import ctl, edit_config, status, switch, wait_for
from tests.test_extract_stage import plan


def test_a_run_key_names_the_target_and_ignores_the_limit(config_factory):
    a = load_config(config_factory())
    more = load_config(config_factory({"data": {"limit": 500}}, name="more.toml"))
    other = load_config(config_factory({"target": {"dtype": "bfloat16"}}, name="b.toml"))
    key = runs.run_key(a.contract_keys(), "w")
    assert key.startswith("smollm2-135m-instruct-q4-1-") and len(key.rsplit("-", 1)[1]) == 8
    assert runs.run_key(more.contract_keys(), "w") == key  # a raised limit extends the run
    assert runs.run_key(other.contract_keys(), "w") != key
    assert runs.run_key(a.contract_keys(), "other weights") != key


def test_the_first_run_lives_in_place_and_a_switch_back_resumes_its_folders(config_factory):
    path = config_factory()
    a = load_config(path)
    first = run_select.select(a)
    assert first.new and first.run.in_place and first.run.dataset_dir == a.paths.dataset_dir
    b = load_config(config_factory({"target": {"dtype": "bfloat16"}}))  # same file, edited
    second = run_select.select(b)
    assert second.new and second.set_aside.id == first.run.id
    assert second.run.dataset_dir == a.paths.dataset_dir / "runs" / second.run.id
    assert second.run.state_dir == a.paths.state_dir / "runs" / second.run.id
    back = run_select.select(load_config(config_factory()))
    assert not back.new and back.run.id == first.run.id and back.set_aside.id == second.run.id
    assert runs.read(a.paths.state_dir).current == first.run.id
    # eagle3ctl follows the current run's config in force.
    run_cfg = runs.run_config(b, second.run)
    prepare_dirs(run_cfg)
    write_in_force(run_cfg)
    run_select.select(b)
    assert load_in_force(path).paths.dataset_dir == second.run.dataset_dir


def test_folders_from_before_runs_are_the_first_run_in_place(config_factory):
    """An install that ran before runs existed: its folders keep the contract of the config in
    force they hold, and a start with another contract opens a new run beside them instead of
    blocking."""
    old = load_config(config_factory())
    prepare_dirs(old)
    write_in_force(old)
    Ledger(layout.ledger(old.paths.state_dir)).close()
    (old.paths.dataset_dir / "shard-0000").mkdir()
    edited = load_config(config_factory({"target": {"dtype": "bfloat16"}}))
    selected = run_select.select(edited)
    reg = runs.read(old.paths.state_dir)
    first = next(r for r in reg.runs.values() if r.in_place)
    assert first.key == runs.run_key(old.contract_keys(), run_select.weights_of(old))
    assert selected.new and not selected.run.in_place and reg.current == selected.run.id
    assert (old.paths.dataset_dir / "shard-0000").is_dir()  # nothing moved


def test_forget_refuses_the_current_run_and_a_forgotten_run_is_never_resumed(config_factory):
    path = config_factory()
    a = load_config(path)
    first = run_select.select(a).run
    for folder in runs.FOLDERS:
        getattr(a.paths, folder).mkdir(parents=True, exist_ok=True)
    (a.paths.dataset_dir / "shard-0000").mkdir()
    (a.paths.dataset_dir / "shard-0000" / "x.safetensors").write_bytes(b"\0" * 4096)
    refused = ctl(path, "forget", first.id, "--reason", "old target")
    assert refused.returncode == 1 and "is the current run" in refused.stderr
    config_factory({"target": {"dtype": "bfloat16"}})
    second = run_select.select(load_config(path)).run
    prepare_dirs(runs.run_config(load_config(path), second))  # what the daemon makes of it
    listed = json.loads(ctl(path, "runs", "--json").stdout)
    assert [r["id"] for r in listed["runs"]] == [first.id, second.id]
    assert listed["runs"][0]["bytes"] >= 4096 and listed["current"] == second.id
    forgot = ctl(path, "forget", first.id[:-3], "--reason", "old target")
    assert forgot.returncode == 0, forgot.stderr
    assert "forgotten, 4.0 KiB freed" in forgot.stdout
    assert not (a.paths.dataset_dir / "shard-0000").exists()
    assert (a.paths.dataset_dir / "runs" / second.id).is_dir()  # the other run is untouched
    assert runs.set_aside(a.paths.state_dir) == []
    config_factory()
    again = run_select.select(load_config(path))
    assert again.new and again.run.id == f"{first.id}-2" and not again.run.in_place
    text = ctl(path, "runs").stdout
    assert "forgotten: old target" in text and f"* {again.run.id}" in text
    with pytest.raises(ValueError, match="forgotten already"):
        runs.forget(a, first.id, "twice")
    assert time.time() - again.run.created < 60


def _files(folder) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


def test_forget_never_deletes_a_root_or_another_runs_folder_inside_the_run_in_place(
        config_factory, tmp_path):
    """[paths] that nest are refused, but a root moved since a run was made can sit inside that
    run's folders: here dataset_dir and the spool moved into the first run's dataset folder. Its
    forget deletes its own files and leaves the current run's, and the spool's, byte for byte."""
    path = config_factory()
    a = load_config(path)
    first = run_select.select(a).run
    prepare_dirs(a)
    (a.paths.dataset_dir / "shard-00000").mkdir()
    (a.paths.dataset_dir / "shard-00000" / "x.safetensors").write_bytes(b"a" * 4096)
    moved = {"dataset_dir": str(a.paths.dataset_dir / "moved"),
             "spool_dir": str(a.paths.dataset_dir / "spool")}  # a restart with [paths] edited
    config_factory({"target": {"dtype": "bfloat16"}, "paths": moved})
    b = load_config(path)
    second = run_select.select(b).run
    b_cfg = runs.run_config(b, second)
    prepare_dirs(b_cfg)
    for folder in (b_cfg.paths.dataset_dir, b_cfg.paths.spool_dir, b_cfg.paths.train_dir):
        (folder / "shard-00000").mkdir()
        (folder / "shard-00000" / "y.safetensors").write_bytes(b"b" * 8192)
    (b_cfg.paths.dataset_dir / "manifest.json").write_text('{"samples": []}')
    kept = {folder: _files(folder) for folder in (b_cfg.paths.dataset_dir,
                                                  b_cfg.paths.spool_dir, b_cfg.paths.train_dir)}
    forgot = ctl(path, "forget", first.id, "--reason", "old target")
    assert forgot.returncode == 0, forgot.stderr
    assert "forgotten, 4.0 KiB freed" in forgot.stdout  # the first run's file, nothing else
    assert not (a.paths.dataset_dir / "shard-00000").exists()
    assert {folder: _files(folder) for folder in kept} == kept


def _a_shards_folders_from_before_runs(config_factory, sharded: dict) -> Config:
    """Shard 1 of 3's state, ledger and one 4 KiB dump, written before runs existed: its
    first run, in place, once a start with another contract sets it aside."""
    old = load_config(config_factory(sharded))
    prepare_dirs(old)
    write_in_force(old)
    Ledger(layout.ledger(old.paths.state_dir)).close()
    (old.paths.dataset_dir / "shard-00000").mkdir()
    (old.paths.dataset_dir / "shard-00000" / "x.safetensors").write_bytes(b"a" * 4096)
    return old


def test_forget_on_a_shard_that_does_not_train_leaves_the_shared_train_folder(config_factory):
    """A shard's folders from before runs existed are its first run, in place, and its
    train_dir is the shared one, which only the training node writes. Once a start with another
    contract has set that run aside, forgetting it on the shard deletes the shard's own files
    and not the training node's drafter, checkpoints or progress."""
    sharded = {"data": {"shards": 3, "shard": 1}}
    old = _a_shards_folders_from_before_runs(config_factory, sharded)
    train = old.paths.train_dir  # the training node's, trained in place
    for part, text in ((layout.progress_file(train), "{}"),
                       (layout.checkpoint_dir(train) / "step-00000004" / "state.pt", "w"),
                       (layout.export_dir(train) / "config.json", "{}")):
        part.parent.mkdir(parents=True, exist_ok=True)
        part.write_text(text)
    trained = _files(train)
    path = config_factory({**sharded, "target": {"dtype": "bfloat16"}})
    selected = run_select.select(load_config(path))
    first = next(r for r in runs.read(old.paths.state_dir).runs.values() if r.in_place)
    assert selected.run.id != first.id and first.train_dir == train
    forgot = ctl(path, "forget", first.id, "--reason", "old target")
    assert forgot.returncode == 0, forgot.stderr
    assert not (old.paths.dataset_dir / "shard-00000").exists()
    assert _files(train) == trained


def test_runs_on_a_shard_counts_only_what_that_shard_owns(config_factory):
    """On a shard that does not train, its first run in place has the shared train folder,
    the training node's: `eagle3ctl runs` shows the bytes the shard owns of that run, what
    `eagle3ctl forget` frees, never the training node's checkpoints."""
    sharded = {"data": {"shards": 3, "shard": 1}}
    old = _a_shards_folders_from_before_runs(config_factory, sharded)
    checkpoint = layout.checkpoint_dir(old.paths.train_dir) / "step-00000004" / "state.pt"
    checkpoint.parent.mkdir(parents=True)
    checkpoint.write_bytes(b"w" * (8 << 20))  # the training node's, in the shared folder
    path = config_factory({**sharded, "target": {"dtype": "bfloat16"}})
    run_select.select(load_config(path))
    shown = json.loads(ctl(path, "runs", "--json").stdout)
    first = next(r for r in shown["runs"] if not r["current"])
    assert 4096 <= first["bytes"] < 1 << 20, first
    forgot = ctl(path, "forget", first["id"], "--reason", "old target")
    assert forgot.returncode == 0 and " MiB freed" not in forgot.stdout, forgot
    assert checkpoint.stat().st_size == 8 << 20


def test_a_reload_refuses_nested_paths_naming_the_key(config_factory):
    path = config_factory()
    daemon = Daemon(load_config(path))
    try:
        edit_config(path, "paths", spool_dir=str(daemon.root_cfg.paths.state_dir / "spool"))
        daemon.reload()
        assert "[paths.spool_dir] is inside [paths] state_dir" in daemon.config_problem
    finally:
        daemon.ledger.close()


def _trained(cfg, acceptance: float) -> None:
    """A run's folders as the daemon leaves them after its drafter is exported and evaluated."""
    prepare_dirs(cfg)
    write_in_force(cfg)
    layout.export_dir(cfg.paths.train_dir).mkdir()
    (layout.export_dir(cfg.paths.train_dir) / "config.json").write_text("{}")
    train_files.write_eval(layout.eval_file(cfg.paths.train_dir), {
        "acceptance_length": acceptance, "acceptance_length_ci95": [acceptance - 0.1,
                                                                    acceptance + 0.1],
        "prompts": 4})


def test_run_until_done_names_the_current_runs_drafter_after_a_switch(config_factory):
    """What `eagle3d run --until done` prints at its end: the drafter of the run it ended in,
    with its acceptance length; never the first run's in the configured train folder, which a
    script copying the path to serving would ship for the other target."""
    path = config_factory()
    a = load_config(path)
    run_select.select(a)
    _trained(a, 1.5)
    config_factory({"target": {"dtype": "bfloat16"}})
    b = load_config(path)
    b_cfg = runs.run_config(b, run_select.select(b).run)
    _trained(b_cfg, 2.5)
    summary = results_summary(str(path))
    assert f"drafter:  {layout.export_dir(b_cfg.paths.train_dir)}  (SGLang" in summary, summary
    assert "acceptance length: 2.500" in summary
    assert str(layout.export_dir(a.paths.train_dir)) not in summary
    assert str(layout.eval_file(b_cfg.paths.train_dir)) in summary


def test_a_budget_hit_names_the_set_aside_runs_and_forget_frees_them(config_factory, tmp_path):
    """The dataset disk's budget counts what set-aside runs hold there: its reason names them
    with their sizes, and once one is forgotten it is neither named nor on the disk."""
    import psutil
    almost_all = psutil.disk_usage(str(tmp_path)).total - 2**20  # a disk never that empty
    path = config_factory({"budget": {"reserve": almost_all}})  # a budget hit from the start
    a = load_config(path)
    old = run_select.select(a).run
    prepare_dirs(a)
    (a.paths.dataset_dir / "shard-0000").mkdir()
    (a.paths.dataset_dir / "shard-0000" / "x.safetensors").write_bytes(b"\0" * (3 << 20))
    config_factory({"target": {"dtype": "bfloat16"}, "budget": {"reserve": almost_all}})
    daemon = Daemon(load_config(path))  # starts on the new contract: the old run set aside
    try:
        assert daemon.current.id != old.id and daemon.cfg.paths.dataset_dir.is_dir()
        # The sizes are walked beside the loop: the budget names them once they are known.
        reason = wait_for(lambda: "set aside" in daemon.observe().budget_pause and
                          daemon.observe().budget_pause, 10, "the set-aside run's size")
        assert "the dataset file system has" in reason
        assert f"runs set aside hold 3.0 MiB on it, reclaimable with eagle3ctl forget RUN " \
               f"--reason TEXT: {old.id} (3.0 MiB)" in reason
        assert ctl(path, "forget", old.id, "--reason", "done with it").returncode == 0
        wait_for(lambda: "set aside" not in daemon.observe().budget_pause, 10,
                 "the forgotten run's bytes gone from the budget")
        assert not (a.paths.dataset_dir / "shard-0000").exists()
        with Ledger(layout.ledger(daemon.cfg.paths.state_dir), readonly=True) as ledger:
            assert "done with it" in ledger.events_of(("run_forgotten",))[0][2]
    finally:
        daemon.ledger.close()


def test_a_switch_to_a_new_run_that_cannot_fit_is_refused_with_the_figures(config_factory):
    """The current run's bytes per sample times the new run's limit, against the dataset disk:
    a switch that cannot fit is refused and the current run stays; a switch back to a run that
    exists is always taken."""
    path = config_factory()
    cfg = load_config(path)
    prepare_dirs(cfg)
    plan(cfg, 2)
    daemon = Daemon(load_config(path))
    try:
        for sample in daemon.ledger.claim(2, 10**6):
            daemon.ledger.mark_extracted(sample.id, "x", 1 << 40, "c")  # a TiB each
        first = daemon.current
        edit_config(path, "target", dtype="bfloat16")
        daemon.reload()
        assert daemon.current == first
        assert daemon.config_problem.startswith("reload refused, the old config stays in force: "
                                                "the rest of the dataset is projected at 20.0 TiB")
        edit_config(path, "target", dtype="float32")
        daemon.reload()
        assert daemon.config_problem is None and daemon.current.id == first.id
    finally:
        daemon.ledger.close()


def test_status_names_the_new_run_from_the_moment_a_reload_enters_it(config_factory):
    """eagle3ctl follows the daemon into the run a reload switched to: never a moment where it
    reads the new run's folder before the daemon has written its state there ('not started',
    'not running', while the daemon works)."""
    path = config_factory()
    daemon = Daemon(load_config(path))
    try:
        first = daemon.current
        assert status(path)["run"]["id"] == first.id
        edit_config(path, "target", dtype="bfloat16")
        switch(daemon)  # no tick after it: the first state file comes from entering the run
        st = status(path)
        assert daemon.current.id != first.id
        assert st["run"]["id"] == daemon.current.id and st["daemon"]["alive"], st
    finally:
        daemon.ledger.close()


def test_an_operators_pause_holds_across_a_run_switch(config_factory):
    """`eagle3ctl pause` pauses the daemon, not a run: a reload that switches targets lands in
    the new run paused, with the operator's reason, until `eagle3ctl resume`."""
    path = config_factory()
    daemon = Daemon(load_config(path))
    try:
        control.submit(daemon.cfg.paths.state_dir, "pause", {"reason": "disk maintenance"})
        daemon.tick()
        first = daemon.current
        edit_config(path, "target", dtype="bfloat16")
        daemon.reload()
        daemon.tick()
        st = status(path)
        assert daemon.current.id != first.id and st["run"]["id"] == daemon.current.id
        assert st["stage"] == "paused" and st["paused_by"] == "operator", st
        assert "paused by the operator: disk maintenance" in st["reason"]
        control.submit(daemon.cfg.paths.state_dir, "resume", {})
        daemon.tick()
        assert status(path)["stage"] == "plan"
    finally:
        daemon.stop_stages(time.monotonic() + 30, "test over")
        daemon.ledger.close()


def test_a_pause_kept_in_the_ledger_before_an_upgrade_still_holds(config_factory):
    """A daemon paused before pauses outlived runs kept the pause in its run's ledger: the
    upgraded daemon starts paused, the pause moved to where every run reads it."""
    path = config_factory()
    daemon = Daemon(load_config(path))
    try:
        daemon.ledger.set_meta("pause", "model swap (since 2026-12-01 10:00:00)")
        daemon.recover()
        daemon.tick()
        assert status(path)["reason"] == ("paused by the operator: model swap "
                                          "(since 2026-12-01 10:00:00)")
        assert daemon.ledger.meta("pause") is None
    finally:
        daemon.stop_stages(time.monotonic() + 30, "test over")
        daemon.ledger.close()


def test_a_request_in_a_set_aside_runs_folder_is_answered_before_its_size_is_known(
        config_factory):
    """eagle3ctl waits 10 s for an answer; the size of a set-aside run is a walk of its every
    file (seconds per million dumps). A request that lands in a set-aside run's folder after a
    restart is answered at the daemon's first tick, never after that walk."""
    path = config_factory()
    daemon = Daemon(load_config(path))
    first = daemon.current
    edit_config(path, "target", dtype="bfloat16")
    switch(daemon)
    daemon.shutdown()
    dumps = first.dataset_dir / "shard-00000"  # the walk's work: many files
    dumps.mkdir()
    for i in range(40_000):
        (dumps / f"{i:08d}.safetensors").touch()
    daemon = Daemon(load_config(path))  # restarted: the set-aside run's size not known yet
    try:
        name = control.submit(first.state_dir, "pause", {"reason": "sent to the old run"})
        daemon.tick()
        ack = layout.control_dir(first.state_dir) / f"{name}.ack.json"
        assert ack.exists(), "no answer at the first tick"
        answer = json.loads(ack.read_text())
        assert not answer["ok"] and f"run {first.id} is set aside" in answer["message"]
        daemon._sizing.join()
        daemon.tick()
        assert [run.id for run, _ in daemon.set_aside] == [first.id]
    finally:
        daemon.stop_stages(time.monotonic() + 30, "test over")
        daemon.ledger.close()


def test_status_names_a_damaged_runs_registry_and_shows_no_other_runs_state(config_factory):
    """With runs.toml damaged, which run is current is not known: status says so in one line
    naming the file, exit 2 as the daemon's refused start, and never shows the run in place's
    state as if it were the current one."""
    path = config_factory()
    daemon = Daemon(load_config(path))
    edit_config(path, "target", dtype="bfloat16")
    switch(daemon)  # the first run, in the configured folders, is set aside
    daemon.shutdown()
    registry = layout.runs_registry(load_config(path).paths.state_dir)
    text = registry.read_bytes()
    registry.write_bytes(text[:text.index(b"[runs.") + 9])  # cut short, in a run's name
    shown = ctl(path, "status")
    assert shown.returncode == 2 and shown.stdout == "", shown
    assert shown.stderr.count("\n") == 1, shown.stderr
    assert f"{registry} is unreadable" in shown.stderr and "put it back" in shown.stderr
