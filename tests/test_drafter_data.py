"""The training data plan across ranks: every sample once per epoch, no rank short of a batch,
and batches read from the real SmolLM2 dumps: the same as the dumps hold, each rank its share,
a resume reading nothing before its place, host memory bounded whatever the dataset's size."""

from __future__ import annotations

import errno
import json
import os
import random
import shutil
import struct
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from drafter_fixtures import cached_dataset
from eagle3d.dataset import dumpformat
from eagle3d.drafter import data, reader
from eagle3d.statemachine import entry
from eagle3d.statemachine import manifest as manifest_mod
from eagle3d.statemachine.entry import DatasetChanged

# 37 samples of uneven lengths: batches of 1 to several samples, and a batch count that no
# world size below divides.
LENGTHS = [random.Random(7).randint(20, 900) for _ in range(37)]


@pytest.mark.parametrize("world", [1, 2, 3])
def test_ranks_share_the_epoch_without_duplicates_or_losses(world):
    for epoch in range(3):
        plan = data.plan_epoch(LENGTHS, 1024, seed=5, epoch=epoch, world=world)
        assert len(plan) == world
        assert len({len(batches) for batches in plan}) == 1  # collectives pair up
        trained = [i for batches in plan for b in batches if b.trained for i in b.indices]
        assert sorted(trained) == list(range(len(LENGTHS)))  # each sample exactly once
        fillers = [b for batches in plan for b in batches if not b.trained]
        assert len(fillers) < world  # only the last round is filled up
        assert all(b.indices == (LENGTHS.index(min(LENGTHS)),) for b in fillers)
        for batches in plan:  # fillers come last, where a fractional epoch is cut first
            flags = [b.trained for b in batches]
            assert flags == sorted(flags, reverse=True)


def test_the_world_size_only_deals_the_same_order():
    """Step s trains batches s·world … s·world + world - 1 of one order: a resume with another
    world size goes on from the same place in the epoch."""
    one = data.plan_epoch(LENGTHS, 1024, seed=5, epoch=1, world=1)[0]
    three = data.plan_epoch(LENGTHS, 1024, seed=5, epoch=1, world=3)
    dealt = [three[r][s] for s in range(len(three[0])) for r in range(3)]
    assert [b for b in dealt if b.trained] == one


@pytest.fixture(scope="module")
def samples():
    root = cached_dataset(32)
    manifest = manifest_mod.read(root / "dataset")
    return data.sample_paths(manifest, root / "dataset"), [s["tokens"] for s in
                                                           manifest["samples"]]


CPU = torch.device("cpu")


def as_read(paths: list[Path], plan, **kwargs) -> list[data.Batch]:
    return list(reader.batches(paths, plan, CPU, **kwargs))


def padded(paths: list[Path], planned: data.Planned, answers_only: bool = True) -> dict:
    """What the batch must hold: each dump as safetensors reads it, right-padded with zeros."""
    rows = [load_file(str(paths[i])) for i in planned.indices]
    T = max(r[dumpformat.INPUT_IDS].shape[0] for r in rows)
    want = {"input_ids": torch.zeros(len(rows), T, dtype=torch.int64),
            "aux": torch.zeros(len(rows), T, *rows[0][dumpformat.AUX].shape[1:],
                               dtype=rows[0][dumpformat.AUX].dtype),
            "last": torch.zeros(len(rows), T, *rows[0][dumpformat.LAST].shape[1:],
                                dtype=rows[0][dumpformat.LAST].dtype),
            "targets": torch.zeros(len(rows), T, dtype=torch.bool)}
    for b, r in enumerate(rows):
        n = r[dumpformat.INPUT_IDS].shape[0]
        want["input_ids"][b, :n] = r[dumpformat.INPUT_IDS]
        want["aux"][b, :n] = r[dumpformat.AUX]
        want["last"][b, :n] = r[dumpformat.LAST]
        if planned.trained:
            want["targets"][b, :n - 1] = (r[dumpformat.LOSS_MASK][1:].bool() if answers_only
                                          else True)
    return want


def assert_holds(batch: data.Batch, want: dict) -> None:
    for name, tensor in want.items():
        assert torch.equal(getattr(batch, name), tensor), name


