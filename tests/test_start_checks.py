"""What the daemon checks before any child starts: its folders, the dataset's capture contract
and the config in force that children read."""

from __future__ import annotations

import subprocess

import pytest

from eagle3d.statemachine.entry import module_argv
from eagle3d.daemon.reconcile import prepare_dirs
from eagle3d.daemon.stages.plan import PlanStage
from eagle3d.dataset import contract
from eagle3d.statemachine import entry, layout, plan_meta
from eagle3d.statemachine.config_in_force import write_in_force
from eagle3d.statemachine.config_schema import Config
from eagle3d.statemachine.config_validation import ConfigError, load_config
from eagle3d.statemachine.ledger import Ledger
from eagle3d.statemachine.stages import Decision, PlanFacts, Seen, Stage
from tests.conftest import smollm_contract, write_conversations



def seen(ledger: Ledger) -> Seen:
    """The plan as the loop reads it for the plan stage, which reads nothing the loop counted."""
    return Seen(counts=None, fingerprint=None, plan=plan_meta.read(ledger))  # type: ignore[arg-type]


@pytest.mark.parametrize("bits, who", [(0o020, "group"), (0o002, "everyone")])
def test_a_state_folder_others_can_write_is_refused(config_factory, bits, who):
    cfg = load_config(config_factory())
    prepare_dirs(cfg)  # created 0o750 / 0o700 under any umask: accepted
    for folder in (cfg.paths.state_dir, cfg.paths.dataset_dir):
        folder.chmod(folder.stat().st_mode | bits)
        with pytest.raises(ConfigError, match=f"{folder} is writable by its group or by "
                                              f"everyone; run chmod go-w {folder}"):
            prepare_dirs(cfg)
        folder.chmod(0o750)
    prepare_dirs(cfg)


def planned_dataset(cfg: Config) -> Ledger:
    """A dataset planned from `cfg`, as the planner leaves it: its capture contract (of
    SmolLM2's real weights) and a ledger whose plan is complete."""
    prepare_dirs(cfg)
    contract.write(cfg.paths.dataset_dir, smollm_contract(cfg))
    ledger = Ledger(layout.ledger(cfg.paths.state_dir))
    data = cfg.data
    ledger.add_planned([], [], {"plan.source": data.source, "plan.first": str(data.first),
                                "plan.max_tokens": str(data.max_tokens),
                                "plan.responses": data.responses, "plan.exhausted": "1",
                                "plan.through": str(data.first + data.limit - 1)})
    return ledger


def test_a_ledger_planned_before_data_responses_existed_resumes_with_the_datasets_answers(
        config_factory, tmp_path):
    """A ledger planned before [data] responses existed records no plan.responses: an old
    install's meta, made by hand. It was planned from the dataset's answers, so the config of
    that install (responses left at "dataset") resumes it, and one whose target writes the
    answers is told the slice changed."""
    write_conversations(tmp_path / "conv.jsonl", 4)
    data = {"source": str(tmp_path / "conv.jsonl"), "format": "messages", "limit": 4}
    cfg = load_config(config_factory({"data": data}))
    with planned_dataset(cfg) as ledger:
        ledger.clear_meta("plan.responses")
        stage = PlanStage(cfg, ledger, layout.children_dir(cfg.paths.state_dir))
        assert stage.observe(seen(ledger)) == PlanFacts(plan_complete=True, blocked=None)
        stage.cfg = cfg._replace(data=cfg.data._replace(responses="target"))
        assert "[data] responses changed since this dataset was planned (was dataset)" in \
            stage.observe(seen(ledger)).blocked


