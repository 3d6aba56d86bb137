"""A hostile dump header: every problem is a rejection with its reason, through the ingest the
daemon runs and the scan verify runs, never an exception out of them."""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path
from typing import Any, Callable

import pytest

from eagle3d.daemon.dump_checks import Expected, scan
from eagle3d.dataset import dumpformat
from tests.test_ingest import CONTRACT, H, env, reason_of, write  # noqa: F401 (a fixture)

DEEP = 100_000  # past Python's recursion limit, inside MAX_HEADER


def tensor(name: str, **fields: Any) -> Callable[[dict], None]:
    return lambda h: h[name].update(fields)


def meta(**fields: Any) -> Callable[[dict], None]:
    return lambda h: h["__metadata__"].update(fields)


# (what, a change to the header's JSON object) -> the file is the header and the same data.
EDITS: list[tuple[str, Callable[[dict], Any]]] = [
    ("a list, not an object", lambda h: [h]),
    ("no metadata", lambda h: h.pop("__metadata__")),
    ("metadata a list", lambda h: h.update(__metadata__=[1, 2])),
    ("another format", meta(format="safetensors")),
    ("sample id a list", meta(sample_id=["0" * 32])),
    ("sample id of 5000 characters", meta(sample_id="a" * 5000)),
    ("tokens a number", meta(tokens=8)),
    ("contract an object", meta(contract={"a": 1})),
    ("a tensor missing", lambda h: h.pop("loss_mask")),
    ("an extra tensor", lambda h: h.update(extra=h["loss_mask"])),
    ("10000 extra tensors", lambda h: h.update({f"t{i}": {} for i in range(10_000)})),
    ("tensor entry a list", lambda h: h.update(input_ids=[1, 2, 3])),
    ("tensor entry a string", lambda h: h.update(input_ids="I32")),
    ("tensor entry null", lambda h: h.update(input_ids=None)),
    ("dtype a list", tensor("input_ids", dtype=["I32"])),
    ("dtype an object", tensor("last_hidden_state", dtype={"BF16": 1})),
    ("dtype unknown", tensor("aux_hidden_states", dtype="F64")),
    ("wrong dtype for ids", tensor("input_ids", dtype="U8")),
    ("no dtype", lambda h: h["input_ids"].pop("dtype")),
    ("shape a string", tensor("input_ids", shape="8")),
    ("shape an object", tensor("input_ids", shape={"8": 8})),
    ("shape negative", tensor("input_ids", shape=[-8])),
    ("shape of booleans", tensor("loss_mask", shape=[True])),
    ("shape of floats", tensor("input_ids", shape=[8.0])),
    ("shape past 2^64", tensor("input_ids", shape=[2**70])),
    ("shape of 1000 huge dimensions", tensor("aux_hidden_states", shape=[2**61] * 1000)),
    ("shape of 3 dimensions", tensor("last_hidden_state", shape=[8, H, 1])),
    ("shape empty", tensor("input_ids", shape=[])),
    ("shapes that do not match", tensor("aux_hidden_states", shape=[8, 2 * H])),
    ("ids and mask of other lengths", tensor("loss_mask", shape=[7])),
    ("offsets one number", tensor("input_ids", data_offsets=[0])),
    ("offsets negative", tensor("input_ids", data_offsets=[-32, 0])),
    ("offsets reversed", tensor("input_ids", data_offsets=[32, 0])),
    ("offsets past the file", tensor("input_ids", data_offsets=[2**62, 2**62 + 32])),
    ("offsets past 2^64", tensor("input_ids", data_offsets=[2**64, 2**64 + 32])),
    ("offsets strings", tensor("input_ids", data_offsets=["0", "32"])),
    ("offsets overlapping", tensor("loss_mask", data_offsets=[0, 8])),
    ("offsets null", tensor("input_ids", data_offsets=None)),
]

