"""The capture contract (`<dataset>/capture.toml`): what every dump in a dataset was made with.

A dataset is never mixed across two contracts: every dump carries the contract's fingerprint and
ingest rejects any other. Layer ids are always in one convention here: id i is the hidden state
entering decoder layer i, which is Hugging Face's `hidden_states[i]`. Engines and exports that
speak another convention translate at their edge (see target/layers.py).
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

from eagle3d.statemachine import layout
from eagle3d.statemachine.atomic import atomic_write_bytes
from eagle3d.statemachine.entry import Refusal
LAYER_CONVENTION = "hidden state entering decoder layer i (HF hidden_states[i])"
FINAL_STATE = "post_norm"

# The fields that bind: two datasets with equal values here can be mixed, others cannot.
# `dtype` is the target's compute dtype; `dump_dtype` (how the dumps store the states) binds
# too, through `_binding`.
BINDING = ("format", "target", "target_fingerprint", "tokenizer_fingerprint",
           "chat_template_fingerprint", "layer_ids", "layer_convention", "final_state", "dtype",
           "hidden_size", "num_layers", "vocab_size")


def default_layer_ids(num_layers: int) -> list[int]:
    """EAGLE-3's usual capture for an N-layer target, in our convention: [2, N//2, N-3]
    (what SGLang captures by default for Llama). Below 8 layers these are not three increasing
    layers: ValueError."""
    ids = [2, num_layers // 2, num_layers - 3]
    if not ids[0] < ids[1] < ids[2]:
        raise ValueError(f"a {num_layers}-layer target has no default capture ({ids} is not "
                         "three increasing layer ids): list them in [target] aux_layers")
    return ids


def dump_dtype(contract: dict[str, Any]) -> str:
    """How the dataset's dumps store the hidden states. A contract written before dump
    precisions has no `dump_dtype`: its dumps hold the states as the target computed them."""
    return contract.get("dump_dtype") or contract.get("dtype") or ""


def _binding(contract: dict[str, Any]) -> dict[str, Any]:
    """The binding fields. `dump_dtype` is one only where it differs from `dtype`, so a contract
    whose dumps store the states as computed keeps the fingerprint it had before dump precisions
    existed, and old datasets stay usable."""
    binding = {k: contract.get(k) for k in BINDING}
    if dump_dtype(contract) != contract.get("dtype"):
        binding["dump_dtype"] = dump_dtype(contract)
    return binding


def fingerprint(contract: dict[str, Any]) -> str:
    binding = json.dumps(_binding(contract), sort_keys=True).encode()
    return hashlib.blake2b(binding, digest_size=16).hexdigest()


def read(dataset_dir: Path) -> dict[str, Any] | None:
    try:
        data = tomllib.loads(layout.contract_file(dataset_dir).read_text())
    except FileNotFoundError:
        return None
    return data


def read_checked(dataset_dir: Path) -> dict[str, Any]:
    """The contract an engine captures under: it must exist and match its own fingerprint."""
    path = layout.contract_file(dataset_dir)
    doc = read(dataset_dir)
    if doc is None:
        raise Refusal(f"no capture contract at {path}; the planner writes it, run it first")
    if doc.get("fingerprint") != fingerprint(doc):
        raise Refusal(f"{path} does not match its fingerprint (edited by hand?)")
    return doc


def write(dataset_dir: Path, contract: dict[str, Any]) -> dict[str, Any]:
    """Write the contract with its fingerprint; returns what was written."""
    import tomli_w  # here, not at the top: the trainer only reads contracts, and GPU images
    # without tomli_w must still run it
    doc = dict(contract)
    doc["fingerprint"] = fingerprint(contract)
    atomic_write_bytes(layout.contract_file(dataset_dir), tomli_w.dumps(doc).encode())
    return doc


def differences(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    pairs = {k: (a.get(k), b.get(k)) for k in BINDING}
    pairs["dump_dtype"] = (dump_dtype(a), dump_dtype(b))
    return [f"{k}: {x!r} -> {y!r}" for k, (x, y) in pairs.items() if x != y]
