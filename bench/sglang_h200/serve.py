"""The exported drafter served by SGLang itself as an EAGLE-3 draft for its target, against plain
SGLang: output tokens/s and time per output token at concurrency 1, 4 and 16, for a chain ([eval]
steps, top-k 1) and for SGLang's default EAGLE-3 tree on a Llama target (5 steps, top-k 4, 8
draft tokens); beside them the measured costs of one target decode step, one verify forward of
k tokens and one draft step, and the speedup they predict (cost_model.py). Each speculative
server's greedy outputs are compared token by token with the plain server's, and SGLang's own
accept length is given beside eval's. Last, the speedup a Kimi-K2.5 target would see with the
same acceptance, from the same cost model over Kimi-K2.5's weight bytes and this GPU's
measured memory bandwidth (a shape proxy, not a published figure).

    python3 serve.py CONFIG OUT_DIR DTYPE [SERVER_ARG...]

CONFIG is a finished run's (pipeline.sh's): its exported drafter, and its [eval] prompts, draft
steps and new tokens, read exactly as eval reads them. DTYPE is every server's (bfloat16,
float32). All three servers run with the same flags: decode CUDA graphs on, unless the bundle
cannot start a server with them (then off for all three, and the result says why), or
CUDA_GRAPHS=0. Writes OUT_DIR/serve-DTYPE.json. The servers keep SGLang's default /health, a
one-token generation; they are waited for as the daemon waits (sglang_client.healthy).

The costs are timed in this process once the servers are gone, with transformers' eager
forwards on the same GPU: the prediction reads only their ratios, which launch-bound kernels
keep alike in SGLang's graphs and in eager mode; the plain server's own decode step is given
beside them.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Iterator

from cost_model import Costs, break_even_tau, kimi_costs, predicted_speedup
from eagle3d.capture.engines.sglang.client import HEALTH_TIMEOUT_S, healthy
from eagle3d.drafter.evaluate import cache_kwargs, prompts_from, read_source
from eagle3d.statemachine import layout
from eagle3d.statemachine.config_schema import Config
from eagle3d.statemachine.config_validation import load_config
from eagle3d.target.loading import load_tokenizer

CONCURRENCY = (1, 4, 16)
COMMON = ["--host", "127.0.0.1", "--mem-fraction-static", "0.25",
          "--cuda-graph-backend-prefill", "disabled", "--disable-radix-cache",
          "--skip-server-warmup", "--cuda-graph-max-bs", str(max(CONCURRENCY))]
NO_DECODE_GRAPHS = ["--cuda-graph-backend-decode", "disabled"]
# SGLang's auto_choose_speculative_params (server_args.py) for LlamaForCausalLM:
# (--speculative-num-steps, --speculative-eagle-topk, --speculative-num-draft-tokens).
SGLANG_TREE = (5, 4, 8)


def post(port: int, path: str, body: dict | None = None) -> dict:
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}",
                                     method="POST" if body else "GET",
                                     data=json.dumps(body).encode() if body else None,
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=600) as answer:
        return json.loads(answer.read())


@contextlib.contextmanager
def server(model: Path, port: int, flags: list[str], log: Path,
           deadline_s: float = 600) -> Iterator[float]:
    """A running SGLang server; yields the slowest of four /health answers once it serves."""
    env = {k: v for k, v in os.environ.items() if k != "EAGLE3D_SPOOL"}  # plain serving
    argv = [sys.executable, "-m", "sglang.launch_server", "--model-path", str(model),
            "--port", str(port), *COMMON, *flags]
    with open(log, "w") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)
    try:
        deadline = time.monotonic() + deadline_s
        while True:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"server did not come up: see {log}")
            asked = time.monotonic()
            if healthy(f"http://127.0.0.1:{port}", HEALTH_TIMEOUT_S):
                break
            time.sleep(1)
        health = [time.monotonic() - asked]
        for _ in range(3):
            asked = time.monotonic()
            assert healthy(f"http://127.0.0.1:{port}", HEALTH_TIMEOUT_S), "/health failed"
            health.append(time.monotonic() - asked)
        yield max(health)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(60)


def generate(port: int, ids: list[int], max_new: int) -> tuple[dict, float]:
    started = time.monotonic()
    answer = post(port, "/generate", {"input_ids": ids, "sampling_params": {
        "temperature": 0.0, "max_new_tokens": max_new}})
    return answer, time.monotonic() - started


def measure(port: int, prompts: list[list[int]], max_new: int) -> dict[str, Any]:
    """Every prompt at each concurrency. Time per output token is a request's latency less its
    first token's (a one-token request of the same prompt, alone), over its other tokens."""
    first = [generate(port, ids, 1)[1] for ids in prompts]
    runs: dict[str, Any] = {}
    for c in CONCURRENCY:
        started = time.monotonic()
        with ThreadPoolExecutor(c) as pool:
            done = list(pool.map(lambda ids: generate(port, ids, max_new), prompts))
        wall = time.monotonic() - started
        tokens = [len(a["output_ids"]) for a, _ in done]
        meta = [a["meta_info"] for a, _ in done]
        verify = sum(m.get("spec_verify_ct", 0) for m in meta)
        runs[str(c)] = {
            "output_tokens_per_s": sum(tokens) / wall,
            "time_per_output_token_s": statistics.mean(
                (latency - f) / max(1, n - 1) for (_, latency), f, n in zip(done, first, tokens)),
            "sglang_accept_length": sum(m.get("completion_tokens", 0) for m in meta) / verify
            if verify else None,
            "seconds": wall, "outputs": [a["output_ids"] for a, _ in done]}
    return runs


