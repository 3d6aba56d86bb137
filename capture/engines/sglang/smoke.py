"""Smoke test of the SGLang engine, for an operator on a GPU box with SGLang installed:

    python -m eagle3d.capture.engines.sglang.smoke --model meta-llama/Llama-3.2-1B-Instruct

It starts SGLang exactly as the daemon would (same command, same capture plugin), prefills a
handful of chat prompts through the same client, and compares every dump with the hidden states
Hugging Face transformers computes for the same token ids (the transformers engine's reference:
`hidden_states[i]` for the contract's layer ids, and the last entry, which is after the final
norm). Exit status 0 when every dump matches, 1 when one does not, 2 when it cannot run.
See docs/sglang.md.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Iterable, Iterator

from eagle3d.dataset import contract as contract_mod
from eagle3d.dataset import dumpformat, precision
from eagle3d.target import loading
from eagle3d.capture import engines
from eagle3d.capture.engines import shell_line
from eagle3d.capture.engines.sglang.client import SGLangClient, Startup
from eagle3d.capture.engines.sglang.launcher import check_version, launch_command
from eagle3d.capture.engines.sglang.serve import API_KEY_ENV
from eagle3d.capture.engines.sglang.settings import SGLangSettings
from eagle3d.capture.engines.sglang.spec import ENV_REQUEST_KEY, ENV_TOKEN, NAME, SETTINGS
from eagle3d.statemachine.config_schema import (DUMP_DTYPES, Config, DataConfig, PathsConfig,
                                                TargetConfig, written)
from eagle3d.statemachine import layout
from eagle3d.statemachine.ledger import Ledger, PlannedSample, token_ids

PROMPTS = ["What is the capital of France?",
           "Write a haiku about the sea.",
           "Explain speculative decoding in two sentences.",
           "List three prime numbers larger than 100.",
           "Translate 'good morning' into German and Spanish.",
           "Why is the sky blue?"]
MIN_COSINE = 0.99    # per token: bf16 kernels differ between the engines
MEAN_COSINE = 0.999  # over a prompt's tokens; a layer off by one scored 0.43-0.95 on SmolLM2


def tokenize(tokenizer, prompt: str) -> tuple[list[int], bytes]:
    """A one-turn chat with the model's answer slot; the mask marks no token (no answer)."""
    messages = [{"role": "user", "content": prompt}]
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    else:
        ids = tokenizer(prompt)["input_ids"]
    return list(ids), bytes(len(ids))


@contextlib.contextmanager
def serving(cfg: Config, contract: dict, startup_timeout: float) -> Iterator[SGLangClient]:
    """SGLang started as the daemon starts it, ready as the daemon judges it (/health and the
    plugin's ready file); stopped on the way out."""
    argv, env = launch_command(cfg, contract)
    print("engine command:", shell_line(argv, env), flush=True)
    server = subprocess.Popen(argv, env={**os.environ, **env}, start_new_session=True)
    settings = SETTINGS.of(cfg)
    client = SGLangClient(f"http://{settings.host}:{settings.port}", 64,
                          env[API_KEY_ENV], env[ENV_REQUEST_KEY])
    startup = Startup(client, cfg.paths.spool_dir, env[ENV_TOKEN], contract, settings.tp,
                      startup_timeout, exited=lambda: server.poll() is not None)
    try:
        while startup.state == "starting":
            if server.poll() is not None:
                raise SystemExit(f"SGLang exited with status {server.poll()} before it was ready")
            time.sleep(0.5)
        if startup.state == "failed":
            raise SystemExit(f"SGLang is not ready: {startup.problem}")
        print("capture plugin ready:", json.dumps(startup.info), flush=True)
        yield client
    finally:
        startup.stop()
        client.close()
        try:
            os.killpg(server.pid, signal.SIGTERM)
            server.wait(60)
        except ProcessLookupError:
            pass  # it had already exited: its status is in the message above
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)


