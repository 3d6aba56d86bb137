"""A file of prompts to evaluate a drafter on, in whichever of three formats it is written:

- MT-bench's questions, JSON lines of {"question_id", "category", "turns": [question, ...]};
- OpenAI-style chats, JSON lines of {"messages": [{"role", "content"}, ...]};
- ShareGPT, a JSON array of {"conversations": [{"from", "value"}, ...]}.

Any of them may be JSON lines or one JSON array.

The format is detected from the file's first record, and every record must then be of it. A
line that is not JSON, or a record of another shape, is an error naming the file and the line
(in a JSON array, the record's number): a user's prompt file with a typo should say where, not
be measured without it. So is a JSON array cut off or damaged, where the user wrote the file
(`strict`); a data source read for its prompts is the ShareGPT file that is cut off mid-record,
whose complete records are taken with a warning (dataset/conversations.py). A conversation that
has no user turn is a prompt-less record, skipped and counted by the caller. Answers are never
needed: the target writes its own.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterator, NamedTuple

from eagle3d.dataset.conversations import (Broken, Damaged, complete_records, is_json_array,
                                           json_array, jsonl_lines, turns_of)

MT_BENCH, MESSAGES, SHAREGPT = "mt-bench", "messages", "sharegpt"


class PromptError(ValueError):
    """A prompt file that cannot be read as any of the formats, naming the file and the line."""


class Question(NamedTuple):
    where: str                       # "line N" (JSON lines) or "record N" (a JSON array)
    first: tuple[dict, ...]          # a system turn, if any, and the first user turn
    follow_ups: tuple[str, ...]      # the later user turns, each asked after the target answers
    category: str | None
    problem: str | None              # why the record has no prompt (then `first` is empty)


def detect_format(path: Path) -> str:
    """MT_BENCH, MESSAGES or SHAREGPT, from the file's first character and first record."""
    for where, record in _records(path, strict=True):
        if isinstance(record, dict) and isinstance(record.get("turns"), list):
            return MT_BENCH
        if isinstance(record, dict) and isinstance(record.get("conversations"), list):
            return SHAREGPT
        if isinstance(record, dict) and isinstance(record.get("messages"), list):
            return MESSAGES
        raise PromptError(f"{path}, {where}: not a prompt of any known format (an MT-bench "
                          f"question with \"turns\", a chat with \"messages\", or a ShareGPT "
                          f"record with \"conversations\")")
    raise PromptError(f"{path}: no prompts in the file")


def read_questions(path: Path, first: int = 0, limit: int | None = None,
                   strict: bool = False) -> Iterator[Question]:
    """The questions with index in [first, first + limit), in file order. `strict`: a JSON
    array that breaks off is an error, not its complete records and a warning."""
    fmt = detect_format(path)
    end = None if limit is None else first + limit
    for idx, (where, record) in enumerate(_records(path, strict)):
        if idx < first:
            continue
        if end is not None and idx >= end:
            return
        yield _question(path, where, record, fmt)


def _records(path: Path, strict: bool) -> Iterator[tuple[str, object]]:
    try:
        array = is_json_array(path)
    except OSError as exc:
        raise PromptError(f"{path}: cannot be read ({exc.strerror})") from None
    if array:
        n = 0
        try:
            for n, record in enumerate(json_array(path) if strict else complete_records(path), 1):
                yield f"record {n}", record
        except Damaged as exc:
            raise PromptError(f"{path}, record {n + 1}: {exc.problem}") from None
        return
    for lineno, record in jsonl_lines(path):
        if isinstance(record, Broken):
            raise PromptError(f"{path}, {record.problem}")
        yield f"line {lineno}", record


def _question(path: Path, where: str, record: object, fmt: str) -> Question:
    category = record.get("category") if isinstance(record, dict) else None
    category = category if isinstance(category, str) else None
    if fmt == MT_BENCH:
        turns = record.get("turns") if isinstance(record, dict) else None
        if not (isinstance(turns, list) and turns and all(isinstance(t, str) for t in turns)):
            raise PromptError(f"{path}, {where}: an MT-bench question needs \"turns\", a "
                              f"non-empty list of strings")
        return Question(where, ({"role": "user", "content": turns[0]},), tuple(turns[1:]),
                        category, None)
    messages, problem = turns_of(record)
    if messages is None and problem in ("not a JSON object", "no conversations/messages list"):
        raise PromptError(f"{path}, {where}: {problem} (the file's first record is a "
                          f"{fmt} prompt)")
    users = [i for i, m in enumerate(messages or ()) if m["role"] == "user"]
    if messages is None or not users:
        return Question(where, (), (), category, problem or "no user turn")
    system = [m for m in messages[:users[0]] if m["role"] == "system"][:1]
    return Question(where, (*system, messages[users[0]]),
                    tuple(messages[i]["content"] for i in users[1:]), category, None)
