"""The drafter in speculators' format (vllm-project/speculators), which vLLM loads from
`--speculative-config '{"model": DIR, ...}'` and speculators' own `Eagle3DraftModel` trains on.

Written from SGLang's export (drafter/export.py), the trained drafter as it is served, through
speculators' own config classes (`Eagle3SpeculatorConfig`, `SpeculatorsConfig`): targets
speculators 0.9 and the vLLM releases whose speculators reader
(vllm/transformers_utils/configs/speculators/algos.py `update_eagle3`) reads `norm_before_fc`,
`fc_norm` and `norm_output`. That reader fills a missing `norm_before_residual` with True, the
opposite of this drafter, and missing EAGLE-3.1 switches with False: every field is written.

- Weights: `midlayer.*` as `layers.0.*` (speculators' module names; vLLM reads both), `fc`,
  `norm`, `lm_head`, and the vocabulary maps `d2t` (draft id + d2t = target id, which is what
  vLLM's `draft_id_to_target_id` and speculators' `d2t` both hold) and `t2d`. The token
  embedding is not written: vLLM shares the target's, speculators loads it from the verifier.
- Layer ids: the contract's, as vLLM reads them (target/layers.py `vllm_layer_ids`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file
from speculators import SpeculatorsConfig, VerifierConfig
from speculators.models.eagle3 import Eagle3SpeculatorConfig
from speculators.proposals.greedy import GreedyTokenProposalConfig
from transformers import LlamaConfig

from eagle3d.drafter.export import CONFIG, WEIGHTS, write_folder
from eagle3d.statemachine.entry import Refusal
from eagle3d.target.layers import vllm_layer_ids

SGLANG_LAYER, LAYER = "midlayer.", "layers.0."
TOP_LEVEL = ("fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d")
LAYER_WEIGHTS = tuple(f"{SGLANG_LAYER}{name}.weight" for name in (
    "input_layernorm", "hidden_norm", "post_attention_layernorm", "self_attn.q_proj",
    "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj",
    "mlp.down_proj"))
# This drafter's layer, as speculators' switches name its structure: hidden_norm normalises
# the feature but the residual stream carries it unnormed; fc reads the three captured states
# as they are (no norm of their concatenation, none per state); the next draft step reads the
# layer's output before the final norm (EAGLE-3, not 3.1).
STRUCTURE = {"norm_before_residual": False, "norm_before_fc": False, "fc_norm": False,
             "norm_output": False}
NUM_AUX_HIDDEN_STATES = 3  # fc reads 3·H: the contract's three layers


def refusal(config: dict[str, Any], names: set[str]) -> str | None:
    """Why this SGLang export has no faithful speculators form, or None."""
    if "ttt_steps" not in config.get("eagle3d", {}):  # an export older than ttt_steps in it
        return "the export does not name the ttt_steps it was trained with (an export of an " \
               "older eagle3d): train it with this version"
    unknown = names - set(TOP_LEVEL) - set(LAYER_WEIGHTS)
    if unknown:
        return f"the export holds weights this format has no place for: {sorted(unknown)}"
    missing = (set(TOP_LEVEL) | set(LAYER_WEIGHTS)) - names
    if missing:
        return f"the export lacks {sorted(missing)}"
    if config["target_hidden_size"] != config["hidden_size"]:
        # Eagle3DraftModel (speculators 0.9) sizes fc as 3 x hidden_size, whatever
        # target_hidden_size says.
        return (f"speculators' EAGLE-3 model needs the target's hidden size "
                f"({config['target_hidden_size']}) equal to the drafter's "
                f"({config['hidden_size']})")
    if len(config["eagle3d"]["contract_layer_ids"]) != NUM_AUX_HIDDEN_STATES:
        return f"fc reads {NUM_AUX_HIDDEN_STATES} captured states, the contract names " \
               f"{len(config['eagle3d']['contract_layer_ids'])} layers"
    return None


def layer_config(sglang: dict[str, Any]) -> dict[str, Any]:
    """`transformer_layer_config`: the decoder layer as a Llama layer, every field written
    (transformers 4.x readers take rope_theta and rope_scaling, 5.x rope_parameters)."""
    keys = ("vocab_size", "hidden_size", "intermediate_size", "num_attention_heads",
            "num_key_value_heads", "head_dim", "hidden_act", "rms_norm_eps",
            "max_position_embeddings", "rope_theta", "rope_scaling", "rope_parameters",
            "attention_bias", "mlp_bias", "tie_word_embeddings")
    return {"model_type": "llama", "num_hidden_layers": 1,
            "num_aux_hidden_states": NUM_AUX_HIDDEN_STATES, **{k: sglang[k] for k in keys}}


def speculators_config(sglang: dict[str, Any], verifier: str) -> dict[str, Any]:
    """config.json, built by speculators' own classes from SGLang's config.json."""
    ours = sglang["eagle3d"]
    layer = layer_config(sglang)
    legacy_rope = ("rope_theta", "rope_scaling")  # transformers 5 folds them into
    # rope_parameters; written back below
    config = Eagle3SpeculatorConfig(
        transformer_layer_config=LlamaConfig(**{k: v for k, v in layer.items()
                                                if k not in legacy_rope}),
        draft_vocab_size=sglang["draft_vocab_size"],
        target_hidden_size=sglang["target_hidden_size"],
        eagle_aux_hidden_state_layer_ids=vllm_layer_ids(ours["contract_layer_ids"]),
        embed_requires_grad=False, **STRUCTURE,
        speculators_config=SpeculatorsConfig(
            algorithm="eagle3",
            # vLLM drafts this many tokens unless --speculative-config says otherwise: as deep
            # as training unrolled.
            proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=ours["ttt_steps"])],
            default_proposal_method="greedy",
            verifier=VerifierConfig(name_or_path=verifier,
                                    architectures=[ours["target_architecture"]])),
    ).to_dict()
    config["transformer_layer_config"] |= layer
    config["eagle3d"] = dict(ours)
    return config


def speculators_tensors(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {name.replace(SGLANG_LAYER, LAYER, 1) if name.startswith(SGLANG_LAYER) else name: t
            for name, t in tensors.items()}


def export_speculators(sglang_dir: Path, out_dir: Path, verifier: str) -> Path:
    """Write `out_dir` (config.json, model.safetensors) from SGLang's export in `sglang_dir`;
    `verifier` is the target's name or folder (speculators loads its embedding from there)."""
    sglang = json.loads((Path(sglang_dir) / CONFIG).read_text())
    tensors = load_file(str(Path(sglang_dir) / WEIGHTS))
    why = refusal(sglang, set(tensors))
    if why:
        raise Refusal(f"no speculators export of {sglang_dir}: {why}")
    return write_folder(Path(out_dir), speculators_config(sglang, verifier),
                        speculators_tensors(tensors))


def serve_hint(out_dir: Path) -> str:
    """vLLM's option for this export (not run here: vLLM does not run on these machines)."""
    config = json.loads((Path(out_dir) / CONFIG).read_text())
    steps = config["speculators_config"]["proposal_methods"][0]["speculative_tokens"]
    spec = {"method": "eagle3", "model": str(out_dir), "num_speculative_tokens": steps}
    return f"--speculative-config '{json.dumps(spec)}'"
