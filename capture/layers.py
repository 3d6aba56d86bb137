"""Layer-id conventions. Ours (the capture contract's): id i is the hidden state entering decoder
layer i, HF's `hidden_states[i]`. SGLang's model classes read the ids of a draft's config.json
differently per family; off by one here silently ruins a drafter, so every translation lives in
this module and is pinned by tests.
"""

from __future__ import annotations

# What SGLang's LlamaForCausalLM.set_eagle3_layers_to_capture does with explicit ids: it adds one
# (an explicit id k means "the output of layer k", which is the input of layer k + 1).
LLAMA_FAMILY = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "MistralForCausalLM")


def draft_config_layer_ids(contract_ids: list[int], target_architecture: str) -> list[int]:
    """The ids to write into the exported draft's config.json
    (`eagle_config.eagle_aux_hidden_state_layer_ids`) so that SGLang, serving the target of
    `target_architecture`, captures exactly the contract's layers."""
    if target_architecture in LLAMA_FAMILY:
        if min(contract_ids) < 1:
            raise ValueError("SGLang's Llama loader cannot capture the embedding output (id 0)")
        return [i - 1 for i in contract_ids]
    raise ValueError(f"no known SGLang layer-id convention for {target_architecture}")
