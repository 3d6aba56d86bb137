"""The train stage: its children are small real processes that exit as a trainer or an
evaluation would, and the stage's answers to each exit are checked; and once the real trainer
of two ranks, refusing its target."""

from __future__ import annotations

import json
import sys
import time
from types import SimpleNamespace

import pytest

from eagle3d.daemon.stages import train
from eagle3d.daemon.stages.train import TrainStage
from eagle3d.statemachine import entry, layout, train_files
from eagle3d.statemachine import manifest as manifest_mod
from eagle3d.statemachine.config_in_force import write_in_force
from eagle3d.statemachine.config_validation import load_config
from eagle3d.statemachine.ledger import Ledger
from eagle3d.statemachine.stages import Decision, Seen, Stage
from tests.pipeline import wait_for

TRAIN = Decision(Stage.TRAIN, "test", Stage.TRAIN)
FINGERPRINT = "f" * 32


def exits_with(code: int, then: str = "") -> list[str]:
    return [sys.executable, "-c", f"{then}\nimport sys; sys.exit({code})"]


@pytest.fixture
def stage(config_factory, monkeypatch):
    cfg = load_config(config_factory({"train": {"max_restarts": 1}}))
    cfg.paths.state_dir.mkdir(parents=True)
    ledger = Ledger(layout.ledger(cfg.paths.state_dir))
    stage = TrainStage(cfg, ledger, cfg.paths.state_dir, lambda: FINGERPRINT)
    yield stage, cfg, monkeypatch
    stage.stop(time.monotonic() + 5)
    ledger.close()


def step_until_idle(stage: TrainStage, seconds: float = 30) -> None:
    stage.step(TRAIN)
    wait_for(lambda: stage.step(TRAIN) or stage.child is None, seconds, "the child's exit")


def test_a_trainer_that_keeps_failing_is_restarted_then_fails_the_stage(stage):
    stage, cfg, monkeypatch = stage
    monkeypatch.setattr(train, "trainer_argv", lambda cfg, path: exits_with(1))
    step_until_idle(stage)
    assert stage.supervisor.restarts == 1 and stage.failure is None and \
        stage.supervisor.retry_at > time.monotonic()
    stage.supervisor.retry_at = 0  # the backoff, elapsed
    step_until_idle(stage)
    assert "[train] max_restarts = 1" in stage.observe(Seen(None, FINGERPRINT)).train_failed
    assert stage.status()["status"] == "failed"


def test_a_done_marker_written_before_eval_settings_were_recorded_stands_for_any(stage):
    """done.json of an install from before the [eval] settings key was recorded (made by hand as
    it wrote it) marks the drafter of its manifest done: the daemon neither trains nor
    evaluates it again; a marker of other [eval] settings does not."""
    stage, cfg, monkeypatch = stage
    layout.done_file(cfg.paths.train_dir).parent.mkdir(parents=True)
    old = {"manifest_fingerprint": FINGERPRINT, "export": str(layout.export_dir(
        cfg.paths.train_dir)), "train_key": stage.key, "acceptance_length": 2.1,
        "identical_to_greedy": True, "finished": time.time()}
    layout.done_file(cfg.paths.train_dir).write_text(json.dumps(old))
    assert stage.observe(Seen(None, FINGERPRINT)).train_done
    layout.done_file(cfg.paths.train_dir).write_text(json.dumps({**old, "eval_key": "other"}))
    assert not stage.observe(Seen(None, FINGERPRINT)).train_done


def test_a_target_that_is_not_the_datasets_fails_at_once(stage):
    stage, cfg, monkeypatch = stage
    monkeypatch.setattr(train, "trainer_argv",
                        lambda cfg, path: exits_with(entry.CONTRACT_MISMATCH))
    step_until_idle(stage)
    assert stage.supervisor.restarts == 1 and "not the dataset's model" in stage.failure


def test_a_refusing_evaluation_fails_at_once_not_after_max_restarts(stage):
    stage, cfg, monkeypatch = stage
    monkeypatch.setattr(train_files, "trained_for", lambda folder, fingerprint: True)
    monkeypatch.setattr(train, "eval_argv", lambda cfg: exits_with(entry.REFUSED))
    step_until_idle(stage)
    assert stage.supervisor.restarts == 1 and stage.supervisor.retry_at == 0
    assert stage.failure == "evaluate exited with code 2; see the log"
    assert stage.status()["status"] == "failed"


def test_a_refusal_left_by_an_earlier_trainer_does_not_count(stage):
    stage, cfg, monkeypatch = stage
    train_files.write_refusal(cfg.paths.train_dir, train_files.Refused(
        entry.CONTRACT_MISMATCH, "an earlier trainer's target"))
    monkeypatch.setattr(train, "trainer_argv", lambda cfg, path: exits_with(1))
    step_until_idle(stage)
    assert stage.failure is None and stage.supervisor.retry_at > time.monotonic()


