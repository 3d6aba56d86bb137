"""Shards ([data] shards, shard, shard_from_env): the index from the config or the scheduler's
environment variable, each shard's own folders, a split of the plan that is disjoint, covers one
daemon's plan exactly and holds under a raised limit, and the training node's join over what the
shards published: it waits naming the shard and its progress, and refuses another contract."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from eagle3d.capture import planner
from eagle3d.dataset.shard_union import ShardSet
from eagle3d.statemachine import layout, manifest, shards
from eagle3d.statemachine.config_in_force import write_in_force
from eagle3d.statemachine.config_validation import ConfigError, load_config
from eagle3d.statemachine.ledger import Ledger
from eagle3d.statemachine.statefile import write_state
from eagle3d.target import loading
from tests.conftest import make_config, write_conversations


# ---- the config -------------------------------------------------------------------------------

@pytest.mark.parametrize("data, env, message", [
    ({"shards": 3}, {}, "[data.shard] is required with [data] shards = 3"),
    ({"shards": 3, "shard": 3}, {}, "[data.shard] must be below [data] shards (3), got 3"),
    ({"shards": 0}, {}, "[data.shards] must be at least 1"),
    ({"shards": 3, "shard_from_env": "SLURM_ARRAY_TASK_ID"}, {},
     "[data.shard_from_env] the environment variable SLURM_ARRAY_TASK_ID is not set"),
    ({"shards": 3, "shard_from_env": "SLURM_ARRAY_TASK_ID"}, {"SLURM_ARRAY_TASK_ID": "3"},
     "allows 0 to 2 (a SLURM array must be --array=0-2)"),
    ({"shards": 3, "shard_from_env": "JOB_COMPLETION_INDEX"}, {"JOB_COMPLETION_INDEX": "x"},
     "JOB_COMPLETION_INDEX is 'x', not a shard index"),
    ({"shards": 3, "shard": 1, "shard_from_env": "JOB_COMPLETION_INDEX"}, {},
     "[data.shard_from_env] and [data] shard both name the shard index"),
    ({"shards": 3, "shard_from_env": "not a name"}, {}, "is not an environment variable's name"),
])
def test_bad_shard_settings_name_the_key(tmp_path, monkeypatch, data, env, message):
    for name in ("SLURM_ARRAY_TASK_ID", "JOB_COMPLETION_INDEX"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ConfigError) as err:
        load_config(make_config(tmp_path, {"data": data}))
    assert message in str(err.value) and str(tmp_path / "eagle3d.toml") in str(err.value)


@pytest.mark.parametrize("variable", ["SLURM_ARRAY_TASK_ID", "JOB_COMPLETION_INDEX"])
def test_the_index_comes_from_the_schedulers_variable(tmp_path, monkeypatch, variable):
    monkeypatch.setenv(variable, "2")
    cfg = load_config(make_config(tmp_path, {"data": {"shards": 3, "shard_from_env": variable}}))
    assert cfg.shard == shards.Shard(2, 3) and not cfg.shard.trains
    for key in ("state_dir", "spool_dir", "dataset_dir"):
        assert getattr(cfg.paths, key).name == "shard-2-of-3"
    assert cfg.paths.train_dir == tmp_path / "train"
    # The config in force (children read it) names the index in force, without the variable.
    cfg.paths.state_dir.mkdir(parents=True)
    write_in_force(cfg)
    monkeypatch.delenv(variable)
    again = load_config(layout.config_in_force(cfg.paths.state_dir))
    assert again.paths == cfg.paths and again.shard == cfg.shard


# ---- the split --------------------------------------------------------------------------------

def _plan(tmp_path: Path, tokenizer, source: Path, name: str, limit: int, **data) -> dict:
    root = tmp_path / name
    root.mkdir()
    cfg = load_config(make_config(root, {"data": {"source": str(source), "format": "messages",
                                                  "limit": limit, **data}}))
    with Ledger(layout.ledger(cfg.paths.state_dir)) as ledger:
        planner.plan(cfg, ledger, tokenizer, 576)
        samples = {s.id: (s.idx, s.tokens, s.loss_tokens) for s in ledger.iter_samples()}
        skipped = dict(ledger.db.execute("SELECT idx, reason FROM skipped").fetchall())
    return {"samples": samples, "skipped": skipped}


@pytest.fixture(scope="module")
def tokenizer():
    cfg = load_config(make_config(Path("/tmp")))
    return loading.load_tokenizer(cfg.target.model_path)


def test_shard_plans_are_disjoint_and_cover_one_daemons_plan(tmp_path, tokenizer):
    source = write_conversations(tmp_path / "conv.jsonl", 70, words=6)
    with open(source, "a") as f:  # a duplicate and an unusable record: each planned once
        f.write(source.read_text().splitlines()[3] + "\n")
        f.write(json.dumps({"messages": [{"role": "assistant", "content": "no user"}]}) + "\n")
    one = _plan(tmp_path, tokenizer, source, "one", 72)
    assert len(one["samples"]) > 60 and len(one["skipped"]) >= 1
    for count in (2, 3, 5):
        parts = [_plan(tmp_path, tokenizer, source, f"n{count}-{i}", 72, shards=count, shard=i)
                 for i in range(count)]
        ids = [set(p["samples"]) for p in parts]
        assert sum(map(len, ids)) == len(set().union(*ids)), f"{count} shards overlap"
        assert {k: v for p in parts for k, v in p["samples"].items()} == one["samples"]
        assert {k: v for p in parts for k, v in p["skipped"].items()} == one["skipped"]
        assert all(ids), f"a shard of {count} planned nothing"
    # A raised limit only adds to each shard: what it planned before stays its own.
    fewer = _plan(tmp_path, tokenizer, source, "fewer", 40, shards=3, shard=1)
    more = _plan(tmp_path, tokenizer, source, "more", 72, shards=3, shard=1)
    assert fewer["samples"].items() <= more["samples"].items()


def test_one_prompt_with_different_answers_is_one_sample_of_one_shard(tmp_path, tokenizer):
    """Where the target writes the answers, a sample's id is its prompt's: two records of one
    prompt and different answers are one sample, planned once by the one shard that owns that
    id, as one daemon plans it once."""
    source = write_conversations(tmp_path / "conv.jsonl", 24, words=6)
    records = [json.loads(line) for line in source.read_text().splitlines()]
    with open(source, "a") as f:  # each prompt again, with another answer
        for r in records:
            f.write(json.dumps({"messages": [r["messages"][0], {
                "role": "assistant", "content": "Another answer entirely."}]}) + "\n")
    one = _plan(tmp_path, tokenizer, source, "one", 48, responses="target")
    assert len(one["samples"]) == 24
    parts = [_plan(tmp_path, tokenizer, source, f"shard{i}", 48, responses="target",
                   shards=3, shard=i) for i in range(3)]
    ids = [set(p["samples"]) for p in parts]
    assert sum(map(len, ids)) == len(set().union(*ids)) == 24, "one prompt planned twice"
    assert {k: v for p in parts for k, v in p["samples"].items()} == one["samples"]
    assert {k: v for p in parts for k, v in p["skipped"].items()} == one["skipped"]


# ---- the join ---------------------------------------------------------------------------------

CONTRACT = {"format": 1, "target": "m", "target_fingerprint": "f", "layer_ids": [2, 15, 27],
            "dtype": "bfloat16", "hidden_size": 576, "num_layers": 30, "vocab_size": 49152}


def publish(root: Path, index: int, count: int, stage: str = "done", n: int = 3,
            also: tuple[str, ...] = (), state: dict | None = None, **contract) -> list[str]:
    """What a shard's daemon leaves in its folder: a manifest of n samples (and of the ids
    `also`), its state file (with `state` over it)."""
    folder = root / shards.folder_name(index, count)
    folder.mkdir(parents=True, exist_ok=True)
    ids = [f"{index:02d}{k:030d}" for k in range(n)] + list(also)
    samples = [{"id": sid, "path": f"000/{index}-{k}.safetensors", "tokens": 10,
                "loss_tokens": 5, "checksum": f"c{index}{k}"} for k, sid in enumerate(ids)]
    doc = {"fingerprint": manifest.fingerprint((s["id"], s["checksum"]) for s in samples),
           "contract": {**CONTRACT, "shard": {"index": index, "count": count}, **contract},
           "samples": samples}
    if stage == "done":
        manifest.write(folder, doc)
    write_state(folder, {"stage": stage, "underlying": stage, "samples": {"verified": n,
                "total": n + (stage != "done")}, "daemon": {"heartbeat": time.time() - 7,
                                                            "alive": True}, **(state or {})},
                layout.published_state(folder))
    return [s["id"] for s in samples]


def test_the_join_waits_for_a_shard_naming_it_then_reads_every_sample_once(tmp_path):
    ids = publish(tmp_path, 0, 3) + publish(tmp_path, 1, 3)
    publish(tmp_path, 2, 3, stage="extract")
    shard_set = ShardSet(tmp_path, 3, CONTRACT)
    waiting = shard_set.join(own="shard-0-of-3")
    assert waiting.manifest is None and not waiting.refused
    assert waiting.waiting == ["shard-2-of-3: extract, 3/4 verified, heartbeat 7 s ago"]
    ids += publish(tmp_path, 2, 3)
    joined = shard_set.join(own="shard-0-of-3")
    assert [s["id"] for s in joined.manifest["samples"]] == ids
    assert joined.manifest["samples"][3]["path"] == "shard-1-of-3/000/1-0.safetensors"
    # A damaged manifest does not join: its fingerprint no longer sums its samples.
    path = layout.manifest_file(tmp_path / "shard-1-of-3")
    doc = json.loads(path.read_text())
    doc["samples"].pop()
    path.write_text(json.dumps(doc))
    assert shard_set.join(own="shard-0-of-3").waiting[0].startswith("shard-1-of-3: done")


def test_a_shard_of_another_model_is_refused_by_name(tmp_path):
    publish(tmp_path, 0, 2)
    publish(tmp_path, 1, 2, target="other-model", target_fingerprint="g")
    joined = ShardSet(tmp_path, 2, CONTRACT).join(own="shard-0-of-2")
    assert joined.manifest is None and len(joined.refused) == 1
    assert joined.refused[0].startswith("shard-1-of-2: captured under another contract")
    assert "target: 'm' -> 'other-model'" in joined.refused[0]


def test_two_shards_listing_one_sample_are_refused_by_name_and_nothing_trains(tmp_path):
    from eagle3d.dataset.shard_union import trained_union
    from eagle3d.statemachine.entry import Refusal
    cfg = load_config(make_config(tmp_path, {"data": {"shards": 3, "shard": 0}}))
    root = tmp_path / "dataset"
    publish(root, 0, 3)
    one = publish(root, 1, 3)
    publish(root, 2, 3, also=(one[1],))
    joined = ShardSet(root, 3, CONTRACT).join(own="shard-0-of-3")
    assert joined.manifest is None and not joined.waiting
    assert joined.refused == [f"shard-1-of-3 and shard-2-of-3 both list 1 sample ({one[1]}), "
                              "which training would read twice: redo one of the two shards"]
    with pytest.raises(Refusal, match=f"shard-1-of-3 and shard-2-of-3 both list 1 sample"):
        trained_union(cfg, {"contract": CONTRACT})


def test_status_on_the_training_node_shows_every_shard_from_what_it_published(tmp_path):
    from tests.pipeline import ctl
    config = make_config(tmp_path, {"data": {"shards": 3, "shard": 0}})
    publish(tmp_path / "dataset", 1, 3)
    publish(tmp_path / "dataset", 2, 3, stage="extract")
    text = ctl(config, "status").stdout
    assert "shard     shard-0-of-3: not started" in text
    assert "shard     shard-1-of-3: done · 3/3 verified" in text and "manifest published" in text
    assert "shard-2-of-3: extract · 3/4 verified" in text and "heartbeat 7 s ago" in text
    view = json.loads(ctl(config, "status", "--json").stdout)["shards"]
    assert [(s["name"], s["stage"], s["manifest"]) for s in view] == [
        ("shard-0-of-3", "not started", False), ("shard-1-of-3", "done", True),
        ("shard-2-of-3", "extract", False)]


def test_the_training_nodes_status_exits_8_for_a_shard_stale_stopped_failed_or_waiting(tmp_path):
    """operations.md pages on any code but 0 from the training node: a shard whose daemon died
    days ago, one stopped before it was done, one failed and one at its own gate each make it
    exit 8, the shard's line saying which; a shard at work or done does not."""
    import os

    from tests.pipeline import ctl
    config = make_config(tmp_path, {"data": {"shards": 3, "shard": 0}})
    cfg = load_config(config)
    cfg.paths.state_dir.mkdir(parents=True)
    write_state(cfg.paths.state_dir, {  # this node's own daemon: alive, waiting for the shards
        "stage": "verify", "underlying": "verify", "reason": "waiting for shards",
        "daemon": {"pid": os.getpid(), "alive": True,
                   "heartbeat": time.time() + 3600}})  # fresh while the test runs
    root = tmp_path / "dataset"
    publish(root, 1, 3)
    publish(root, 2, 3, stage="extract")
    done = ctl(config, "status")
    assert done.returncode == 0, done.stdout + done.stderr
    away = time.time() - 3 * 86400 - 60
    for state, words in [
            ({"daemon": {"heartbeat": away, "alive": True}}, "stale: no heartbeat for 3d 00h"),
            ({"daemon": {"heartbeat": away, "alive": False}}, "not running: stopped 3d 00h ago"),
            ({"stage": "failed", "reason": "spot check failed"}, "failed: spot check failed"),
            ({"stage": "verify", "reason": "training gate closed: 2 failed",
              "gate": {"waits_for_operator": True}}, "waiting for an operator: training gate"),
            ({"stage": "paused", "paused_by": "budget", "reason": "[budget] reserve"},
             "waiting for an operator: [budget] reserve")]:
        publish(root, 2, 3, stage="extract", state=state)
        shown = ctl(config, "status")
        assert shown.returncode == 8, (words, shown.stdout + shown.stderr)
        line = next(x for x in shown.stdout.splitlines() if "shard-2-of-3:" in x)
        assert words in line
        assert json.loads(ctl(config, "status", "--json").stdout)["shards_down"] == [
            f"shard-2-of-3: {line.split(' · ')[-1]}"]
    # A shard's own node judges itself only: the training node answers for the others.
    one = load_config(make_config(tmp_path, {"data": {"shards": 3, "shard": 1}}, "one.toml"))
    assert json.loads(ctl(one.path, "status", "--json").stdout)["shards_down"] == []


