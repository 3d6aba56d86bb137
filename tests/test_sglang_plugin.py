"""The capture plugin's real code path, from forward-batch tensors laid out as SGLang lays them out
(ForwardBatch.input_ids / extend_start_loc / extend_seq_lens / extend_prefix_lens_cpu / rids, and
the hidden states LogitsProcessor.forward receives) to dump files in a spool, with loss masks from
a real ledger. SGLang itself cannot run here; these batches stand in for its forward passes.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from eagle3d.capture import dumpformat
from eagle3d.capture.sglang_plugin import (Capture, CaptureError, CaptureSettings, DumpWriter,
                                           ledger_loss_masks, split_extend_batch)
from eagle3d.statemachine.ledger import Ledger, PlannedSample

HIDDEN = 16
VOCAB = 300
CONTRACT = "f" * 32


def sample_id(ids: list[int]) -> str:
    return hashlib.blake2b(torch.tensor(ids, dtype=torch.int32).numpy().tobytes(),
                           digest_size=16).hexdigest()


def loss_mask(ids: list[int]) -> bytes:
    return bytes((i * 7 + t) % 2 for i, t in enumerate(ids))


def plan(state_dir: Path, samples: list[list[int]]) -> Path:
    """A real ledger holding these token lists as planned samples."""
    path = state_dir / "ledger.sqlite"
    planned = []
    for idx, ids in enumerate(samples):
        raw = torch.tensor(ids, dtype=torch.int32).numpy().tobytes()
        mask = loss_mask(ids)
        planned.append(PlannedSample(sample_id(ids), idx, len(ids), sum(mask),
                                     dumpformat.ids_hash(raw), raw, mask))
    with Ledger(path) as ledger:
        ledger.add_planned(planned, [], {})
    return path


def hidden_table(seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(VOCAB, HIDDEN, generator=g).to(torch.bfloat16)


def states(ids: torch.Tensor, table: torch.Tensor) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Stand-in hidden states: row-wise functions of the token, so a row that lands in the wrong
    request or position shows. Three aux layers and a final state."""
    emb = table[ids]
    return [emb + 1, emb * 3, emb - 2], emb * 2


def extend_batch(requests: list[tuple[str, list[int]]], table: torch.Tensor, padding: int = 3,
                 packed: bool = False, prefix: list[int] | None = None) -> dict:
    """One EXTEND batch as SGLang builds it: requests' tokens end to end, then padding rows."""
    lens = torch.tensor([len(ids) for _, ids in requests], dtype=torch.int32)
    starts = torch.zeros_like(lens)
    starts[1:] = torch.cumsum(lens[:-1], dim=0)
    flat = torch.tensor([t for _, ids in requests for t in ids] + [0] * padding)
    aux, last = states(flat, table)
    return {"forward_mode_is_extend": True, "rids": [r for r, _ in requests],
            "extend_start_loc": starts, "extend_seq_lens": lens,
            "extend_prefix_lens": prefix if prefix is not None else [0] * len(requests),
            "input_ids": flat, "aux_hidden": torch.cat(aux, dim=-1) if packed else aux,
            "last_hidden": last}


def decode_batch(rids: list[str], table: torch.Tensor) -> dict:
    """One DECODE step: one new token per request, no extend fields."""
    flat = torch.tensor([5] * len(rids))
    aux, last = states(flat, table)
    return {"forward_mode_is_extend": False, "rids": rids, "extend_start_loc": None,
            "extend_seq_lens": None, "extend_prefix_lens": None, "input_ids": flat,
            "aux_hidden": aux, "last_hidden": last}


def check_dump(path: Path, ids: list[int], table: torch.Tensor) -> None:
    header = dumpformat.read_header(path)
    assert header.sample_id == sample_id(ids) and header.tokens == len(ids)
    assert header.contract == CONTRACT and header.dtype == "BF16"
    t = load_file(str(path))
    aux, last = states(torch.tensor(ids), table)
    assert t["input_ids"].tolist() == ids
    assert bytes(t["loss_mask"].tolist()) == loss_mask(ids)
    assert torch.equal(t["aux_hidden_states"], torch.cat(aux, dim=-1))
    assert torch.equal(t["last_hidden_state"], last)


REQUESTS = [[11, 12, 13, 14, 15], [200], [7, 8, 9, 10, 11, 12, 13], [42, 43]]


