"""Ingest on real files: every bad dump is rejected with a reason and never ingested, every good
one lands once, and a flood of renames into a watched tmpfs loses nothing."""

from __future__ import annotations

import os
import shutil
import time
import uuid
from pathlib import Path

import numpy as np
import pytest
import torch

from eagle3d.dataset import dumpformat, precision
from eagle3d.dataset import checksum
from eagle3d.daemon.ingest import Ingestor, remove_dataset_debris
from eagle3d.daemon.stages.extract_spool import Spool
from eagle3d.statemachine import layout
from eagle3d.statemachine.ledger import Ledger, PlannedSample
from eagle3d.statemachine.safepath import HeldDir

H = 16
CONTRACT = {"fingerprint": "c" * 32, "hidden_size": H, "dtype": "bfloat16"}


def sample_ids(i: int, tokens: int) -> bytes:
    return np.arange(i, i + tokens, dtype="<i4").tobytes()


def write(spool: Path, sid: str, ids: bytes, tokens: int | None = None, hidden: int = H,
          contract: str = CONTRACT["fingerprint"], values: np.ndarray | None = None) -> Path:
    t = len(ids) // 4 if tokens is None else tokens
    rng = np.random.default_rng(0)
    aux = (values if values is not None else rng.standard_normal((t, 3 * hidden))).astype(np.float32)
    bf16 = lambda a: (a.view(np.uint32) >> 16).astype(np.uint16)  # noqa: E731
    last = rng.standard_normal((t, hidden)).astype(np.float32)
    return dumpformat.write_dump(spool, sid, contract, {
        "input_ids": ("I32", (t,), ids[:4 * t]),
        "loss_mask": ("U8", (t,), bytes([1]) * t),
        "aux_hidden_states": ("BF16", (t, 3 * hidden), bf16(aux).tobytes()),
        "last_hidden_state": ("BF16", (t, hidden), bf16(last).tobytes())})


@pytest.fixture
def env(tmp_path):
    spool = Path("/dev/shm") / f"eagle3d-test-{uuid.uuid4().hex[:8]}"
    spool.mkdir()
    ledger = Ledger(tmp_path / "ledger.sqlite")
    samples = []
    for i in range(6):
        sid = f"{i:032x}"
        ids = sample_ids(i, 8 + i)
        samples.append(PlannedSample(sid, i, 8 + i, 8 + i, dumpformat.ids_hash(ids), ids,
                                     b"\1" * (8 + i)))
    ledger.add_planned(samples, [], {})
    ledger.claim(100, 10_000)
    ing = Ingestor(ledger, HeldDir.open(spool), tmp_path / "dataset", CONTRACT, max_attempts=3)
    yield ing, ledger, spool, samples
    ledger.close()
    shutil.rmtree(spool, ignore_errors=True)


def reason_of(spool: Path, name: str) -> str:
    return (spool / "rejected" / f"{name}.reason.txt").read_text()


def test_a_good_dump_lands_once_with_its_checksum(env):
    ing, ledger, spool, samples = env
    s = samples[0]
    path = write(spool, s.id, s.input_ids)
    out = ing.ingest(path.name)
    assert out.kind == "ingested"
    row = ledger.sample(s.id)
    dst = ing.dataset_dir / row.path
    assert row.status == "extracted" and row.path.startswith("samples-00000/")
    assert checksum.file_checksum(dst) == row.checksum and row.bytes == dst.stat().st_size
    assert not path.exists()
    again = write(spool, s.id, s.input_ids)
    assert ing.ingest(again.name).kind == "dropped"  # a crash between commit and unlink
    assert ledger.counts().get("extracted") == 1