def test_the_training_nodes_status_exits_8_for_a_shard_never_heard_from(tmp_path):
    """A shard that never published its state (never started, started on another host's
    folder, or cannot reach the shared one) is as lost as a dead one: once this node's run has
    expected it past the stale bound, status exits 8 naming it and since when it has been
    expected; before that, a shard still starting up pages nobody. The clock is the run's, not
    the daemon's: a restart of the training node's daemon hides no shard missing for days."""
    import os

    from eagle3d.ctl.exit_codes import SHARD_DOWN
    from eagle3d.ctl.status import SHARD_STALE_S
    from tests.pipeline import ctl
    config = make_config(tmp_path, {"data": {"shards": 3, "shard": 0}})
    cfg = load_config(config)
    cfg.paths.state_dir.mkdir(parents=True)
    root = tmp_path / "dataset"
    publish(root, 1, 3)

    def own_run_began(ago: float) -> None:
        now = time.time()
        write_state(cfg.paths.state_dir, {
            "stage": "verify", "underlying": "verify", "reason": "waiting for shards",
            "run": {"id": "r", "created": now - ago},
            "daemon": {"pid": os.getpid(), "alive": True, "started": now - 5,  # restarted
                       "heartbeat": now + 3600}})  # fresh while the test runs

    own_run_began(SHARD_STALE_S / 2)
    starting = ctl(config, "status")
    assert starting.returncode == 0, starting.stdout + starting.stderr
    own_run_began(3 * 86400 + 60)
    began = time.strftime("%Y-%m-%d %H:%M", time.localtime(time.time() - 3 * 86400 - 60))
    shown = ctl(config, "status")
    assert shown.returncode == SHARD_DOWN, shown.stdout + shown.stderr
    line = next(x for x in shown.stdout.splitlines() if "shard-2-of-3:" in x)
    assert f"never heard from: expected since {began} (3d 00h" in line, line
    assert str(root / "shard-2-of-3") in line
    assert json.loads(ctl(config, "status", "--json").stdout)["shards_down"] == [
        f"shard-2-of-3: {line.split(' · ')[-1]}"]


