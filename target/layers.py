"""Layer-id conventions. Ours (the capture contract's): id i is the hidden state entering decoder
layer i, HF's `hidden_states[i]`. SGLang's model classes read the ids given to
`set_eagle3_layers_to_capture` (from a draft's config.json, or from our capture plugin)
differently per family; off by one here silently ruins a drafter, so every translation lives in
this module and is pinned by tests.

What SGLang does with explicit ids, read in sglang 0.5.14 and 0.5.23 (python/sglang/srt/models/):
- llama.py `LlamaForCausalLM.set_eagle3_layers_to_capture` (and qwen2.py, qwen3.py; mistral.py
  subclasses Llama): `layers_to_capture = [k + 1 for k in ids]`, where `layers_to_capture`
  holds indices of the decoder layers whose *input* is captured, i.e. our convention.
- deepseek_v2.py `DeepseekV2ForCausalLM.set_eagle3_layers_to_capture` (DeepSeek-V3 and V3.2
  share the class): adds 1 only when the first id is 1, and otherwise keeps the ids as they are
  (before 0.5.13 it always added 1).
- kimi_k25.py `KimiK25ForConditionalGeneration.set_eagle3_layers_to_capture` delegates to its
  `language_model`, a `DeepseekV3ForCausalLM`.

vLLM reads `eagle_aux_hidden_state_layer_ids` from the draft's config as they are
(gpu_model_runner.py `_get_eagle3_aux_layers_from_config`), and its model classes capture
`hidden_states + residual` before running layer `idx` when `idx` is one of them (llama.py, and
the shared `EagleModelMixin` of the other families): our convention, for every family.
"""

from __future__ import annotations

from typing import Iterable

LLAMA_FAMILY = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "MistralForCausalLM")
DEEPSEEK_FAMILY = ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM", "DeepseekV32ForCausalLM")
# Classes that hand the call to the language model they wrap.
DELEGATES = {"KimiK25ForConditionalGeneration": "DeepseekV3ForCausalLM"}


def known_architecture(class_names: Iterable[str]) -> str | None:
    """The first name with a known convention, e.g. from a model class's MRO (a subclass such
    as Phi3ForCausalLM inherits LlamaForCausalLM's method)."""
    for name in class_names:
        if name in LLAMA_FAMILY or name in DEEPSEEK_FAMILY or name in DELEGATES:
            return name
    return None


def _increasing(contract_ids: list[int]) -> list[int]:
    ids = list(contract_ids)
    if not ids or sorted(set(ids)) != ids:
        raise ValueError(f"layer ids must be increasing and distinct, got {ids}")
    return ids


def sglang_layer_ids(contract_ids: list[int], target_architecture: str,
                     num_layers: int | None = None) -> list[int]:
    """The ids to pass to SGLang's `set_eagle3_layers_to_capture` on a target of
    `target_architecture` so that it captures exactly the contract's layers."""
    ids = _increasing(contract_ids)
    if num_layers is not None and ids[-1] >= num_layers:
        # Capturing happens at a layer's input; nothing follows the last layer.
        raise ValueError(f"layer id {ids[-1]} does not enter any of the {num_layers} layers")
    architecture = DELEGATES.get(target_architecture, target_architecture)
    if min(ids) < 1:
        raise ValueError("SGLang cannot capture the embedding output (id 0)")
    if architecture in LLAMA_FAMILY:
        return [i - 1 for i in ids]
    if architecture in DEEPSEEK_FAMILY:
        if ids[0] == 1:
            # Any list SGLang receives that starts with 1 is shifted as a whole to start at 2.
            raise ValueError(f"SGLang's DeepSeek loader cannot capture the input of layer 1 "
                             f"({target_architecture}); choose a first layer id of 2 or more")
        if ids[0] == 2:
            # [1, ...] is shifted by one in every SGLang version, old and new rule alike.
            return [i - 1 for i in ids]
        return ids
    raise ValueError(f"no known SGLang layer-id convention for {target_architecture}")


def draft_config_layer_ids(contract_ids: list[int], target_architecture: str) -> list[int]:
    """The ids to write into the exported draft's config.json
    (`eagle_config.eagle_aux_hidden_state_layer_ids`) so that SGLang, serving the target of
    `target_architecture`, captures exactly the contract's layers. SGLang's model runner passes
    them to the same `set_eagle3_layers_to_capture` as the capture plugin does."""
    return sglang_layer_ids(contract_ids, target_architecture)


def vllm_layer_ids(contract_ids: list[int]) -> list[int]:
    """The ids to write into a speculators-format draft's config.json so that vLLM captures
    exactly the contract's layers: the same ids (module docstring)."""
    ids = _increasing(contract_ids)
    if ids[0] < 1:
        # Before layer 0 vLLM's residual is still None: there is nothing to add it to.
        raise ValueError("vLLM cannot capture the embedding output (id 0)")
    return ids
