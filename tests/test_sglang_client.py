"""The SGLang client against a real HTTP server on 127.0.0.1 that behaves like SGLang's: /health
answers 503 while starting, /generate takes input_ids + rid + max_new_tokens=0, requests that
arrive together are prefilled as one EXTEND batch, and every batch is followed by a DECODE step.
Each forward goes through the real capture plugin (Capture, DumpWriter, ledger loss masks), so
the dumps in the spool come out of the same code path as inside SGLang."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from eagle3d.dataset import dumpformat
from eagle3d.capture.engines.sglang.client import SGLangClient, check_serves, healthy
from eagle3d.capture.engines.sglang.handle import deliver_redirected
from eagle3d.capture.engines.sglang.plugin import (SPOT_FOLDER, Capture, DumpWriter,
                                                   ledger_loss_masks)
from eagle3d.capture.engines.sglang.spec import SPOT_PREFIX
from test_sglang_plugin import (CONTRACT, check_dump, decode_batch, extend_batch, hidden_table,
                                plan, sample_id)

CONTEXT_LENGTH = 40
BATCH_WINDOW_S = 0.1


class FakeSGLang:
    """The scheduler part: pending requests are prefilled together, like SGLang's batches."""

    def __init__(self, capture: Capture) -> None:
        self.capture = capture
        self.table = hidden_table()
        self.batch_sizes: list[int] = []
        self.health_calls = 0
        self._pending: list[tuple[str, list[int], threading.Event]] = []
        self.failure: str | None = None
        self._lock = threading.Lock()
        self._wake = threading.Event()
        threading.Thread(target=self._schedule, daemon=True).start()

    def prefill(self, rid: str, ids: list[int]) -> str | None:
        """Returns what went wrong in the forward, if anything (SGLang answers 500 then)."""
        done = threading.Event()
        with self._lock:
            self._pending.append((rid, ids, done))
        self._wake.set()
        return self.failure if done.wait(30.0) else "forward timed out"

    def _schedule(self) -> None:
        while self._wake.wait():
            time.sleep(BATCH_WINDOW_S)  # let concurrent requests join the batch
            with self._lock:
                batch, self._pending = self._pending, []
                self._wake.clear()
            requests = [(rid, ids) for rid, ids, _ in batch]
            try:
                self.capture.on_forward(**extend_batch(requests, self.table))
                self.capture.on_forward(**decode_batch([rid for rid, _ in requests], self.table))
            except Exception as exc:
                self.failure = repr(exc)
            self.batch_sizes.append(len(batch))
            for *_, done in batch:
                done.set()


def serve(fake: FakeSGLang) -> ThreadingHTTPServer:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def reply(self, code: int, body: dict | None = None) -> None:
            raw = json.dumps(body or {}).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(raw)))
            self.end_headers()
            self.wfile.write(raw)

        def do_GET(self):
            if self.path == "/get_model_info":
                return self.reply(200, {"model_path": "/models/served"})
            if self.path != "/health":
                return self.reply(404)
            fake.health_calls += 1
            self.reply(503 if fake.health_calls == 1 else 200)  # the first: still starting

        def do_POST(self):
            req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            ids, rid = req.get("input_ids"), req.get("rid")
            if self.path != "/generate" or req["sampling_params"] != {"max_new_tokens": 0}:
                return self.reply(400, {"error": {"message": "unexpected request"}})
            if len(ids) > CONTEXT_LENGTH:
                return self.reply(400, {"error": {"message": f"The input ({len(ids)} tokens) is "
                                                  f"longer than the model's context length "
                                                  f"({CONTEXT_LENGTH} tokens)."}})
            failure = fake.prefill(rid, ids)
            if failure:
                return self.reply(500, {"error": {"message": failure}})
            self.reply(200, {"text": "", "output_ids": [],
                             "meta_info": {"id": rid, "prompt_tokens": len(ids),
                                           "completion_tokens": 0}})

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def wait_events(client: SGLangClient, n: int, timeout: float = 30.0) -> list[dict]:
    events: list[dict] = []
    deadline = time.monotonic() + timeout
    while len(events) < n and time.monotonic() < deadline:
        events += client.poll()
        time.sleep(0.02)
    return events


@pytest.fixture
def spool(tmp_path: Path) -> Path:
    path = tmp_path / "spool"
    path.mkdir()
    return path