def test_a_dataset_whose_contract_predates_the_generate_record_goes_on_under_its_config(
        config_factory, tmp_path):
    """The target wrote the answers before the contract recorded the [generate] settings: such a
    contract (an old install's, made by hand) cannot tell which settings wrote them, so neither
    the start's check nor the training node's comparison of contracts refuses the config."""
    write_conversations(tmp_path / "conv.jsonl", 4)
    data = {"source": str(tmp_path / "conv.jsonl"), "format": "messages", "limit": 4,
            "responses": "target"}
    cfg = load_config(config_factory({"data": data, "generate": {"temperature": 0.7}}))
    with planned_dataset(cfg) as ledger:
        old = {k: v for k, v in smollm_contract(cfg).items() if k != "generate"}
        contract.write(cfg.paths.dataset_dir, old)
        stage = PlanStage(cfg, ledger, layout.children_dir(cfg.paths.state_dir))
        assert stage.observe(seen(ledger)) == PlanFacts(plan_complete=True, blocked=None)
    assert contract.differences(old, smollm_contract(cfg)) == []


@pytest.mark.parametrize("section, values, named", [
    ("target", {"dtype": "bfloat16"}, "[target] dtype is 'bfloat16', the contract says "
                                      "'float32'"),
    ("target", {"aux_layers": [3, 15, 27]}, "[target] aux_layers (layer ids) is [3, 15, 27]"),
    ("extract", {"dump_dtype": "float8_e4m3fn"}, "[extract] dump_dtype is 'float8_e4m3fn'"),
    ("generate", {"temperature": 0.7}, "[generate] is {"),
])
def test_a_config_that_breaks_the_contract_blocks_the_daemon_before_any_child(
        config_factory, tmp_path, section, values, named):
    """A restart with an edited contract key (the plan long complete) must not capture into the
    dataset: the stage is failed with the key, the config and the contract named."""
    write_conversations(tmp_path / "conv.jsonl", 4)
    data = {"source": str(tmp_path / "conv.jsonl"), "format": "messages", "limit": 4,
            "responses": "target"}
    cfg = load_config(config_factory({"data": data}))
    with planned_dataset(cfg) as ledger:
        stage = PlanStage(cfg, ledger, layout.children_dir(cfg.paths.state_dir))
        assert stage.observe(seen(ledger)) == PlanFacts(plan_complete=True, blocked=None)
        edited = load_config(config_factory({"data": data, section: values}))._replace(
            paths=cfg.paths)
        stage.cfg = edited  # a restart (or a reload) with the edit in force
        facts = stage.observe(seen(ledger))
        assert not facts.plan_complete
        reason = facts.blocked
        assert named in reason and str(edited.path) in reason
        assert str(layout.contract_file(cfg.paths.dataset_dir)) in reason
        stage.step(Decision(Stage.FAILED, reason, Stage.PLAN))  # what derive makes of it
        assert stage.child is None  # no planner, and no later stage, under the edited config
        assert ledger.events_of(("contract_mismatch",))
        # The edit undone, the dataset goes on.
        stage.cfg = cfg
        assert stage.observe(seen(ledger)) == PlanFacts(plan_complete=True, blocked=None)


def test_other_weights_under_the_same_model_name_block_the_daemon(config_factory, tmp_path):
    cfg = load_config(config_factory())
    with planned_dataset(cfg) as ledger:
        doc = contract.read(cfg.paths.dataset_dir)
        doc["target_fingerprint"] = "0" * 32  # the model file replaced in place
        contract.write(cfg.paths.dataset_dir, {k: v for k, v in doc.items() if k != "fingerprint"})
        reason = PlanStage(cfg, ledger, tmp_path).observe(seen(ledger)).blocked
        assert "[target] model's weights (fingerprint) is " in reason


