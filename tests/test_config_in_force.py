"""One config in force: a refused reload never reaches a child, and a target whose weights are
not the dataset's is refused by the engine, the trainer and the evaluation."""

from __future__ import annotations

import signal
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from eagle3d.daemon import control
from eagle3d.dataset import contract
from eagle3d.statemachine import entry, layout
from eagle3d.statemachine.config_in_force import to_toml
from eagle3d.statemachine.config_schema import resolve_location
from eagle3d.statemachine.config_validation import load_config, parse_config
from eagle3d.statemachine.ledger import Ledger
from eagle3d.target import loading
from tests.conftest import REPO, SMOLLM
from tests.pipeline import DaemonProcess, ctl, edit_config, messages_config, status, wait_for


def test_the_config_in_force_loads_back_the_same_from_any_folder(config_factory, tmp_path):
    operator = config_factory({"target": {"aux_layers": [3, 10, 25]},
                               "data": {"source": "conv.jsonl", "format": "messages"},
                               "extract": {"dump_dtype": "float8_e4m3fn"}})
    (tmp_path / "conv.jsonl").write_text("")
    cfg = load_config(operator)
    assert cfg.data.source == str(tmp_path / "conv.jsonl")  # relative: made absolute
    assert cfg.target.model == SMOLLM  # package locations keep their spelling
    elsewhere = tmp_path / "elsewhere" / "config.toml"
    again = parse_config(tomllib.loads(to_toml(cfg)), elsewhere)
    assert again == cfg._replace(path=elsewhere)


def test_the_weights_fingerprint_sees_an_edit_spread_over_a_file(tmp_path):
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(bytes(range(256)) * (40 << 12))  # 40 MiB
    before = loading.fingerprint_file_or_folder(weights)
    data = bytearray(weights.read_bytes())
    for offset in range(4 << 20, len(data) - (4 << 20), 4096):  # a fine-tune touches the bulk
        data[offset] ^= 1
    weights.write_bytes(data)
    assert loading.fingerprint_file_or_folder(weights) != before


SMOLLM_FILE = resolve_location(SMOLLM, REPO)


def perturbed_model(folder: Path) -> Path:
    """SmolLM2 with noise on every MLP weight: the same shape, other weights."""
    # Through the loader's converted folder: transformers parses the GGUF file again at every
    # load from it (tens of seconds each for the weights and the tokenizer).
    model = loading.load_model(SMOLLM_FILE, "bfloat16", "cpu")
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, weight in model.named_parameters():
            if ".mlp." in name:
                noise = torch.randn(weight.shape, generator=generator) * weight.float().std()
                weight.add_(noise.to(weight.dtype))
    model.save_pretrained(folder)
    loading.load_tokenizer(SMOLLM_FILE).save_pretrained(folder)
    return folder


@pytest.mark.slow
def test_a_refused_model_edit_never_reaches_a_restarted_engine(config_factory, tmp_path):
    config = messages_config(config_factory, tmp_path, 8)
    edited = perturbed_model(tmp_path / "edited-model")
    with DaemonProcess(config, "--until", "extract") as d:  # the plan only
        assert d.wait(300) == 0, d.output()[-4000:]
    # Paused from the daemon's first tick: nothing is extracted by the first engine.
    control.submit(load_config(config).paths.state_dir, "pause", {"reason": "model swap"})
    with DaemonProcess(config, "--until", "train") as d:
        st = d.status_until(lambda s: s["engine"].get("status") == "ready", 300, "the engine")
        assert st["samples"]["pending"] == 8
        # A model edit alone switches runs: one in a file that does not validate is refused.
        edit_config(config, "target", model=str(edited))
        edit_config(config, "extract", batch_tokens=-1)
        d.proc.send_signal(signal.SIGHUP)
        wait_for(lambda: "reload refused" in d.output(), 60, "the refusal")
        edit_config(config, "extract", batch_tokens=2048)  # valid again, never reloaded
        st = d.status_until(lambda s: "does not validate" in (s.get("config_problem") or ""), 60,
                            "the refusal in status")
        first_engine = st["engine"]["pid"]
        subprocess.run(["kill", "-9", str(first_engine)], check=True)
        st = d.status_until(lambda s: s["engine"].get("status") == "ready"
                            and s["engine"].get("pid") != first_engine, 300, "a new engine")
        assert st["engine"]["model"] == SMOLLM
        assert ctl(config, "resume").returncode == 0
        assert d.wait(600) == 0, d.output()[-4000:]
    in_force = load_config(layout.config_in_force(load_config(config).paths.state_dir))
    assert in_force.target.model == SMOLLM

    # Every dump written after the restart is the original model's.
    cfg = load_config(config)
    with Ledger(layout.ledger(cfg.paths.state_dir), readonly=True) as ledger:
        restart = max(seq for seq, *_ in ledger.events_of(("engine_exit",)))
        after = [sid for seq, kind, sid in ledger.db.execute(
            "SELECT seq, kind, sample FROM events WHERE kind = 'extracted' AND seq > ?",
            (restart,))]
        assert after, "nothing was extracted after the engine restart"
        paths = {sid: ledger.sample(sid).path for sid in after[:4]}
    model = loading.load_model(SMOLLM_FILE, cfg.target.dtype, "cpu")
    for sid, path in paths.items():
        dump = load_file(str(cfg.paths.dataset_dir / path))
        with torch.no_grad():
            out = model(dump["input_ids"].long()[None], output_hidden_states=True)
        want = out.hidden_states[-1][0].float()
        cosine = torch.nn.functional.cosine_similarity(want, dump["last_hidden_state"].float(),
                                                       dim=-1)
        assert cosine.min() > 0.98, (sid, cosine.min())


@pytest.mark.slow
def test_the_engine_refuses_a_target_with_other_weights(config_factory, tmp_path):
    config = messages_config(config_factory, tmp_path, 4)
    with DaemonProcess(config, "--until", "extract") as d:
        assert d.wait(300) == 0, d.output()[-4000:]
    cfg = load_config(config)
    doc = contract.read(cfg.paths.dataset_dir)
    doc["target_fingerprint"] = "0" * 32  # as if the model file had been replaced in place
    contract.write(cfg.paths.dataset_dir, {k: v for k, v in doc.items() if k != "fingerprint"})
    worker = subprocess.run([sys.executable, "-m", "eagle3d.capture.engines.transformers.worker", "-c",
                             str(layout.config_in_force(cfg.paths.state_dir))],
                            stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=120)
    assert worker.returncode == entry.CONTRACT_MISMATCH, worker.stderr
    assert "not the model this dataset was captured with" in worker.stderr
    assert worker.stdout == ""  # no "ready": the daemon never dispatches to it
    assert status(config)["samples"]["total"] == 4
