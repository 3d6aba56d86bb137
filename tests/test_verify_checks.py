"""The verify checks on real dump files: each kind of damage is caught and named."""

from __future__ import annotations

import hashlib
import os
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from eagle3d.dataset import checksum, dumpformat, precision
from eagle3d.daemon import dump_checks
from eagle3d.daemon.dump_checks import Expected, check_file, compare_dumps, verify_many
from eagle3d.statemachine import manifest

CONTRACT = "c0" * 16
OTHER_CONTRACT = "d1" * 16
TOKENS, HIDDEN = 24, 16
DTYPES = {"BF16": "bfloat16", "F16": "float16", "F32": "float32", "F8_E4M3": "float8_e4m3fn"}


def sample_id(n: int) -> str:
    return hashlib.blake2b(str(n).encode(), digest_size=16).hexdigest()


def encode(values: np.ndarray, dtype: str) -> bytes:
    """float32 values as the raw little-endian bytes of a safetensors dtype."""
    values = values.astype(np.float32)
    if dtype == "BF16":
        return (values.view(np.uint32) >> 16).astype(np.uint16).tobytes()
    return values.astype({"F16": np.float16, "F32": np.float32}[dtype]).tobytes()


def hidden_entries(aux: np.ndarray, last: np.ndarray, dtype: str) -> dict:
    """A dump's hidden-state tensors as write_dump takes them; fp8 ones quantized the way the
    engines quantize, with their scales."""
    if not dumpformat.is_scaled(dtype):
        return {name: (dtype, values.shape, encode(values, dtype))
                for name, values in ((dumpformat.AUX, aux), (dumpformat.LAST, last))}
    stored = precision.encode_states(torch.from_numpy(aux).float(), torch.from_numpy(last).float(),
                                     DTYPES[dtype])
    return {name: precision.dump_entry(t) for name, t in stored.items()}


def make_dump(folder: Path, n: int = 0, dtype: str = "BF16", tokens: int = TOKENS,
              hidden: int = HIDDEN, contract: str = CONTRACT, aux: np.ndarray | None = None,
              last: np.ndarray | None = None, mask: np.ndarray | None = None, seed: int = 0
              ) -> Expected:
    """Write one dump and return what the ledger would expect of it after ingest."""
    rng = np.random.default_rng(seed + n)
    ids = rng.integers(0, 50_000, tokens, dtype=np.int32).tobytes()
    mask = (np.arange(tokens) % 3 != 0).astype(np.uint8) if mask is None else mask
    aux = rng.standard_normal((tokens, 3 * hidden)) if aux is None else aux
    last = rng.standard_normal((tokens, hidden)) if last is None else last
    sid = sample_id(n)
    path = dumpformat.write_dump(folder, sid, contract, {
        "input_ids": ("I32", (tokens,), ids),
        "loss_mask": ("U8", (tokens,), mask.tobytes()),
        **hidden_entries(aux, last, dtype)})
    return Expected(sid, str(path), tokens, int(np.count_nonzero(mask)), dumpformat.ids_hash(ids),
                    checksum.file_checksum(path), CONTRACT, hidden, DTYPES[dtype])


def flip_byte(path: str, offset: int, bits: int = 0x01) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([byte ^ bits]))


@pytest.mark.parametrize("dtype", DTYPES)
def test_good_file_passes_with_its_stat_key(tmp_path: Path, dtype: str) -> None:
    e = make_dump(tmp_path, dtype=dtype)
    st = os.stat(e.path)
    assert check_file(e) == (None, f"{st.st_size}:{st.st_mtime_ns}:{st.st_ino}")


def test_rewritten_file_gets_a_new_stat_key(tmp_path: Path) -> None:
    e = make_dump(tmp_path)
    _, before = check_file(e)
    e = make_dump(tmp_path)  # the same sample captured again: a new inode
    problem, after = check_file(e)
    assert problem is None and after != before


def test_a_manifest_written_before_stats_were_recorded_lets_its_files_be_trained(
        tmp_path: Path) -> None:
    """A manifest's sample of an install from before verify's stat key was listed has no
    `stat`: its file is not called changed (the reader's checksum still checks every byte),
    where a manifest that lists a stat names the difference."""
    e = make_dump(tmp_path)
    st = os.stat(e.path)
    old = {"id": e.id, "path": e.path, "checksum": "xxh3-128:00"}  # no "stat"
    assert manifest.file_changed(old, st) is None
    listed = {**old, "stat": f"{st.st_size + 1}:{st.st_mtime_ns}:{st.st_ino}"}
    assert manifest.file_changed(listed, st) == \
        f"{st.st_size} bytes, verify saw {st.st_size + 1}"