def test_the_training_nodes_gate_refuses_a_shard_of_another_model_by_name(tmp_path):
    from eagle3d.daemon.stages.shard_gate import ShardGate
    from eagle3d.dataset import contract
    from eagle3d.statemachine.ledger import Counts
    from eagle3d.statemachine.stages import Seen, ShardFacts
    cfg = load_config(make_config(tmp_path, {"data": {"shards": 3, "shard": 0}}))
    root = tmp_path / "dataset"
    publish(root, 0, 3)
    contract.write(cfg.paths.dataset_dir, {**CONTRACT, "shard": {"index": 0, "count": 3}})
    publish(root, 1, 3)
    publish(root, 2, 3, stage="verify")
    gate = ShardGate(cfg)
    seen = Seen(Counts({"verified": 3}, {}, {}), "fp")
    assert gate.observe(seen) == ShardFacts(shards_waiting=(
        "waiting for shards to publish a verified manifest: shard-2-of-3: verify, 3/4 verified, "
        "heartbeat 7 s ago"))
    assert gate.fingerprint() == ""
    publish(root, 2, 3, target="another/model")
    blocked = gate.observe(seen).blocked
    assert blocked.startswith("refused shards: shard-2-of-3: captured under another contract")
    publish(root, 2, 3)  # the shard redone under the right contract joins
    assert gate.observe(seen) == ShardFacts() and gate.fingerprint()
    one = load_config(make_config(tmp_path, {"data": {"shards": 3, "shard": 1}}, "one.toml"))
    assert ShardGate(one).observe(seen).trains_elsewhere


