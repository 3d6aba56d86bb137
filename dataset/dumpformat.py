"""The dump format: one safetensors file per sample, shared by every engine, ingest, verify and
the trainer. Writing goes to a dot-prefixed temp name in the same folder and is renamed into
place, so a reader never sees a half-written `<id>.safetensors`. Reading the header needs no
torch and no numpy: a safetensors header is 8 bytes of length and then JSON.
"""

from __future__ import annotations

import json
import math
import os
import re
import stat
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

from eagle3d.statemachine import digests
from eagle3d.statemachine.atomic import temp_path

FORMAT = "eagle3d-dump/1"
SUFFIX = ".safetensors"
# Sample ids are content hashes: lowercase hex, so an id is always a safe file name.
SAMPLE_ID = re.compile(r"[0-9a-f]{32}")

# torch / config names -> safetensors names
DTYPE_NAMES = {"float32": "F32", "bfloat16": "BF16", "float16": "F16", "float8_e4m3fn": "F8_E4M3",
               "int32": "I32", "uint8": "U8"}
DTYPE_SIZES = {"F32": 4, "BF16": 2, "F16": 2, "F8_E4M3": 1, "I32": 4, "I64": 8, "U8": 1}
# The tensors of a dump, in the order write_dump lays them out (another writer may lay them out
# in another: a reader takes each file's from its header); readers name them through these.
INPUT_IDS, LOSS_MASK, AUX, LAST = "input_ids", "loss_mask", "aux_hidden_states", "last_hidden_state"
TENSORS = (INPUT_IDS, LOSS_MASK, AUX, LAST)
HIDDEN = (AUX, LAST)  # the floating-point ones
# The captured layers side by side in each hidden-state tensor, blocks of H columns: fp8 scales
# them apart, and the spot check compares them apart.
LAYER_BLOCKS = {AUX: 3, LAST: 1}
# fp8 dumps add each hidden-state tensor's scales, float32, one per token row of each layer block
# (the math is in precision.py).
SCALED = "F8_E4M3"
AUX_SCALE, LAST_SCALE = "aux_hidden_states_scale", "last_hidden_state_scale"
SCALES = {AUX: AUX_SCALE, LAST: LAST_SCALE}
SCALED_TENSORS = (*TENSORS, AUX_SCALE, LAST_SCALE)
MAX_HEADER = 1 << 20
# Every dimension and offset of a dump is a count of bytes or elements below this: a header's
# numbers are bounded before any arithmetic on them.
MAX_COUNT = 1 << 62
HEAD = 4096  # read at once: a dump's header is ~600 bytes


class DumpError(ValueError):
    """A dump that must not be ingested; the message is the reason recorded for it."""


@dataclass(frozen=True)
class TensorInfo:
    dtype: str
    shape: tuple[int, ...]
    begin: int  # absolute file offsets
    end: int


@dataclass(frozen=True)
class DumpHeader:
    sample_id: str
    tokens: int
    contract: str
    tensors: dict[str, TensorInfo]
    file_size: int

    @property
    def hidden_size(self) -> int:
        return self.tensors[LAST].shape[1]

    @property
    def dtype(self) -> str:
        return self.tensors[LAST].dtype


def dump_name(sample_id: str) -> str:
    if not SAMPLE_ID.fullmatch(sample_id):
        raise DumpError(f"malformed sample id {sample_id!r}")
    return sample_id + SUFFIX


def is_scaled(dtype: str) -> bool:
    """Whether hidden states of this safetensors dtype carry scales (fp8) or are the values."""
    return dtype == SCALED


def bytes_per_token(hidden_size: int, dump_dtype: str) -> int:
    """Dataset bytes per token: 3 aux layers + the final state (with fp8, their 3 + 1 float32
    scales), plus input id and mask."""
    stored = DTYPE_NAMES[dump_dtype]
    scales = sum(LAYER_BLOCKS.values()) * DTYPE_SIZES["F32"] if is_scaled(stored) else 0
    return 4 * hidden_size * DTYPE_SIZES[stored] + scales + 4 + 1


