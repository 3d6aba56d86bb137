"""The exported drafter served by SGLang itself as an EAGLE-3 draft for its target: greedy
outputs of a plain server and of a speculative one (--speculative-algorithm EAGLE3) on the same
held-out prompts, compared token by token, with SGLang's own accept length.

    python3 serve.py MODEL_DIR EXPORT_DIR OUT_DIR PROMPTS.json FIRST COUNT [SERVER_ARG...]

PROMPTS.json is ShareGPT-shaped; the prompts are the first user turns of conversations
FIRST..FIRST+COUNT, as `eagle3ctl eval` takes them. Writes OUT_DIR/serve.json.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from eagle3d.capture.sglang_smoke import tokenize

MAX_NEW_TOKENS = 48
SPECULATIVE = ["--speculative-algorithm", "EAGLE3", "--speculative-num-steps", "4",
               "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", "5",
               "--speculative-draft-attention-backend", "triton"]
# Decode graphs are off in both servers so that their numerics differ only by speculation.
COMMON = ["--dtype", "bfloat16", "--host", "127.0.0.1", "--mem-fraction-static", "0.25",
          "--cuda-graph-backend-prefill", "disabled", "--cuda-graph-backend-decode", "disabled",
          "--disable-radix-cache", "--skip-server-warmup"]


def post(port: int, path: str, body: dict | None = None) -> dict:
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", method="POST" if body else "GET",
                                     data=json.dumps(body).encode() if body else None,
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as answer:
        return json.loads(answer.read())


def serve(model: Path, port: int, flags: list[str], log: Path, prompts: list[list[int]]) -> dict:
    env = {**os.environ, "SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION": "0"}
    env.pop("EAGLE3D_SPOOL", None)  # no capture: this is plain serving
    argv = [sys.executable, "-m", "sglang.launch_server", "--model-path", str(model),
            "--port", str(port), *COMMON, *flags]
    with open(log, "w") as out:
        server = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env,
                                  start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        while True:
            if server.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"server did not come up: see {log}")
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=30).close()
                break
            except OSError:
                time.sleep(1)
        outputs = [post(port, "/generate", {"input_ids": ids, "sampling_params": {
            "temperature": 0.0, "max_new_tokens": MAX_NEW_TOKENS}}) for ids in prompts]
        return {"outputs": outputs, "server_info": post(port, "/server_info")}
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(60)


def main() -> int:
    model, export, out, source = map(Path, sys.argv[1:5])
    first, count, extra = int(sys.argv[5]), int(sys.argv[6]), sys.argv[7:]
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(model)
    conversations = json.loads(source.read_text())[first:first + count]
    texts = [next(t["value"] for t in c["conversations"] if t["from"] == "human")
             for c in conversations]
    prompts = [tokenize(tokenizer, t)[0] for t in texts]
    plain = serve(model, 30801, extra, out / "serve-plain.log", prompts)
    spec = serve(model, 30802, [*extra, *SPECULATIVE, "--speculative-draft-model-path",
                                str(export)], out / "serve-eagle3.log", prompts)
    same = [a["output_ids"] == b["output_ids"] for a, b in zip(plain["outputs"], spec["outputs"])]
    meta = [b["meta_info"] for b in spec["outputs"]]
    completion = sum(m.get("completion_tokens", 0) for m in meta)
    verify = sum(m.get("spec_verify_ct", 0) for m in meta)
    states = spec["server_info"].get("internal_states") or [{}]
    result = {"prompts": len(prompts), "identical_to_plain": sum(same),
              "spec_accept_length_per_request": [m.get("spec_accept_length") for m in meta],
              "completion_tokens_per_verify": completion / verify if verify else None,
              "avg_spec_accept_length": states[0].get("avg_spec_accept_length"),
              "sglang": spec["server_info"].get("version")}
    (out / "serve.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
