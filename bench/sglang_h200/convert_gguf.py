"""GGUF → a plain Hugging Face folder SGLang can serve, with transformers' own GGUF loader for the
weights and the tokenizer (chat template included). A hand-rolled dequantizer with a rebuilt
tokenizer gave a model that answered chats with newlines (2026-11-30): anything that looks at
generated text needs this conversion.

    python3 convert_gguf.py MODEL.gguf OUT_DIR
"""

import sys
from pathlib import Path


def convert(gguf: Path, out: Path) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    quantized = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name,
                                                     dtype=torch.bfloat16)
    config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
    # The GGUF's quantization_config would make SGLang look for quantized kernels.
    config.__dict__.pop("quantization_config", None)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.load_state_dict(quantized.state_dict())
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(out)


if __name__ == "__main__":
    convert(Path(sys.argv[1]).resolve(), Path(sys.argv[2]))
