"""A small random-weight model of the DeepSeek-V3 architecture (multi-head latent attention and
a mixture of experts with a shared expert, routed as Kimi-K2 routes: sigmoid scores, one group,
a correction bias), saved as a Hugging Face folder with the tokenizer of another model, for the
SGLang capture path Kimi-K2.5 takes (its class delegates to DeepseekV3ForCausalLM).

    python3 mla_model.py TOKENIZER_DIR OUT_DIR

The per-head shapes are Kimi-K2.5's (latent KV rank 512, rope 64, nope 128, value 128), the
counts small (8 layers, 4 heads, 8 experts, 2 per token). The default initialisation already
makes neighbouring layers differ (mean cosine 0.2-0.9 between consecutive hidden states), which
the capture check needs to tell the right layer from the next.
"""

from __future__ import annotations

import sys

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, DeepseekV3Config


def main() -> int:
    tokenizer = AutoTokenizer.from_pretrained(sys.argv[1])
    config = DeepseekV3Config(
        vocab_size=len(tokenizer), hidden_size=512, intermediate_size=1024, num_hidden_layers=8,
        num_attention_heads=4, num_key_value_heads=4, q_lora_rank=256, kv_lora_rank=512,
        qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128, first_k_dense_replace=1,
        n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, moe_intermediate_size=256,
        n_group=1, topk_group=1, routed_scaling_factor=2.827, num_nextn_predict_layers=0,
        # Keys of DeepSeek-V3's own config.json that transformers does not define and SGLang reads.
        moe_layer_freq=1, topk_method="noaux_tc", scoring_func="sigmoid", seq_aux=True,
        aux_loss_alpha=0.001, ep_size=1, rope_theta=10000.0,
        max_position_embeddings=4096, tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(sys.argv[2])
    tokenizer.save_pretrained(sys.argv[2])
    print(f"{type(model).__name__}: {sum(p.numel() for p in model.parameters()) / 1e6:.0f} M "
          f"parameters in {sys.argv[2]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
