"""The checks of a dump file against what the ledger planned: the verify stage re-reads every
dataset file through them, and ingest runs the same scan on each dump as it copies it.

One pass over each file, in large chunks read into a reused buffer: each chunk feeds the
checksum and, inside the float tensors, a finiteness test on the raw bits (an exponent of all
ones is Inf or NaN; fp8 e4m3 has NaN only, all seven bits set) and, in the scales of fp8 dumps,
a test that each is finite and positive, so verifying costs about what reading the file costs.
Chunks start at each tensor's first byte, so a chunk never splits an element whatever the
header's length.

Also the numerical spot check: a verified sample re-run through the engine must match its stored
dump (`compare_dumps`). No torch here: this runs in the daemon's worker threads.
"""

from __future__ import annotations

import errno
import json
import os
import stat
import struct
import threading
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator

import numpy as np

from eagle3d.dataset import checksum, dumpformat, precision
from eagle3d.dataset.dumpformat import DumpError, DumpHeader, TensorInfo
from eagle3d.statemachine.manifest import stat_key

CHUNK = 8 << 20  # a multiple of every element size, larger than any header (MAX_HEADER)

# dtype -> (signed and unsigned integer views, the bits that are all ones in Inf and NaN: the
# exponent; in e4m3, exponent and mantissa). A float is not finite when those bits are all ones:
# as a signed integer, a positive one is >= the mask, and as unsigned, a negative one is
# >= sign | mask. So two max reductions find any, without writing a masked copy (twice as fast
# as and + compare).
_FLOAT_BITS = {
    "BF16": (np.int16, np.uint16, 0x7F80),
    "F16": (np.int16, np.uint16, 0x7C00),
    "F32": (np.int32, np.uint32, 0x7F800000),
    "F8_E4M3": (np.int8, np.uint8, 0x7F),
}
_SCALE_NAMES = frozenset(dumpformat.SCALES.values())


@dataclass(frozen=True)
class Expected:
    """What the ledger and the capture contract say one dataset file must be."""
    id: str
    path: str  # absolute
    tokens: int
    loss_tokens: int
    ids_hash: str
    checksum: str
    contract_fingerprint: str
    hidden_size: int
    dtype: str  # the contract's dump dtype: "bfloat16", "float16", "float32", "float8_e4m3fn"


def check_file(e: Expected, from_disk: bool = False) -> tuple[str | None, str | None]:
    """Check one dataset file against its expectation: (problem or None, stat key or None).
    `from_disk` reads what the disk holds, not what the page cache holds (see durability.py)."""
    try:
        fd = dumpformat.open_dump(e.path)
    except FileNotFoundError:
        return "missing file", None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            return "a symlink is in place of the file", None
        return f"cannot open: {exc.strerror}", None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            return "not a regular file", stat_key(st)
        if from_disk:
            # Clean pages are evicted (the pass synced first, so all of these are clean), and
            # with them the good bytes a failed write-back left in the cache.
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
        try:
            return _FileCheck(fd, st.st_size, e).run(), stat_key(st)
        except OSError as exc:
            return f"read error: {exc.strerror}", stat_key(st)
    finally:
        os.close(fd)


class _Stop(Exception):
    """A problem that ends the pass early: nothing after it can be read meaningfully."""


_per_thread = threading.local()


def _read_buffer() -> np.ndarray:
    """One read buffer per thread, reused across files: a fresh one would page-fault on every
    file."""
    if getattr(_per_thread, "buffer", np.empty(0)).size < CHUNK:
        _per_thread.buffer = np.empty(CHUNK, np.uint8)
    return _per_thread.buffer


def scan(fd: int, size: int, e: Expected, sink: int | None = None) -> tuple[str | None, str]:
    """Every check in one pass over an open dump: (problem or None, its checksum). With `sink`,
    each byte read is also written there, so ingest copies and checks in the same pass. The
    checksum is compared only when `e.checksum` is set (verify); ingest learns it here."""
    check = _FileCheck(fd, size, e, sink)
    return check.run(), checksum.digest(check.sum)