def test_a_contract_without_generate_settings_keeps_its_fingerprint_and_stays_valid(tmp_path):
    """Datasets made before the contract recorded [generate] keep working: their fingerprint
    (in every dump's header) is unchanged, and no generate setting is held against them."""
    old = {"format": 1, "target": "m", "target_fingerprint": "f", "dtype": "bfloat16",
           "layer_ids": [2, 15, 27], "num_layers": 30}
    before = "86c3cd5dbbb8ed680d8827dab7dde5df"  # fingerprint(old) before generate was recorded
    assert contract.fingerprint(old) == before
    written = contract.write(tmp_path, old)
    assert contract.read_checked(tmp_path) == written
    new = {**old, "generate": {"max_new_tokens": 512, "max_turns": 0, "temperature": 0.0,
                               "top_p": 1.0, "seed": 0}}
    assert contract.differences(old, new) == []
    assert contract.fingerprint(new) != before
    assert contract.differences(new, {**new, "generate": {**new["generate"], "seed": 1}}) == [
        "generate.seed: 0 -> 1"]


def test_a_hand_edited_config_in_force_never_reaches_a_child(config_factory):
    """Children start from the config in force, never from the operator's file: one edited
    behind the daemon's back (here to another dtype) is refused by the child, with the reason,
    before it reads a setting; the one the daemon wrote runs."""
    cfg = load_config(config_factory())
    prepare_dirs(cfg)
    path = write_in_force(cfg)
    argv = module_argv(cfg, "eagle3d.capture.planner")
    path.write_text(path.read_text().replace('dtype = "float32"', 'dtype = "bfloat16"'))
    child = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert child.returncode == entry.REFUSED
    assert f"{path} is not the config in force the daemon holds" in child.stderr
    assert not layout.contract_file(cfg.paths.dataset_dir).exists()  # it planned nothing


def test_a_reserve_no_disk_can_keep_is_refused_alike_by_check_config_a_start_and_a_reload(
        config_factory, tmp_path):
    """check-config said exit 2 while `eagle3d run` started and paused for good: the three
    judge one config the same way."""
    import signal

    from tests.conftest import venv_bin
    from tests.pipeline import DaemonProcess, edit_config, messages_config
    impossible = {"reserve": "1000000TiB"}
    config = config_factory({"budget": impossible})
    for argv in (["eagle3ctl", "-c", str(config), "check-config"],
                 ["eagle3d", "run", "-c", str(config)]):
        out = subprocess.run([venv_bin(argv[0]), *argv[1:]], capture_output=True, text=True,
                             timeout=120)
        assert out.returncode == entry.REFUSED and "[budget] reserve" in out.stderr, out
    config = messages_config(config_factory, tmp_path, 2)
    with DaemonProcess(config, "--until", "train") as d:
        d.status_until(lambda s: s["samples"]["total"] == 2, 300, "the plan")
        paused = subprocess.run([venv_bin("eagle3ctl"), "-c", str(config), "pause"],  # kept up
                                capture_output=True, timeout=60)
        assert paused.returncode == 0
        edit_config(config, "budget", **impossible)
        d.proc.send_signal(signal.SIGHUP)
        st = d.status_until(lambda s: bool(s.get("config_problem")), 60, "the refused reload")
        assert "[budget] reserve" in st["config_problem"] and d.proc.poll() is None


def test_an_unknown_engine_is_refused_alike_by_check_config_and_a_start(config_factory):
    """The schema reads [target] engine as any name (statemachine cannot know the engines);
    the registry refuses one it does not hold, in the config's words, before anything starts
    (a reload: tests/test_operator.py, RELOAD_CASES)."""
    from tests.conftest import venv_bin
    from tests.test_operator import UNKNOWN_ENGINE
    config = config_factory({"target": {"engine": "vllm"}})
    for argv in (["eagle3ctl", "-c", str(config), "check-config"],
                 ["eagle3d", "run", "-c", str(config)]):
        out = subprocess.run([venv_bin(argv[0]), *argv[1:]], capture_output=True, text=True,
                             timeout=120)
        assert out.returncode == entry.REFUSED, out
        assert f"{config}: {UNKNOWN_ENGINE}" in out.stderr, out
    assert not load_config(config).paths.state_dir.exists()  # the daemon made nothing