@pytest.mark.parametrize("case,expect", [
    ("decode step", "a decode step"),
    ("truncated", "bad dump"),
    ("header larger than file", "bad dump: header length"),
    ("invalid header json", "not valid JSON"),
    ("wrong hidden size", "hidden size"),
    ("other contract", "is not the dataset's"),
    ("nan", "NaN/Inf in aux_hidden_states at token 3"),
    ("wrong dtype", "dtype F32, the contract says bfloat16"),
    ("ids differ", "input_ids differ"),
    ("empty", "bad dump: file too short"),
])
def test_bad_dumps_are_rejected_and_retried(env, case, expect):
    ing, ledger, spool, samples = env
    s = samples[1]
    name = dumpformat.dump_name(s.id)
    if case == "decode step":
        write(spool, s.id, s.input_ids, tokens=1)
    elif case == "truncated":
        p = write(spool, s.id, s.input_ids)
        os.truncate(p, p.stat().st_size - 7)
    elif case == "header larger than file":
        (spool / name).write_bytes((10**6).to_bytes(8, "little") + b"{}")
    elif case == "invalid header json":
        (spool / name).write_bytes((8).to_bytes(8, "little") + b"{not js}")
    elif case == "wrong hidden size":
        write(spool, s.id, s.input_ids, hidden=H * 2)
    elif case == "other contract":
        write(spool, s.id, s.input_ids, contract="d" * 32)
    elif case == "ids differ":
        write(spool, s.id, sample_ids(99, s.tokens))
    elif case == "nan":
        values = np.zeros((s.tokens, 3 * H), np.float32)
        values[3, 5] = np.nan
        write(spool, s.id, s.input_ids, values=values)
    elif case == "wrong dtype":
        t = s.tokens
        dumpformat.write_dump(spool, s.id, CONTRACT["fingerprint"], {
            "input_ids": ("I32", (t,), s.input_ids), "loss_mask": ("U8", (t,), b"\1" * t),
            "aux_hidden_states": ("F32", (t, 3 * H), np.zeros((t, 3 * H), np.float32).tobytes()),
            "last_hidden_state": ("F32", (t, H), np.zeros((t, H), np.float32).tobytes())})
    elif case == "empty":
        (spool / name).write_bytes(b"")
    out = ing.ingest(name)
    assert out.kind == "rejected" and expect in out.detail
    assert expect in reason_of(spool, name)
    row = ledger.sample(s.id)
    assert row.status == "pending" and expect in row.error
    assert not list(ing.dataset_dir.rglob("*.safetensors")) if ing.dataset_dir.exists() else True


def test_hostile_names_and_file_kinds(env, tmp_path):
    ing, ledger, spool, samples = env
    outside = tmp_path / "secret.safetensors"
    outside.write_bytes(b"x" * 100)
    link = spool / dumpformat.dump_name(samples[2].id)
    link.symlink_to(outside)
    os.mkfifo(spool / dumpformat.dump_name(samples[3].id))
    (spool / "..%2Fetc%2Fpasswd.safetensors").write_bytes(b"x")
    write(spool, "f" * 32, sample_ids(0, 4))  # unknown sample id
    results = {n: ing.ingest(n) for n in sorted(os.listdir(spool)) if n != "rejected"}
    assert all(r.kind == "rejected" for r in results.values())
    assert "not a regular file" in results[link.name].detail
    assert "not <sample id>" in results["..%2Fetc%2Fpasswd.safetensors"].detail
    assert "unknown sample id" in results["f" * 32 + ".safetensors"].detail
    assert outside.read_bytes() == b"x" * 100  # never followed
    assert ledger.counts().get("extracted") == 0


FP8_CONTRACT = {**CONTRACT, "dump_dtype": "float8_e4m3fn"}


def write_fp8(spool: Path, sid: str, ids: bytes, damage=None) -> Path:
    """An fp8 dump quantized the way the engines quantize; `damage(tensors)` may change the
    stored tensors (states and scales, by name) before they are written."""
    t = len(ids) // 4
    g = torch.Generator().manual_seed(0)
    stored = precision.encode_states(torch.randn(t, 3 * H, generator=g),
                                     torch.randn(t, H, generator=g), "float8_e4m3fn")
    if damage is not None:
        damage(stored)
    return dumpformat.write_dump(spool, sid, CONTRACT["fingerprint"], {
        "input_ids": ("I32", (t,), ids), "loss_mask": ("U8", (t,), b"\1" * t),
        **{name: precision.dump_entry(tensor) for name, tensor in stored.items()}})