def timed(fn: Any, repeats: int = 30) -> float:
    """The median seconds of `fn` on the GPU."""
    import torch
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        started = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def measured_costs(cfg: Config, prompts: list[list[int]], max_new: int, dtype: str,
                   arms: dict[str, tuple[int, int, int]]) -> dict[str, Any]:
    """One decode step and each arm's verify forward of the target, each arm's draft step (its
    top-k rows), at a context of the median prompt and half the new tokens."""
    import torch
    from transformers import DynamicCache
    from eagle3d.drafter.export import load_export
    from eagle3d.target.loading import load_model
    target = load_model(cfg.target.model_path, dtype, "cuda")
    embed = target.get_input_embeddings().weight.detach().float().cpu()
    drafter, _, _ = load_export(layout.export_dir(cfg.paths.train_dir), embed)
    drafter.to("cuda", getattr(torch, dtype))
    n = int(statistics.median(len(p) for p in prompts)) + max_new // 2
    ids = torch.tensor([(sum(prompts, []) * n)[:n]], device="cuda")
    with torch.inference_mode():
        cache = DynamicCache()
        target(input_ids=ids, **cache_kwargs(target, cache))

        def verify(k: int) -> None:
            target(input_ids=ids[:, :k], **cache_kwargs(target, cache))
            cache.crop(n)
        aux = torch.zeros(1, n, drafter.fc.in_features, device="cuda",
                          dtype=drafter.fc.weight.dtype)
        out, context = drafter.step(ids, drafter.fc(aux), torch.arange(n, device="cuda")[None],
                                    None, None)

        def draft(rows: int) -> None:
            drafter.step(ids[:, :1].expand(rows, 1), out[:, -1:].expand(rows, 1, -1),
                         torch.full((rows, 1), n, device="cuda"),
                         tuple(t.expand(rows, -1, -1, -1) for t in context), [])
        costs = {"context_tokens": n, "decode_s": timed(lambda: verify(1))}
        for name, (steps, topk, k) in arms.items():
            costs[name] = {"verify_s": timed(lambda: verify(k)),
                           "draft_s": timed(lambda: draft(topk))}
        # A shape proxy for a target too large for one GPU: how fast one H200 reads weights.
        weights = torch.empty(8192, 65536, device="cuda", dtype=torch.bfloat16)
        x = torch.ones(1, 8192, device="cuda", dtype=torch.bfloat16)
        costs["bandwidth_bytes_per_s"] = weights.numel() * 2 / timed(lambda: x @ weights)
    return costs


