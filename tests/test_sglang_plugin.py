"""The capture plugin's real code path, from forward-batch tensors laid out as SGLang lays them out
(ForwardBatch.input_ids / extend_seq_lens_cpu / extend_prefix_lens_cpu / rids, and
the hidden states LogitsProcessor.forward receives) to dump files in a spool, with loss masks from
a real ledger. SGLang itself cannot run here; these batches stand in for its forward passes.
"""

from __future__ import annotations

import hashlib
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

from eagle3d.dataset import dumpformat, precision
from eagle3d.capture.engines.sglang.plugin import (HANDSHAKE_FILE, Capture, CaptureError,
                                           CaptureSettings, DumpWriter, HostBatch, check_layers,
                                           handshake_problem, ledger_loss_masks, prepare,
                                           read_handshake, request_id, split_extend_batch)
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
    flat = torch.tensor([t for _, ids in requests for t in ids] + [0] * padding)
    aux, last = states(flat, table)
    return {"forward_mode_is_extend": True, "rids": [r for r, _ in requests],
            "extend_seq_lens": lens,
            "extend_prefix_lens": prefix if prefix is not None else [0] * len(requests),
            "input_ids": flat, "aux_hidden": torch.cat(aux, dim=-1) if packed else aux,
            "last_hidden": last}