def test_a_filler_is_read_but_trains_nothing(samples):
    paths, lengths = samples
    plan = data.plan_epoch(lengths, 4096, seed=0, epoch=0, world=len(lengths) + 1)
    filler = plan[-1][-1]
    assert not filler.trained
    batch, real = as_read(paths, [filler, data.Planned(filler.indices)])
    assert batch.tokens == 0 and not batch.targets.any()
    assert batch.input_ids.shape[1] == min(lengths)
    assert real.tokens == min(lengths) and real.targets.any()
    assert torch.equal(real.aux, batch.aux)


@pytest.mark.parametrize("ahead,readers", [(1, 1), (3, 2)])
def test_batches_hold_the_dumps_padded_in_plan_order_however_many_read_ahead(samples, ahead,
                                                                              readers):
    """The same batches as reading each dump and padding it: reused buffers leave nothing of
    an earlier batch behind, in the padding either."""
    paths, lengths = samples
    plan = data.plan_epoch(lengths, 1024, seed=0, epoch=0, world=1)[0]
    got = as_read(paths, plan, ahead=ahead, readers=readers)
    assert len(got) == len(plan)
    for planned, batch in zip(plan, got):
        assert batch.tokens == sum(lengths[i] for i in planned.indices)
        assert_holds(batch, padded(paths, planned))


def test_loss_on_every_position_counts_all_but_each_rows_last_and_never_padding(samples):
    """[train] loss_on = "all": the drafter learns the target's next token after prompt tokens
    too; padding and a row's last token (no next token) never count."""
    paths, lengths = samples
    planned = data.Planned(tuple(range(4)))
    answers, = as_read(paths, [planned])
    every, = as_read(paths, [planned], answers_only=False)
    assert_holds(every, padded(paths, planned, answers_only=False))
    assert every.tokens == answers.tokens
    assert answers.targets.sum() < every.targets.sum()
    assert not (answers.targets & ~every.targets).any()


def test_each_rank_reads_its_own_share_and_together_every_sample_once(samples):
    paths, lengths = samples
    world = 3
    seen: list[tuple[int, ...]] = []
    for rank_plan in data.plan_epoch(lengths, 1024, seed=2, epoch=0, world=world):
        for batch in as_read(paths, rank_plan):
            if batch.tokens:  # a filler trains nothing
                seen += [tuple(row[row.ne(0)].tolist()) for row in batch.input_ids]
    dumps = [tuple(load_file(str(p))[dumpformat.INPUT_IDS].tolist()) for p in paths]
    assert sorted(seen) == sorted(dumps)


def test_a_resume_skips_the_trained_batches_without_reading_them(samples, tmp_path):
    """The dumps of the batches before the resume's place are gone: nothing asks for them."""
    paths, lengths = samples
    plans = [data.plan_epoch(lengths, 1024, seed=0, epoch=e, world=1)[0] for e in range(2)]
    step = len(plans[0]) + 4  # the fifth batch of the second epoch
    assert data.position(plans, step) == (1, 4)
    later = plans[1][4:]
    needed = {i for planned in later for i in planned.indices}
    gone = [p if i in needed else tmp_path / "gone.safetensors" for i, p in enumerate(paths)]
    resumed = data.remaining(plans, step, len(later))
    got = as_read(gone, resumed)
    assert len(got) == len(later)
    for planned, batch in zip(later, got):
        assert_holds(batch, padded(paths, planned))


def test_a_damaged_dump_is_named_in_the_error(samples, tmp_path):
    paths, _ = samples
    cut = tmp_path / paths[0].name
    cut.write_bytes(paths[0].read_bytes()[:-100])
    with pytest.raises(dumpformat.DumpError, match=str(cut)):
        as_read([cut], [data.Planned((0,))])


def flip_bit_keeping_time(path: Path, offset: int) -> None:
    """Bit rot: one bit of the file flipped, its size and modification time as they were."""
    st = path.stat()
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([byte ^ 0x10]))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


