"""Training for real: gloo on CPU (one node's ranks as the daemon starts them, torchrun for
several nodes), checkpoints that survive kill -9, the refusal of a dataset that does not match
the ledger. The dataset is the real SmolLM2 fixture."""

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from drafter_fixtures import MODEL, cached_dataset, write_config
from eagle3d.statemachine.config_schema import TrainConfig
from tests.pipeline import listeners_beyond_loopback

PY = sys.executable
SMALL = {"draft_vocab": 2048, "ttt_steps": 2, "epochs": 1.0, "batch_tokens": 1024, "lr": 3e-4,
         "warmup_steps": 2, "threads": 1}


def train_cmd(config: Path) -> list[str]:
    """The trainer's command as the daemon gives it for `config` ([train] nproc processes)."""
    from eagle3d.daemon.stages.train import trainer_argv
    from eagle3d.statemachine.config_validation import load_config
    return trainer_argv(load_config(config), config)


def metrics(train_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (train_dir / "metrics.jsonl").read_text().splitlines()]

def wait_for_steps(train: Path, steps: int, seconds: float) -> None:
    """Until the trainer in `train` has logged `steps` steps; fails after `seconds`."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if (train / "metrics.jsonl").exists() and len(metrics(train)) >= steps:
            return
        time.sleep(0.1)
    logged = len(metrics(train)) if (train / "metrics.jsonl").exists() else 0
    pytest.fail(f"the trainer logged {logged} of {steps} steps in {seconds} s")



def kill_tree(proc: subprocess.Popen, sig: int, wait: bool = True) -> None:
    """Signal the trainer's command and every process under it."""
    import psutil
    for p in [*psutil.Process(proc.pid).children(recursive=True), psutil.Process(proc.pid)]:
        p.send_signal(sig)
    if wait:
        proc.wait()


@pytest.fixture(scope="module")
def data_root() -> Path:
    return cached_dataset(32)