def write_dump(folder: str | os.PathLike, sample_id: str, contract: str,
               tensors: Mapping[str, tuple[str, tuple[int, ...], memoryview | bytes]]) -> Path:
    """Write one dump atomically. `tensors` maps each name of TENSORS (SCALED_TENSORS for fp8
    states) to (safetensors dtype, shape, raw little-endian bytes). Returns the final path."""
    final = Path(folder) / dump_name(sample_id)
    names = SCALED_TENSORS if AUX_SCALE in tensors else TENSORS
    header: dict = {"__metadata__": {"format": FORMAT, "sample_id": sample_id,
                                     "tokens": str(tensors[INPUT_IDS][1][0]),
                                     "contract": contract}}
    offset = 0
    buffers = []
    for name in names:
        dtype, shape, data = tensors[name]
        view = memoryview(data).cast("B")
        expected = DTYPE_SIZES[dtype]
        for dim in shape:
            expected *= dim
        if view.nbytes != expected:
            raise DumpError(f"{name}: {view.nbytes} bytes for shape {shape} {dtype}")
        header[name] = {"dtype": dtype, "shape": list(shape),
                        "data_offsets": [offset, offset + view.nbytes]}
        offset += view.nbytes
        buffers.append(view)
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # keep tensor data 8-byte aligned
    tmp = temp_path(final)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    try:
        with os.fdopen(fd, "wb", buffering=0) as f:
            f.write(struct.pack("<Q", len(raw)) + raw)
            for view in buffers:
                f.write(view)
        os.rename(tmp, final)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    return final


def parse_header(head: bytes, file_size: int) -> DumpHeader:
    """Validate a dump's header (the first 8 + N bytes of the file) against its size."""
    if file_size < 8 or len(head) < 8:
        raise DumpError(f"file too short for a header ({file_size} bytes)")
    (n,) = struct.unpack("<Q", head[:8])
    if n > MAX_HEADER or 8 + n > file_size:
        raise DumpError(f"header length {n} does not fit in a {file_size}-byte file")
    if len(head) < 8 + n:
        raise DumpError("header cut short")
    try:
        header = json.loads(head[8:8 + n])
    except (ValueError, RecursionError) as exc:  # not JSON, not UTF-8, [[[[…, 5000-digit ints
        raise DumpError(f"header is not valid JSON: {_brief(exc)}") from None
    if not isinstance(header, dict):
        raise DumpError("header is not a JSON object")
    meta = header.pop("__metadata__", None)
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise DumpError(f"not an {FORMAT} file (metadata {_brief(meta)})")
    sid = meta.get("sample_id", "")
    if not isinstance(sid, str) or not SAMPLE_ID.fullmatch(sid):
        raise DumpError(f"malformed sample id in metadata: {_brief(sid)}")
    names = SCALED_TENSORS if set(header) == set(SCALED_TENSORS) else TENSORS
    if set(header) != set(names):
        raise DumpError(f"tensors {_brief(sorted(header))} differ from {list(TENSORS)} (and the "
                        f"scales {list(SCALES.values())} with {SCALED} states)")
    base = 8 + n
    tensors = {name: _tensor_info(name, header[name], base) for name in names}
    spans = sorted((t.begin - base, t.end - base) for t in tensors.values())
    if spans[0][0] != 0 or any(a[1] != b[0] for a, b in zip(spans, spans[1:])):
        raise DumpError("tensor data is not contiguous")
    if base + spans[-1][1] != file_size:
        raise DumpError(f"file is {file_size} bytes, header describes {base + spans[-1][1]}")
    tokens = tensors[INPUT_IDS].shape
    if tensors[INPUT_IDS].dtype != "I32" or tensors[LOSS_MASK].dtype != "U8":
        raise DumpError("input_ids must be I32 and loss_mask U8")
    if len(tokens) != 1 or tensors[LOSS_MASK].shape != tokens:
        raise DumpError("input_ids and loss_mask must be [T]")
    t_count = tokens[0]
    last = tensors[LAST]
    aux = tensors[AUX]
    if len(last.shape) != 2 or last.shape[0] != t_count:
        raise DumpError(f"last_hidden_state shape {last.shape} is not [{t_count}, H]")
    if aux.shape != (t_count, 3 * last.shape[1]) or aux.dtype != last.dtype:
        raise DumpError(f"aux_hidden_states {aux.shape} {aux.dtype} is not "
                        f"[{t_count}, {3 * last.shape[1]}] {last.dtype}")
    _check_scales(tensors, t_count)
    if meta.get("tokens") != str(t_count):
        raise DumpError(f"metadata says {str(meta.get('tokens'))[:40]} tokens, tensors hold "
                        f"{t_count}")
    contract = meta.get("contract", "")
    if not isinstance(contract, str):
        raise DumpError(f"the contract in its metadata is not a string: {_brief(contract)}")
    return DumpHeader(sid, t_count, contract, tensors, file_size)


