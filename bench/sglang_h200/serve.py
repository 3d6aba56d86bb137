"""The exported drafter served by SGLang itself as an EAGLE-3 draft for its target: greedy
outputs of a plain server and of a speculative one (--speculative-algorithm EAGLE3) on the
prompts `eagle3ctl eval` measured, compared token by token, with SGLang's own accept length
beside eval's.

    python3 serve.py CONFIG OUT_DIR DTYPE [SERVER_ARG...]

CONFIG is a finished run's (pipeline.sh's): its exported drafter, and its [eval] prompts, draft
steps and new tokens, taken exactly as eval takes them. DTYPE is both servers' (bfloat16,
float32). Writes OUT_DIR/serve-DTYPE.json. Both servers keep SGLang's default /health, which
runs a one-token generation; they are waited for as the daemon waits (sglang_client.healthy),
and the slowest /health answer is reported.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from eagle3d.capture.sglang_client import HEALTH_TIMEOUT_S, healthy
from eagle3d.drafter.evaluate import prompts_from
from eagle3d.statemachine import layout
from eagle3d.statemachine.config import load_config
from eagle3d.target.loading import load_tokenizer

CONCURRENT = 16  # requests in flight: decoding one at a time with native ops took minutes
# Decode graphs are off in both servers so that their numerics differ only by speculation.
COMMON = ["--host", "127.0.0.1", "--mem-fraction-static", "0.25",
          "--cuda-graph-backend-prefill", "disabled", "--cuda-graph-backend-decode", "disabled",
          "--disable-radix-cache", "--skip-server-warmup"]


def post(port: int, path: str, body: dict | None = None) -> dict:
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", method="POST" if body else "GET",
                                     data=json.dumps(body).encode() if body else None,
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as answer:
        return json.loads(answer.read())


def serve(model: Path, port: int, flags: list[str], log: Path, prompts: list[list[int]],
          max_new: int) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "EAGLE3D_SPOOL"}  # plain serving
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
            asked = time.monotonic()
            if healthy(f"http://127.0.0.1:{port}", HEALTH_TIMEOUT_S):
                break
            time.sleep(1)
        health = [time.monotonic() - asked]  # the first 200, then three more once it serves
        for _ in range(3):
            asked = time.monotonic()
            assert healthy(f"http://127.0.0.1:{port}", HEALTH_TIMEOUT_S), "/health failed"
            health.append(time.monotonic() - asked)
        started = time.monotonic()
        with ThreadPoolExecutor(CONCURRENT) as pool:
            outputs = list(pool.map(lambda ids: post(port, "/generate", {
                "input_ids": ids, "sampling_params": {"temperature": 0.0,
                                                      "max_new_tokens": max_new}}), prompts))
        return {"outputs": outputs, "seconds": time.monotonic() - started,
                "health_s": max(health), "server_info": post(port, "/server_info")}
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(60)


def first_difference(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def main() -> int:
    cfg, out, dtype, extra = load_config(sys.argv[1]), Path(sys.argv[2]), sys.argv[3], sys.argv[4:]
    extra = ["--dtype", dtype, *extra]
    steps, max_new = cfg.eval.steps, cfg.eval.max_new_tokens
    prompts = prompts_from(cfg.eval.source_path, cfg.data.format, cfg.eval.first,
                           cfg.eval.limit, load_tokenizer(cfg.target.model_path),
                           cfg.data.max_tokens - max_new).ids
    model = cfg.target.model_path
    plain = serve(model, 30801, extra, out / f"serve-plain-{dtype}.log", prompts, max_new)
    speculative = ["--speculative-algorithm", "EAGLE3", "--speculative-num-steps", str(steps),
                   "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens",
                   str(steps + 1), "--speculative-draft-attention-backend", "triton",
                   "--speculative-draft-model-path", str(layout.export_dir(cfg.paths.train_dir))]
    spec = serve(model, 30802, [*extra, *speculative], out / f"serve-eagle3-{dtype}.log", prompts,
                 max_new)
    same = [a["output_ids"] == b["output_ids"] for a, b in zip(plain["outputs"], spec["outputs"])]
    meta = [b["meta_info"] for b in spec["outputs"]]
    completion = sum(m.get("completion_tokens", 0) for m in meta)
    verify = sum(m.get("spec_verify_ct", 0) for m in meta)
    states = spec["server_info"].get("internal_states") or [{}]
    evaluated = json.loads(layout.eval_file(cfg.paths.train_dir).read_text())
    result = {"dtype": dtype, "prompts": len(prompts), "max_new_tokens": max_new,
              "draft_steps": steps,
              "identical_to_plain": sum(same),
              # where each differing answer first departs from the plain server's
              "first_difference": [first_difference(a["output_ids"], b["output_ids"])
                                   for a, b, ok in zip(plain["outputs"], spec["outputs"], same)
                                   if not ok],
              "sglang_accept_length": completion / verify if verify else None,
              "sglang_avg_spec_accept_length": states[0].get("avg_spec_accept_length"),
              "eval_acceptance_length": evaluated["acceptance_length"],
              "eval_prompts": evaluated["prompts"],
              "seconds": {"plain": plain["seconds"], "eagle3": spec["seconds"]},
              "slowest_health_s": {"plain": plain["health_s"], "eagle3": spec["health_s"]},
              "sglang": spec["server_info"].get("version")}
    (out / f"serve-{dtype}.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
