"""A hostile dataset record is skipped with its line and reason; damage before the end of a
source is never taken for its end."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from eagle3d.capture import planner
from eagle3d.dataset import conversations
from eagle3d.dataset.conversations import Damaged, iter_conversations
from eagle3d.statemachine import entry
from eagle3d.statemachine.config_validation import load_config
from eagle3d.statemachine.ledger import Ledger
from tests.test_planner import ledger_rows, run_planner, tokenizer, write_config  # noqa: F401

DEEP = 100_000  # past Python's recursion limit


def conversation(i: int) -> dict:
    return {"id": f"c{i}", "conversations": [
        {"from": "human", "value": f"Question {i}: what is {i} plus {i}?"},
        {"from": "gpt", "value": f"Answer {i}: it is {2 * i}, and \u00e9t\u00e9 {i}."}]}


def sharegpt(path: Path, records: list[bytes]) -> Path:
    """A ShareGPT-style JSON array, one record a line, as the real file is laid out."""
    path.write_bytes(b"[\n" + b",\n".join(records) + b"\n]\n")
    return path


def records(n: int) -> list[bytes]:
    return [json.dumps(conversation(i), ensure_ascii=False).encode() for i in range(n)]


def test_a_byte_damaged_mid_file_refuses_the_plan_naming_line_and_byte(tmp_path):
    """The issue's case: one corrupted byte in record 4 of 40, and a limit of 40 became 3
    samples, a plan called done and one log warning. Now the planner refuses the source, naming
    the line and byte, and plans nothing from it."""
    lines = records(40)
    lines[3] = lines[3].replace(b'"from": "gpt"', b'"from"; "gpt"')
    source = sharegpt(tmp_path / "sharegpt.json", lines)
    at = source.read_bytes().index(b'; "gpt"')
    result = run_planner(write_config(tmp_path, str(source), limit=40))
    assert result.returncode == entry.REFUSED, result.stderr[-3000:]
    assert f"line 5 (byte {at})" in result.stderr and "before its end" in result.stderr, \
        result.stderr[-3000:]
    rows = ledger_rows(tmp_path / "state")
    assert rows["samples"] == [] and "plan.exhausted" not in rows["meta"]


def test_a_cut_off_tail_keeps_the_complete_records_with_a_warning(tmp_path, caplog):
    """The ShareGPT file's own damage: cut off mid-record. Its complete records are the data."""
    source = tmp_path / "cut.json"
    whole = sharegpt(tmp_path / "whole.json", records(10)).read_bytes()
    for cut in (len(whole) - 40, len(whole) - 6, len(whole) - 3):
        source.write_bytes(whole[:cut])
        with caplog.at_level("WARNING"):
            got = [c.idx for c in iter_conversations(source)]
        assert got == list(range(len(got))) and len(got) >= 9, (cut, got)
        assert "cut off" in caplog.text


@pytest.mark.parametrize("chunk", [1, 7, 64, 1 << 20])
def test_records_across_every_chunk_boundary_read_as_json_reads_them(tmp_path, monkeypatch, chunk):
    """The reader's "read on" rule (an error near the end of what it holds may be the end of the
    input) against every place a chunk may end: the records are json.load's."""
    rng = random.Random(chunk)
    data = [conversation(i) | {"n": rng.randrange(10**12), "f": rng.random(), "t": True,
                                "e": "\\u00e9\"\\\\"} for i in range(30)] + [12345, "x", None]
    source = tmp_path / "s.json"
    source.write_text(json.dumps(data, indent=rng.choice((None, 1))))
    monkeypatch.setattr(conversations, "_CHUNK", chunk)
    assert list(conversations.json_array(source)) == json.loads(source.read_text())


HOSTILE_RECORDS = {
    3: b"[" * DEEP + b"]" * DEEP,
    5: b'{"conversations": [{"from": "human", "value": "x"}], "n": ' + b"9" * 5000 + b"}",
    7: b'{"a": ' + b'{"b": ' * DEEP + b"1" + b"}" * DEEP + b"}",
}


def test_records_the_decoder_cannot_hold_are_skipped_with_their_line(tmp_path, tokenizer):
    """Nested past the recursion limit, a number of 5000 digits: the plan went on to raise out
    of the planner (one hostile record stopped the plan). Now each is skipped at its own index
    with its line, and every record after it is planned at its index."""
    for fmt in ("sharegpt", "messages"):
        lines = records(10)
        for i, bad in HOSTILE_RECORDS.items():
            lines[i] = bad
        if fmt == "sharegpt":
            source = sharegpt(tmp_path / "s.json", lines)
        else:
            source = tmp_path / "s.jsonl"
            source.write_bytes(b"\n".join(lines) + b"\n")
        folder = tmp_path / fmt
        folder.mkdir()
        cfg = load_config(write_config(folder, str(source), limit=10, max_tokens=600))
        with Ledger(cfg.paths.state_dir / "ledger.sqlite") as ledger:
            planner.plan(cfg, ledger, tokenizer, hidden_size=576)
            reasons = dict(ledger.db.execute("SELECT idx, reason FROM skipped").fetchall())
            planned = [idx for (idx,) in ledger.db.execute("SELECT idx FROM samples")]
            grouped = ledger.skipped_reasons()
        assert sorted(reasons) == sorted(HOSTILE_RECORDS), (fmt, reasons)
        line = {i: i + 2 if fmt == "sharegpt" else i + 1 for i in HOSTILE_RECORDS}
        for i, why in reasons.items():
            assert f"line {line[i]}" in why and "not valid JSON" in why, (fmt, i, why)
        assert sorted(planned) == [i for i in range(10) if i not in HOSTILE_RECORDS], fmt
        assert grouped == {"not valid JSON": 3}, (fmt, grouped)


def test_a_jsonl_line_damaged_mid_file_is_skipped_and_the_rest_taken(tmp_path):
    """JSON lines resync at the next line: the damaged one is skipped with its number."""
    source = tmp_path / "s.jsonl"
    lines = [json.dumps({"messages": [{"role": "user", "content": f"q{i}"},
                                      {"role": "assistant", "content": f"a{i}"}]}).encode()
             for i in range(40)]
    lines[3] = lines[3][:20] + b"\xff" + lines[3][21:]
    lines[9] = lines[9][:-5]
    source.write_bytes(b"\n".join(lines) + b"\n")
    convs = list(iter_conversations(source, limit=40))
    assert [c.idx for c in convs] == list(range(40))
    damaged = {c.idx: c.problem for c in convs if c.messages is None}
    assert sorted(damaged) == [3, 9] and "line 4" in damaged[3] and "line 10" in damaged[9]


def test_a_strict_read_names_mid_file_damage_as_such(tmp_path):
    lines = records(5)
    lines[1] = lines[1][:30] + b"\x01" + lines[1][31:]  # a control character inside a string
    source = sharegpt(tmp_path / "s.json", lines)
    with pytest.raises(Damaged) as err:
        list(conversations.json_array(source))
    assert not err.value.tail and "line 3" in err.value.problem
