"""The capture contract (`<dataset>/capture.toml`): what every dump in a dataset was made with.

A dataset is never mixed across two contracts: every dump carries the contract's fingerprint and
ingest rejects any other. Layer ids are always in one convention here: id i is the hidden state
entering decoder layer i, which is Hugging Face's `hidden_states[i]`. Engines and exports that
speak another convention translate at their edge (see target/layers.py).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

from eagle3d.statemachine import digests, layout
from eagle3d.statemachine.atomic import atomic_write_bytes
from eagle3d.statemachine.config_schema import Config, contract_fields
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


def generate_record(cfg: Config) -> dict[str, Any]:
    """What a contract records of the [generate] settings: where the target writes the
    answers, the settings that decide what it writes (Config.generate_keys: answers only above
    1, so a contract of one answer per conversation keeps the fingerprint it had before answers
    existed, and its dumps stay valid); else nothing."""
    record = cfg.generate_keys()
    return {"generate": record} if record else {}


def _binding(contract: dict[str, Any]) -> dict[str, Any]:
    """The binding fields. `dump_dtype` is one only where it differs from `dtype`, and
    `generate` only where recorded, so a contract whose dumps store the states as computed, or
    written before the generate settings were recorded, keeps the fingerprint it had, and old
    datasets stay usable."""
    binding = {k: contract.get(k) for k in BINDING}
    if dump_dtype(contract) != contract.get("dtype"):
        binding["dump_dtype"] = dump_dtype(contract)
    if contract.get("generate") is not None:
        binding["generate"] = contract["generate"]
    return binding


def fingerprint(contract: dict[str, Any]) -> str:
    return digests.json_digest(_binding(contract))


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
    """What binds differently in contract `b` than in `a`, the dataset's: generate settings
    only where `a` records them (a contract written before they were cannot tell)."""
    pairs = {k: (a.get(k), b.get(k)) for k in BINDING}
    pairs["dump_dtype"] = (dump_dtype(a), dump_dtype(b))
    if a.get("generate") is not None:
        pairs.update(_generate_pairs(a["generate"], b.get("generate")))
    return [f"{k}: {x!r} -> {y!r}" for k, (x, y) in pairs.items() if x != y]


def _generate_pairs(a: dict[str, Any], b: dict[str, Any] | None) -> dict[str, tuple[Any, Any]]:
    """The recorded [generate] settings of two contracts side by side, one setting a pair (a
    shard of another K names `generate.answers`), `answers` 1 where left out."""
    if b is None:
        return {"generate": (a, None)}
    left_out = {key.name: key.binds.left_out_at for _, key in contract_fields()
                if key.binds.left_out_at is not None}
    a, b = {**left_out, **a}, {**left_out, **b}
    return {f"generate.{k}": (a.get(k), b.get(k)) for k in {**a, **b}}


def config_problem(doc: dict[str, Any], cfg: Config, target_fingerprint: str) -> str | None:
    """Why the config cannot capture into the dataset of contract `doc`, or None: every setting
    the contract binds that the config decides, the target's weights (`target_fingerprint`, of
    the config's model) among them. The [data] slice is the ledger's (plan.* keys)."""
    try:
        layer_ids = list(cfg.target.aux_layers or default_layer_ids(doc.get("num_layers", 0)))
    except ValueError:
        layer_ids = []
    generate = generate_record(cfg).get("generate")
    pairs = {"[target] model": (doc.get("target"), cfg.target.model),
             "[target] model's weights (fingerprint)": (doc.get("target_fingerprint"),
                                                        target_fingerprint),
             "[target] dtype": (doc.get("dtype"), cfg.target.dtype),
             "[target] aux_layers (layer ids)": (doc.get("layer_ids"), layer_ids),
             "[extract] dump_dtype": (dump_dtype(doc), cfg.extract.dump_dtype)}
    if doc.get("generate") is not None:
        pairs["[generate]"] = (doc["generate"], generate)
    changed = [f"{k} is {y!r}, the contract says {x!r}" for k, (x, y) in pairs.items() if x != y]
    if not changed:
        return None
    return (f"{cfg.path} does not match the dataset's capture contract "
            f"{layout.contract_file(cfg.paths.dataset_dir)}: {'; '.join(changed)}. Put the "
            "settings back and reload (systemctl reload eagle3d): a reload of another contract "
            "switches to that contract's own run")