def set_value(name: str, row: int, column: int, value: float):
    def damage(stored: dict) -> None:
        stored[name][row, column] = value
    return damage


def nan_byte(stored: dict) -> None:
    stored[dumpformat.AUX].view(torch.uint8)[4, 9] = 0x7F  # e4m3's NaN


def scale_shape(stored: dict) -> None:
    stored[dumpformat.AUX_SCALE] = stored[dumpformat.AUX_SCALE][:, :1].contiguous()


def no_scales(stored: dict) -> None:
    del stored[dumpformat.AUX_SCALE], stored[dumpformat.LAST_SCALE]


def bf16_with_scales(stored: dict) -> None:
    for name in (dumpformat.AUX, dumpformat.LAST):
        stored[name] = stored[name].to(torch.bfloat16)


@pytest.mark.parametrize("damage,expect", [
    (set_value(dumpformat.AUX_SCALE, 3, 1, float("nan")),
     "aux_hidden_states_scale holds nan at token 3 (a scale must be finite and positive)"),
    (set_value(dumpformat.LAST_SCALE, 2, 0, 0.0),
     "last_hidden_state_scale holds 0.0 at token 2 (a scale must be finite and positive)"),
    (set_value(dumpformat.AUX_SCALE, 5, 2, -0.25),
     "aux_hidden_states_scale holds -0.25 at token 5"),
    (set_value(dumpformat.LAST_SCALE, 0, 0, float("inf")),
     "last_hidden_state_scale holds inf at token 0"),
    (scale_shape, "bad dump: aux_hidden_states_scale is F32 [8, 1], not F32 [8, 3]"),
    (no_scales, "bad dump: F8_E4M3 states need their scales"),
    (bf16_with_scales, "bad dump: BF16 states must come without scales"),
    (nan_byte, "NaN/Inf in aux_hidden_states at token 4"),
], ids=["nan scale", "zero scale", "negative scale", "inf scale", "scale shape", "no scales",
        "bf16 with scales", "nan in the fp8 values"])
def test_fp8_dumps_with_bad_scales_or_values_are_rejected(env, damage, expect):
    ing, ledger, spool, samples = env
    ing.contract = FP8_CONTRACT
    s = samples[0]
    out = ing.ingest(write_fp8(spool, s.id, s.input_ids, damage).name)
    assert out.kind == "rejected" and expect in out.detail
    assert expect in ledger.sample(s.id).error and ledger.sample(s.id).status == "pending"


def test_fp8_contract_takes_fp8_dumps_only(env):
    ing, ledger, spool, samples = env
    ing.contract = FP8_CONTRACT
    s, other = samples[0], samples[1]
    assert ing.ingest(write_fp8(spool, s.id, s.input_ids).name).kind == "ingested"
    out = ing.ingest(write(spool, other.id, other.input_ids).name)
    assert out.kind == "rejected" and "dtype BF16, the contract says float8_e4m3fn" in out.detail


def test_duplicate_for_an_extracted_sample_is_rejected(env):
    ing, ledger, spool, samples = env
    s = samples[4]
    assert ing.ingest(write(spool, s.id, s.input_ids).name).kind == "ingested"
    other = write(spool, s.id, s.input_ids, values=np.ones((s.tokens, 3 * H)))
    out = ing.ingest(other.name)
    assert out.kind == "rejected" and "duplicate" in out.detail
    assert ledger.sample(s.id).status == "extracted"


@pytest.mark.parametrize("index", [0, 100_000_000], ids=["five digits", "past five digits"])
def test_debris_of_an_interrupted_ingest_is_removed(env, index):
    ing, ledger, spool, samples = env
    s = samples[5]
    shard = ing.dataset_dir / layout.sample_folder(index)
    shard.mkdir(parents=True)
    (shard / f".{s.id}.safetensors.tmp").write_bytes(b"partial")
    (shard / f"{s.id}.safetensors").write_bytes(b"renamed but never committed")
    removed = remove_dataset_debris(ing.dataset_dir, ledger)
    assert len(removed) == 2 and not list(shard.iterdir())