def refuses_changed(cfg, samples: list[str]) -> list[str]:
    """A trainer of several nodes (torchrun exits 1) that found these samples' files changed
    since verify."""
    refused = train_files.Refused(entry.DATASET_CHANGED, "refusing to train: a file changed",
                                  tuple(samples))
    return exits_with(1, "from eagle3d.statemachine import train_files\n"
                         "from eagle3d.statemachine.train_files import Refused\n"
                         f"train_files.write_refusal({str(cfg.paths.train_dir)!r}, {refused!r})")


def test_a_changed_dataset_file_sends_its_sample_back_to_verify_without_a_restart(stage):
    """The trainer refused a file changed since verify: its sample goes back to extracted (verify
    re-reads it), the manifest that listed it as verified goes, and nothing is charged. A sample
    this ledger does not hold (another node's) cannot be sent back: the refusal stops the stage."""
    from eagle3d.statemachine.ledger import PlannedSample
    stage, cfg, monkeypatch = stage
    sid = "a" * 32
    stage.ledger.add_planned([PlannedSample(sid, 0, 4, 2, "h", b"\0" * 16, b"\0\0\1\1")], [], {})
    stage.ledger.claim(1, 100)
    stage.ledger.mark_extracted(sid, "shard-0000/a.safetensors", 100, "xxh3-128:0")
    stage.ledger.mark_verified(stage.ledger.sample(sid), "100:1:1")
    cfg.paths.dataset_dir.mkdir(parents=True)
    manifest_mod.write(cfg.paths.dataset_dir, manifest_mod.build(stage.ledger, {}))
    monkeypatch.setattr(train, "trainer_argv", lambda cfg, path: refuses_changed(cfg, [sid]))
    step_until_idle(stage)
    assert stage.ledger.sample(sid).status == "extracted"
    assert manifest_mod.read(cfg.paths.dataset_dir) is None
    assert stage.failure is None and stage.supervisor.restarts == 0 and stage.supervisor.may_start
    assert [(kind, s) for _, kind, s, _ in stage.ledger.recent_events(1)] == [("unverified", sid)]

    monkeypatch.setattr(train, "trainer_argv",
                        lambda cfg, path: refuses_changed(cfg, ["b" * 32]))
    step_until_idle(stage)
    assert "a file changed" in stage.failure and stage.status()["status"] == "failed"


@pytest.mark.slow
def test_a_contract_refusal_of_two_ranks_fails_the_stage_with_its_reason(config_factory,
                                                                         tmp_path):
    """The real trainer, two gloo processes started by the launcher, refuses a target whose
    weights were replaced after the capture: the stage sees CONTRACT_MISMATCH (the launcher
    keeps the ranks' code; torchrun, for several nodes, would exit 1 and refusal.json says it)
    and stops with the trainer's reason, not restarting it."""
    import torch
    from drafter_fixtures import contract_for, planned_sample, record_dataset
    target = tmp_path / "target"
    target.mkdir()
    (target / "model.safetensors").write_bytes(b"the weights the dataset was captured with")
    cfg = load_config(config_factory({
        "target": {"model": str(target), "device": "cpu"},
        "train": {"nproc": 2, "device": "cpu", "threads": 1, "max_restarts": 3}}))
    shape = SimpleNamespace(hidden_size=8, num_hidden_layers=4, vocab_size=64)
    sample = planned_sample(0, list(range(16)), [1] * 16, torch.randn(16, 24), torch.randn(16, 8))
    record_dataset(tmp_path, contract_for(str(target), target, shape, "transformers"), [sample])
    (target / "model.safetensors").write_bytes(b"other weights, written over the file in place")
    write_in_force(cfg)
    fingerprint = manifest_mod.read(cfg.paths.dataset_dir)["fingerprint"]
    with Ledger(layout.ledger(cfg.paths.state_dir)) as ledger:
        stage = TrainStage(cfg, ledger, cfg.paths.state_dir, lambda: fingerprint)
        step_until_idle(stage, 300)
        assert stage.status()["status"] == "failed", stage.status()
        assert stage.supervisor.restarts == 1 and stage.supervisor.retry_at == 0
        assert "exited with code 3" in stage.failure
        assert "is not the model this dataset was captured with" in stage.failure
        assert [detail for _, kind, detail in ledger.events_of(("train_failed", "train_restart"))
                ] == [stage.failure]