def prefill_all(client: SGLangClient, samples: dict[str, list[int]]) -> list[dict]:
    """Send every sample at once; returns one event each, when all have answered."""
    client.submit(list(samples.items()))
    events: list[dict] = []
    while len(events) < len(samples):
        events += client.poll()
        time.sleep(0.05)
    return events


def wait_for_dumps(spool: Path, sids: Iterable[str], seconds: float = 30.0) -> None:
    """Dumps are written after the answer, on the plugin's writer thread."""
    names = {dumpformat.dump_name(s) for s in sids}
    wait_until = time.monotonic() + seconds
    while not names <= {p.name for p in spool.iterdir()} and time.monotonic() < wait_until:
        time.sleep(0.2)


def cosines(got, ref) -> tuple[float, float]:
    import torch
    cos = torch.nn.functional.cosine_similarity(got.float(), ref.float(), dim=-1)
    return round(cos.min().item(), 5), round(cos.mean().item(), 5)


def compare(model, path: Path, sid: str, ids: list[int], layer_ids: list[int],
            fingerprint: str) -> tuple[list[str], dict]:
    """Problems with the dump at `path` (empty when it matches the transformers reference) and
    the figures: per captured part, (min, mean) cosine per token against the reference layer and
    against its neighbours, which must score clearly lower (no off-by-one). An fp8 dump is
    dequantized first, and its floors are lowered by what quantization alone may cost: with
    ‖q(x) − x‖ ≤ u‖x‖, the cosine of x and q(x) is at least √(1 − u²) (0.998)."""
    import torch
    from safetensors.torch import load_file
    if not path.exists():
        return [f"{sid}: no dump at {path}"], {}
    header = dumpformat.read_header(path)
    problems = [] if header.contract == fingerprint else [f"{sid}: contract {header.contract}"]
    dump = load_file(str(path))
    if dump["input_ids"].tolist() != ids:
        return problems + [f"{sid}: dumped {header.tokens} token ids differ from the {len(ids)} "
                           "sent"], {}
    with torch.no_grad():
        hs = model(torch.tensor([ids], device=model.device),
                   output_hidden_states=True).hidden_states
    width = hs[0].shape[-1]
    aux, last = (t.to(model.device) for t in precision.decode_states(dump))
    floor = (1 - precision.E4M3_RELATIVE_ERROR ** 2) ** 0.5 \
        if dumpformat.is_scaled(header.dtype) else 1.0
    # (name, dumped rows, index of the reference in hs, indices of its neighbours)
    parts = [(f"layer {i}", aux[:, k * width:(k + 1) * width], i, (i - 1, i + 1))
             for k, i in enumerate(layer_ids)]
    parts.append(("final", last, len(hs) - 1, (len(hs) - 2,)))
    figures = {}
    for name, got, i, neighbours in parts:
        low, mean = cosines(got, hs[i][0])
        near = {j: cosines(got, hs[j][0]) for j in neighbours}
        figures[name] = {"min": low, "mean": mean, "neighbours": {str(j): v for j, v in near.items()}}
        print(f"  {sid[:8]} {name}: cosine min {low:.5f} mean {mean:.5f}; neighbours "
              + ", ".join(f"hs[{j}] min {v[0]:.3f} mean {v[1]:.3f}" for j, v in near.items()))
        if low < MIN_COSINE * floor or mean < MEAN_COSINE * floor:
            problems.append(f"{sid}: {name} differs (cosine min {low:.4f}, mean {mean:.4f})")
        if any(v[1] >= mean for v in near.values()):
            problems.append(f"{sid}: {name} matches a neighbouring layer as well (off by one?)")
    return problems, figures


