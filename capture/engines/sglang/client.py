"""The daemon's side of the SGLang engine: prefill requests to the server's /generate, on a small
thread pool, with the events the transformers worker would send; and the generate stage's
batched decodes (`generate`). Stdlib only (urllib), because the daemon imports it.

A request asks for no new tokens and names the sample as its request id (`rid`), which is the
name the capture plugin gives the dump. The HTTP answer says only that the prefill ran: the dump
in the spool is the result, and ingest checks it.
"""

from __future__ import annotations

import json
import queue
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable

from eagle3d.capture.engines.sglang.plugin import (HANDSHAKE_FILE, handshake_problem, read_handshake,
                                           request_id)

REQUEST_TIMEOUT_S = 3600.0  # a prefill queued behind many others; the daemon has its own timeout
# SGLang's /health can run a one-token generation (the launcher turns that off, an operator's
# server may not) and waits up to 20 s for it (SGLANG_HEALTH_CHECK_TIMEOUT): wait longer.
HEALTH_TIMEOUT_S = 30.0
HEALTH_EVERY_S = 2.0
# The plugin writes its ready file while the model loads, before /health answers 200: once the
# server is up, a missing one means the plugin was not loaded or failed (SGLang goes on without it).
HANDSHAKE_GRACE_S = 30.0


# The server is on this machine or a private network: an http_proxy from the environment must
# not be asked for it.
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def healthy(base_url: str, timeout: float) -> bool:
    """True once the server answers /health with 200 (it answers 503 while starting)."""
    try:
        with _OPENER.open(base_url.rstrip("/") + "/health", timeout=timeout) as response:
            return response.status == 200
    except (OSError, ValueError):
        return False


def _request(base_url: str, path: str, api_key: str,
             body: dict[str, Any] | None = None) -> urllib.request.Request:
    """A request to the server, with the start's API key (serve.API_KEY_ENV): the server
    refuses every other caller."""
    headers = {"Authorization": f"Bearer {api_key}"}
    if body is not None:
        headers["Content-Type"] = "application/json"
    return urllib.request.Request(base_url.rstrip("/") + path, headers=headers,
                                  data=None if body is None else json.dumps(body).encode(),
                                  method="GET" if body is None else "POST")


def check_serves(base_url: str, model_path: str, api_key: str) -> None:
    """Refuse (ContractMismatch) a server that says it loaded another model than `model_path`,
    whose weights the caller checked against the capture contract: SGLang's /get_model_info
    names the path it loaded. A server that does not answer it is refused too."""
    from eagle3d.statemachine.entry import ContractMismatch
    try:
        with _OPENER.open(_request(base_url, "/get_model_info", api_key),
                          timeout=HEALTH_TIMEOUT_S) as response:
            served = json.loads(response.read()).get("model_path")
    except (OSError, ValueError, AttributeError) as exc:
        raise ContractMismatch(f"the SGLang server at {base_url} does not say which model it "
                               f"loaded (/get_model_info: {exc})") from None
    if served != model_path:
        raise ContractMismatch(f"the SGLang server at {base_url} loaded {served}, not the "
                               f"target {model_path}: another server answers on its port, or "
                               "it was started from another config")


class SGLangRefused(OSError):
    """SGLang answered with an HTTP error; the message carries its status and its words."""


def _post_generate(base_url: str, body: dict[str, Any], api_key: str) -> Any:
    """POST /generate; its JSON answer. Raises SGLangRefused for an HTTP error, OSError or
    ValueError when there is no usable answer."""
    try:
        with _OPENER.open(_request(base_url, "/generate", api_key, body),
                          timeout=REQUEST_TIMEOUT_S) as response:
            return json.loads(response.read() or b"{}")
    except urllib.error.HTTPError as exc:
        detail = exc.read()[:500].decode("utf-8", "replace").strip()
        raise SGLangRefused(f"SGLang answered HTTP {exc.code}: {detail or exc.reason}") from None


def generate(base_url: str, api_key: str, prompts: list[list[int]],
             sampling: list[dict[str, Any]]) -> list[list[int]]:
    """The new token ids of each prompt, decoded by the server in one batched request (SGLang
    schedules its members independently). Raises OSError when the server does not answer."""
    answers = _post_generate(base_url, {"input_ids": prompts, "sampling_params": sampling,
                                        "stream": False}, api_key)
    if not isinstance(answers, list) or len(answers) != len(prompts):
        raise OSError(f"SGLang answered {len(prompts)} prompts with {answers!r:.200}")
    return [list(answer["output_ids"]) for answer in answers]


class SGLangClient:
    def __init__(self, base_url: str, max_concurrency: int, api_key: str,
                 request_key: str = "") -> None:
        """`api_key`: the server start's (serve.API_KEY_ENV). `request_key`: the
        capturing server's (spec.ENV_REQUEST_KEY), which each request id carries;
        events name the samples without it."""
        if max_concurrency < 1:
            raise ValueError(f"max_concurrency must be at least 1, got {max_concurrency}")
        self.base_url = base_url.rstrip("/")
        self.api_key = api_key
        self.request_key = request_key
        self._pool = ThreadPoolExecutor(max_concurrency, thread_name_prefix="sglang-request")
        self._events: queue.Queue[dict] = queue.Queue()
        self._closed = False

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
        try:
            answer = _post_generate(self.base_url, {
                "input_ids": ids, "rid": request_id(self.request_key, sid), "stream": False,
                "sampling_params": {"max_new_tokens": 0}}, self.api_key)
        except SGLangRefused as exc:
            self._error(sid, str(exc))
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


class Startup:
    """Watches a starting server on a thread of its own, so no caller waits on a slow /health.
    `state` becomes "ready" once /health answers 200 and the capture plugin's ready file for this
    start shows the capture asked for (the capture contract's layers, target weights and dtype),
    or "failed" with `problem` saying why; a server that exits leaves it "starting" (its exit
    status says more)."""

    def __init__(self, client: SGLangClient, spool: Path, token: str, contract: dict[str, Any],
                 tp: int, timeout_s: float, exited: Callable[[], bool]) -> None:
        self.state = "starting"
        self.problem: str | None = None
        self.info: dict | None = None
        self._args = (client, Path(spool), token, contract, tp, timeout_s, exited)
        self._stop = threading.Event()
        threading.Thread(target=self._run, daemon=True, name="sglang-startup").start()

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        client, spool, token, contract, tp, timeout_s, exited = self._args
        deadline = time.monotonic() + timeout_s
        while not healthy(client.base_url, HEALTH_TIMEOUT_S):
            if self._stop.is_set() or exited():
                return
            if time.monotonic() > deadline:
                return self._fail(f"SGLang did not answer /health with 200 within {timeout_s:.0f} s")
            self._stop.wait(HEALTH_EVERY_S)
        grace = time.monotonic() + HANDSHAKE_GRACE_S
        while (found := read_handshake(spool, token)) is None:
            if self._stop.is_set() or exited():
                return
            if time.monotonic() > grace:
                return self._fail(
                    "SGLang is up but eagle3d's capture plugin did not report ready (no "
                    f"{spool / HANDSHAKE_FILE} from this start): it was not loaded or "
                    "it failed, and SGLang serves on without it; look for 'eagle3d' in the "
                    "server's log")
            self._stop.wait(0.5)
        problem = handshake_problem(found, contract, tp)
        if problem:
            return self._fail(f"eagle3d's capture plugin is loaded but wrong: {problem}")
        self.info = found
        self.state = "ready"

    def _fail(self, problem: str) -> None:
        self.problem = problem
        self.state = "failed"