def test_the_training_nodes_gate_fails_where_every_share_is_empty(tmp_path):
    """An empty share joins (its manifest lists nothing); the union of empty shares is nothing to
    train on, and the training node says so."""
    from eagle3d.daemon.stages.shard_gate import ShardGate
    from eagle3d.dataset import contract
    from eagle3d.statemachine.ledger import Counts
    from eagle3d.statemachine.stages import Seen, ShardFacts
    cfg = load_config(make_config(tmp_path, {"data": {"shards": 3, "shard": 0}}))
    root = tmp_path / "dataset"
    for index in range(3):
        publish(root, index, 3, n=0)
    contract.write(cfg.paths.dataset_dir, {**CONTRACT, "shard": {"index": 0, "count": 3}})
    seen = Seen(Counts({}, {}, {}), manifest.EMPTY)
    assert ShardGate(cfg).observe(seen) == ShardFacts(blocked="every shard's share is empty (3 "
                                                      "shards): nothing to train on; check [data] "
                                                      "source, first, limit")
    publish(root, 2, 3, n=1)
    assert ShardGate(cfg).observe(seen) == ShardFacts()


def test_the_training_nodes_gate_refuses_a_shard_of_another_answers_count_naming_it(tmp_path):
    """[generate] answers is part of the contract: a shard whose target wrote two answers per
    conversation cannot join a training node's dataset of one, and the refusal names the key."""
    from eagle3d.daemon.stages.shard_gate import ShardGate
    from eagle3d.dataset import contract
    from eagle3d.statemachine.ledger import Counts
    from eagle3d.statemachine.stages import Seen
    sections = {"data": {"shards": 2, "shard": 0, "responses": "target"},
                "generate": {"temperature": 0.7}}
    cfg = load_config(make_config(tmp_path, sections))
    two = load_config(make_config(tmp_path, {**sections, "generate": {"temperature": 0.7,
                                                                      "answers": 2}}, "two.toml"))
    root = tmp_path / "dataset"
    publish(root, 0, 2, **contract.generate_record(cfg))
    contract.write(cfg.paths.dataset_dir, {**CONTRACT, **contract.generate_record(cfg),
                                           "shard": {"index": 0, "count": 2}})
    publish(root, 1, 2, **contract.generate_record(two))
    seen = Seen(Counts({"verified": 3}, {}, {}), "fp")
    assert ShardGate(cfg).observe(seen).blocked == (
        "refused shards: shard-1-of-2: captured under another contract than this node's "
        "(generate.answers: 1 -> 2): it cannot join this training")