class _FileCheck:
    """One sequential pass over an open file."""

    def __init__(self, fd: int, size: int, e: Expected, sink: int | None = None) -> None:
        self.fd, self.size, self.e, self.sink = fd, size, e, sink
        self.offset = 0
        self.sum = checksum.hasher()
        self.buf = _read_buffer()

    def read(self, n: int) -> np.ndarray:
        """The next n bytes of the file (n <= CHUNK), also fed to the checksum."""
        view = memoryview(self.buf)[:n]
        got = 0
        while got < n:
            k = os.readv(self.fd, [view[got:]])
            if k == 0:
                raise _Stop(f"truncated: file ended at byte {self.offset + got} "
                                 f"of {self.size}")
            got += k
        self.offset += n
        self.sum.update(view)
        if self.sink is not None:
            while view:
                view = view[os.write(self.sink, view):]
        return self.buf[:n]

    def run(self) -> str | None:
        try:
            header = self.read_header()
            problem = header_mismatch(header, self.e)
            if problem:
                return problem
            problem = self.scan_tensors(header)
        except _Stop as exc:
            return str(exc)
        if self.e.checksum and checksum.digest(self.sum) != self.e.checksum:
            # The file changed after ingest checksummed it; a content problem is a symptom.
            return "checksum mismatch" + (f" ({problem})" if problem else "")
        return problem

    def read_header(self) -> DumpHeader:
        # The header is parsed from the bytes of this one pass (not a second open), so the
        # header and the data checked are certainly from the same file.
        head = bytes(self.read(min(8, self.size)))
        if len(head) == 8:
            (n,) = struct.unpack("<Q", head)
            if n <= dumpformat.MAX_HEADER and 8 + n <= self.size:
                head += bytes(self.read(n))
        try:
            return dumpformat.parse_header(head, self.size)
        except DumpError as exc:
            raise _Stop(_truncation(head, self.size) or f"bad header: {exc}") from None

    def scan_tensors(self, header: DumpHeader) -> str | None:
        """Read every tensor in file order; the first content problem found, if any."""
        problem = None
        for name, info in sorted(header.tensors.items(), key=lambda item: item[1].begin):
            scan = _TensorScan(name, info)
            for start in range(info.begin, info.end, CHUNK):
                chunk = self.read(min(CHUNK, info.end - start))
                if problem is None:
                    problem = scan.feed(chunk, start - info.begin)
            if problem is None:
                problem = scan.finish(self.e)
        return problem


def header_mismatch(h: DumpHeader, e: Expected) -> str | None:
    """The header facts against the plan and the contract."""
    if h.sample_id != e.id:
        return f"sample id in file is {h.sample_id}"
    if h.contract != e.contract_fingerprint:
        return f"contract {h.contract} is not the dataset's {e.contract_fingerprint}"
    want_dtype = dumpformat.DTYPE_NAMES.get(e.dtype, e.dtype)
    if h.dtype != want_dtype:
        return f"dtype {h.dtype}, the contract says {e.dtype}"
    if h.hidden_size != e.hidden_size:
        return f"hidden size {h.hidden_size}, the contract says {e.hidden_size}"
    if h.tokens != e.tokens:
        return (f"file has {h.tokens} tokens, plan says {e.tokens} (a decode step or a truncated "
                "prefill?)")
    return None


def _truncation(head: bytes, size: int) -> str | None:
    """Tell a cut-off file from a corrupt header: an intact header still says how long the
    file was meant to be."""
    if len(head) < 8:
        return f"truncated: {size} bytes, too short for a header"
    (n,) = struct.unpack_from("<Q", head)
    if n <= dumpformat.MAX_HEADER and 8 + n > size:
        return f"truncated: {size} bytes, inside the {n}-byte header"
    try:
        entries = json.loads(head[8:8 + n])
        end = max(t["data_offsets"][1] for k, t in entries.items() if k != "__metadata__")
    except (ValueError, TypeError, KeyError, IndexError, AttributeError, RecursionError):
        return None
    if isinstance(end, int) and 8 + n + end > size:
        return f"truncated: {size} bytes, the header describes {8 + n + end}"
    return None