def measure_overhead(client: SGLangClient, spool: Path, samples: dict[str, list[int]],
                     rounds: int) -> dict:
    """Prefill tokens/s of the same requests with capture (request ids are planned samples:
    dumped, timed until the dumps are on disk) and without (other request ids: the plugin lets
    them pass), interleaved round by round on the same server."""
    tokens = sum(map(len, samples.values()))
    timings: dict[str, list[float]] = {"capture": [], "plain": []}
    for r in range(rounds):
        for mode in ("plain", "capture"):
            batch = samples if mode == "capture" else {f"plain{r}-{k}": v
                                                       for k, v in samples.items()}
            start = time.monotonic()
            prefill_all(client, batch)
            if mode == "capture":
                wait_for_dumps(spool, samples, 300.0)
            timings[mode].append(time.monotonic() - start)
            for sid in samples:
                (spool / dumpformat.dump_name(sid)).unlink(missing_ok=True)
    rate = {m: tokens * len(t) / sum(t) for m, t in timings.items()}
    result = {"tokens_per_round": tokens, "rounds": rounds, "seconds": timings,
              "tokens_per_s": rate, "ratio": rate["capture"] / rate["plain"]}
    print("capture overhead:", json.dumps(result), flush=True)
    return result


def plan_samples(token_lists: list[list[int]], masks: list[bytes], start: int = 0
                 ) -> tuple[dict[str, list[int]], list[PlannedSample]]:
    samples, planned = {}, []
    for idx, (ids, mask) in enumerate(zip(token_lists, masks), start):
        raw = b"".join(i.to_bytes(4, "little", signed=True) for i in ids)
        sid = dumpformat.ids_hash(raw)  # a smoke sample is named by its token ids
        samples[sid] = ids
        planned.append(PlannedSample(sid, idx, len(ids), 0, sid, raw, mask))
    return samples, planned


def synthetic(count: int, tokens: int, vocab: int) -> list[list[int]]:
    import random
    rng = random.Random(0)
    return [[rng.randrange(100, vocab) for _ in range(tokens)] for _ in range(count)]