def test_the_gate_reads_only_what_a_shard_republished_and_sees_it_at_the_next_tick(tmp_path):
    """The gate joins at every tick: an unchanged set is read and joined once, and a manifest
    published again (here of the same size and mtime, as a quick rewrite can be) at once."""
    import os

    from eagle3d.daemon.stages.shard_gate import ShardGate
    from eagle3d.dataset import contract
    from eagle3d.statemachine.ledger import Counts
    from eagle3d.statemachine.stages import Seen, ShardFacts
    cfg = load_config(make_config(tmp_path, {"data": {"shards": 3, "shard": 0}}))
    root = tmp_path / "dataset"
    for index in range(3):
        publish(root, index, 3)
    contract.write(cfg.paths.dataset_dir, {**CONTRACT, "shard": {"index": 0, "count": 3}})
    gate, seen = ShardGate(cfg), Seen(Counts({"verified": 3}, {}, {}), "fp")
    assert gate.observe(seen) == ShardFacts()
    first, reads, union = gate.fingerprint(), gate.set.reads, gate.last.manifest
    for _ in range(3):
        assert gate.observe(seen) == ShardFacts() and gate.last.manifest is union
    assert gate.set.reads == reads and gate.fingerprint() == first
    folder = root / "shard-1-of-3"
    path, doc = layout.manifest_file(folder), manifest.read(folder)
    before = path.stat()
    doc["samples"][0]["checksum"] = "cX0"
    doc["fingerprint"] = manifest.fingerprint((s["id"], s["checksum"]) for s in doc["samples"])
    manifest.write(folder, doc)
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert path.stat().st_size == before.st_size
    assert gate.observe(seen) == ShardFacts() and gate.fingerprint() != first
    assert gate.set.reads == reads + 1  # that manifest, and nothing else
    assert {s["checksum"] for s in gate.last.manifest["samples"]} >= {"cX0"}