def test_a_finished_training_is_evaluated_and_marked_done(stage):
    stage, cfg, monkeypatch = stage
    train_dir = cfg.paths.train_dir
    train_dir.mkdir(parents=True)
    (layout.export_dir(train_dir)).mkdir()
    (layout.export_dir(train_dir) / "config.json").write_text("{}")
    train_files.ProgressWriter(train_dir, FINGERPRINT).write(train_files.DONE)
    report = {"acceptance_length": 1.7, "identical_to_greedy": False}
    write = (f"from eagle3d.statemachine.train_files import write_eval\n"
             f"write_eval({str(layout.eval_file(train_dir))!r}, {report!r})")
    monkeypatch.setattr(train, "eval_argv", lambda cfg: exits_with(entry.DIVERGED, write))
    step_until_idle(stage)
    assert stage.observe(Seen(None, FINGERPRINT)).train_done
    assert stage.status()["acceptance_length"] == 1.7
    assert [kind for _, kind, _ in stage.ledger.events_of(("eval_not_greedy", "drafter_done"))] \
        == ["eval_not_greedy", "drafter_done"]


def test_the_trainer_command_of_one_node_and_of_several(config_factory):
    alone = load_config(config_factory({"train": {"nproc": 1}}, "alone.toml"))
    # One process trains without torchrun, whose agent would listen on every interface.
    assert train.trainer_argv(alone, alone.path)[1:] == [
        "-m", "eagle3d.drafter.train", "-c", str(alone.path)]
    # Several processes of one node are started by our launcher, which listens nowhere either.
    one = load_config(config_factory({"train": {"nproc": 8}}))
    argv = train.trainer_argv(one, layout.config_in_force(one.paths.state_dir))
    assert argv[1:] == ["-m", "eagle3d.drafter.launch", "-c",
                        str(one.paths.state_dir / "config.toml")]
    node = load_config(config_factory({"train": {"nproc": 8, "nnodes": 4, "node_rank": 3,
                                                 "rendezvous": "[fd00::1]:29400"}}, "n3.toml"))
    argv = train.trainer_argv(node, node.path)
    # Static rendezvous: node k's processes are ranks 8k .. 8k+7, so rank 0 is on node 0.
    assert argv[1:8] == ["-m", "torch.distributed.run", "--nnodes=4", "--node_rank=3", "--rdzv_backend=static",
                         "--rdzv_endpoint=[fd00::1]:29400", "--nproc_per_node=8"]
    assert argv[-2:] == ["-c", str(node.path)]


def test_only_node_0_runs_the_daemon(config_factory):
    from eagle3d.daemon.reconcile import Daemon
    from eagle3d.statemachine.config_validation import ConfigError
    from eagle3d.statemachine.reload_policy import reload_verdict
    zero = load_config(config_factory({"train": {"nnodes": 2, "rendezvous": "10.0.0.1:29400"}}))
    one = load_config(config_factory({"train": {"nnodes": 2, "node_rank": 1,
                                                "rendezvous": "10.0.0.1:29400"}}, "n1.toml"))
    with pytest.raises(ConfigError, match=r"node_rank = 1: the daemon runs on node 0 only; on "
                                          r"this node run `eagle3d train-node -c .*n1.toml`"):
        Daemon(one)
    assert not one.paths.state_dir.exists()  # refused before it touched anything
    assert "train-node" in reload_verdict(zero, zero._replace(train=one.train))[1]


def test_a_multi_node_failure_points_at_the_other_nodes(config_factory, monkeypatch):
    cfg = load_config(config_factory({"train": {"nnodes": 2, "rendezvous": "127.0.0.1:29400",
                                                "max_restarts": 0}}))
    cfg.paths.state_dir.mkdir(parents=True)
    ledger = Ledger(layout.ledger(cfg.paths.state_dir))
    stage = TrainStage(cfg, ledger, cfg.paths.state_dir, lambda: FINGERPRINT)
    monkeypatch.setattr(train, "trainer_argv", lambda cfg, path: exits_with(1))
    try:
        step_until_idle(stage)
        assert "is `eagle3d train-node` running on every other node?" in stage.failure
    finally:
        ledger.close()


def test_train_node_is_for_the_other_nodes_only(config_factory, caplog):
    from eagle3d.daemon import train_node
    zero = config_factory({"train": {"nnodes": 2, "rendezvous": "127.0.0.1:29400"}})
    assert train_node.run(str(zero)) == entry.REFUSED
    assert "node_rank = 0 is the daemon's node" in caplog.text