def first_difference(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def speculative_flags(steps: int, topk: int, k: int, export: Path) -> list[str]:
    return ["--speculative-algorithm", "EAGLE3", "--speculative-num-steps", str(steps),
            "--speculative-eagle-topk", str(topk), "--speculative-num-draft-tokens", str(k),
            "--speculative-draft-attention-backend", "triton",
            "--speculative-draft-model-path", str(export)]


def serve_all(cfg: Config, out: Path, dtype: str, extra: list[str], graphs: bool,
              prompts: list[list[int]], max_new: int,
              arms: dict[str, tuple[int, int, int]]) -> dict[str, Any]:
    flags = ["--dtype", dtype, *extra, *([] if graphs else NO_DECODE_GRAPHS)]
    export = layout.export_dir(cfg.paths.train_dir)
    runs = {}
    for port, name in enumerate(["plain", *arms], 30801):
        spec = speculative_flags(*arms[name], export) if name in arms else []
        with server(cfg.target.model_path, port, [*flags, *spec],
                    out / f"serve-{name}-{dtype}.log") as health:
            runs[name] = {"slowest_health_s": health, "concurrency": measure(port, prompts,
                                                                             max_new),
                          "sglang": post(port, "/server_info").get("version")}
    return runs


def main() -> int:
    cfg, out, dtype, extra = load_config(sys.argv[1]), Path(sys.argv[2]), sys.argv[3], sys.argv[4:]
    steps, max_new = cfg.eval.steps, cfg.eval.max_new_tokens
    source, fmt, questions = read_source(cfg, None, None, None, None)
    prompts = prompts_from(questions, fmt, load_tokenizer(cfg.target.model_path),
                           cfg.data.max_tokens - max_new).ids
    arms = {"chain": (steps, 1, steps + 1), "tree": SGLANG_TREE}
    graphs, why_not = os.environ.get("CUDA_GRAPHS", "1") != "0", None
    try:
        runs = serve_all(cfg, out, dtype, extra, graphs, prompts, max_new, arms)
    except (RuntimeError, OSError) as exc:  # did not come up, or broke off a request
        if not graphs:
            raise
        graphs, why_not = False, f"with decode CUDA graphs: {exc}"
        runs = serve_all(cfg, out, dtype, extra, graphs, prompts, max_new, arms)
    costs = measured_costs(cfg, prompts, max_new, dtype, arms)
    evaluated = json.loads(layout.eval_file(cfg.paths.train_dir).read_text())
    plain = runs["plain"]["concurrency"]
    result: dict[str, Any] = {
        "dtype": dtype, "prompts": len(prompts), "max_new_tokens": max_new,
        "cuda_graphs": graphs, "cuda_graphs_off_because": why_not,
        "eval_acceptance_length": evaluated["acceptance_length"], "costs": costs,
        "plain": {c: {k: v for k, v in r.items() if k != "outputs"} for c, r in plain.items()}}
    for name, (arm_steps, topk, k) in arms.items():
        spec = runs[name]["concurrency"]
        tau = spec["1"]["sglang_accept_length"] or 0.0
        model = Costs(costs["decode_s"], costs[name]["verify_s"], costs[name]["draft_s"])
        kimi = kimi_costs(costs["bandwidth_bytes_per_s"], k)
        same = [a == b for a, b in zip(plain["16"]["outputs"], spec["16"]["outputs"])]
        result[name] = {
            "steps": arm_steps, "topk": topk, "num_draft_tokens": k,
            "concurrency": {c: {**{key: v for key, v in r.items() if key != "outputs"},
                                "measured_speedup": plain[c]["time_per_output_token_s"]
                                / r["time_per_output_token_s"]} for c, r in spec.items()},
            "predicted_speedup_at_1": predicted_speedup(tau, arm_steps, model),
            "break_even_acceptance_length": break_even_tau(arm_steps, model),
            "identical_to_plain": sum(same),
            # where each differing answer first departs from the plain server's
            "first_difference": [first_difference(a, b) for a, b, ok in
                                 zip(plain["16"]["outputs"], spec["16"]["outputs"], same)
                                 if not ok],
            "kimi_k25": {"costs_s": kimi._asdict(),
                         "projected_speedup": predicted_speedup(tau, arm_steps, kimi)}}
    result["sglang"] = runs["plain"]["sglang"]
    (out / f"serve-{dtype}.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))
    for name in arms:
        r = result[name]
        print(f"{name}: speedup at concurrency 1 measured "
              f"{r['concurrency']['1']['measured_speedup']:.2f}, predicted "
              f"{r['predicted_speedup_at_1']:.2f} (acceptance length "
              f"{r['concurrency']['1']['sglang_accept_length']}, break-even "
              f"{r['break_even_acceptance_length']:.2f}); Kimi-K2.5 projected "
              f"{r['kimi_k25']['projected_speedup']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