def test_missing_file(tmp_path: Path) -> None:
    e = make_dump(tmp_path)
    os.unlink(e.path)
    assert check_file(e) == ("missing file", None)


def test_symlink_in_place_of_the_file_is_refused(tmp_path: Path) -> None:
    good = make_dump(tmp_path)
    elsewhere = tmp_path / "elsewhere.safetensors"
    os.rename(good.path, elsewhere)
    os.symlink(elsewhere, good.path)
    problem, _ = check_file(good)
    assert problem == "a symlink is in place of the file"


def test_flipped_byte_in_tensor_data_is_a_checksum_mismatch(tmp_path: Path) -> None:
    e = make_dump(tmp_path)
    last = dumpformat.read_header(e.path).tensors["last_hidden_state"]
    flip_byte(e.path, last.begin + 10)  # a mantissa bit: the value stays finite
    assert check_file(e)[0] == "checksum mismatch"


def test_flipped_byte_breaking_the_header(tmp_path: Path) -> None:
    e = make_dump(tmp_path)
    flip_byte(e.path, 8)  # the header's opening brace
    problem, _ = check_file(e)
    assert problem.startswith("bad header: header is not valid JSON")


def test_flipped_byte_in_header_metadata(tmp_path: Path) -> None:
    e = make_dump(tmp_path)
    with open(e.path, "rb") as f:
        head = f.read(4096)
    flip_byte(e.path, head.index(b'"tokens":"24"') + len('"tokens":"2'))  # 24 -> 25
    problem, _ = check_file(e)
    assert problem == "bad header: metadata says 25 tokens, tensors hold 24"


@pytest.mark.parametrize("keep, says", [(0.5, "the header describes"),
                                        (0.01, "inside the")])
def test_truncated_file(tmp_path: Path, keep: float, says: str) -> None:
    e = make_dump(tmp_path)
    cut = int(os.path.getsize(e.path) * keep)
    os.truncate(e.path, cut)
    problem, _ = check_file(e)
    assert problem.startswith(f"truncated: {cut} bytes, {says}")


def test_two_swapped_files_are_each_caught(tmp_path: Path) -> None:
    a, b = make_dump(tmp_path, 1), make_dump(tmp_path, 2)
    os.rename(a.path, tmp_path / "x")
    os.rename(b.path, a.path)
    os.rename(tmp_path / "x", b.path)
    assert check_file(a)[0] == f"sample id in file is {b.id}"
    assert check_file(b)[0] == f"sample id in file is {a.id}"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_nonfinite_value_is_found_at_its_token(tmp_path: Path, dtype: str, bad: float) -> None:
    aux = np.random.default_rng(1).standard_normal((TOKENS, 3 * HIDDEN))
    aux[17, 5] = bad
    e = make_dump(tmp_path, dtype=dtype, aux=aux)  # ingested as is: the checksum matches
    assert check_file(e)[0] == "NaN/Inf in aux_hidden_states at token 17"