def _tensor_info(name: str, entry: object, base: int) -> TensorInfo:
    """One tensor's entry, its types and bounds checked before any arithmetic on it: a shape
    of a thousand huge dimensions would be a product of a million digits."""
    if not isinstance(entry, dict):
        raise DumpError(f"{name}: malformed tensor entry {_brief(entry)}")
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if not isinstance(dtype, str) or dtype not in DTYPE_SIZES:
        raise DumpError(f"{name}: bad dtype {_brief(dtype)}")
    if not (isinstance(shape, list) and 1 <= len(shape) <= 2 and all(map(_is_count, shape))):
        raise DumpError(f"{name}: bad shape {_brief(shape)}")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(map(_is_count, offsets))):
        raise DumpError(f"{name}: bad data offsets {_brief(offsets)}")
    (b, e), size = offsets, DTYPE_SIZES[dtype] * math.prod(shape)
    if e - b != size:
        raise DumpError(f"{name}: data offsets {b}..{e} do not match shape {tuple(shape)} {dtype}")
    return TensorInfo(dtype, tuple(shape), base + b, base + e)


def _is_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < MAX_COUNT


def _brief(value: object) -> str:
    """A value from a header for a rejection's reason: the reason is stored, the value may be
    a megabyte."""
    shown = repr(value) if not isinstance(value, BaseException) else str(value)
    return shown if len(shown) <= 120 else shown[:117] + "..."


def _check_scales(tensors: dict[str, TensorInfo], t_count: int) -> None:
    """fp8 states come with their scales, float states without."""
    scaled = is_scaled(tensors[LAST].dtype)
    if scaled != (AUX_SCALE in tensors):
        raise DumpError(f"{tensors[LAST].dtype} states " + ("need their scales" if scaled else
                                                              "must come without scales"))
    for name, scale in SCALES.items() if scaled else ():
        want = (t_count, LAYER_BLOCKS[name])
        if tensors[scale].shape != want or tensors[scale].dtype != "F32":
            raise DumpError(f"{scale} is {tensors[scale].dtype} {list(tensors[scale].shape)}, "
                            f"not F32 {list(want)}")


def open_dump(path: str | os.PathLike) -> int:
    """A dump's file descriptor, opened for reading without following a symlink (a link in a
    dataset could point anywhere) and without waiting on a FIFO's writer."""
    return os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)


def header_of(fd: int) -> DumpHeader:
    """Read and validate the header of the dump open at `fd`."""
    return header_and_bytes(fd)[0]


def header_and_bytes(fd: int) -> tuple[DumpHeader, bytes]:
    """The header of the dump open at `fd`, validated, and its bytes as the file holds them (up
    to the first tensor's: a checksum of the whole file begins with them). One pread of HEAD
    bytes holds a whole header, a second reads the rest of a longer one."""
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        raise DumpError("not a regular file")
    head = os.pread(fd, HEAD, 0)
    if len(head) >= 8:
        (n,) = struct.unpack("<Q", head[:8])
        if len(head) < 8 + n <= min(st.st_size, 8 + MAX_HEADER):
            head += os.pread(fd, 8 + n - len(head), len(head))
    header = parse_header(head, st.st_size)
    return header, head[:min(t.begin for t in header.tensors.values())]


def read_header(path: str | os.PathLike) -> DumpHeader:
    """Read and validate a dump's header without following symlinks."""
    fd = open_dump(path)
    try:
        return header_of(fd)
    finally:
        os.close(fd)


def ids_hash(input_ids: bytes) -> str:
    """The planned identity of a sample's token ids (little-endian int32 bytes), as stored in the
    ledger: ingest and verify compare a dump's `input_ids` against it."""
    h = ids_hasher()
    h.update(input_ids)
    return h.hexdigest()


def ids_hasher() -> digests.Hasher:
    """ids_hash fed chunk by chunk, as verify streams a dump: `hexdigest()` at the end."""
    return digests.hasher()