def decode_batch(rids: list[str], table: torch.Tensor) -> dict:
    """One DECODE step: one new token per request, no extend fields."""
    flat = torch.tensor([5] * len(rids))
    aux, last = states(flat, table)
    return {"forward_mode_is_extend": False, "rids": rids, "extend_seq_lens": None, "extend_prefix_lens": None, "input_ids": flat,
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
    slices = split_extend_batch(**batch, dump_dtype="bfloat16").slices
    assert [s.rid for s in slices] == [sample_id(ids) for ids in REQUESTS]
    for s, ids in zip(slices, REQUESTS):
        aux, last = states(torch.tensor(ids), table)
        assert s.input_ids.tolist() == ids
        assert torch.equal(s.states[dumpformat.AUX], torch.cat(aux, dim=-1))
        assert torch.equal(s.states[dumpformat.LAST], last)


def test_split_ignores_decode_and_refuses_inconsistent_batches():
    table = hidden_table()
    assert split_extend_batch(**decode_batch(["a" * 32], table),
                              dump_dtype="bfloat16").slices == []
    batch = extend_batch([("a" * 32, [1, 2, 3]), ("b" * 32, [4, 5])], table, padding=0)
    batch["last_hidden"] = batch["last_hidden"][:4]  # sharded or pruned: fewer rows than tokens
    with pytest.raises(CaptureError, match="5 tokens"):
        split_extend_batch(**batch, dump_dtype="bfloat16")
    batch = extend_batch([("a" * 32, [1, 2, 3])], table)
    batch["rids"] = ["a" * 32, "b" * 32]
    with pytest.raises(CaptureError, match="2 request ids, 1 lengths"):
        split_extend_batch(**batch, dump_dtype="bfloat16")
    batch = extend_batch([("a" * 32, [1, 2, 3])], table)
    batch["aux_hidden"] = None
    with pytest.raises(CaptureError, match="no aux hidden states"):
        split_extend_batch(**batch, dump_dtype="bfloat16")


def test_capture_writes_one_dump_per_planned_request_and_ignores_decode(tmp_path):
    table = hidden_table()
    spool = tmp_path / "spool"
    spool.mkdir()
    cached = [1, 2, 3, 4]
    ledger = plan(tmp_path, REQUESTS + [cached])
    writer = DumpWriter(spool, CONTRACT, ledger_loss_masks(ledger))
    capture = Capture(writer, num_layers=3, radix_cache_off=True, dump_dtype="bfloat16")
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


def test_only_requests_carrying_the_starts_request_key_are_dumped(tmp_path):
    """Any local user can reach the server's port: a request for a planned sample without this
    start's request key (or with another's) writes nothing; the daemon's, with it, write the
    sample's dump under its own name."""
    table = hidden_table()
    spool = tmp_path / "spool"
    spool.mkdir()
    key = "k" * 32
    writer = DumpWriter(spool, CONTRACT, ledger_loss_masks(plan(tmp_path, REQUESTS)), key)
    capture = Capture(writer, num_layers=3, radix_cache_off=True, dump_dtype="bfloat16")
    foreign = [(sample_id(ids), ids) for ids in REQUESTS] + \
        [(request_id("j" * 32, sample_id(ids)), ids) for ids in REQUESTS]
    assert capture.on_forward(**extend_batch(foreign, table)) == 0
    ours = [(request_id(key, sample_id(ids)), ids) for ids in REQUESTS]
    assert capture.on_forward(**extend_batch(ours, table)) == len(REQUESTS)
    writer.flush()
    for ids in REQUESTS:
        check_dump(spool / dumpformat.dump_name(sample_id(ids)), ids, table)
    assert writer.written == len(REQUESTS)
    writer.close()


def test_writer_writes_a_batch_only_once_its_copy_has_arrived(tmp_path):
    """On a GPU the rows reach the host behind the forward (the copy is only queued): the writer
    must wait for the copy's event, and the forward must not wait at all."""
    table = hidden_table()
    spool = tmp_path / "spool"
    spool.mkdir()
    writer = DumpWriter(spool, CONTRACT, ledger_loss_masks(plan(tmp_path, REQUESTS)))
    batch = split_extend_batch(**extend_batch([(sample_id(ids), ids) for ids in REQUESTS],
                                              table), dump_dtype="bfloat16")
    copied = threading.Event()
    writer.put(HostBatch(batch.slices, copied.wait))  # returns at once: nothing waits here
    time.sleep(0.3)
    assert list(spool.iterdir()) == []  # the rows have not arrived: nothing is written
    copied.set()
    writer.flush()
    for ids in REQUESTS:
        check_dump(spool / dumpformat.dump_name(sample_id(ids)), ids, table)
    writer.close()


def test_capture_writes_fp8_dumps_that_dequantize_to_the_states(tmp_path):
    table = hidden_table()
    spool = tmp_path / "spool"
    spool.mkdir()
    writer = DumpWriter(spool, CONTRACT, ledger_loss_masks(plan(tmp_path, REQUESTS)))
    capture = Capture(writer, num_layers=3, radix_cache_off=True, dump_dtype="float8_e4m3fn")
    requests = [(sample_id(ids), ids) for ids in REQUESTS]
    assert capture.on_forward(**extend_batch(requests, table)) == len(REQUESTS)
    writer.flush()
    for ids in REQUESTS:
        path = spool / dumpformat.dump_name(sample_id(ids))
        header = dumpformat.read_header(path)
        assert header.dtype == "F8_E4M3" and header.tokens == len(ids)
        assert header.tensors[dumpformat.AUX_SCALE].shape == (len(ids), 3)
        stored = load_file(str(path))
        assert stored["input_ids"].tolist() == ids
        aux, last = precision.decode_states(stored)
        want_aux, want_last = states(torch.tensor(ids), table)
        for got, want, scale in ((aux, torch.cat(want_aux, dim=-1), dumpformat.AUX_SCALE),
                                 (last, want_last, dumpformat.LAST_SCALE)):
            got, want = got.float(), want.float()
            row_scale = stored[scale].repeat_interleave(HIDDEN, dim=-1)
            # e4m3's rounding (2^-10 of the scale in its subnormal range), then bf16's.
            bound = 2 ** -4 * want.abs() + 2 ** -10 * row_scale + 2 ** -8 * got.abs()
            assert ((got - want).abs() <= bound).all()
            assert not torch.equal(got, want)  # quantized, not stored as is
    writer.close()


def test_capture_refuses_a_model_that_captures_other_layers(tmp_path):
    table = hidden_table()
    writer = DumpWriter(tmp_path, CONTRACT, lambda sid: None)
    batch = extend_batch([("a" * 32, [1, 2, 3])], table)
    batch["aux_hidden"] = batch["aux_hidden"][:2]
    with pytest.raises(CaptureError, match="captured 2 layers, the contract names 3"):
        Capture(writer, num_layers=3, radix_cache_off=True,
                dump_dtype="bfloat16").on_forward(**batch)
    writer.close()


def test_settings_travel_through_the_environment(tmp_path):
    settings = CaptureSettings(tmp_path / "spool", CONTRACT, (2, 30, 58), tmp_path / "l.sqlite",
                               "float8_e4m3fn")
    assert CaptureSettings.from_env(settings.to_env()) == settings
    assert CaptureSettings.from_env({}) is None  # a server eagle3d did not start: left alone
    with pytest.raises(CaptureError, match="EAGLE3D_LAYER_IDS"):
        CaptureSettings.from_env({**settings.to_env(), "EAGLE3D_LAYER_IDS": "2;30"})


# ---- the load-model hook's checks, the ready file, the zero-prefix rule --------------------------

class ServerArgs:
    """The fields of SGLang's ServerArgs the plugin reads, as the launcher's command sets them."""

    def __init__(self, **changes) -> None:
        self.tp_size, self.pp_size, self.attn_cp_size = 1, 1, 1
        self.disable_radix_cache, self.chunked_prefill_size = True, -1
        self.enable_dp_attention = self.enable_prefill_cp = self.enable_mixed_chunk = False
        self.enable_layernorm_sp = self.enable_attn_tp_input_scattered = False
        self.enable_two_batch_overlap = self.enable_return_aux_hidden_states = False
        self.speculative_algorithm = None
        self.model_path, self.dtype = "/nonexistent/model", "bfloat16"
        self.cuda_graph_config = SimpleNamespace(prefill=SimpleNamespace(backend="disabled"))
        self.__dict__.update(changes)


class LlamaForCausalLM:
    """What SGLang's llama.py does with the ids it is given: layers_to_capture = ids + 1."""

    def __init__(self) -> None:
        self.model = SimpleNamespace(layers_to_capture=[])

    def set_eagle3_layers_to_capture(self, ids: list[int]) -> None:
        self.model.layers_to_capture = [i + 1 for i in ids]


def settings(tmp_path: Path, token: str = "t1") -> CaptureSettings:
    return CaptureSettings(tmp_path / "spool", CONTRACT, (2, 16, 29), plan(tmp_path, REQUESTS),
                           "bfloat16", token)


REFUSED = {
    "attention data parallelism": ({"enable_dp_attention": True}, 2),
    "attention context parallelism": ({"attn_cp_size": 2}, 1),
    "context parallelism of prefill": ({"enable_prefill_cp": True}, 1),
    "sequence-parallel norms": ({"enable_layernorm_sp": True}, 1),
    "scattered": ({"enable_attn_tp_input_scattered": True}, 1),
    "radix cache": ({"disable_radix_cache": False}, 1),
    "chunked prefill": ({"chunked_prefill_size": 8192}, 1),
    "prefill CUDA graphs": ({"cuda_graph_config": SimpleNamespace(
        prefill=SimpleNamespace(backend="breakable"))}, 1),
    "pipeline parallelism": ({"pp_size": 2}, 1),
    "speculative decoding": ({"speculative_algorithm": "EAGLE3"}, 1),
    "aux hidden states returned": ({"enable_return_aux_hidden_states": True}, 1),
}


@pytest.mark.parametrize("what", REFUSED)
def test_the_load_model_hook_refuses_what_it_cannot_capture(tmp_path, what):
    changes, attn_dp_size = REFUSED[what]
    with pytest.raises(CaptureError, match="cannot run in this SGLang configuration") as err:
        prepare(settings(tmp_path), LlamaForCausalLM(), ServerArgs(**changes), 0, attn_dp_size,
                "0.5.17")
    assert what.split()[0] in str(err.value)
    assert not (tmp_path / "spool" / HANDSHAKE_FILE).exists()  # so the daemon never says ready


def test_attention_dp_is_refused_even_when_only_the_group_size_shows_it(tmp_path):
    # A model override (DeepSeek's prefill CP) can turn attention-DP on behind the flags.
    with pytest.raises(CaptureError, match="attention-DP size 4"):
        prepare(settings(tmp_path), LlamaForCausalLM(), ServerArgs(), 0, 4, "0.5.17")


def test_rank_0_reports_ready_with_what_it_read_back(tmp_path):
    s = settings(tmp_path)
    capture = prepare(s, LlamaForCausalLM(), ServerArgs(tp_size=2), 0, 1, "0.5.17")
    assert capture is not None and capture.radix_cache_off
    found = read_handshake(s.spool, "t1")
    assert found["layers"] == [2, 16, 29] and found["sglang"] == "0.5.17"
    assert found["tp_size"] == 2 and found["attn_dp_size"] == 1 and found["pid"] > 0
    assert found["model_path"] == "/nonexistent/model" and found["dtype"] == "bfloat16"
    wanted = {"fingerprint": CONTRACT, "layer_ids": [2, 16, 29], "dtype": "bfloat16",
              "target_fingerprint": found["target_fingerprint"]}
    assert handshake_problem(found, wanted, tp=2) is None
    assert "tp=2" in handshake_problem(found, wanted, tp=1)
    assert "computes in bfloat16, the capture contract says float16" in handshake_problem(
        found, {**wanted, "dtype": "float16"}, tp=2)
    assert "is not the model this dataset was captured with" in handshake_problem(
        found, {**wanted, "target_fingerprint": "0" * 32}, tp=2)
    assert read_handshake(s.spool, "another start") is None  # a stale file is not this start's
    assert prepare(s, LlamaForCausalLM(), ServerArgs(tp_size=2), 1, 1, "0.5.17") is None
    capture.writer.close()


def test_a_model_that_ignores_the_layers_stops_the_server(tmp_path):
    class Stubborn(LlamaForCausalLM):
        def set_eagle3_layers_to_capture(self, ids: list[int]) -> None:
            self.model.layers_to_capture = [2, 16, 30]  # e.g. ids from a draft config
    s = settings(tmp_path)
    with pytest.raises(CaptureError, match=r"captures the inputs of layers \[2, 16, 30\]"):
        prepare(s, Stubborn(), ServerArgs(), 0, 1, "0.5.17")
    model = LlamaForCausalLM()
    capture = prepare(s, model, ServerArgs(), 0, 1, "0.5.17")
    model.model.layers_to_capture = [1, 2, 3]  # re-set after load: the first forward's re-read
    with pytest.raises(CaptureError, match=r"\[1, 2, 3\]"):
        check_layers(model, (2, 16, 29))
    capture.writer.close()


def test_missing_prefix_lengths_are_zero_only_with_the_radix_cache_off(tmp_path):
    table = hidden_table()
    spool = tmp_path / "spool"
    spool.mkdir()
    writer = DumpWriter(spool, CONTRACT, ledger_loss_masks(plan(tmp_path, REQUESTS)))
    batch = extend_batch([(sample_id(ids), ids) for ids in REQUESTS], table)
    batch["extend_prefix_lens"] = None  # as on SGLang's GPU-only path
    with pytest.raises(CaptureError, match="radix cache is on"):
        Capture(writer, 3, radix_cache_off=False, dump_dtype="bfloat16").on_forward(**batch)
    assert Capture(writer, 3, radix_cache_off=True,
                   dump_dtype="bfloat16").on_forward(**batch) == len(REQUESTS)
    writer.close()


@pytest.fixture
def full_tmpfs(tmpfs):
    """A real small tmpfs, filled to its last byte by someone else."""
    from tests.pipeline import fill_file_system
    mount = tmpfs("small-spool", "1m")
    (mount / "sglang").mkdir()  # the plugin's folder, made at its start
    fill_file_system(mount)
    return mount


def test_a_dump_the_full_spool_cannot_hold_reaches_the_daemon_as_a_disk_event(tmp_path,
                                                                             full_tmpfs):
    """ENOSPC in the plugin's writer: no partial dump, and the daemon reads which sample and why
    at its next look (not after [extract] inflight_timeout_s), once."""
    from eagle3d.capture.engines.sglang.plugin import failed_writes
    table = hidden_table()
    writer = DumpWriter(full_tmpfs, CONTRACT, ledger_loss_masks(plan(tmp_path, REQUESTS)))
    capture = Capture(writer, num_layers=3, radix_cache_off=True, dump_dtype="bfloat16")
    requests = [(sample_id(ids), ids) for ids in REQUESTS]
    assert capture.on_forward(**extend_batch(requests, table)) == len(REQUESTS)
    writer.flush()
    assert writer.written == 0
    assert not [p for p in full_tmpfs.iterdir() if p.name.endswith(dumpformat.SUFFIX)]
    assert sorted(failed_writes(full_tmpfs)) == sorted((sid, "disk_full") for sid, _ in requests)
    assert failed_writes(full_tmpfs) == []
    writer.close()