def test_a_bit_flipped_since_verify_is_refused_naming_its_file_before_its_batch(tmp_path):
    """Every file read is checked against the checksum verify recorded: the real verified
    dataset reads whole, and in a copy with one bit of one dump's hidden states flipped (its
    size and time unchanged), the batches before it come and its own never does; the refusal
    names the file and its sample."""
    root = cached_dataset(32)
    manifest = manifest_mod.read(root / "dataset")
    recorded = [(s["id"], s["checksum"]) for s in manifest["samples"]]
    paths = data.sample_paths(manifest, root / "dataset")
    plan = [data.Planned((i,)) for i in range(len(paths))]
    assert len(as_read(paths, plan, recorded=recorded, ahead=3, readers=2)) == len(paths)

    copies = [tmp_path / p.name for p in paths]
    for path, copy in zip(paths, copies):
        shutil.copy2(path, copy)
    damaged = 5
    flip_bit_keeping_time(copies[damaged], copies[damaged].stat().st_size // 2)
    got = []
    with pytest.raises(DatasetChanged) as refused:
        for batch in reader.batches(copies, plan, CPU, recorded=recorded, ahead=3, readers=2):
            got.append(batch)
    assert len(got) == damaged
    sid = manifest["samples"][damaged]["id"]
    assert refused.value.samples == (sid,) and refused.value.code == entry.DATASET_CHANGED
    assert f"{copies[damaged]} (sample {sid}) changed since verify passed it" in \
        str(refused.value)


def test_a_symlink_in_place_of_a_dump_is_refused_naming_it(samples, tmp_path):
    """The reader opens a dump as the dump format's owner does: never through a symlink, which
    in a dataset folder could point at any file."""
    paths, _ = samples
    link = tmp_path / paths[0].name
    link.symlink_to(paths[0])
    with pytest.raises(OSError, match=str(link)) as refused:
        as_read([link], [data.Planned((0,))])
    assert refused.value.errno == errno.ELOOP


def test_a_folder_in_place_of_a_dump_is_named_in_the_error(tmp_path):
    folder = tmp_path / f"{0:032x}.safetensors"
    folder.mkdir()
    with pytest.raises(dumpformat.DumpError, match=f"{folder}: not a regular file"):
        as_read([folder], [data.Planned((0,))])


def test_a_header_longer_than_one_read_is_read_whole(tmp_path):
    """A header comes with one pread of dumpformat.HEAD bytes; a longer one (here a long
    contract string) with a second, for the reader and the owner's read_header alike."""
    tokens, hidden = 5, 8
    path = dumpformat.write_dump(tmp_path, f"{1:032x}", "c" * dumpformat.HEAD, {
        "input_ids": ("I32", (tokens,), torch.arange(tokens, dtype=torch.int32).numpy().tobytes()),
        "loss_mask": ("U8", (tokens,), b"\1" * tokens),
        "aux_hidden_states": ("BF16", (tokens, 3 * hidden), bytes(6 * hidden * tokens)),
        "last_hidden_state": ("BF16", (tokens, hidden), bytes(2 * hidden * tokens))})
    assert dumpformat.read_header(path).contract == "c" * dumpformat.HEAD
    batch, = as_read([path], [data.Planned((0,))])
    assert batch.input_ids.tolist() == [list(range(tokens))] and batch.tokens == tokens


def _dump_tensors(seed: int, tokens: int, hidden: int = 8) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {dumpformat.INPUT_IDS: torch.randint(1, 1000, (tokens,), generator=g, dtype=torch.int32),
            dumpformat.LOSS_MASK: torch.randint(0, 2, (tokens,), generator=g, dtype=torch.uint8),
            dumpformat.AUX: torch.randn(tokens, 3 * hidden, generator=g).bfloat16(),
            dumpformat.LAST: torch.randn(tokens, hidden, generator=g).bfloat16()}


def _stored(t: torch.Tensor) -> tuple[str, tuple[int, ...], bytes]:
    """A tensor as write_dump takes it: safetensors dtype, shape, raw bytes."""
    dtype = dumpformat.DTYPE_NAMES[str(t.dtype).removeprefix("torch.")]
    return dtype, tuple(t.shape), t.view(torch.uint8).numpy().tobytes()


def _metadata(sample_id: str, tensors: dict[str, torch.Tensor]) -> dict[str, str]:
    return {"format": dumpformat.FORMAT, "sample_id": sample_id, "contract": "c",
            "tokens": str(len(tensors[dumpformat.INPUT_IDS]))}


def _write_last_first(path: Path, sample_id: str, tensors: dict[str, torch.Tensor]) -> None:
    """A dump laid out last_hidden_state first and input_ids last, as a writer may."""
    header: dict = {"__metadata__": _metadata(sample_id, tensors)}
    offset, blobs = 0, []
    for name in reversed(dumpformat.TENSORS):
        dtype, shape, blob = _stored(tensors[name])
        header[name] = {"dtype": dtype, "shape": list(shape),
                        "data_offsets": [offset, offset + len(blob)]}
        offset += len(blob)
        blobs.append(blob)
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + b"".join(blobs))


