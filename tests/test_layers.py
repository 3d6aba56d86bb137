"""The contract's layer ids → what SGLang is told, per model family. Each `sglang_*` function below
transcribes what SGLang's `set_eagle3_layers_to_capture` does with explicit ids (the source files
are named in target/layers.py); the mapping is right when SGLang ends up capturing exactly the
contract's layers (`layers_to_capture` holds the indices of the layers whose input is captured,
which is the contract's convention)."""

from __future__ import annotations

import itertools

import pytest

from eagle3d.target import layers
from eagle3d.dataset.contract import default_layer_ids


def sglang_llama(ids: list[int]) -> list[int]:  # models/llama.py, qwen2.py, qwen3.py
    return [k + 1 for k in ids]


def sglang_deepseek(ids: list[int]) -> list[int]:  # models/deepseek_v2.py, sglang >= 0.5.13
    return [k + 1 for k in ids] if ids and ids[0] == 1 else list(ids)


def sglang_deepseek_before_0_5_13(ids: list[int]) -> list[int]:
    return [k + 1 for k in ids]


SGLANG_RULES = {"LlamaForCausalLM": sglang_llama, "Qwen3ForCausalLM": sglang_llama,
                "DeepseekV3ForCausalLM": sglang_deepseek,
                # models/kimi_k25.py hands the call to its DeepseekV3ForCausalLM language model.
                "KimiK25ForConditionalGeneration": sglang_deepseek}

# (architecture, decoder layers, ids to pass for the default [2, N//2, N-3])
TARGETS = [("LlamaForCausalLM", 32, [1, 15, 28]),        # Llama-3.1-8B
           ("LlamaForCausalLM", 80, [1, 39, 76]),        # Llama-3.1-70B
           ("DeepseekV3ForCausalLM", 61, [1, 29, 57]),   # DeepSeek-V3
           ("KimiK25ForConditionalGeneration", 61, [1, 29, 57])]  # Kimi-K2.5


@pytest.mark.parametrize("arch,num_layers,expected", TARGETS)
def test_default_capture_maps_to_what_sglang_captures(arch, num_layers, expected):
    contract_ids = default_layer_ids(num_layers)
    ids = layers.sglang_layer_ids(contract_ids, arch, num_layers)
    assert ids == expected
    assert SGLANG_RULES[arch](ids) == contract_ids
    assert layers.draft_config_layer_ids(contract_ids, arch) == expected


def test_a_target_too_shallow_for_the_default_capture_is_told_to_list_its_layers():
    assert default_layer_ids(8) == [2, 4, 5]
    with pytest.raises(ValueError, match="6-layer target has no default capture"):
        default_layer_ids(6)


def test_deepseek_default_ids_also_hold_under_the_older_rule():
    ids = layers.sglang_layer_ids([2, 30, 58], "DeepseekV3ForCausalLM")
    assert sglang_deepseek_before_0_5_13(ids) == [2, 30, 58]


@pytest.mark.parametrize("arch", sorted(SGLANG_RULES))
def test_every_choice_of_layers_is_captured_exactly_or_refused(arch):
    num_layers = 12
    deepseek = layers.DELEGATES.get(arch, arch) in layers.DEEPSEEK_FAMILY
    for ids in itertools.combinations(range(num_layers), 3):
        ids = list(ids)
        unrepresentable = ids[0] == 0 or (deepseek and ids[0] == 1)
        if unrepresentable:
            with pytest.raises(ValueError):
                layers.sglang_layer_ids(ids, arch, num_layers)
        else:
            assert SGLANG_RULES[arch](layers.sglang_layer_ids(ids, arch, num_layers)) == ids


def test_bad_ids_and_unknown_models_are_refused_with_the_reason():
    with pytest.raises(ValueError, match="embedding"):
        layers.draft_config_layer_ids([0, 15, 27], "LlamaForCausalLM")
    with pytest.raises(ValueError, match="layer 1"):
        layers.sglang_layer_ids([1, 30, 58], "KimiK25ForConditionalGeneration")
    with pytest.raises(ValueError, match="increasing"):
        layers.sglang_layer_ids([15, 2, 27], "LlamaForCausalLM")
    with pytest.raises(ValueError, match="61 layers"):
        layers.sglang_layer_ids([2, 30, 61], "DeepseekV3ForCausalLM", num_layers=61)
    with pytest.raises(ValueError, match="GPT2LMHeadModel"):
        layers.sglang_layer_ids([2, 6, 9], "GPT2LMHeadModel")


def test_a_subclass_uses_its_parents_convention():
    mro = ["Phi3ForCausalLM", "LlamaForCausalLM", "Module", "object"]
    assert layers.known_architecture(mro) == "LlamaForCausalLM"
    assert layers.known_architecture(["KimiK25ForConditionalGeneration", "Module"]) == \
        "KimiK25ForConditionalGeneration"
    assert layers.known_architecture(["GPT2LMHeadModel", "Module"]) is None


def test_vllm_reads_the_contracts_ids_as_they_are_and_cannot_capture_the_embedding():
    assert layers.vllm_layer_ids([2, 15, 27]) == [2, 15, 27]
    with pytest.raises(ValueError, match="embedding"):
        layers.vllm_layer_ids([0, 15, 27])
    with pytest.raises(ValueError, match="increasing"):
        layers.vllm_layer_ids([15, 2, 27])
