"""Smoke test of the SGLang engine, for an operator on a GPU box with SGLang installed:

    python -m eagle3d.capture.sglang_smoke --model meta-llama/Llama-3.2-1B-Instruct

It starts SGLang exactly as the daemon would (same command, same capture plugin), prefills a
handful of chat prompts through the same client, and compares every dump with the hidden states
Hugging Face transformers computes for the same token ids (the transformers engine's reference:
`hidden_states[i]` for the contract's layer ids, and the last entry, which is after the final
norm). Exit status 0 when every dump matches, 1 when one does not, 2 when it cannot run.
See docs/sglang.md.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from eagle3d.capture import contract as contract_mod
from eagle3d.capture import dumpformat, target
from eagle3d.capture.sglang_client import SGLangClient
from eagle3d.capture.sglang_launcher import check_version, launch_command, shell_line
from eagle3d.statemachine.config import (Config, DataConfig, PathsConfig, SGLangConfig,
                                         TargetConfig)
from eagle3d.statemachine.ledger import Ledger, PlannedSample

PROMPTS = ["What is the capital of France?",
           "Write a haiku about the sea.",
           "Explain speculative decoding in two sentences.",
           "List three prime numbers larger than 100.",
           "Translate 'good morning' into German and Spanish.",
           "Why is the sky blue?"]
MIN_COSINE = 0.99  # bf16 kernels differ between the engines; a wrong layer scores far lower


def tokenize(tokenizer, prompt: str) -> tuple[list[int], bytes]:
    """A one-turn chat with the model's answer slot; the mask marks no token (no answer)."""
    messages = [{"role": "user", "content": prompt}]
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    else:
        ids = tokenizer(prompt)["input_ids"]
    return list(ids), bytes(len(ids))


def sample_id(ids: list[int]) -> str:
    import numpy as np
    return hashlib.blake2b(np.asarray(ids, dtype="<i4").tobytes(), digest_size=16).hexdigest()


def run_sglang(cfg: Config, contract: dict, samples: dict[str, list[int]],
               startup_timeout: float) -> list[dict]:
    argv, env = launch_command(cfg, contract)
    print("engine command:", shell_line(argv, env), flush=True)
    server = subprocess.Popen(argv, env={**os.environ, **env}, start_new_session=True)
    client = SGLangClient(f"http://{cfg.sglang.host}:{cfg.sglang.port}", 4)
    try:
        deadline = time.monotonic() + startup_timeout
        while not client.healthy(timeout=2.0):
            if server.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"SGLang did not come up (exit status {server.poll()})")
            time.sleep(2.0)
        client.submit(list(samples.items()))
        events: list[dict] = []
        while len(events) < len(samples):
            events += client.poll()
            time.sleep(0.1)
        names = {dumpformat.dump_name(s) for s in samples}
        wait_until = time.monotonic() + 30.0  # dumps are written after the answer, on a thread
        while not names <= {p.name for p in cfg.paths.spool_dir.iterdir()}:
            if time.monotonic() > wait_until:
                break
            time.sleep(0.2)
        return events
    finally:
        client.close()
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)


def compare(model, spool: Path, sid: str, ids: list[int], layer_ids: list[int],
            fingerprint: str) -> list[str]:
    """Problems with one dump; empty when it matches the transformers reference."""
    import torch
    from safetensors.torch import load_file
    path = spool / dumpformat.dump_name(sid)
    if not path.exists():
        return [f"{sid}: no dump in {spool}"]
    header = dumpformat.read_header(path)
    problems = [] if header.contract == fingerprint else [f"{sid}: contract {header.contract}"]
    dump = load_file(str(path))
    if dump["input_ids"].tolist() != ids:
        return problems + [f"{sid}: dumped {header.tokens} token ids differ from the {len(ids)} sent"]
    with torch.no_grad():
        out = model(torch.tensor([ids], device=model.device), output_hidden_states=True)
    hs = out.hidden_states
    reference = {"aux_hidden_states": torch.cat([hs[i][0] for i in layer_ids], dim=-1),
                 "last_hidden_state": hs[-1][0]}
    for name, ref in reference.items():
        got = dump[name].to(ref.device, torch.float32)
        ref = ref.float()
        width = ref.shape[1] // (len(layer_ids) if name == "aux_hidden_states" else 1)
        for k in range(ref.shape[1] // width):
            part = slice(k * width, (k + 1) * width)
            cos = torch.nn.functional.cosine_similarity(got[:, part], ref[:, part], dim=-1)
            print(f"  {sid[:8]} {name}[{k}]: min cosine {cos.min().item():.5f}, max |diff| "
                  f"{(got[:, part] - ref[:, part]).abs().max().item():.4g}")
            if cos.min().item() < MIN_COSINE:
                problems.append(f"{sid}: {name} part {k} differs (min cosine {cos.min():.4f})")
    return problems


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="a small Llama: HF folder or hub name")
    ap.add_argument("--python", default=sys.executable, help="the interpreter with SGLang")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--port", type=int, default=30777)
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16"))
    ap.add_argument("--samples", type=int, default=len(PROMPTS))
    ap.add_argument("--work", type=Path, default=None, help="folder kept for inspection")
    ap.add_argument("--startup-timeout", type=float, default=900.0)
    args = ap.parse_args(argv)

    problem = check_version(args.python)
    if problem:
        print(problem, file=sys.stderr)
        return 2
    work = args.work or Path(tempfile.mkdtemp(prefix="eagle3d-sglang-smoke-"))
    model_path = Path(args.model)
    tokenizer = target.load_tokenizer(model_path)
    hf_config = target.load_config(model_path)
    layer_ids = contract_mod.default_layer_ids(hf_config.num_hidden_layers)
    samples, planned = {}, []
    for idx, prompt in enumerate(PROMPTS[:args.samples]):
        ids, mask = tokenize(tokenizer, prompt)
        raw = b"".join(i.to_bytes(4, "little", signed=True) for i in ids)
        sid = sample_id(ids)
        samples[sid] = ids
        planned.append(PlannedSample(sid, idx, len(ids), 0, dumpformat.ids_hash(raw), raw, mask))
    paths = PathsConfig(work / "state", work / "spool", work / "dataset", work / "train")
    for folder in (paths.state_dir, paths.spool_dir):
        folder.mkdir(parents=True, exist_ok=True)
    with Ledger(paths.state_dir / "ledger.sqlite") as ledger:
        ledger.add_planned(planned, [], {})
    contract = {"layer_ids": layer_ids, "dtype": args.dtype, "target": args.model,
                "hidden_size": hf_config.hidden_size, "num_layers": hf_config.num_hidden_layers}
    contract["fingerprint"] = contract_mod.fingerprint(contract)
    cfg = Config(path=work / "smoke.toml",
                 target=TargetConfig(model=args.model, engine="sglang", dtype=args.dtype,
                                     model_path=model_path),
                 data=DataConfig(source="smoke", max_tokens=max(map(len, samples.values()))),
                 paths=paths, sglang=SGLangConfig(python=args.python, tp=args.tp, port=args.port))
    print(f"{len(samples)} samples, layers {layer_ids}, work folder {work}", flush=True)

    events = run_sglang(cfg, contract, samples, args.startup_timeout)
    problems = [f"{e['ids'][0]}: {e['error']}" for e in events if e["event"] == "error"]
    model = target.load_model(model_path, args.dtype, "auto")
    for sid, ids in samples.items():
        problems += compare(model, paths.spool_dir, sid, ids, layer_ids, contract["fingerprint"])
    for p in problems:
        print("PROBLEM", p)
    print("SMOKE TEST", "FAILED" if problems else "PASSED")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
