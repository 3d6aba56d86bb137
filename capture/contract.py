"""The capture contract (`<dataset>/capture.toml`): what every dump in a dataset was made with.

A dataset is never mixed across two contracts: every dump carries the contract's fingerprint and
ingest rejects any other. Layer ids are always in one convention here: id i is the hidden state
entering decoder layer i, which is Hugging Face's `hidden_states[i]`. Engines and exports that
speak another convention translate at their edge (see capture/layers.py).
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path
from typing import Any

import tomli_w

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

from eagle3d.statemachine.atomic import atomic_write_bytes

FILE = "capture.toml"
LAYER_CONVENTION = "hidden state entering decoder layer i (HF hidden_states[i])"
FINAL_STATE = "post_norm"

# The fields that bind: two datasets with equal values here can be mixed, others cannot.
BINDING = ("format", "target", "target_fingerprint", "tokenizer_fingerprint",
           "chat_template_fingerprint", "layer_ids", "layer_convention", "final_state", "dtype",
           "hidden_size", "num_layers", "vocab_size")


def default_layer_ids(num_layers: int) -> list[int]:
    """EAGLE-3's usual capture for an N-layer target, in our convention: [2, N//2, N-3]
    (what SGLang captures by default for Llama)."""
    return [2, num_layers // 2, num_layers - 3]


def fingerprint(contract: dict[str, Any]) -> str:
    binding = {k: contract.get(k) for k in BINDING}
    return hashlib.blake2b(json.dumps(binding, sort_keys=True).encode(), digest_size=16).hexdigest()


def read(dataset_dir: Path) -> dict[str, Any] | None:
    path = Path(dataset_dir) / FILE
    try:
        data = tomllib.loads(path.read_text())
    except FileNotFoundError:
        return None
    return data


def write(dataset_dir: Path, contract: dict[str, Any]) -> dict[str, Any]:
    """Write the contract with its fingerprint; returns what was written."""
    doc = dict(contract)
    doc["fingerprint"] = fingerprint(contract)
    atomic_write_bytes(Path(dataset_dir) / FILE, tomli_w.dumps(doc).encode())
    return doc


def differences(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    return [f"{k}: {a.get(k)!r} -> {b.get(k)!r}" for k in BINDING if a.get(k) != b.get(k)]