# (what, the raw bytes after the 8-byte length) -> a header that is no JSON object at all.
RAW: list[tuple[str, bytes]] = [
    ("binary garbage", bytes(range(256)) * 4),
    ("not UTF-8", b'{"\xff\xfe": 1}'),
    ("cut off", b'{"__metadata__": {"format": '),
    ("arrays nested past the recursion limit", b"[" * DEEP + b"]" * DEEP),
    ("objects nested past the recursion limit", b'{"a":' * DEEP + b"1" + b"}" * DEEP),
    ("an integer of 5000 digits", b'{"a": ' + b"9" * 5000 + b"}"),
    ("NaN", b"NaN"),
    ("empty", b""),
]


def split(path: Path) -> tuple[dict, bytes]:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8:8 + n]), raw[8 + n:]


def with_header(path: Path, header: bytes, length: int | None = None) -> None:
    body = split(path)[1]
    path.write_bytes(struct.pack("<Q", len(header) if length is None else length) + header + body)


def cases(good: Path) -> list[tuple[str, Callable[[Path], None]]]:
    def edit(change: Callable[[dict], Any]) -> Callable[[Path], None]:
        def apply(path: Path) -> None:
            header = split(path)[0]
            changed = change(header)
            doc = changed if isinstance(changed, list) else header
            with_header(path, json.dumps(doc).encode())
        return apply

    def raw(data: bytes) -> Callable[[Path], None]:
        return lambda path: with_header(path, data)

    def length(n: int) -> Callable[[Path], None]:
        return lambda path: with_header(path, json.dumps(split(path)[0]).encode(), n)

    return ([(what, edit(change)) for what, change in EDITS]
            + [(what, raw(data)) for what, data in RAW]
            + [("header length 2^64 - 1", length(2**64 - 1)), ("header length 0", length(0)),
               ("header length past the file", length(good.stat().st_size)),
               ("header length 7", length(7)),
               ("file of 5 bytes", lambda path: path.write_bytes(b"\0" * 5))])


def test_every_malformed_header_is_a_rejection_with_its_reason(env):
    """Each malformed header goes through Ingestor.ingest, the daemon's ingest, and verify's
    scan of the same file: a rejection with a reason, never an exception; nothing is ingested.
    Before, a dtype given as a list was a TypeError out of ingest, a header nested 100000 deep
    a RecursionError, and a shape of a thousand huge dimensions a product of 18000 digits."""
    ing, ledger, spool, samples = env
    s = samples[0]
    expected = Expected(id=s.id, path="", tokens=s.tokens, loss_tokens=s.loss_tokens,
                        ids_hash=s.ids_hash, checksum="", contract_fingerprint=CONTRACT["fingerprint"],
                        hidden_size=H, dtype="bfloat16")
    good = write(spool, s.id, s.input_ids)
    assert scan_problem(good, expected) is None  # the dump the cases damage is a good one
    for what, damage in cases(good):
        path = write(spool, s.id, s.input_ids)
        damage(path)
        problem = scan_problem(path, expected)
        assert problem, what
        out = ing.ingest(path.name)
        assert out.kind == "rejected" and out.detail, (what, out)
        assert len(out.detail) < 1000, (what, out.detail[:2000])
        assert out.detail in reason_of(spool, path.name), what
        assert ledger.sample(s.id).status != "extracted", what


def scan_problem(path: Path, expected: Expected) -> str | None:
    fd = os.open(path, os.O_RDONLY)
    try:
        return scan(fd, os.fstat(fd).st_size, expected)[0]
    finally:
        os.close(fd)


def test_a_header_json_can_hold_no_python_object_deeper_than_the_reader(tmp_path):
    """read_header, which verify's compare and the trainer's reader call, says DumpError too."""
    path = tmp_path / ("0" * 32 + dumpformat.SUFFIX)
    path.write_bytes(struct.pack("<Q", 2 * DEEP) + b"[" * DEEP + b"]" * DEEP)
    with pytest.raises(dumpformat.DumpError, match="not valid JSON"):
        dumpformat.read_header(path)