@pytest.mark.slow
def test_two_processes_with_gloo_train_and_export(tmp_path, data_root):
    config = write_config(tmp_path, data_root, {**SMALL, "nproc": 2, "max_steps": 4,
                                                "checkpoint_every": 2})
    run = subprocess.run(train_cmd(config), capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    train = tmp_path / "train"
    rows = metrics(train)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert all(len(r["acc"]) == 2 and r["tokens_per_s"] > 0 for r in rows)
    progress = json.loads((train / "progress.json").read_text())
    assert progress["status"] == "done" and progress["step"] == progress["total_steps"] == 4
    assert sorted(p.name for p in (train / "export").iterdir()) == ["config.json",
                                                                     "model.safetensors"]
    assert (train / "metrics.png").stat().st_size > 1000
    assert sorted(p.name for p in (train / "checkpoints").iterdir()) == ["step-00000002",
                                                                          "step-00000004"]
    # The export runs: speculative decoding with it, checked against plain greedy decoding.
    ev = subprocess.run([PY, "-m", "eagle3d.drafter.evaluate", "-c", str(config), "--first",
                         "17000", "--limit", "2", "--steps", "3", "--max-new-tokens", "12",
                         "--json", "--out", str(train / "eval.json")],
                        capture_output=True, text=True, timeout=600)
    assert ev.returncode == 0, ev.stderr[-3000:]
    report = json.loads((train / "eval.json").read_text())
    assert report == json.loads(ev.stdout.splitlines()[-1])
    assert report["identical_to_greedy"] is True and report["prompts"] == 2
    assert report["new_tokens"] > 2 and report["acceptance_length"] >= 1.0
    assert len(report["per_position_acceptance"]) == 3


@pytest.mark.slow
def test_kill_9_and_resume_follows_the_uninterrupted_trajectory(tmp_path, data_root):
    settings = {**SMALL, "max_steps": 7, "checkpoint_every": 3}
    (tmp_path / "whole").mkdir()
    whole = write_config(tmp_path / "whole", data_root, settings)
    run = subprocess.run(train_cmd(whole), capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]

    (tmp_path / "cut").mkdir()
    cut = write_config(tmp_path / "cut", data_root, settings)
    train = tmp_path / "cut" / "train"
    proc = subprocess.Popen(train_cmd(cut), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    wait_for_steps(train, 5, 600)  # past the step-3 checkpoint, before the end
    kill_tree(proc, signal.SIGKILL)
    assert len(metrics(train)) < 7, "the run ended before it could be killed"
    resumed = subprocess.run(train_cmd(cut), capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resuming at step 3" in resumed.stderr

    want, got = metrics(tmp_path / "whole" / "train"), metrics(train)
    assert [r["step"] for r in got] == list(range(1, 8))
    for a, b in zip(want, got):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-4), (a["step"], a["loss"], b["loss"])
        assert b["lr"] == pytest.approx(a["lr"], rel=1e-9)


@pytest.mark.slow
def test_a_wider_drafter_starts_over_and_exports_its_width(tmp_path, data_root):
    """[train] intermediate_size changes the drafter's shape: the narrower run's checkpoint is
    not resumed into it (it could not load), and the export tells SGLang the width."""
    narrow = write_config(tmp_path, data_root, {**SMALL, "max_steps": 2, "checkpoint_every": 2})
    run = subprocess.run(train_cmd(narrow), capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    exported = json.loads((tmp_path / "train" / "export" / "config.json").read_text())
    assert exported["intermediate_size"] == 1536  # SmolLM2-135M's own
    wide = write_config(tmp_path, data_root, {**SMALL, "max_steps": 2, "checkpoint_every": 2,
                                              "intermediate_size": 2048})
    run = subprocess.run(train_cmd(wide), capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "for a drafter of another shape" in run.stderr
    assert [r["step"] for r in metrics(tmp_path / "train")] == [1, 2]
    exported = json.loads((tmp_path / "train" / "export" / "config.json").read_text())
    assert exported["intermediate_size"] == 2048


def test_a_checkpoint_of_an_earlier_weight_layout_is_not_resumed(tmp_path, caplog):
    """A checkpoint from an eagle3d that held the attention's projections as SGLang does
    (q_proj, k_proj, v_proj) cannot load into today's drafter: training starts over and says
    why, rather than crashing at every restart."""
    import torch
    from eagle3d.drafter import checkpoint
    shape, train = {"draft": 1}, TrainConfig()
    now = {"midlayer.self_attn.qkv_tokens.weight": torch.zeros(8, 4)}
    made = {"manifest_fingerprint": "m", "draft_config": shape,
            "schedule": checkpoint.schedule(train)}
    checkpoint.save(tmp_path, 3, {**made, "model": {
        "midlayer.self_attn.q_proj.weight": torch.zeros(4, 8)}})
    assert checkpoint.latest(tmp_path, "m", 1, shape, now, train)[0] is None
    assert "lays the drafter's weights out otherwise" in caplog.text
    checkpoint.save(tmp_path, 4, {**made, "model": now})
    assert checkpoint.latest(tmp_path, "m", 1, shape, now, train)[0]["model"].keys() == now.keys()


def test_a_checkpoint_that_did_not_record_its_manifests_size_starts_over_saying_why(
        tmp_path, caplog):
    """A checkpoint of an eagle3d that did not record its manifest's sample count (made by hand
    as it saved one), of another manifest: training starts over, saying the manifest changed."""
    import torch
    from eagle3d.drafter import checkpoint
    shape, train = {"draft": 1}, TrainConfig()
    now = {"fc.weight": torch.zeros(2, 2)}
    checkpoint.save(tmp_path, 3, {"manifest_fingerprint": "old", "draft_config": shape,
                                  "schedule": checkpoint.schedule(train), "model": now})
    assert checkpoint.latest(tmp_path, "new", 5, shape, now, train) == \
        (None, "the checkpoint was made from another dataset manifest")


def test_a_retraining_resumes_its_own_checkpoint_beside_higher_steps_of_the_old_manifest(
        tmp_path):
    """A grown manifest trains from step 0 beside the old manifest's checkpoints of higher
    steps: the newest checkpoint is the one written last, not the highest step, so a restart
    of the retraining resumes its own (and its first save does not prune it away)."""
    import torch
    from eagle3d.drafter import checkpoint
    shape, train = {"draft": 1}, TrainConfig()
    now = {"fc.weight": torch.zeros(2, 2)}
    made = {"draft_config": shape, "schedule": checkpoint.schedule(train), "model": now}
    for step in (8, 10):
        checkpoint.save(tmp_path, step, {**made, "manifest_fingerprint": "old", "step": step})
    checkpoint.save(tmp_path, 2, {**made, "manifest_fingerprint": "grown", "step": 2})
    state, why = checkpoint.latest(tmp_path, "grown", 1, shape, now, train)
    assert why is None and state["step"] == 2


class _Planted:
    """What a hostile checkpoint holds: an object whose unpickling runs a command."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def test_a_checkpoint_that_would_run_code_is_not_loaded(tmp_path, caplog):
    """A checkpoint is loaded as tensors and plain values only: one that names code to run
    when unpickled is not resumed (training starts over and says why), and the code never ran."""
    import torch
    from eagle3d.drafter import checkpoint
    shape, train = {"draft": 1}, TrainConfig()
    now = {"fc.weight": torch.zeros(2, 2)}
    marker = tmp_path / "ran"
    checkpoint.save(tmp_path / "ckpt", 2, {
        "manifest_fingerprint": "m", "draft_config": shape, "model": now,
        "schedule": checkpoint.schedule(train), "payload": _Planted(marker)})
    assert checkpoint.latest(tmp_path / "ckpt", "m", 1, shape, now, train)[0] is None
    assert not marker.exists()
    assert "holds more than tensors and plain values" in caplog.text
    assert "starting over" in caplog.text


@pytest.mark.parametrize("change", [{"batch_tokens": 8192}, {"epochs": 2.0}, {"seed": 1},
                                    {"ttt_steps": 3}])
def test_a_checkpoint_is_not_resumed_under_another_schedule(tmp_path, caplog, change):
    """A checkpoint's step and batch position count in its epochs' batches and unroll: resumed
    under other [train] batch_tokens, epochs, seed or ttt_steps, samples would be trained twice
    or not at all. Training starts over and says why; so it does for a checkpoint that recorded
    no schedule (an earlier eagle3d)."""
    import torch
    from eagle3d.drafter import checkpoint
    shape, train = {"draft": 1}, TrainConfig()
    now = {"fc.weight": torch.zeros(2, 2)}
    made = {"manifest_fingerprint": "m", "draft_config": shape, "model": now}
    checkpoint.save(tmp_path, 2, made)
    assert checkpoint.latest(tmp_path, "m", 1, shape, now, train)[0] is None
    checkpoint.save(tmp_path, 3, {**made, "schedule": checkpoint.schedule(train)})
    assert checkpoint.latest(tmp_path, "m", 1, shape, now, train)[0]["model"].keys() == now.keys()
    caplog.clear()
    assert checkpoint.latest(tmp_path, "m", 1, shape, now, train._replace(**change))[0] is None
    assert "was made under other [train] settings" in caplog.text
    assert "starting over" in caplog.text


def fewer_verified(where: Path, data_root: Path, keep: int) -> Path:
    """A copy of the fixture as it stood before the operator raised [data] limit: only its
    first `keep` samples verified (the others excluded) and listed in the manifest. The dumps
    are the fixture's own files (hard links)."""
    import os
    import shutil
    from eagle3d.dataset import contract as contract_mod
    from eagle3d.statemachine import layout, manifest as manifest_mod
    from eagle3d.statemachine.ledger import Ledger
    shutil.copytree(data_root / "state", where / "state")
    shutil.copytree(data_root / "dataset", where / "dataset", copy_function=os.link)
    dataset = where / "dataset"
    with Ledger(layout.ledger(where / "state")) as ledger:
        ledger.exclude([s["id"] for s in manifest_mod.read(dataset)["samples"][keep:]], "test")
        manifest_mod.write(dataset, manifest_mod.build(ledger, contract_mod.read(dataset)))
    return where


@pytest.mark.slow
def test_a_grown_manifest_trains_from_step_0_and_says_why(tmp_path, data_root):
    """A raised [data] limit grows the manifest; the drafter's checkpoint is of the smaller one
    (its vocabulary and batches), so training starts over at step 0, and the trainer says why in
    progress.json (what eagle3ctl status shows) and in its checkpoints, so that a restart
    during that training still says it."""
    import torch
    settings = {**SMALL, "max_steps": 2, "checkpoint_every": 2}
    before = fewer_verified(tmp_path / "before", data_root, 16)
    run = subprocess.run(train_cmd(write_config(tmp_path, before, settings)),
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    train = tmp_path / "train"
    assert json.loads((train / "progress.json").read_text())["started_over"] is None
    grown = subprocess.run(train_cmd(write_config(tmp_path, data_root, settings)),
                           capture_output=True, text=True, timeout=600)
    assert grown.returncode == 0, grown.stderr[-3000:]
    why = "the manifest grew from 16 to 32 samples (a raised [data] limit)"
    assert why in grown.stderr and "starting over" in grown.stderr
    assert [r["step"] for r in metrics(train)] == [1, 2]
    assert json.loads((train / "progress.json").read_text())["started_over"] == why
    state = torch.load(train / "checkpoints" / "step-00000002" / "state.pt", weights_only=True)
    assert state["started_over"] == why and state["samples"] == 32


@pytest.mark.slow
def test_sigterm_checkpoints_and_exits_0(tmp_path, data_root):
    config = write_config(tmp_path, data_root, {**SMALL, "max_steps": 50,
                                                "checkpoint_every": 1000})
    train = tmp_path / "train"
    # The trainer itself, without torchrun: torchrun answers SIGTERM with exit code 1 whatever
    # its workers do.
    proc = subprocess.Popen([PY, "-m", "eagle3d.drafter.train", "-c", str(config)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if (train / "metrics.jsonl").exists() and len(metrics(train)) >= 2:
            break
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err[-3000:]
    done = len(metrics(train))
    assert (train / "checkpoints" / f"step-{done:08d}" / "state.pt").exists()
    assert json.loads((train / "progress.json").read_text())["status"] == "training"


@pytest.mark.slow
def test_an_fp8_dataset_trains_like_its_bf16_twin(tmp_path, data_root):
    """The same conversations dumped in fp8: the trainer dequantizes them as it loads each batch,
    and the same seed follows the bf16 run's loss within a percent."""
    fp8_root = cached_dataset(32, dump_dtype="float8_e4m3fn")
    fp8_bytes, bf16_bytes = (sum(p.stat().st_size
                                 for p in (root / "dataset").rglob("*.safetensors"))
                             for root in (fp8_root, data_root))
    assert fp8_bytes <= 0.55 * bf16_bytes
    runs = {}
    for name, root in (("bf16", data_root), ("fp8", fp8_root)):
        (tmp_path / name).mkdir()
        config = write_config(tmp_path / name, root, {**SMALL, "max_steps": 4})
        run = subprocess.run(train_cmd(config), capture_output=True, text=True, timeout=600)
        assert run.returncode == 0, run.stderr[-3000:]
        runs[name] = metrics(tmp_path / name / "train")
    for a, b in zip(runs["bf16"], runs["fp8"]):
        assert b["loss"] == pytest.approx(a["loss"], rel=0.01), (a["step"], a["loss"], b["loss"])
    assert runs["fp8"][-1]["loss"] < runs["fp8"][0]["loss"]


def free_port() -> int:
    import socket
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def node_config(where: Path, data_root: Path, settings: dict, node: int, port: int) -> Path:
    where.mkdir()
    return write_config(where, data_root, {**settings, "nproc": 1, "nnodes": 2,
                                           "node_rank": node, "rendezvous": f"127.0.0.1:{port}"})


def trainer_rank(train_node: subprocess.Popen):
    """The trainer process that `eagle3d train-node` runs under torchrun, once it runs."""
    import psutil
    for p in psutil.Process(train_node.pid).children(recursive=True):
        cmd = p.cmdline()
        if "eagle3d.drafter.train" in cmd and "torch.distributed.run" not in cmd:
            return p
    return None


def final_weights(train_dir: Path) -> dict:
    import torch
    last = sorted((train_dir / "checkpoints").iterdir())[-1]
    return torch.load(last / "state.pt", weights_only=True)["model"]


@pytest.mark.slow
def test_two_nodes_train_as_one_job_and_resume_after_losing_a_node(tmp_path, data_root):
    """Two torchrun agents on this machine as two nodes (static rendezvous on localhost, one
    gloo process each): node 0 started as the daemon starts it, node 1 by `eagle3d train-node`.
    They train exactly what one node with two processes trains (the same data shards, losses
    and weights); node 1's trainer is killed after a checkpoint, node 0 is restarted as the
    daemon restarts it, train-node rejoins by itself, and the job resumes from the checkpoint.
    Only node 0 writes: node 1's train folder stays empty."""
    import torch
    from eagle3d.daemon.stages.train import trainer_argv
    from eagle3d.statemachine.config_validation import load_config
    steps = 5
    settings = {**SMALL, "batch_tokens": 512, "max_steps": steps, "checkpoint_every": 2}
    (tmp_path / "one").mkdir()
    one = write_config(tmp_path / "one", data_root, {**settings, "nproc": 2})
    run = subprocess.run(trainer_argv(load_config(one), one), capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]

    port = free_port()
    node0 = node_config(tmp_path / "node0", data_root, settings, 0, port)
    node1 = node_config(tmp_path / "node1", data_root, settings, 1, port)
    follower_log = tmp_path / "node1" / "train-node.log"
    with open(follower_log, "w") as log:
        follower = subprocess.Popen([PY, "-m", "eagle3d.daemon.main", "train-node", "-c",
                                     str(node1)], stderr=log)
    train = tmp_path / "node0" / "train"
    leader_argv = trainer_argv(load_config(node0), node0)
    try:
        first = subprocess.Popen(leader_argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                 text=True)
        wait_for_steps(train, 3, 300)  # past the step-2 checkpoint, before the end
        follower_trainer = trainer_rank(follower)
        assert follower_trainer is not None, "node 1's trainer is not running"
        follower_trainer.kill()
        _, err = first.communicate(timeout=120)
        assert first.returncode != 0, "node 0 finished although node 1 was killed"
        assert "node 0 of 2: ranks 0 to 0 of 2" in err
        assert len(metrics(train)) < steps, "the run ended before node 1 could be killed"
        again = subprocess.run(leader_argv, capture_output=True, text=True, timeout=600)
        assert again.returncode == 0, again.stderr[-3000:]
        assert "resuming at step" in again.stderr
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # its trainer ends a moment after node 0's
            if "this node's trainer exited with code 0" in follower_log.read_text():
                break
            time.sleep(0.1)
    finally:
        follower.send_signal(signal.SIGTERM)
        follower.wait(timeout=120)
    follower_err = follower_log.read_text()
    assert follower.returncode == 0, follower_err[-3000:]
    assert "node 1 of 2: ranks 1 to 1 of 2" in follower_err
    assert "this node's trainer exited with code 0" in follower_err, follower_err[-3000:]
    assert not (tmp_path / "node1" / "train").exists()

    want, got = metrics(tmp_path / "one" / "train"), metrics(train)
    assert [r["step"] for r in got] == list(range(1, steps + 1))
    for a, b in zip(want, got):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-4), (a["step"], a["loss"], b["loss"])
    reference, trained = final_weights(tmp_path / "one" / "train"), final_weights(train)
    assert reference.keys() == trained.keys()
    for name in reference:
        torch.testing.assert_close(trained[name], reference[name], rtol=1e-4, atol=1e-6)


def other_model_of_the_same_shape(where: Path) -> Path:
    """A copy of the fixture's target with its last weight byte changed: every shape check
    passes."""
    import shutil
    from eagle3d.statemachine.config_schema import resolve_location
    original = resolve_location(MODEL, Path("."))
    other = where / original.name
    shutil.copyfile(original, other)
    with open(other, "r+b") as fh:
        fh.seek(-1, 2)
        byte = fh.read(1)[0]
        fh.seek(-1, 1)
        fh.write(bytes([byte ^ 1]))
    return other


def train_two_nodes(tmp_path: Path, data_root: Path, node1_data: Path,
                    node1_model: str = MODEL) -> list[str]:
    """Node 0 and node 1 of one training (2 steps), node 1 with its own dataset copy and
    target; both must fail. Returns their logs."""
    from eagle3d.daemon.stages.train import trainer_argv
    from eagle3d.statemachine.config_validation import load_config
    port = free_port()
    settings = {**SMALL, "max_steps": 2}
    node0 = node_config(tmp_path / "node0", data_root, settings, 0, port)
    node1 = node_config(tmp_path / "node1", node1_data, settings, 1, port)
    node1.write_text(node1.read_text().replace(f'model = "{MODEL}"', f'model = "{node1_model}"'))
    nodes = [subprocess.Popen(trainer_argv(load_config(c), c), stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, text=True) for c in (node0, node1)]
    errors = [node.communicate(timeout=300)[1] for node in nodes]
    for node, err in zip(nodes, errors):
        assert node.returncode != 0, err[-3000:]
    assert not (tmp_path / "node0" / "train" / "metrics.jsonl").exists()
    return errors


@pytest.mark.slow
def test_a_rank_on_another_node_refuses_another_model(tmp_path, data_root):
    """Node 1's copy of the target is another model of the same shape. Its rank checks the
    weights it would load the embedding and head from, and both nodes stop before training
    with one refusal naming node 1 and its model (the daemon's exit code for a contract
    mismatch, in refusal.json); node 0, whose target is right, trains nothing."""
    from eagle3d.statemachine import entry, train_files
    other = other_model_of_the_same_shape(tmp_path)
    for err in train_two_nodes(tmp_path, data_root, data_root, str(other)):
        assert f"node 1 of 2: the target {other} is not the model this dataset was captured " \
               "with" in err, err[-3000:]
    refused = train_files.read_refusal(tmp_path / "node0" / "train")
    assert refused is not None and refused.code == entry.CONTRACT_MISMATCH


@pytest.mark.slow
def test_a_rank_on_another_node_refuses_a_dataset_file_that_is_not_the_manifests(tmp_path,
                                                                                  data_root):
    """Node 1's copy of the dataset has two samples' files swapped (each a valid dump, of the
    same contract): its ranks read the header of every file of their node and both nodes refuse,
    naming node 1 and the file."""
    import shutil
    from eagle3d.statemachine import manifest as manifest_mod
    copy = tmp_path / "copy"
    shutil.copytree(data_root, copy)
    a, b = [copy / "dataset" / s["path"]
            for s in manifest_mod.read(copy / "dataset")["samples"][:2]]
    a.rename(tmp_path / "a")
    b.rename(a)
    (tmp_path / "a").rename(b)
    for err in train_two_nodes(tmp_path, data_root, copy):
        assert f"node 1 of 2: refusing to train: {a} holds sample" in err, err[-3000:]


@pytest.mark.slow
def test_a_resume_with_another_process_count_goes_on_where_the_epoch_stood(tmp_path, data_root):
    """A node lost for good: the training goes on with fewer processes from the checkpoint.
    Two processes trained 2 steps (4 batches of the epoch's order); one process goes on from
    the epoch's 5th batch, as its step 4, and ends the epoch."""
    from eagle3d.drafter import data
    from eagle3d.statemachine import manifest as manifest_mod
    settings = {**SMALL, "checkpoint_every": 2}
    two = write_config(tmp_path, data_root, {**settings, "nproc": 2, "max_steps": 2})
    run = subprocess.run(train_cmd(two), capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    one = write_config(tmp_path, data_root, {**settings, "nproc": 1})
    run = subprocess.run(train_cmd(one), capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    assert ("resuming a 2-process run with 1 processes: epoch 0 goes on from batch 4 of its "
            "order, as step 4") in run.stderr
    lengths = [s["tokens"] for s in manifest_mod.read(data_root / "dataset")["samples"]]
    total = len(data.plan_epoch(lengths, SMALL["batch_tokens"], 0, 0, 1)[0])
    steps = [r["step"] for r in metrics(tmp_path / "train")]
    assert steps == [1, 2, *range(5, total + 1)]


def test_refuses_a_dataset_that_does_not_match_the_ledger(tmp_path, data_root):
    from eagle3d.statemachine.ledger import Ledger
    other = tmp_path / "other"
    (other / "state").mkdir(parents=True)
    Ledger(other / "state" / "ledger.sqlite").close()  # a ledger with no verified sample
    (other / "dataset").symlink_to(data_root / "dataset")
    config = write_config(tmp_path, other, SMALL)
    run = subprocess.run([PY, "-m", "eagle3d.drafter.train", "-c", str(config)],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 2
    assert "refusing to train" in run.stderr and "does not match" in run.stderr
    assert not (tmp_path / "train" / "export").exists()


def test_refuses_a_manifest_whose_token_count_is_not_the_dumps(tmp_path, data_root):
    """The batches are planned by the manifest's token counts and read by the dumps' headers:
    a manifest that disagrees with a header (its fingerprint covers ids and checksums, not
    counts) is refused before training, naming the dump, not trained into wrong batches."""
    import shutil
    from eagle3d.statemachine import manifest as manifest_mod
    other = tmp_path / "other"
    shutil.copytree(data_root / "state", other / "state")
    (other / "dataset").mkdir()
    shutil.copy(data_root / "dataset" / "capture.toml", other / "dataset")
    (other / "dataset" / "shard-0000").symlink_to(data_root / "dataset" / "shard-0000")
    manifest = manifest_mod.read(data_root / "dataset")
    sample = manifest["samples"][3]
    sample["tokens"] += 1
    manifest_mod.write(other / "dataset", manifest)
    config = write_config(tmp_path, other, SMALL)
    run = subprocess.run([PY, "-m", "eagle3d.drafter.train", "-c", str(config)],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 2, run.stderr[-3000:]
    dump = other / "dataset" / sample["path"]
    assert (f"refusing to train: {dump} holds {sample['tokens'] - 1} tokens, the manifest lists "
            f"{sample['tokens']} for sample {sample['id']}") in run.stderr, run.stderr[-3000:]
    assert "Traceback" not in run.stderr
    assert not (tmp_path / "train" / "export").exists()


def changed_copy(tmp_path: Path, data_root: Path, keep_time: bool) -> tuple[Path, dict]:
    """A copy of the verified dataset (times kept, as verify saw them) with one bit flipped in
    the hidden states of a dump of the first batch the trainer reads: with its time kept (bit
    rot) or not (a write). Returns the copy and the damaged sample's manifest entry."""
    import os
    import shutil
    from eagle3d.drafter import data
    from eagle3d.statemachine import manifest as manifest_mod
    copy = tmp_path / "copy"
    shutil.copytree(data_root, copy)
    samples = manifest_mod.read(copy / "dataset")["samples"]
    first = data.plan_epoch([s["tokens"] for s in samples], SMALL["batch_tokens"], 0, 0, 1)[0][0]
    sample = samples[first.indices[0]]
    path = copy / "dataset" / sample["path"]
    st = path.stat()
    with open(path, "r+b") as f:
        f.seek(st.st_size - 100)
        byte = f.read(1)[0]
        f.seek(-1, 1)
        f.write(bytes([byte ^ 0x40]))
    if keep_time:
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    return copy, sample


def assert_sent_back(run: subprocess.CompletedProcess, train_dir: Path, path: Path,
                     sample: dict, why: str) -> None:
    """The trainer refused the changed file, naming it and its sample for the daemon, and
    trained nothing."""
    from eagle3d.statemachine import entry, train_files
    assert "refusing to train: " in run.stderr and str(path) in run.stderr, run.stderr[-3000:]
    assert why in run.stderr, run.stderr[-3000:]
    refused = train_files.read_refusal(train_dir)
    assert refused is not None and refused.code == entry.DATASET_CHANGED
    assert refused.samples == (sample["id"],)
    logged = metrics(train_dir) if (train_dir / "metrics.jsonl").exists() else []
    assert logged == [] and not (train_dir / "export").exists()


def test_a_dataset_file_written_since_verify_is_refused_at_the_start_naming_it(tmp_path,
                                                                              data_root):
    """A file whose modification time is not verify's is refused before anything loads, with
    the exit code that sends its sample back to verify."""
    from eagle3d.statemachine import entry
    copy, sample = changed_copy(tmp_path, data_root, keep_time=False)
    config = write_config(tmp_path, copy, SMALL)
    run = subprocess.run([PY, "-m", "eagle3d.drafter.train", "-c", str(config)],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == entry.DATASET_CHANGED, run.stderr[-3000:]
    path = copy / "dataset" / sample["path"]
    assert_sent_back(run, tmp_path / "train", path, sample,
                     "1 dataset file(s) changed since verify passed them")
    assert f"{path} (modified at " in run.stderr and "Traceback" not in run.stderr


@pytest.mark.slow
def test_a_bit_flipped_since_verify_is_refused_by_its_checksum_before_it_is_trained_on(
        tmp_path, data_root):
    """Bit rot in a file of the first batch: size and time are verify's, so only the checksum
    the reader checks as it reads can tell. The trainer stops before its first step, naming the
    file and its sample in refusal.json."""
    copy, sample = changed_copy(tmp_path, data_root, keep_time=True)
    config = write_config(tmp_path, copy, SMALL)
    run = subprocess.run(train_cmd(config), capture_output=True, text=True, timeout=600)
    assert run.returncode != 0
    assert_sent_back(run, tmp_path / "train", copy / "dataset" / sample["path"], sample,
                     "changed since verify passed it: its checksum is")


def test_the_reported_rate_holds_steady_through_one_slow_step_and_follows_a_lasting_change():
    from eagle3d.drafter.reporting import RecentRate
    rate, now = RecentRate(window_s=10.0), 0.0

    def steps(count: int, seconds: float, tokens: float = 1000.0) -> float:
        nonlocal now
        for _ in range(count):
            got = rate.add(now, now + seconds, tokens)
            now += seconds
        return got

    assert steps(200, 0.1) == pytest.approx(10_000)
    # One step that waited a second (its own rate: 1,000 tokens/s) is not a stall.
    assert steps(1, 1.0) > 8_000
    # A slowdown that lasts is reported once the window has moved past the old pace.
    assert steps(100, 0.2) == pytest.approx(5_000, rel=0.05)


def test_the_eta_counts_the_pace_after_the_first_step_not_the_wait_for_it(tmp_path):
    """On CUDA the first step waits a minute or more for the kernels to compile: an ETA that
    spreads that wait over the steps done would read hours too long for the first minutes.
    Before the first step status says the trainer is starting; after it, no ETA until a
    pace exists."""
    import torch

    from eagle3d.drafter.reporting import Reporter, StepFigures
    from eagle3d.statemachine import train_files
    progress = train_files.ProgressWriter(tmp_path, "fp", total_steps=100)
    reporter = Reporter(1, 100, 0, tmp_path / "metrics.jsonl", progress)
    assert train_files.read_progress(tmp_path)["status"] == train_files.STARTING
    one = torch.ones(1)

    def report(step: int) -> dict:
        reporter.report(StepFigures.send(torch.device("cpu"), 1, step, step / 100, 1e-3,
                                         time.monotonic(), one, one, one, 1000, False))
        progress.last_write = 0.0  # the writer's once-a-second limit: every step read here
        return train_files.read_progress(tmp_path)

    time.sleep(2.0)  # the first step, compiling
    assert report(1)["eta_s"] is None
    for step in range(2, 12):
        shown = report(step)
        time.sleep(0.01)
    # 10 steps in ~0.1 s: ~0.9 s for the 89 left; counted from the start, ~16 s.
    assert shown["status"] == train_files.TRAINING and shown["eta_s"] < 8.0
    reporter.close()


@pytest.mark.slow
def test_the_curves_are_there_while_it_trains(tmp_path, data_root):
    """TensorBoard's scalars, metrics.jsonl's wall times and metrics.png, all before the end:
    a week-long training is watched while it runs, not after."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    config = write_config(tmp_path, data_root, {**SMALL, "max_steps": 400, "checkpoint_every": 2,
                                                "report_to": "tensorboard"})
    train = tmp_path / "train"
    proc = subprocess.Popen(train_cmd(config), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        wait_for_steps(train, 3, 300)
        deadline = time.monotonic() + 120
        while not (train / "metrics.png").exists() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert (train / "metrics.png").stat().st_size > 1000
        assert json.loads((train / "progress.json").read_text())["status"] == "training"
    finally:
        kill_tree(proc, signal.SIGKILL)
    rows = metrics(train)
    assert all(abs(r["time"] - time.time()) < 600 for r in rows)
    board = EventAccumulator(str(train / "tensorboard")).Reload()
    assert {"train/loss", "train/tokens_per_s", "ttt_step_0/accuracy", "ttt_step_1/loss"} <= \
        set(board.Tags()["scalars"])
    logged = [e.step for e in board.Scalars("train/loss")]
    assert logged and logged == sorted(logged) and logged[0] == 1


def start_as_the_daemon_does(config: Path, env: dict[str, str] | None = None
                             ) -> subprocess.Popen:
    """The trainer's command from the daemon, in a session of its own as the daemon's children
    are."""
    return subprocess.Popen(train_cmd(config), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True, start_new_session=True, env={**os.environ, **(env or {})})


def tree(proc: subprocess.Popen) -> list:
    """`proc` and its descendants, those still alive."""
    import psutil
    try:
        return [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
    except psutil.Error:
        return []


def trainer_ranks(proc: subprocess.Popen, count: int) -> list:
    """The `count` trainer ranks under `proc`, once they have all started."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        ranks = [p for p in tree(proc)[1:] if "eagle3d.drafter.train" in " ".join(p.cmdline())]
        if len(ranks) == count:
            return ranks
        time.sleep(0.05)
    pytest.fail(f"{count} trainer ranks did not start")


@pytest.mark.slow
@pytest.mark.parametrize("nproc", [1, 2])
def test_a_one_node_training_listens_on_no_network_address(tmp_path, data_root, nproc):
    """On a shared server the trainer of one node opens no port beyond loopback, from its
    start to its last step: watched over its whole process tree, as the daemon starts it
    (trainer_argv), with one process and with two (gloo's sockets included)."""
    import ipaddress
    import socket
    import psutil
    config = write_config(tmp_path, data_root, {**SMALL, "nproc": nproc, "max_steps": 3})
    # Where the host's name resolves to its network address gloo binds that address, as it
    # binds the interface named here: the ranks must keep to loopback all the same.
    network = [name for name, addresses in psutil.net_if_addrs().items()
               if not any(ipaddress.ip_address(a.address.split("%")[0]).is_loopback
                          for a in addresses if a.family in (socket.AF_INET, socket.AF_INET6))]
    proc = start_as_the_daemon_does(config, {"GLOO_SOCKET_IFNAME": network[0]} if network else {})
    seen: set = set()
    deadline = time.monotonic() + 600
    while proc.poll() is None and time.monotonic() < deadline:
        seen |= listeners_beyond_loopback(proc.pid)
        time.sleep(0.05)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err[-3000:]
    assert len(metrics(tmp_path / "train")) == 3
    assert not seen, seen


@pytest.mark.slow
def test_a_gguf_targets_embedding_and_head_are_read_from_its_conversion_not_by_loading_it():
    """Every trainer rank reads the target's embedding and lm_head: from a GGUF, the two tensors
    of the folder it is converted to, the same as the loaded model's, with no model loaded (the
    model class never imported), which cost seconds of every trainer's start."""
    script = (
        "import sys, torch\n"
        "from pathlib import Path\n"
        "from eagle3d.statemachine.config_schema import resolve_location\n"
        "from eagle3d.drafter.target_weights import load_embedding_and_head\n"
        f"embed, head = load_embedding_and_head(resolve_location({MODEL!r}, Path('.')))\n"
        "print('transformers.models.llama.modeling_llama' in sys.modules)\n"
        "torch.save({'embed': embed, 'head': head}, sys.argv[1])\n")
    import tempfile
    import torch
    from eagle3d.statemachine.config_schema import resolve_location
    from eagle3d.target.loading import load_model
    with tempfile.NamedTemporaryFile(suffix=".pt") as out:
        run = subprocess.run([PY, "-c", script, out.name], capture_output=True, text=True,
                             timeout=300)
        assert run.returncode == 0, run.stderr[-3000:]
        assert run.stdout.split() == ["False"], "the model was loaded for two of its tensors"
        got = torch.load(out.name)
    model = load_model(resolve_location(MODEL, Path(".")), "float32", "cpu")
    assert torch.equal(got["embed"], model.get_input_embeddings().weight)
    assert torch.equal(got["head"], model.get_output_embeddings().weight)


@pytest.mark.slow
def test_a_rank_killed_stops_the_others_and_the_launch_fails(tmp_path, data_root):
    """kill -9 of one rank of a one-node training: the other is stopped, the command the
    daemon started exits non-zero (the daemon restarts it from its checkpoint), and no process
    of the training is left."""
    import psutil
    config = write_config(tmp_path, data_root, {**SMALL, "nproc": 2, "max_steps": 50,
                                                "stop_grace_s": 5})
    proc = start_as_the_daemon_does(config)
    try:
        wait_for_steps(tmp_path / "train", 1, 600)
        ranks = trainer_ranks(proc, 2)
        everyone = tree(proc)
        ranks[1].kill()
        proc.communicate(timeout=60)
        assert proc.returncode != 0
        _, alive = psutil.wait_procs(everyone, timeout=10)
        assert not alive, alive
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # what a failure left: the ranks share its group


@pytest.mark.slow
def test_sigterm_to_a_two_rank_training_checkpoints_and_it_resumes(tmp_path, data_root):
    """The daemon's stop (SIGTERM to the command it started, here to it alone): both ranks
    checkpoint at the same step and exit, the command exits 0, and the next start resumes."""
    config = write_config(tmp_path, data_root, {**SMALL, "nproc": 2, "max_steps": 6,
                                                "checkpoint_every": 1000})
    train = tmp_path / "train"
    proc = start_as_the_daemon_does(config)
    wait_for_steps(train, 2, 600)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err[-3000:]
    done = len(metrics(train))
    assert done < 6, "the run ended before it could be stopped"
    assert (train / "checkpoints" / f"step-{done:08d}" / "state.pt").exists()
    resumed = start_as_the_daemon_does(config)
    _, err = resumed.communicate(timeout=600)
    assert resumed.returncode == 0, err[-3000:]
    assert f"resuming at step {done}" in err
    assert [r["step"] for r in metrics(train)] == list(range(1, 7))