def _file_order(path: Path) -> list[str]:
    tensors = dumpformat.read_header(path).tensors
    return sorted(tensors, key=lambda name: tensors[name].begin)


def test_dumps_whose_tensors_lie_in_other_orders_are_read_into_their_own_tensors(tmp_path):
    """The format does not fix the tensors' order in a file: safetensors' own writer sorts them
    by dtype (input_ids, the states, loss_mask), another writer may put last_hidden_state
    first. Each dump of a batch, whichever comes first, is read as safetensors reads it."""
    ids = [f"{k:032x}" for k in range(3)]
    tensors = [_dump_tensors(k, tokens) for k, tokens in enumerate((7, 5, 9))]
    paths = [dumpformat.write_dump(tmp_path, ids[0], "c",
                                   {name: _stored(t) for name, t in tensors[0].items()}),
             tmp_path / dumpformat.dump_name(ids[1]), tmp_path / dumpformat.dump_name(ids[2])]
    save_file(tensors[1], str(paths[1]), metadata=_metadata(ids[1], tensors[1]))
    _write_last_first(paths[2], ids[2], tensors[2])
    assert len({tuple(_file_order(p)) for p in paths}) == 3
    assert _file_order(paths[2])[0] == dumpformat.LAST
    for indices in ((0, 1, 2), (2, 1, 0), (1, 0, 2)):
        planned = data.Planned(indices)
        batch, = as_read(paths, [planned])
        assert_holds(batch, padded(paths, planned))


MEMORY_PROBE = textwrap.dedent("""
    import resource, sys
    from pathlib import Path
    import torch
    from eagle3d.drafter import data, reader
    paths = sorted(Path(sys.argv[1]).glob("*.safetensors"))
    plan = [data.Planned((i,)) for i in range(len(paths))]
    list(reader.batches(paths, plan[:2], torch.device("cpu"), ahead=2))  # warm: imports, pools
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    total = 0.0
    for batch in reader.batches(paths, plan, torch.device("cpu"), ahead=int(sys.argv[2])):
        total += float(batch.aux[0, 0, 0])  # the batch is used, as a step would
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print((after - before) * 1024)
""")


def test_host_memory_stays_at_the_read_ahead_on_a_dataset_many_times_larger(tmp_path):
    """A dataset 8x the read-ahead bound, read in a process of its own: its peak resident
    memory grows by at most the bound (the slots, plus the batch in use and the one before
    on CPU) and a margin, whatever the dataset's size."""
    tokens, hidden, ahead = 1024, 256, 2
    sample = dumpformat.bytes_per_token(hidden, "bfloat16") * tokens  # ~2 MiB
    bound = (ahead + 2) * sample
    count = 8 * bound // sample
    g = torch.Generator().manual_seed(0)
    for n in range(count):
        ids = torch.randint(0, 1000, (tokens,), dtype=torch.int32, generator=g)
        dumpformat.write_dump(tmp_path, f"{n:032x}", "fp", {
            "input_ids": ("I32", (tokens,), ids.numpy().tobytes()),
            "loss_mask": ("U8", (tokens,), b"\1" * tokens),
            "aux_hidden_states": ("BF16", (tokens, 3 * hidden), bytes(6 * hidden * tokens)),
            "last_hidden_state": ("BF16", (tokens, hidden), bytes(2 * hidden * tokens))})
    dataset = sum(p.stat().st_size for p in tmp_path.iterdir())
    assert dataset >= 8 * bound
    out = subprocess.run([sys.executable, "-c", MEMORY_PROBE, str(tmp_path), str(ahead)],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    grown = int(out.stdout.split()[-1])
    assert grown < bound + 4 * 2**20, (grown, bound, dataset)