@pytest.mark.parametrize("packed", [False, True])
def test_split_gives_each_request_its_own_rows(packed):
    table = hidden_table()
    batch = extend_batch([(sample_id(ids), ids) for ids in REQUESTS], table, packed=packed)
    slices = split_extend_batch(**batch)
    assert [s.rid for s in slices] == [sample_id(ids) for ids in REQUESTS]
    for s, ids in zip(slices, REQUESTS):
        aux, last = states(torch.tensor(ids), table)
        assert s.input_ids.tolist() == ids
        assert torch.equal(s.aux_hidden, torch.cat(aux, dim=-1))
        assert torch.equal(s.last_hidden, last)


def test_split_ignores_decode_and_refuses_inconsistent_batches():
    table = hidden_table()
    assert split_extend_batch(**decode_batch(["a" * 32], table)) == []
    batch = extend_batch([("a" * 32, [1, 2, 3]), ("b" * 32, [4, 5])], table, padding=0)
    batch["last_hidden"] = batch["last_hidden"][:4]  # sharded or pruned: fewer rows than tokens
    with pytest.raises(CaptureError, match="5 tokens"):
        split_extend_batch(**batch)
    batch = extend_batch([("a" * 32, [1, 2, 3])], table)
    batch["rids"] = ["a" * 32, "b" * 32]
    with pytest.raises(CaptureError, match="2 request ids, 1 start"):
        split_extend_batch(**batch)
    batch = extend_batch([("a" * 32, [1, 2, 3])], table)
    batch["aux_hidden"] = None
    with pytest.raises(CaptureError, match="no aux hidden states"):
        split_extend_batch(**batch)


def test_capture_writes_one_dump_per_planned_request_and_ignores_decode(tmp_path):
    table = hidden_table()
    spool = tmp_path / "spool"
    spool.mkdir()
    cached = [1, 2, 3, 4]
    ledger = plan(tmp_path, REQUESTS + [cached])
    writer = DumpWriter(spool, CONTRACT, ledger_loss_masks(ledger))
    capture = Capture(writer, num_layers=3)
    # Beside the samples: SGLang's own health check and a warm-up whose uuid looks like an id.
    others = [("HEALTH_CHECK_0f1e", [3, 4]), ("0123456789abcdef0123456789abcdef", [9, 9, 9])]
    requests = [(sample_id(ids), ids) for ids in REQUESTS] + others
    assert capture.on_forward(**extend_batch(requests, table)) == len(REQUESTS) + 1
    # A prefill that found part of its prompt cached covers only the rest: no dump.
    assert capture.on_forward(**extend_batch([(sample_id(cached), cached[2:])], table,
                                             prefix=[2])) == 0
    writer.flush()
    names = sorted(p.name for p in spool.iterdir())
    assert names == sorted(dumpformat.dump_name(sample_id(ids)) for ids in REQUESTS)
    before = {n: (spool / n).read_bytes() for n in names}
    # The same requests decoding a token afterwards must not touch their dumps.
    assert capture.on_forward(**decode_batch([r for r, _ in requests], table)) == 0
    writer.flush()
    assert {n: (spool / n).read_bytes() for n in names} == before
    for ids in REQUESTS:
        check_dump(spool / dumpformat.dump_name(sample_id(ids)), ids, table)
    assert writer.written == len(REQUESTS)
    writer.close()


def test_capture_refuses_a_model_that_captures_other_layers(tmp_path):
    table = hidden_table()
    writer = DumpWriter(tmp_path, CONTRACT, lambda sid: None)
    batch = extend_batch([("a" * 32, [1, 2, 3])], table)
    batch["aux_hidden"] = batch["aux_hidden"][:2]
    with pytest.raises(CaptureError, match="captured 2 layers, the contract names 3"):
        Capture(writer, num_layers=3).on_forward(**batch)
    writer.close()


def test_settings_travel_through_the_environment(tmp_path):
    settings = CaptureSettings(tmp_path / "spool", CONTRACT, (2, 30, 58), tmp_path / "l.sqlite")
    assert CaptureSettings.from_env(settings.to_env()) == settings
    assert CaptureSettings.from_env({}) is None  # a server eagle3d did not start: left alone
    with pytest.raises(CaptureError, match="EAGLE3D_LAYER_IDS"):
        CaptureSettings.from_env({**settings.to_env(), "EAGLE3D_LAYER_IDS": "2;30"})