class _TensorScan:
    """The checks on one tensor's bytes, fed chunk by chunk in order."""

    def __init__(self, name: str, info: TensorInfo) -> None:
        self.name, self.info = name, info
        self.ids = dumpformat.ids_hasher()
        self.mask_ones = 0

    def feed(self, chunk: np.ndarray, offset: int) -> str | None:
        if self.name == "input_ids":
            self.ids.update(chunk)
        elif self.name == "loss_mask":
            if chunk.max() > 1:
                token = offset + int(np.argmax(chunk > 1))
                return f"loss mask holds {chunk.max()} at token {token} (only 0 and 1 allowed)"
            self.mask_ones += int(np.count_nonzero(chunk))
        elif self.name in _SCALE_NAMES:
            return self.positive(chunk, offset)
        else:
            return self.finite(chunk, offset)
        return None

    def positive(self, chunk: np.ndarray, offset: int) -> str | None:
        """A scale must be finite and positive: zero, negative or NaN would wipe out, flip or
        poison its whole row when dequantized."""
        scales = chunk.view(np.float32)
        good = (scales > 0) & (scales < np.inf)
        if good.all():
            return None
        element = int(np.argmin(good))
        token = (offset // 4 + element) // self.info.shape[1]
        return (f"{self.name} holds {scales[element]} at token {token} (a scale must be finite "
                "and positive)")

    def finite(self, chunk: np.ndarray, offset: int) -> str | None:
        signed, unsigned, exponent = _FLOAT_BITS[self.info.dtype]
        x = chunk.view(unsigned)
        sign = np.iinfo(unsigned).max ^ np.iinfo(signed).max
        if x.view(signed).max() < exponent and x.max() < (sign | exponent):
            return None
        element = offset // x.itemsize + int(np.argmax((x & exponent) == exponent))
        return f"NaN/Inf in {self.name} at token {element // self.info.shape[1]}"

    def finish(self, e: Expected) -> str | None:
        if self.name == "input_ids" and self.ids.hexdigest() != e.ids_hash:
            return "input_ids differ from the plan"
        if self.name == "loss_mask" and self.mask_ones != e.loss_tokens:
            return f"loss mask has {self.mask_ones} tokens, plan says {e.loss_tokens}"
        return None


def _check_one(e: Expected, from_disk: bool) -> tuple[str, str | None, str | None]:
    problem, key = check_file(e, from_disk)
    return e.id, problem, key


def verify_many(items: Iterable[Expected], workers: int, from_disk: bool = False
                ) -> Iterator[tuple[str, str | None, str | None]]:
    """Check many files in parallel; yields (id, problem, stat key) as each completes. Reads
    `items` lazily, keeping a few files per worker in flight. `from_disk`: see `check_file`."""
    pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="verify")
    pending: set[Future] = set()
    try:
        for e in items:
            if len(pending) >= 4 * workers:
                done, pending = wait(pending, return_when=FIRST_COMPLETED)
                yield from (f.result() for f in done)
            pending.add(pool.submit(_check_one, e, from_disk))
        while pending:
            done, pending = wait(pending, return_when=FIRST_COMPLETED)
            yield from (f.result() for f in done)
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


# The row whose relative error is judged: one in a hundred rows may carry a kernel's outlier
# noise, while a wrong capture (another layer, model or row order) is wrong in far more.
SPOT_QUANTILE = 0.99


def compare_dumps(stored: Path, fresh: Path, tolerance: float) -> str | None:
    """The numerical spot check: a fresh capture of a verified sample must hold the same ids and
    mask, and hidden states within `tolerance` relative error (‖fresh − stored‖ / ‖stored‖ of
    each token row, at the SPOT_QUANTILE row of each captured layer)."""
    try:
        a, b = dumpformat.read_header(stored), dumpformat.read_header(fresh)
    except (OSError, DumpError) as exc:
        return f"cannot read a dump to compare: {exc}"
    if set(a.tensors) != set(b.tensors):
        return (f"the fresh dump holds {sorted(b.tensors)}, the stored one {sorted(a.tensors)}")
    for name in a.tensors:
        sa, sb = a.tensors[name], b.tensors[name]
        if (sa.dtype, sa.shape) != (sb.dtype, sb.shape):
            return (f"{name} is {sb.dtype} {list(sb.shape)} in the fresh dump, "
                    f"{sa.dtype} {list(sa.shape)} stored")
    try:
        with open(stored, "rb", buffering=0, opener=_no_follow) as fa, \
                open(fresh, "rb", buffering=0, opener=_no_follow) as fb:
            bound = precision.spot_tolerance(tolerance, a.dtype)
            problem = _compare_tensors(fa.fileno(), a, fb.fileno(), b, bound)
            return problem and (problem if bound == tolerance else f"{problem} (fp8 dumps' bound "
                                f"at [verify] spot_tolerance = {tolerance:g})")
    except (OSError, DumpError) as exc:
        return f"cannot read a dump to compare: {exc}"