def test_debris_removal_leaves_a_node_shards_folder_alone(env):
    """A dataset folder that is also the shared root of several nodes' shards: another node's
    publish in progress (a temp file at the top of `shard-1-of-3/`) is not this daemon's debris."""
    ing, ledger, spool, samples = env
    other = ing.dataset_dir / "shard-1-of-3"
    other.mkdir(parents=True)
    publishing = other / ".manifest.json.tmp"
    publishing.write_bytes(b"another node writing")
    assert remove_dataset_debris(ing.dataset_dir, ledger) == [] and publishing.exists()


def test_a_flood_of_renames_is_never_missed(tmp_path):
    """More renames than inotify's default queue holds: the rescan catches what events miss."""
    spool = Path("/dev/shm") / f"eagle3d-flood-{uuid.uuid4().hex[:8]}"
    spool.mkdir()
    outside = Path("/dev/shm") / f"eagle3d-flood-src-{uuid.uuid4().hex[:8]}"
    outside.mkdir()
    try:
        watcher = Spool(spool, rescan_interval=0.5)
        n = 20_000
        for i in range(n):
            tmp = outside / f"{i:032x}.tmp"  # renamed in from outside: a *created* event
            tmp.write_bytes(b"")
            os.rename(tmp, spool / f"{i:032x}.safetensors")
        seen: set[str] = set()
        deadline = time.time() + 60
        while len(seen) < n and time.time() < deadline:
            watcher.rescan()
            while (name := watcher.take(0.05)) is not None:
                assert name not in seen
                seen.add(name)
        watcher.stop()
        assert len(seen) == n
    finally:
        shutil.rmtree(spool, ignore_errors=True)
        shutil.rmtree(outside, ignore_errors=True)


def _queued(watcher: Spool) -> set[str]:
    watcher.rescan(force=True)
    queued = set()
    while (name := watcher.take(0)) is not None:
        queued.add(name)
        watcher.done(name)
    return queued


def test_a_wall_clock_step_makes_no_live_writers_file_stale_and_a_dead_writers_goes(tmp_path):
    """A forward step of the wall clock makes a file just written look hours old: a live writer's
    files stay where they are, whatever their names; what a dead writer left is removed (its
    temp file) or handed to ingest to be rejected (a dot-named file of no known writer)."""
    from eagle3d.statemachine.atomic import HOST
    spool = Path("/dev/shm") / f"eagle3d-step-{uuid.uuid4().hex[:8]}"
    spool.mkdir()
    hours_ago = time.time() - 3 * 3600
    try:
        left = spool / ".notes-left-before-the-start"  # there before the daemon: as old as it says
        left.write_bytes(b"nobody's")
        os.utime(left, (hours_ago, hours_ago))
        gone = os.fork()
        if gone == 0:
            os._exit(0)
        os.waitpid(gone, 0)
        dead = spool / f".{'d' * 32}.safetensors.{HOST}.{gone}.tmp"
        dead.write_bytes(b"half a dump")
        watcher = Spool(spool, rescan_interval=3600)
        live = spool / f".{'a' * 32}.safetensors.{HOST}.{os.getpid()}.tmp"
        copying = spool / f".{'b' * 32}.safetensors.XyZ123"  # rsync's temp name: no writer in it
        for f in (live, copying):
            f.write_bytes(b"being written")
        assert _queued(watcher) == {left.name} and not dead.exists()
        left.unlink()  # as ingest moves it to rejected/
        for f in (live, copying):  # written on, and the wall clock stepped three hours ahead
            f.write_bytes(b"being written, more")
            os.utime(f, (hours_ago, hours_ago))
        assert _queued(watcher) == set()
        assert live.exists() and copying.exists()
        watcher.stop()
    finally:
        shutil.rmtree(spool, ignore_errors=True)
