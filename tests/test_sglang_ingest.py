"""The SGLang capture plugin's dumps, ingested by the real daemon.

SGLang cannot run here, so the daemon runs with `engine = "sglang"` and refuses to start the
server with a clear reason (SGLang is not installed); its ingest still runs. The plugin's real
code (Capture → split_extend_batch → DumpWriter) writes the dumps from tensors laid out as
SGLang's extend batches, for the daemon's own planned samples, stamped with its contract."""

from __future__ import annotations

import array

import pytest
import torch

from eagle3d.dataset import contract as capture_contract
from eagle3d.capture.engines.sglang.plugin import Capture, DumpWriter, ledger_loss_masks
from eagle3d.statemachine.config_validation import load_config
from eagle3d.statemachine.ledger import Ledger
from tests.conftest import write_conversations
from tests.pipeline import DaemonProcess

pytestmark = pytest.mark.slow


def extend_batch(requests: list[tuple[str, list[int]]], hidden: int, padding: int = 5):
    lens = torch.tensor([len(ids) for _, ids in requests], dtype=torch.int32)
    flat = torch.tensor([t for _, ids in requests for t in ids] + [0] * padding)
    g = torch.Generator().manual_seed(0)
    aux = [torch.randn(len(flat), hidden, generator=g).to(torch.bfloat16) for _ in range(3)]
    last = torch.randn(len(flat), hidden, generator=g).to(torch.bfloat16)
    return dict(forward_mode_is_extend=True, rids=[r for r, _ in requests],
                extend_seq_lens=lens,
                extend_prefix_lens=[0] * len(requests), input_ids=flat, aux_hidden=aux,
                last_hidden=last)


def test_plugin_dumps_are_ingested_by_the_daemon(config_factory, tmp_path):
    source = write_conversations(tmp_path / "conv.jsonl", 6)
    config = config_factory({"target": {"engine": "sglang"},
                             "data": {"source": str(source), "format": "messages", "limit": 6},
                             "sglang": {"python": "/usr/bin/python3"}})
    with DaemonProcess(config) as d:
        st = d.status_until(lambda s: s["stage"] == "failed", 300, "the engine refusal")
        assert "SGLang" in st["reason"] or "sglang" in st["reason"]
        cfg = load_config(config)
        contract = capture_contract.read(cfg.paths.dataset_dir)
        with Ledger(cfg.paths.state_dir / "ledger.sqlite", readonly=True) as ledger:
            samples = ledger.samples("pending")
            planned = ledger.plan_tokens([s.id for s in samples])
        requests = []
        for s in samples:
            ids = array.array("i")
            ids.frombytes(planned[s.id][0])
            requests.append((s.id, ids.tolist()))
        writer = DumpWriter(cfg.paths.spool_dir, contract["fingerprint"],
                            ledger_loss_masks(cfg.paths.state_dir / "ledger.sqlite"))
        capture = Capture(writer, num_layers=3, radix_cache_off=True, dump_dtype="bfloat16")
        hidden = contract["hidden_size"]
        assert capture.on_forward(**extend_batch(requests[:4], hidden)) == 4
        decode = extend_batch(requests[4:], hidden)
        decode["forward_mode_is_extend"] = False  # a decode step: never a dump
        assert capture.on_forward(**decode) == 0
        assert capture.on_forward(**extend_batch(requests[4:], hidden)) == 2
        writer.close()
        st = d.status_until(lambda s: s["samples"]["extracted"] == 6, 60, "ingest of 6 dumps")
        assert st["samples"]["pending"] == 0
    spool = cfg.paths.spool_dir
    assert not (spool / "rejected").exists() or not list((spool / "rejected").iterdir())
