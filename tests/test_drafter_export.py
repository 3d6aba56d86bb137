"""The export, pinned to what SGLang's `LlamaForCausalLMEagle3` loads
(python/sglang/srt/models/llama_eagle3.py, sgl-project/sglang). Its load_weights silently skips
a name it does not know, so a misnamed tensor would serve an untrained drafter."""

import json

import torch
from safetensors import safe_open

from eagle3d.drafter import vocab as vocab_mod
from eagle3d.drafter.export import export, load_export
from eagle3d.drafter.model import DraftConfig, Eagle3Drafter
from eagle3d.drafter.vocab import from_counts
from eagle3d.statemachine import layout
from tests.conftest import modes

# SmolLM2-135M's shape: hidden 576, 9 heads of 64, 3 KV heads, MLP 1536, vocab 49152.
CFG = DraftConfig(hidden_size=576, target_hidden_size=576, intermediate_size=1536,
                  num_attention_heads=9, num_key_value_heads=3, head_dim=64,
                  rms_norm_eps=1e-5, max_position_embeddings=8192, vocab_size=49152,
                  draft_vocab_size=1000,
                  rope_parameters={"rope_type": "default", "rope_theta": 100000.0})
CONTRACT = {"layer_ids": [2, 15, 27], "architecture": "LlamaForCausalLM"}

# SGLang's parameters (the module tree of LlamaForCausalLMEagle3 with one layer), after its
# stacked mapping q/k/v -> qkv_proj and gate/up -> gate_up_proj. embed_tokens comes from the
# target, d2t and t2d are read by name.
SGLANG_PARAMS = {"model.midlayer.self_attn.qkv_proj.weight",
                 "model.midlayer.self_attn.o_proj.weight",
                 "model.midlayer.mlp.gate_up_proj.weight", "model.midlayer.mlp.down_proj.weight",
                 "model.midlayer.input_layernorm.weight", "model.midlayer.hidden_norm.weight",
                 "model.midlayer.post_attention_layernorm.weight", "model.fc.weight",
                 "model.norm.weight", "lm_head.weight"}
STACKED = {".q_proj": ".qkv_proj", ".k_proj": ".qkv_proj", ".v_proj": ".qkv_proj",
           ".gate_proj": ".gate_up_proj", ".up_proj": ".gate_up_proj"}


def sglang_param_for(name: str) -> str | None:
    """Where SGLang's load_weights puts a tensor of this name (None: used by name or dropped)."""
    if "d2t" in name or "t2d" in name:
        return None
    for shard, stacked in STACKED.items():
        if shard in name:
            name = name.replace(shard, stacked)
            break
    return name if name in SGLANG_PARAMS else f"model.{name}"


def test_export_names_shapes_and_config_match_sglang(tmp_path):
    torch.manual_seed(0)
    model = Eagle3Drafter(CFG, torch.zeros(49152, 576))
    counts = torch.zeros(49152, dtype=torch.int64)
    counts[torch.arange(0, 49152, 37)] = 5
    vocab = from_counts(counts, 1000)
    out = export(model, vocab, CONTRACT, tmp_path / "export", 3)
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]

    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
        d2t, t2d = f.get_tensor("d2t"), f.get_tensor("t2d")
    assert shapes == {
        "midlayer.self_attn.q_proj.weight": (576, 2 * 576),  # attention reads 2·H
        "midlayer.self_attn.k_proj.weight": (192, 2 * 576),
        "midlayer.self_attn.v_proj.weight": (192, 2 * 576),
        "midlayer.self_attn.o_proj.weight": (576, 576),
        "midlayer.mlp.gate_proj.weight": (1536, 576),
        "midlayer.mlp.up_proj.weight": (1536, 576),
        "midlayer.mlp.down_proj.weight": (576, 1536),
        "midlayer.input_layernorm.weight": (576,),
        "midlayer.hidden_norm.weight": (576,),
        "midlayer.post_attention_layernorm.weight": (576,),
        "fc.weight": (576, 3 * 576),
        "norm.weight": (576,),
        "lm_head.weight": (1000, 576),
        "d2t": (1000,),
        "t2d": (49152,),
    }
    loaded = {sglang_param_for(k) for k in shapes} - {None}
    assert loaded == SGLANG_PARAMS  # every name lands on a parameter, none is left untrained
    # SGLang's hot_token_id = d2t + arange: the target ids of the draft vocabulary.
    assert d2t.dtype == torch.int64 and t2d.dtype == torch.bool
    assert (d2t + torch.arange(1000)).tolist() == vocab.target_ids.tolist()
    assert t2d.nonzero().flatten().tolist() == vocab.target_ids.tolist()

    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"]
    # Contract id i is the input of layer i; SGLang's Llama adds one to the ids it reads.
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 14, 26]
    assert config["tie_word_embeddings"] is False  # else SGLang uses the embedding as lm_head
    expected = {"hidden_size": 576, "target_hidden_size": 576, "intermediate_size": 1536,
                "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64,
                "num_hidden_layers": 1, "vocab_size": 49152, "draft_vocab_size": 1000,
                "rope_theta": 100000.0, "rope_scaling": None, "max_position_embeddings": 8192,
                "hidden_act": "silu", "model_type": "llama"}
    assert {k: config[k] for k in expected} == expected
    assert abs(config["rms_norm_eps"] - 1e-5) < 1e-12

    again, vocab2, _ = load_export(out, torch.zeros(49152, 576))
    ids, aux = torch.randint(0, 49152, (1, 8)), torch.randn(1, 8, 3 * 576)
    with torch.no_grad():
        want = model.logits(model.unroll(ids, aux, 2)[1]).float()
        got = again.logits(again.unroll(ids, aux, 2)[1])
    assert torch.equal(vocab2.d2t, vocab.d2t)
    torch.testing.assert_close(got, want, atol=0.05, rtol=0.05)  # bf16 export


def test_the_drafter_and_its_vocabulary_are_the_service_groups_to_read(tmp_path, unit_umask):
    """Under the unit's UMask, an operator of the service's group (or SGLang's server run by
    one) reads the export and the draft vocabulary; nobody else does. safetensors writes its
    files for their owner alone."""
    model = Eagle3Drafter(CFG, torch.zeros(49152, 576))
    vocab = from_counts(torch.arange(49152), 1000)
    out = export(model, vocab, CONTRACT, tmp_path / "export", 3)
    assert modes(out) == {"export": "drwxr-x---", "config.json": "-rw-r-----",
                          "model.safetensors": "-rw-r-----"}
    vocab_mod.save(vocab, tmp_path, "fp")
    assert modes(layout.vocab_file(tmp_path)) == {"vocab.safetensors": "-rw-r-----"}
