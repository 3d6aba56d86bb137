"""The short digests that an install has already written down (run keys in folder names, drafter
version keys, sample ids that split the shards, token-id hashes and checksums in the ledger)
keep their values: a changed algorithm or serialization would orphan every existing run,
re-split the shards and fail every stored sample. Each value below was computed by the code as
it was before the digests had one owner (statemachine/digests.py)."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from types import SimpleNamespace
from typing import NamedTuple

from eagle3d.capture import planner
from eagle3d.dataset import contract, dumpformat
from eagle3d.dataset.conversations import Conversation
from eagle3d.statemachine import manifest, runs, shards, train_files
from eagle3d.statemachine.config_validation import load_config
from eagle3d.statemachine.ledger import Ledger, PlannedSample, Prompt
from eagle3d.target import loading
from tests.conftest import make_config

MESSAGES = ({"role": "user", "content": "Grüß dich, wie geht's?"},
            {"role": "assistant", "content": "Gut, danke — und dir?"})


def test_a_run_key_keeps_its_value():
    keys = {"model": "pkg:x/SmolLM2-135M-Instruct.Q4_1.gguf", "dtype": "bfloat16",
            "layer_ids": [2, 15, 27]}
    assert runs.run_key(keys, "weights") == "smollm2-135m-instruct-q4-1-a508bfff"


class Train(NamedTuple):
    lr: float = 1e-4
    epochs: int = 2
    nproc: int = 1
    out: Path = Path("/srv/train")


def test_a_drafter_version_key_keeps_its_value_and_ignores_where_training_runs():
    key = train_files.train_key(SimpleNamespace(train=Train()))
    assert key == "c4e267ae"
    assert train_files.train_key(SimpleNamespace(train=Train(nproc=8, out=Path("/x")))) == key


def test_a_sample_id_and_its_shard_keep_their_values():
    """The content id is the sample's name in the ledger and its dumps; the shard split follows
    it, and a record without messages goes by its index."""
    sid = planner.sample_id(MESSAGES)
    assert sid == "52f8d556a8f8d7175d73c8cfb4cd3477"
    assert shards.owner(sid, 7) == 4
    owned = [idx for idx in range(16)
             if planner.owned(Conversation(idx, None, "empty"), shards.Shard(0, 3), "dataset")]
    assert owned == [1, 2, 6, 8, 14]


def test_the_token_ids_hash_keeps_its_value():
    raw = struct.pack("<4i", 1, 2, 3, 50000)
    assert dumpformat.ids_hash(raw) == "5cc17aa410c5b0f88cde941f845b7d20"


def test_a_generated_conversation_stored_before_still_reads(tmp_path):
    """A ledger row written by an earlier install, checksum and all, is read back, not refused
    as damaged."""
    text = json.dumps(list(MESSAGES), ensure_ascii=False)
    with Ledger(tmp_path / "ledger.sqlite") as ledger:
        with ledger.transaction() as db:
            db.execute("INSERT INTO generated VALUES (?, ?, ?, ?)",
                       ("s1", text, "4d6daed44c2343fa9d5fb9f347cd0b51", json.dumps({"seed": 0})))
        assert ledger.generated("s1") == (list(MESSAGES), {"seed": 0})
        # And one stored now is checksummed as before.
        ledger.add_prompts([Prompt("s2", 2, json.dumps(list(MESSAGES[:1])))], [], {})
        assert [s.id for s, _ in ledger.claim_prompts(1)] == ["s2"]
        raw = struct.pack("<2i", 1, 2)
        assert ledger.mark_generated(PlannedSample("s2", 2, 2, 1, dumpformat.ids_hash(raw), raw,
                                                   b"\x00\x01"), list(MESSAGES), {"seed": 0})
        assert ledger.db.execute("SELECT checksum FROM generated WHERE id = 's2'").fetchone() == (
            "4d6daed44c2343fa9d5fb9f347cd0b51",)


def test_the_manifest_and_weights_fingerprints_keep_their_values(tmp_path):
    """A dataset's manifest fingerprint (the trainer's done marker holds it) and the target's
    weights fingerprint (in its capture contract)."""
    rows = [("a" * 32, "xxh3-128:00"), ("b" * 32, "xxh3-128:01")]
    assert manifest.fingerprint(rows) == "32e3eaa02d4483129b6a8671065b177f"
    (tmp_path / "model.safetensors").write_bytes(bytes(range(256)) * 64)
    (tmp_path / "config.json").write_text('{"hidden_size": 8}')
    assert loading.fingerprint_file_or_folder(tmp_path) == "2348eb44ad3e0d09e5fcde851937959d"


def test_a_capture_contracts_fingerprint_keeps_its_value_with_one_answer(tmp_path):
    """Every dump carries its contract's fingerprint: recording [generate] answers (above 1
    only) leaves the contracts of one answer per conversation as they were."""
    base = {"format": dumpformat.FORMAT, "target": "m", "target_fingerprint": "f",
            "layer_ids": [2, 15, 27], "dtype": "bfloat16", "hidden_size": 576, "num_layers": 30,
            "vocab_size": 49152}
    cfg = load_config(make_config(tmp_path, {"data": {"responses": "target"},
                                             "generate": {"max_new_tokens": 512,
                                                          "temperature": 0.7, "answers": 1}}))
    assert contract.fingerprint(base) == "d2ebf4874409aac83556140784892b29"
    assert contract.fingerprint({**base, **contract.generate_record(cfg)}) == \
        "2f96977140e4f00ce27d5b233fa8a7a9"