def _no_follow(path: str, flags: int) -> int:
    return os.open(path, flags | os.O_NOFOLLOW)


def _compare_tensors(fa: int, a: DumpHeader, fb: int, b: DumpHeader, tolerance: float
                     ) -> str | None:
    for name in ("input_ids", "loss_mask"):
        ta, tb = a.tensors[name], b.tensors[name]
        if _pread(fa, ta.begin, ta.end) != _pread(fb, tb.begin, tb.end):
            return f"{name} differ between the stored and the fresh dump"
    for name in dumpformat.HIDDEN:
        errors = np.quantile(_relative_errors(fa, a, fb, b, name), SPOT_QUANTILE, axis=0,
                             method="higher")
        worst = int(np.argmax(np.nan_to_num(errors, nan=np.inf)))
        if not errors[worst] <= tolerance:  # NaN fails too
            where = f" (captured layer {worst + 1} of {len(errors)})" if len(errors) > 1 else ""
            return (f"{name}{where} differs from the fresh capture: relative error "
                    f"{errors[worst]:.4g} in the {SPOT_QUANTILE:.0%} row > tolerance "
                    f"{tolerance:g}")
    return None


def _pread(fd: int, begin: int, end: int) -> bytes:
    data = os.pread(fd, end - begin, begin)
    if len(data) != end - begin:
        raise DumpError("file shorter than its header says")
    return data


def _relative_errors(fa: int, a: DumpHeader, fb: int, b: DumpHeader, name: str) -> np.ndarray:
    """‖b − a‖ / ‖a‖ of each token row of each captured layer of one hidden-state tensor
    [T, layers], in float32, whole rows at a time (an fp8 row dequantized with its scales). Per
    layer, because the layers' norms differ by orders of magnitude (outlier features): over the
    whole tensor, a wrong shallow layer would hide under the deep ones. Per row, because a few
    tokens' massive activations (SmolLM2: ~26,000 in layers 15 and 27) hold most of a layer's
    norm: over all rows, half the rows unrelated measured 0.06 to 0.13."""
    info = a.tensors[name]
    rows, width = info.shape
    blocks = dumpformat.LAYER_BLOCKS[name]
    scales_a, scales_b = _scales(fa, a, name), _scales(fb, b, name)
    step = max(1, CHUNK // (width * dumpformat.DTYPE_SIZES[info.dtype]))
    diff_sq, ref_sq = np.zeros((rows, blocks)), np.zeros((rows, blocks))
    for start in range(0, rows, step):
        end = min(rows, start + step)
        x = _rows(fa, info, start, end, scales_a).reshape(end - start, blocks, -1)
        y = _rows(fb, b.tensors[name], start, end, scales_b).reshape(end - start, blocks, -1)
        diff_sq[start:end] = np.einsum("rbh,rbh->rb", y - x, y - x, dtype=np.float64)
        ref_sq[start:end] = np.einsum("rbh,rbh->rb", x, x, dtype=np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(ref_sq == 0, np.where(diff_sq == 0, 0.0, np.inf),
                        np.sqrt(diff_sq / ref_sq))


def _scales(fd: int, h: DumpHeader, name: str) -> np.ndarray | None:
    """The scales [T, groups] of an fp8 states tensor, None for float states."""
    scale = h.tensors.get(dumpformat.SCALES[name])
    if scale is None:
        return None
    return np.frombuffer(_pread(fd, scale.begin, scale.end), np.float32).reshape(scale.shape)


def _rows(fd: int, info: TensorInfo, start: int, end: int, scales: np.ndarray | None
          ) -> np.ndarray:
    row_bytes = info.shape[1] * dumpformat.DTYPE_SIZES[info.dtype]
    raw = _pread(fd, info.begin + start * row_bytes, info.begin + end * row_bytes)
    return precision.rows_as_float32(raw, info.dtype, info.shape[1],
                                     None if scales is None else scales[start:end])