def check_dataset(config_path: Path, count: int) -> tuple[list[str], dict]:
    """The dumps a finished run wrote to its dataset (the daemon's own extraction, by whichever
    engine its config names) against transformers' forward of the same token ids: the first
    `count` verified samples, by plan order."""
    from eagle3d.statemachine.config_validation import load_config
    cfg = load_config(config_path)
    captured = contract_mod.read_checked(cfg.paths.dataset_dir)
    with Ledger(layout.ledger(cfg.paths.state_dir), readonly=True) as ledger:
        verified = list(itertools.islice(ledger.iter_samples("verified"), count))
        planned = ledger.plan_tokens([s.id for s in verified])
    if not verified:
        return [f"no verified sample in {cfg.paths.state_dir}"], {}
    model = loading.load_model(cfg.target.model_path, captured["dtype"], "auto")
    problems: list[str] = []
    figures: dict = {}
    for sample in verified:
        found, figures[sample.id] = compare(model, cfg.paths.dataset_dir / sample.path,
                                            sample.id, token_ids(planned[sample.id][0]),
                                            captured["layer_ids"], captured["fingerprint"])
        problems += found
    return problems, {"engine": engines.get(cfg.target.engine).name, "dumps": figures}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="a small Llama: HF folder or hub name")
    ap.add_argument("--dataset", type=Path, metavar="CONFIG",
                    help="instead of starting SGLang: compare the dataset of this config's "
                         "finished run with transformers (--samples of its verified samples)")
    ap.add_argument("--python", default=sys.executable, help="the interpreter with SGLang")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--port", type=int, default=30777)
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16"))
    ap.add_argument("--dump-dtype", default=None, choices=DUMP_DTYPES,
                    help="how the dumps store the states ([extract] dump_dtype; default: --dtype)")
    ap.add_argument("--samples", type=int, default=len(PROMPTS))
    ap.add_argument("--work", type=Path, default=None, help="folder kept for inspection")
    ap.add_argument("--startup-timeout", type=float, default=900.0)
    ap.add_argument("--mem-fraction", type=float, default=SGLangSettings().mem_fraction)
    ap.add_argument("--extra-arg", action="append", default=[], dest="extra_args",
                    help="one more server flag, as [sglang] extra_args holds it (repeatable)")
    ap.add_argument("--overhead", type=int, default=0, metavar="ROUNDS",
                    help="also measure capture overhead: prefill tokens/s with and without "
                         "capture over this many rounds of 128 synthetic 1024-token prompts")
    ap.add_argument("--summary", type=Path, default=None, help="write the figures here (JSON)")
    args = ap.parse_args(argv)
    if args.dataset:
        problems, summary = check_dataset(args.dataset, args.samples)
        return report(problems, summary, args.summary)
    if not args.model:
        ap.error("--model or --dataset is required")

    problem = check_version(args.python)
    if problem:
        print(problem, file=sys.stderr)
        return 2
    work = args.work or Path(tempfile.mkdtemp(prefix="eagle3d-sglang-smoke-"))
    model_path = Path(args.model)
    tokenizer = loading.load_tokenizer(model_path)
    hf_config = loading.load_config(model_path)
    layer_ids = contract_mod.default_layer_ids(hf_config.num_hidden_layers)
    chats = [tokenize(tokenizer, prompt) for prompt in PROMPTS[:args.samples]]
    samples, planned = plan_samples([c[0] for c in chats], [c[1] for c in chats])
    bench: dict[str, list[int]] = {}
    if args.overhead:
        ids = synthetic(128, 1024, hf_config.vocab_size)
        bench, more = plan_samples(ids, [bytes(len(i)) for i in ids], len(planned))
        planned += more
    paths = PathsConfig(work / "state", work / "spool", work / "dataset", work / "train")
    for folder in (paths.state_dir, paths.spool_dir):
        folder.mkdir(parents=True, exist_ok=True)
    with Ledger(layout.ledger(paths.state_dir)) as ledger:
        ledger.add_planned(planned, [], {})
    contract = {"layer_ids": layer_ids, "dtype": args.dtype,
                "dump_dtype": args.dump_dtype or args.dtype, "target": args.model,
                "target_fingerprint": loading.fingerprint_file_or_folder(model_path),
                "hidden_size": hf_config.hidden_size, "num_layers": hf_config.num_hidden_layers}
    contract["fingerprint"] = contract_mod.fingerprint(contract)
    longest = max(map(len, [*samples.values(), *bench.values()]))
    cfg = Config(path=work / "smoke.toml",
                 target=TargetConfig(model=args.model, engine=NAME, dtype=args.dtype,
                                     model_path=model_path),
                 data=DataConfig(source="smoke", max_tokens=longest), paths=paths,
                 engine_sections={SETTINGS.name: written(SGLangSettings(
                     python=args.python, tp=args.tp, port=args.port,
                     mem_fraction=args.mem_fraction, extra_args=tuple(args.extra_args)))})
    print(f"{len(samples)} samples, layers {layer_ids}, work folder {work}", flush=True)

    summary: dict = {"layers": layer_ids}
    with serving(cfg, contract, args.startup_timeout) as client:
        events = prefill_all(client, samples)
        wait_for_dumps(paths.spool_dir, samples)
        if args.overhead:
            summary["overhead"] = measure_overhead(client, paths.spool_dir, bench, args.overhead)
    problems = [f"{e['ids'][0]}: {e['error']}" for e in events if e["event"] == "error"]
    model = loading.load_model(model_path, args.dtype, "auto")
    summary["dumps"] = {}
    for sid, ids in samples.items():
        found, figures = compare(model, paths.spool_dir / dumpformat.dump_name(sid), sid, ids,
                                 layer_ids, contract["fingerprint"])
        problems += found
        summary["dumps"][sid] = {"tokens": len(ids), **figures}
    return report(problems, summary, args.summary)


def report(problems: list[str], summary: dict, out: Path | None) -> int:
    for p in problems:
        print("PROBLEM", p)
    summary["problems"] = problems
    if out:
        out.write_text(json.dumps(summary, indent=1))
    print("SMOKE TEST", "FAILED" if problems else "PASSED")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
