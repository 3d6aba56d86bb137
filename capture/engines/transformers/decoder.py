"""The transformers engine's decoder for the generator child ([data] responses = "target"):
the target loaded in the generator's own process, decoding a batch of conversations in
lockstep (capture/generator.py, _write_in_batches).
"""

from __future__ import annotations

from typing import Any

import torch

from eagle3d.statemachine.config_schema import Config, GenerateConfig
from eagle3d.target import loading


class TransformersDecoder:
    """The target loaded in this process: one left-padded `generate` with a KV cache."""

    def __init__(self, model: Any, pad: int, eos: set[int], settings: GenerateConfig) -> None:
        self.model, self.pad, self.eos, self.settings = model, pad, eos, settings

    def __call__(self, prompts: list[list[int]], rooms: list[int], seed: int) -> list[list[int]]:
        device = self.model.device
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), self.pad, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for row, prompt in enumerate(prompts):
            ids[row, width - len(prompt):] = torch.tensor(prompt)
            mask[row, width - len(prompt):] = 1
        sample = self.settings.temperature > 0
        torch.manual_seed(seed)
        with torch.inference_mode():
            out = self.model.generate(
                input_ids=ids.to(device), attention_mask=mask.to(device),
                max_new_tokens=max(rooms), do_sample=sample,
                temperature=self.settings.temperature if sample else None,
                top_p=self.settings.top_p if sample else None, top_k=None,
                pad_token_id=self.pad, eos_token_id=sorted(self.eos))
        return out[:, width:].tolist()


def load(cfg: Config, tokenizer: Any) -> tuple[TransformersDecoder, set[int]]:
    """The target loaded here, and the tokens that end an answer."""
    # The configured dtype on a CPU too: the target that writes the answers is the one extract
    # captures, and a CPU with bfloat16 units (AVX512-BF16, AMX) writes about twice as fast.
    model = loading.load_model(cfg.target.model_path, cfg.target.dtype, cfg.target.device)
    eos = loading.stop_tokens(tokenizer, model.generation_config)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(eos)
    return TransformersDecoder(model, pad, eos, cfg.generate), eos
