"""A stand-in for `python -m sglang.launch_server`, as slow to answer /health as the real one
with its default one-token health generation.

Started with capture settings in its environment (the daemon's capturing server), it loads a
"model" from --model-path in --dtype through the capture plugin's real load-model step
(`prepare`, which reports the weights fingerprint of that path in its ready file) unless
FAKE_SGLANG says otherwise:
  ok            the plugin sets capture up and writes its ready file
  no-plugin     SGLang started without the plugin (or swallowed its failure in register())
  dp-attention  attention data parallelism on: the plugin refuses, which stops the server
Started without (the generate stage's server), it loads the real target from --model-path and
answers batched /generate requests greedily, one request at a time, as SGLang answers them:
each request's new ids, its stop token included. FAKE_SGLANG=die-generating makes it exit with
code 3 at the first /generate instead; FAKE_SGLANG=hold-first holds the first /generate until
HOLD_UNTIL other requests have been answered (or HOLD_LIMIT_S has passed) and then writes to the
file FAKE_SGLANG_LOG which of the two released it.

Started with --api-key, it refuses as SGLang does (401) every request but /health and /metrics
that does not carry the key as `Authorization: Bearer KEY`.
"""

import json
import os
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

HEALTH_SECONDS = 1.5
HOLD_UNTIL = 2
HOLD_LIMIT_S = 120


def arg(name: str) -> str:
    return sys.argv[sys.argv.index(name) + 1]


def load_model(mode: str) -> None:
    from eagle3d.capture.engines.sglang.plugin import CaptureSettings, prepare
    from test_sglang_plugin import LlamaForCausalLM, ServerArgs
    from types import SimpleNamespace
    server_args = ServerArgs(
        tp_size=int(arg("--tp-size")), disable_radix_cache="--disable-radix-cache" in sys.argv,
        chunked_prefill_size=int(arg("--chunked-prefill-size")),
        cuda_graph_config=SimpleNamespace(
            prefill=SimpleNamespace(backend=arg("--cuda-graph-backend-prefill"))),
        enable_dp_attention=mode == "dp-attention", model_path=arg("--model-path"),
        dtype=arg("--dtype"))
    settings = CaptureSettings.from_env(os.environ)
    prepare(settings, LlamaForCausalLM(), server_args, 0, 2 if mode == "dp-attention" else 1,
            "0.5.17")


class Generator:
    def __init__(self, mode: str) -> None:
        from eagle3d.target import loading
        self.mode = mode
        self.model = loading.load_model(arg("--model-path"), "float32", "cpu")
        self.first, self.counting = threading.Lock(), threading.Lock()
        self.answered, self.others_done = 0, threading.Event()

    def __call__(self, body: dict) -> list[dict]:
        if self.mode == "die-generating":
            os._exit(3)
        if self.mode == "hold-first" and self.first.acquire(blocking=False):
            released = self.others_done.wait(HOLD_LIMIT_S)
            with open(os.environ["FAKE_SGLANG_LOG"], "w") as log:
                log.write(f"released by {HOLD_UNTIL} other answers\n" if released
                          else f"released after {HOLD_LIMIT_S} s\n")
            return self.decode(body)
        answers = self.decode(body)
        with self.counting:
            self.answered += 1
            if self.answered >= HOLD_UNTIL:
                self.others_done.set()
        return answers

    def decode(self, body: dict) -> list[dict]:
        import torch
        answers = []
        for ids, params in zip(body["input_ids"], body["sampling_params"]):
            assert params["temperature"] == 0.0, "the fake decodes greedily only"
            with torch.inference_mode():
                out = self.model.generate(
                    input_ids=torch.tensor([ids]), attention_mask=torch.ones(1, len(ids)).long(),
                    max_new_tokens=params["max_new_tokens"], do_sample=False,
                    eos_token_id=params["stop_token_ids"], pad_token_id=params["stop_token_ids"][0])
            answers.append({"output_ids": out[0, len(ids):].tolist(),
                            "meta_info": {"prompt_tokens": len(ids)}})
        return answers


def handler(generate: Generator | None) -> type:
    key = arg("--api-key") if "--api-key" in sys.argv else None

    class Handler(BaseHTTPRequestHandler):
        def refused(self) -> bool:
            """SGLang's rule: with a key, only the health and metrics probes go without it."""
            if key is None or self.path.startswith(("/health", "/metrics")) or \
                    self.headers.get("Authorization") == f"Bearer {key}":
                return False
            self.send_response(401)
            self.end_headers()
            return True

        def do_GET(self) -> None:
            if self.refused():
                return
            if self.path == "/get_model_info":  # as SGLang names what it loaded
                answer = json.dumps({"model_path": arg("--model-path")}).encode()
                self.send_response(200)
                self.send_header("Content-Length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)
                return
            time.sleep(HEALTH_SECONDS)
            self.send_response(200 if self.path == "/health" else 404)
            self.end_headers()

        def do_POST(self) -> None:
            if self.refused():
                return
            if self.path != "/generate" or generate is None:
                self.send_response(404)
                self.end_headers()
                return
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            answer = json.dumps(generate(body)).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(answer)))
            self.end_headers()
            self.wfile.write(answer)

        def log_message(self, *args) -> None:
            pass
    return Handler


if __name__ == "__main__":
    from eagle3d.capture.engines.sglang.plugin import CaptureSettings
    mode = os.environ.get("FAKE_SGLANG", "ok")
    generate = None
    if CaptureSettings.from_env(os.environ) is None:
        generate = Generator(mode)
    elif mode != "no-plugin":
        load_model(mode)  # raises on a refusal: SGLang's scheduler dies, and the server with it
    ThreadingHTTPServer((arg("--host"), int(arg("--port"))), handler(generate)).serve_forever()