def test_samples_become_dumps_through_batched_prefills(tmp_path, spool):
    samples = [[(7 * i + j) % 250 for j in range(5 + 3 * i)] for i in range(8)]
    too_long = list(range(CONTEXT_LENGTH + 1))
    key = "k" * 32  # the server's request key: the dumps are named by sample ids all the same
    writer = DumpWriter(spool, CONTRACT, ledger_loss_masks(plan(tmp_path, samples + [too_long])),
                        key)
    fake = FakeSGLang(Capture(writer, num_layers=3, radix_cache_off=True, dump_dtype="bfloat16"))
    server = serve(fake)
    client = SGLangClient(f"http://127.0.0.1:{server.server_address[1]}/", max_concurrency=4,
                          api_key="a", request_key=key)
    try:
        assert not healthy(client.base_url, timeout=2.0)  # 503 while starting
        assert healthy(client.base_url, timeout=2.0)
        client.submit([(sample_id(ids), ids) for ids in samples + [too_long]])
        events = wait_events(client, len(samples) + 1)
        writer.flush()
    finally:
        client.close()
        server.shutdown()
    done = {e["ids"][0]: e for e in events if e["event"] == "done"}
    errors = [e for e in events if e["event"] == "error"]
    assert set(done) == {sample_id(ids) for ids in samples}
    assert all(done[sample_id(ids)]["tokens"] == len(ids) for ids in samples)
    # Each answer says how long it took: the first request waited out a whole batching window
    # (one that joined a batch late waits less: asserting the window for all of them was a race).
    assert max(e["seconds"] for e in done.values()) >= BATCH_WINDOW_S
    assert all(0 < e["seconds"] < 30 for e in done.values())
    assert [e["ids"] for e in errors] == [[sample_id(too_long)]]
    assert "HTTP 400" in errors[0]["error"] and "context length" in errors[0]["error"]
    # Requests were in flight together (the pool bounds them to 4) and shared prefills.
    assert max(fake.batch_sizes) > 1 and max(fake.batch_sizes) <= 4
    assert sorted(p.name for p in spool.iterdir()) == sorted(
        dumpformat.dump_name(sample_id(ids)) for ids in samples)
    for ids in samples:
        check_dump(spool / dumpformat.dump_name(sample_id(ids)), ids, fake.table)
    writer.close()


def test_a_server_that_loaded_another_model_path_is_refused():
    """The generator checks the weights of its config's target, then asks the server which
    model it loaded: another path (another server on the port, another config) is refused."""
    from eagle3d.statemachine.entry import ContractMismatch
    server = serve(FakeSGLang(None))
    url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        check_serves(url, "/models/served", "a")
        with pytest.raises(ContractMismatch, match="loaded /models/served, not the target "
                                                   "/models/checked"):
            check_serves(url, "/models/checked", "a")
    finally:
        server.shutdown()
    with pytest.raises(ContractMismatch, match="does not say which model it loaded"):
        check_serves("http://127.0.0.1:9", "/models/served", "a")  # the discard port: refused


def test_a_server_that_is_not_there_yields_errors_not_hangs():
    client = SGLangClient("http://127.0.0.1:9", max_concurrency=2, api_key="a")  # discard port
    assert not healthy(client.base_url, timeout=1.0)
    client.submit([("a" * 32, [1, 2, 3])])
    events = wait_events(client, 1, timeout=10.0)
    client.close()
    assert [e["event"] for e in events] == ["error"]
    assert events[0]["ids"] == ["a" * 32] and "request to SGLang failed" in events[0]["error"]
    with pytest.raises(RuntimeError, match="closed"):
        client.submit([("b" * 32, [1])])


def test_a_spot_check_gets_its_dumps_where_it_asked_not_in_the_spool(tmp_path, spool):
    """The daemon's spot check re-extracts verified samples into a folder of its own; the
    plugin writes only under the spool, out of the ingest's sight, and the engine moves them."""
    samples = [[5, 6, 7, 8], [9, 10, 11]]
    writer = DumpWriter(spool, CONTRACT, ledger_loss_masks(plan(tmp_path, samples)))
    fake = FakeSGLang(Capture(writer, num_layers=3, radix_cache_off=True, dump_dtype="bfloat16"))
    server = serve(fake)
    client = SGLangClient(f"http://127.0.0.1:{server.server_address[1]}", max_concurrency=2,
                          api_key="a")
    wanted = tmp_path / "spot-check"
    wanted.mkdir()
    redirected = {sample_id(ids): wanted for ids in samples}
    try:
        while not healthy(client.base_url, timeout=2.0):
            time.sleep(0.05)
        client.submit([(SPOT_PREFIX + sample_id(ids), ids) for ids in samples])
        assert all(e["event"] == "done" for e in wait_events(client, len(samples)))
        writer.flush()
    finally:
        client.close()
        server.shutdown()
    assert [p.name for p in spool.iterdir() if p.is_file()] == []  # nothing for ingest
    deliver_redirected(spool, redirected)
    assert redirected == {}
    for ids in samples:
        check_dump(wanted / dumpformat.dump_name(sample_id(ids)), ids, fake.table)
    assert list((spool / SPOT_FOLDER).iterdir()) == []
    writer.close()