def test_nonfinite_value_found_in_a_later_chunk(tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """Chunk boundaries fall inside the tensors; the token index still comes out right."""
    monkeypatch.setattr(dump_checks, "CHUNK", 1024)
    tokens, hidden = 64, 32  # last_hidden_state: 4 KiB of bf16, four chunks
    last = np.random.default_rng(2).standard_normal((tokens, hidden))
    last[50, 31] = -np.inf
    e = make_dump(tmp_path, tokens=tokens, hidden=hidden, last=last)
    assert check_file(e)[0] == "NaN/Inf in last_hidden_state at token 50"
    assert check_file(make_dump(tmp_path, 1, tokens=tokens, hidden=hidden))[0] is None


def test_largest_finite_values_pass(tmp_path: Path) -> None:
    aux = np.full((TOKENS, 3 * HIDDEN), np.finfo(np.float16).max)
    aux[::2] *= -1
    assert check_file(make_dump(tmp_path, dtype="F16", aux=aux))[0] is None


def test_file_from_another_contract(tmp_path: Path) -> None:
    e = make_dump(tmp_path, contract=OTHER_CONTRACT)
    assert check_file(e)[0] == f"contract {OTHER_CONTRACT} is not the dataset's {CONTRACT}"


def test_input_ids_not_matching_the_plan(tmp_path: Path) -> None:
    e = make_dump(tmp_path)
    planned = replace(e, ids_hash=dumpformat.ids_hash(np.arange(TOKENS, dtype="<i4").tobytes()))
    assert check_file(planned)[0] == "input_ids differ from the plan"


def test_loss_mask_count_and_values(tmp_path: Path) -> None:
    e = make_dump(tmp_path)
    assert check_file(replace(e, loss_tokens=40))[0] == \
        f"loss mask has {e.loss_tokens} tokens, plan says 40"
    mask = np.ones(TOKENS, np.uint8)
    mask[7] = 2
    assert check_file(make_dump(tmp_path, 1, mask=mask))[0] == \
        "loss mask holds 2 at token 7 (only 0 and 1 allowed)"


def test_header_facts_against_plan_and_contract(tmp_path: Path) -> None:
    e = make_dump(tmp_path, dtype="F16")
    assert check_file(replace(e, dtype="bfloat16"))[0] == "dtype F16, the contract says bfloat16"
    assert check_file(replace(e, hidden_size=32))[0] == "hidden size 16, the contract says 32"
    assert check_file(replace(e, tokens=30))[0].startswith("file has 24 tokens, plan says 30")


def test_not_a_regular_file(tmp_path: Path) -> None:
    e = make_dump(tmp_path)
    os.unlink(e.path)
    os.mkfifo(e.path)
    assert check_file(e)[0] == "not a regular file"


def test_verify_many_reports_every_file_once(tmp_path: Path) -> None:
    good = [make_dump(tmp_path, n) for n in range(12)]
    os.unlink(good[3].path)
    flip_byte(good[7].path, os.path.getsize(good[7].path) - 1)
    results = {sid: (problem, key) for sid, problem, key in verify_many(iter(good), workers=3)}
    assert set(results) == {e.id for e in good}
    assert {sid for sid, (problem, _) in results.items() if problem} == {good[3].id, good[7].id}
    assert results[good[3].id] == ("missing file", None)
    assert results[good[7].id][0] == "checksum mismatch"
    assert results[good[0].id][1] == check_file(good[0])[1]


def folder(parent: Path, name: str) -> Path:
    (parent / name).mkdir(exist_ok=True)
    return parent / name


@pytest.mark.parametrize("dtype", ["BF16", "F16", "F32"])
def test_compare_dumps_tolerance(tmp_path: Path, dtype: str) -> None:
    rng = np.random.default_rng(3)
    aux, last = rng.standard_normal((TOKENS, 3 * HIDDEN)), rng.standard_normal((TOKENS, HIDDEN))
    stored = Path(make_dump(folder(tmp_path, "stored"), dtype=dtype, aux=aux, last=last).path)
    close = Path(make_dump(folder(tmp_path, "close"), dtype=dtype, aux=aux * 1.001,
                           last=last).path)
    assert compare_dumps(stored, close, tolerance=0.01) is None
    far = Path(make_dump(folder(tmp_path, "far"), dtype=dtype, aux=aux, last=last * 1.1).path)
    problem = compare_dumps(stored, far, tolerance=0.01)
    assert problem.startswith("last_hidden_state differs from the fresh capture: relative error "
                              "0.1")
    assert problem.endswith("> tolerance 0.01")


def test_compare_dumps_ids_shapes_and_nan(tmp_path: Path) -> None:
    stored = Path(make_dump(folder(tmp_path, "stored"), seed=0).path)
    other_ids = Path(make_dump(folder(tmp_path, "other"), seed=1).path)
    assert compare_dumps(stored, other_ids, 0.5) == \
        "input_ids differ between the stored and the fresh dump"
    shorter = Path(make_dump(folder(tmp_path, "shorter"), tokens=TOKENS - 1).path)
    assert compare_dumps(stored, shorter, 0.5) == \
        f"input_ids is I32 [{TOKENS - 1}] in the fresh dump, I32 [{TOKENS}] stored"
    nan_last = np.random.default_rng(0).standard_normal((TOKENS, HIDDEN))
    nan_last[0, 0] = np.nan
    with_nan = Path(make_dump(folder(tmp_path, "nan"), seed=0, last=nan_last).path)
    assert compare_dumps(stored, with_nan, 0.5) == \
        "last_hidden_state differs from the fresh capture: relative error nan in the 99% row " \
        "> tolerance 0.5"
    os.unlink(with_nan)
    assert compare_dumps(stored, with_nan, 0.5).startswith("cannot read a dump to compare: ")


def test_compare_fp8_dumps_within_the_derived_bound(tmp_path: Path) -> None:
    """Two fp8 captures of the same sample differ by kernel noise plus two roundings to e4m3:
    the spot check allows that (0.156 for spot_tolerance 0.02), not a neighbouring layer."""
    rng = np.random.default_rng(4)
    aux, last = rng.standard_normal((TOKENS, 3 * HIDDEN)), rng.standard_normal((TOKENS, HIDDEN))
    stored = Path(make_dump(folder(tmp_path, "stored"), dtype="F8_E4M3", aux=aux, last=last).path)
    # A fresh capture: about 1% of noise on every value, as bf16 kernels of another batch shape;
    # after two roundings to e4m3 the dumps differ by ~0.03, over the bf16 tolerance of 0.02.
    noisy = aux * (1 + 0.01 * rng.standard_normal(aux.shape))
    fresh = Path(make_dump(folder(tmp_path, "fresh"), dtype="F8_E4M3", aux=noisy, last=last).path)
    assert compare_dumps(stored, fresh, tolerance=0.02) is None
    # The same noise between two bf16 dumps stays under the configured tolerance itself.
    assert compare_dumps(Path(make_dump(folder(tmp_path, "bf16"), aux=aux, last=last).path),
                         Path(make_dump(folder(tmp_path, "bf16-fresh"), aux=noisy,
                                        last=last).path), tolerance=0.02) is None
    # A neighbouring layer: a quarter of the norm away.
    neighbour = last + 0.25 * rng.standard_normal(last.shape)
    other = Path(make_dump(folder(tmp_path, "other"), dtype="F8_E4M3", aux=aux,
                           last=neighbour).path)
    problem = compare_dumps(stored, other, tolerance=0.02)
    assert problem.startswith("last_hidden_state differs from the fresh capture")
    assert problem.endswith(
        "> tolerance 0.156 (fp8 dumps' bound at [verify] spot_tolerance = 0.02)")


@pytest.mark.parametrize("dtype", ["BF16", "F8_E4M3"])
def test_the_spot_check_judges_each_row_so_massive_activations_hide_nothing(tmp_path: Path,
                                                                             dtype: str) -> None:
    """A few tokens' massive activations hold most of a layer's norm: a capture with half its
    rows unrelated must fail all the same, and a right one with bf16 noise on every value must
    pass."""
    rng = np.random.default_rng(7)
    tokens = 64
    aux = rng.standard_normal((tokens, 3 * HIDDEN))
    last = rng.standard_normal((tokens, HIDDEN))
    for states in (aux, last):
        states[[0, 5]] *= 3000.0  # the attention sink and one more, as SmolLM2's layers have
    stored = Path(make_dump(folder(tmp_path, "stored"), dtype=dtype, tokens=tokens, aux=aux,
                            last=last).path)
    noisy = [x * (1 + 2.0 ** -8 * rng.standard_normal(x.shape)) for x in (aux, last)]
    fresh = Path(make_dump(folder(tmp_path, "fresh"), dtype=dtype, tokens=tokens, aux=noisy[0],
                           last=noisy[1]).path)
    assert compare_dumps(stored, fresh, tolerance=0.02) is None
    half = [x.copy() for x in (aux, last)]
    for x in half:
        x[tokens // 2:] = rng.standard_normal(x[tokens // 2:].shape)
    wrong = Path(make_dump(folder(tmp_path, "wrong"), dtype=dtype, tokens=tokens, aux=half[0],
                           last=half[1]).path)
    problem = compare_dumps(stored, wrong, tolerance=0.02)
    assert problem is not None and problem.startswith("aux_hidden_state")
    assert "differs from the fresh capture: relative error" in problem


def test_fp8_values_dequantize_like_torch() -> None:
    """verify's numpy view of e4m3 bytes is torch's, for all 256 of them."""
    every = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float().numpy()
    np.testing.assert_array_equal(precision.E4M3_VALUES, every)
