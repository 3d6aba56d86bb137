"""The check at the door: where the dataset's disk, probed for a moment, reads slower than the
GPUs would consume the dataset, check-config and the train stage's start warn, with figures;
neither refuses."""

from __future__ import annotations

import sys
import time

import pytest

from eagle3d.daemon.stages.train import TrainStage
from eagle3d.dataset import contract as contract_mod
from eagle3d.dataset import dumpformat, readrate
from eagle3d.statemachine import layout
from eagle3d.statemachine.config_schema import FP8
from eagle3d.statemachine.config_validation import load_config
from eagle3d.statemachine.ledger import Ledger
from eagle3d.statemachine.stages import Decision, Stage
from tests.test_ctl import ctl

KIMI_FP8 = {"hidden_size": 7168, "dtype": "bfloat16", "dump_dtype": FP8}


def test_the_expected_pace_passes_through_the_measured_points_and_falls_with_the_width():
    for hidden, tokens_per_s in readrate.GPU_TOKENS_PER_S:
        assert readrate.gpu_tokens_per_s(hidden) == pytest.approx(tokens_per_s)
    widths = [256, 576, 2048, 4096, 7168, 16384]
    paces = [readrate.gpu_tokens_per_s(h) for h in widths]
    assert paces == sorted(paces, reverse=True)


def test_eight_gpus_on_the_kimi_shape_need_about_3_gb_per_second_of_fp8_dumps():
    """The issue's figures: ~13k tokens/s per H200 at 4 x 7168 + 21 bytes per token."""
    said = readrate.shortfall(KIMI_FP8, 8, 1e9)
    assert "2,938 MB/s that 8 GPUs would consume" in said and "28,693 bytes per token" in said
    assert "fp8 dumps" not in said  # already fp8
    assert "fp8 dumps" in readrate.shortfall({**KIMI_FP8, "dump_dtype": "bfloat16"}, 8, 1e9)
    assert readrate.shortfall(KIMI_FP8, 8, 3e9) is None
    assert readrate.shortfall(KIMI_FP8, 1, 1e9) is None


def dataset(root, dumps: int = 3, index: int = 0) -> None:
    """A dataset folder with the contract and a few dump files of the Kimi shape's width, in the
    sample folder of ledger index `index`."""
    root.mkdir(parents=True)
    contract_mod.write(root, {**KIMI_FP8, "layer_ids": [2, 30, 57]})
    shard = root / layout.sample_folder(index)
    shard.mkdir()
    tokens = 64
    for n in range(dumps):
        dumpformat.write_dump(shard, f"{n:032x}", "fp", {
            "input_ids": ("I32", (tokens,), bytes(4 * tokens)),
            "loss_mask": ("U8", (tokens,), bytes(tokens)),
            "aux_hidden_states": ("BF16", (tokens, 3 * 7168), bytes(6 * 7168 * tokens)),
            "last_hidden_state": ("BF16", (tokens, 7168), bytes(2 * 7168 * tokens))})


@pytest.mark.parametrize("index", [0, 100_000_000], ids=["five digits", "past five digits"])
def test_check_config_warns_that_a_thousand_gpus_would_wait_for_the_disk(config_factory, index):
    config = config_factory({"train": {"nproc": 1000}})
    before = ctl(config, "check-config")
    assert before.returncode == 0 and "warning" not in before.stdout  # no dataset yet
    dataset(load_config(config).paths.dataset_dir, index=index)
    after = ctl(config, "check-config")  # the dataset's contract is another target's: refused
    assert ": valid (" in after.stdout, after.stderr
    assert "warning: the dataset's disk reads" in after.stdout
    assert "that 1000 GPUs would consume" in after.stdout


def test_the_train_stage_warns_once_at_its_start_and_trains_anyway(config_factory, caplog,
                                                                   monkeypatch):
    from eagle3d.daemon.stages import train
    monkeypatch.setattr(train, "trainer_argv",
                        lambda cfg, path: [sys.executable, "-c", "pass"])
    cfg = load_config(config_factory({"train": {"nproc": 1000}}))
    cfg.paths.state_dir.mkdir(parents=True)
    dataset(cfg.paths.dataset_dir)
    with Ledger(layout.ledger(cfg.paths.state_dir)) as ledger:
        stage = TrainStage(cfg, ledger, cfg.paths.state_dir, lambda: "f" * 32)
        training = Decision(Stage.TRAIN, "test", Stage.TRAIN)
        stage.step(training)
        assert stage.child is not None  # a warning, not a refusal
        stage.stop(time.monotonic() + 10)
        stage.step(training)
        stage.stop(time.monotonic() + 10)
        warned = [r.getMessage() for r in caplog.records if "dataset's disk" in r.getMessage()]
        assert len(warned) == 1, warned
        assert len(ledger.events_of(["slow_dataset_disk"])) == 1
