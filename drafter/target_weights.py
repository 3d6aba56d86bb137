"""The two target tensors the drafter needs: the token embedding (the drafter's input, frozen)
and the lm_head (the teacher). For an HF folder of safetensors, and a GGUF file through the
folder it is converted to once (target.loading), only those tensors are read, so a 70B target
costs two matrices of memory, not the model; anything else (.bin, a GGUF whose conversion could
not be cached) loads the model through target.loading and keeps the two."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open


def _safetensors_names(folder: Path) -> dict[str, Path]:
    index = folder / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: folder / f for name, f in weight_map.items()}
    names: dict[str, Path] = {}
    for f in sorted(folder.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as st:
            names.update({k: f for k in st.keys()})
    return names


def _pick(names: dict[str, Path], suffix: str) -> str | None:
    found = sorted((n for n in names if n == suffix or n.endswith("." + suffix)), key=len)
    return found[0] if found else None


def load_embedding_and_head(model_path: Path) -> tuple[torch.Tensor, torch.Tensor]:
    """(embed_tokens [V, H], lm_head [V, H]) in float32; a tied head is the embedding."""
    path = Path(model_path)
    if path.is_file() and path.suffix == ".gguf":
        # Each trainer rank loaded the whole target from it, seconds of every start, for two
        # tensors the converted folder holds as they are.
        from eagle3d.target.loading import converted_gguf
        path = converted_gguf(path) or path
    names = _safetensors_names(path) if path.is_dir() else {}
    embed_name = _pick(names, "embed_tokens.weight")
    if embed_name is not None:
        head_name = _pick(names, "lm_head.weight") or embed_name

        def read(name: str) -> torch.Tensor:
            with safe_open(str(names[name]), framework="pt") as st:
                return st.get_tensor(name).float()

        embed = read(embed_name)
        return embed, (embed if head_name == embed_name else read(head_name))
    from eagle3d.target.loading import load_model
    model = load_model(path, "float32", "cpu")
    embed = model.get_input_embeddings().weight.detach().float().clone()
    head = model.get_output_embeddings().weight.detach().float()
    return embed, (embed if head.data_ptr() == model.get_input_embeddings().weight.data_ptr()
                   else head.clone())
