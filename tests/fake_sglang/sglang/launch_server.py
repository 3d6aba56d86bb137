"""A stand-in for `python -m sglang.launch_server`, as slow to answer /health as the real one
with its default one-token health generation. It loads a "model" through the capture plugin's
real load-model step (`prepare`) unless FAKE_SGLANG says otherwise:
  ok            the plugin sets capture up and writes its ready file
  no-plugin     SGLang started without the plugin (or swallowed its failure in register())
  dp-attention  attention data parallelism on: the plugin refuses, which stops the server
"""

import os
import sys
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

HEALTH_SECONDS = 1.5


def arg(name: str) -> str:
    return sys.argv[sys.argv.index(name) + 1]


def load_model(mode: str) -> None:
    from eagle3d.capture.sglang_plugin import CaptureSettings, prepare
    from test_sglang_plugin import LlamaForCausalLM, ServerArgs
    from types import SimpleNamespace
    server_args = ServerArgs(
        tp_size=int(arg("--tp-size")), disable_radix_cache="--disable-radix-cache" in sys.argv,
        chunked_prefill_size=int(arg("--chunked-prefill-size")),
        cuda_graph_config=SimpleNamespace(
            prefill=SimpleNamespace(backend=arg("--cuda-graph-backend-prefill"))),
        enable_dp_attention=mode == "dp-attention")
    settings = CaptureSettings.from_env(os.environ)
    prepare(settings, LlamaForCausalLM(), server_args, 0, 2 if mode == "dp-attention" else 1,
            "0.5.17")


class Health(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        time.sleep(HEALTH_SECONDS)
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()

    def log_message(self, *args) -> None:
        pass


if __name__ == "__main__":
    mode = os.environ.get("FAKE_SGLANG", "ok")
    if mode != "no-plugin":
        load_model(mode)  # raises on a refusal: SGLang's scheduler dies, and the server with it
    ThreadingHTTPServer((arg("--host"), int(arg("--port"))), Health).serve_forever()