def test_only_the_training_node_clears_the_train_folder_and_only_this_hosts_temps(tmp_path):
    """The train folder is shared by every shard, and by hosts: a shard's start leaves it alone,
    and the training node's removes a dead writer's temp file only where that writer ran on this
    host (another host's pid means nothing here, and its writer may be at work)."""
    import subprocess

    from eagle3d.daemon.reconcile import Daemon
    from eagle3d.statemachine.atomic import HOST
    source = write_conversations(tmp_path / "conv.jsonl", 4)
    configs = [make_config(tmp_path, {"data": {"source": str(source), "format": "messages",
                                               "limit": 4, "shards": 2, "shard": i}},
                           name=f"shard{i}.toml") for i in range(2)]
    gone = subprocess.Popen(["true"])  # a writer that has exited, as a pid on each host
    gone.wait()
    train = tmp_path / "train"
    train.mkdir(mode=0o750)
    here, there = (train / f".progress.json.{host}.{gone.pid}.tmp" for host in (HOST, "node-b"))
    for temp in (here, there):
        temp.write_text("half")

    def start(config: Path) -> None:
        daemon = Daemon(load_config(config))
        daemon.recover()
        daemon.shutdown()
        daemon.ledger.close()
    start(configs[1])
    assert here.exists() and there.exists(), "a shard's start touched the train folder"
    start(configs[0])
    assert not here.exists() and there.exists()


def test_a_sharded_node_refuses_a_run_its_folders_cannot_hold(tmp_path):
    """A shard's folders hold one run: a config of another contract is refused with the way out,
    never laid out where the gate and status would not find it."""
    from eagle3d.daemon import run_select
    source = write_conversations(tmp_path / "conv.jsonl", 4)
    data = {"source": str(source), "format": "messages", "limit": 4, "shards": 3, "shard": 1}
    first = load_config(make_config(tmp_path, {"data": data}))
    assert run_select.select(first, "w").new
    assert run_select.select(first, "w").run.in_place  # the same contract resumes
    other = load_config(make_config(tmp_path, {"data": data, "target": {"dtype": "bfloat16"}},
                                    name="other.toml"))
    with pytest.raises(ConfigError, match="keeps one run per set of roots"):
        run_select.select(other, "w")