def test_an_evaluation_that_ends_after_the_manifest_changed_is_not_done(stage):
    """The manifest is rewritten (an exclude) while the evaluation runs, and the evaluation exits
    before the loop has left train: its drafter was trained on the old manifest, so no done.json;
    the stage trains again."""
    stage, cfg, monkeypatch = stage
    current = [FINGERPRINT]
    stage.fingerprint = lambda: current[0]
    train_dir = cfg.paths.train_dir
    layout.export_dir(train_dir).mkdir(parents=True)
    (layout.export_dir(train_dir) / "config.json").write_text("{}")
    train_files.ProgressWriter(train_dir, FINGERPRINT).write(train_files.DONE)
    write = (f"from eagle3d.statemachine.train_files import write_eval\n"
             f"write_eval({str(layout.eval_file(train_dir))!r}, "
             "{'acceptance_length': 1.5, 'identical_to_greedy': True})")
    monkeypatch.setattr(train, "eval_argv", lambda cfg: exits_with(entry.OK, write))
    monkeypatch.setattr(train, "trainer_argv", lambda cfg, path: exits_with(1))
    stage.step(TRAIN)
    assert stage.child is not None and stage.child.name == "evaluate"
    current[0] = "e" * 32  # an exclude rewrote the manifest
    wait_for(lambda: stage.step(TRAIN) or stage.child is None, 30, "the evaluation's exit")
    assert not stage.observe(Seen(None, current[0])).train_done
    assert not train_files.done_for(train_dir, FINGERPRINT, train_files.eval_key(stage.cfg))
    assert [kind for _, kind, _ in stage.ledger.events_of(("train_stale", "drafter_done"))] == \
        ["train_stale"]
    stage.step(TRAIN)
    assert stage.child is not None and stage.child.name == "trainer"


def test_a_tick_hashes_no_settings_and_lists_no_versions_folder(stage):
    """The daemon ticks often: the [train] and [eval] keys are hashed once per config in force,
    and the versions folder is listed once, then again only after the stage moved a drafter."""
    stage, cfg, monkeypatch = stage
    calls: list[str] = []
    for name in ("train_key", "eval_key", "versions"):
        real = getattr(train_files, name)
        monkeypatch.setattr(train_files, name,
                            lambda *args, real=real, name=name: calls.append(name) or real(*args))
    for _ in range(3):
        stage.observe(Seen(None, FINGERPRINT))
        assert stage.status()["version"] == stage.key
    assert calls == ["versions"]
    stage.reconfigure(cfg)
    assert calls == ["versions", "train_key", "eval_key"]
    stage.ledger.set_meta(train.HELD_KEY, "0" * 8)  # a drafter of other settings
    monkeypatch.setattr(train, "trainer_argv", lambda cfg, path: exits_with(0))
    step_until_idle(stage)  # sets that drafter aside
    assert [v["key"] for v in stage.status()["versions"]] == ["0" * 8]


def published(stage: TrainStage, state_dir) -> dict:
    """The stage's status as eagle3ctl reads it: through the state file."""
    from eagle3d.statemachine.statefile import read_state, write_state
    write_state(state_dir, {"stage": "train", stage.state_key: stage.status()})
    return read_state(state_dir)[0][stage.state_key]


def test_status_says_why_training_started_over_from_step_0_while_it_trains(stage):
    """A raised [data] limit grows the manifest: the trainer cannot resume the drafter's
    checkpoint and starts at step 0 beside a drafter that was done. Status says why while that
    training runs (step 0 alone reads as lost progress), and no more once it is done."""
    from eagle3d.ctl import stage_views
    stage, cfg, monkeypatch = stage
    why = "the manifest grew from 4 to 6 samples (a raised [data] limit)"
    go = cfg.paths.train_dir / "go"
    trains = (f"from eagle3d.statemachine import train_files\nimport os, time\n"
              f"p = train_files.ProgressWriter({str(cfg.paths.train_dir)!r}, {FINGERPRINT!r}, 9)\n"
              f"p.started_over = {why!r}\np.write(train_files.TRAINING, step=2, loss=1.0)\n"
              f"while not os.path.exists({str(go)!r}): time.sleep(0.05)\n"
              f"p.write(train_files.DONE, step=9, loss=1.0)")
    monkeypatch.setattr(train, "trainer_argv", lambda cfg, path: exits_with(0, trains))
    view = next(v for v in stage_views.VIEWS if v.key == stage.state_key)
    stage.step(TRAIN)
    trainer = wait_for(lambda: (t := published(stage, cfg.paths.state_dir)).get("started_over")
                       and t, 30, "the trainer's progress")
    assert trainer["started_over"] == why  # eagle3ctl status --json
    assert f"retrain   training started over from step 0: {why}" in view.lines(trainer)
    go.touch()
    wait_for(lambda: stage.step(TRAIN) or stage.child is None, 30, "the trainer's exit")
    trainer = published(stage, cfg.paths.state_dir)
    assert trainer["step"] == 9 and "started_over" not in trainer
    assert not [line for line in view.lines(trainer) if line.startswith("retrain")]
