"""The daemon's side of the SGLang engine: prefill requests to the server's /generate, on a small
thread pool, with the events the transformers worker would send. Stdlib only (urllib), because
the daemon imports it.

A request asks for no new tokens and names the sample as its request id (`rid`), which is the
name the capture plugin gives the dump. The HTTP answer says only that the prefill ran: the dump
in the spool is the result, and ingest checks it.
"""

from __future__ import annotations

import json
import queue
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

REQUEST_TIMEOUT_S = 3600.0  # a prefill queued behind many others; the daemon has its own timeout


class SGLangClient:
    def __init__(self, base_url: str, max_concurrency: int) -> None:
        if max_concurrency < 1:
            raise ValueError(f"max_concurrency must be at least 1, got {max_concurrency}")
        self.base_url = base_url.rstrip("/")
        # The server is on this machine or a private network: an http_proxy from the
        # environment must not be asked for it.
        self._opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        self._pool = ThreadPoolExecutor(max_concurrency, thread_name_prefix="sglang-request")
        self._events: queue.Queue[dict] = queue.Queue()
        self._closed = False

    def healthy(self, timeout: float) -> bool:
        """True once the server answers /health with 200 (it answers 503 while starting)."""
        try:
            with self._opener.open(self.base_url + "/health", timeout=timeout) as response:
                return response.status == 200
        except (OSError, ValueError):
            return False

    def submit(self, samples: list[tuple[str, list[int]]]) -> None:
        """Queue prefill requests; returns at once. Each ends in one event from poll()."""
        if self._closed:
            raise RuntimeError("the SGLang client is closed")
        for sid, ids in samples:
            self._pool.submit(self._prefill, sid, list(ids))

    def poll(self) -> list[dict]:
        out = []
        while True:
            try:
                out.append(self._events.get_nowait())
            except queue.Empty:
                return out

    def close(self) -> None:
        """Drop requests not yet sent; those under way end with the server."""
        self._closed = True
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _prefill(self, sid: str, ids: list[int]) -> None:
        start = time.monotonic()
        body = json.dumps({"input_ids": ids, "rid": sid, "stream": False,
                           "sampling_params": {"max_new_tokens": 0}}).encode()
        request = urllib.request.Request(self.base_url + "/generate", data=body, method="POST",
                                         headers={"Content-Type": "application/json"})
        try:
            with self._opener.open(request, timeout=REQUEST_TIMEOUT_S) as response:
                answer = json.loads(response.read() or b"{}")
        except urllib.error.HTTPError as exc:
            detail = exc.read()[:500].decode("utf-8", "replace").strip()
            self._error(sid, f"SGLang answered HTTP {exc.code}: {detail or exc.reason}")
            return
        except (OSError, ValueError) as exc:
            self._error(sid, f"request to SGLang failed: {exc}")
            return
        meta = answer.get("meta_info", {}) if isinstance(answer, dict) else {}
        seen = meta.get("prompt_tokens")
        if seen is not None and seen != len(ids):
            self._error(sid, f"SGLang prefilled {seen} tokens of the {len(ids)} sent")
            return
        self._events.put({"event": "done", "ids": [sid], "tokens": len(ids),
                          "seconds": round(time.monotonic() - start, 3)})

    def _error(self, sid: str, message: str) -> None:
        self._events.put({"event": "error", "ids": [sid], "error": message})
