"""The layer taps: hooks that take EAGLE-3's hidden states out of a Hugging Face decoder during a
forward. The one implementation that both capture (the transformers worker's dumps) and evaluation
(the features the drafter reads while decoding) use, so the two cannot number layers apart.

Layer id i (the capture contract's convention) is the hidden state *entering* decoder layer i,
which is HF's `hidden_states[i]`: a forward pre-hook on `layers[i]` sees exactly that tensor. The
final state is the output of the final norm (the lm_head's input). Hooks keep only references to
tensors the forward creates anyway, so capturing costs no extra copies; `output_hidden_states`
would keep every layer's state alive instead of three.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


def decoder_of(model: nn.Module) -> nn.Module:
    """The base decoder (embeddings, layers, final norm) of a causal LM, without its lm_head."""
    base = getattr(model, "model", model)
    if not (hasattr(base, "layers") and hasattr(base, "norm")):
        raise TypeError(f"{type(model).__name__}: expected a decoder with .layers and .norm "
                        "(a Llama-like model)")
    return base


class LayerTap:
    """While entered, records the state entering each of `layer_ids` and the final norm's output
    of every forward of `decoder`."""

    def __init__(self, decoder: nn.Module, layer_ids: list[int]) -> None:
        n = len(decoder.layers)
        if any(not 0 <= i < n for i in layer_ids):
            raise ValueError(f"layer ids {layer_ids} out of range for a {n}-layer model")
        self.decoder = decoder
        self.layer_ids = list(layer_ids)
        self._states: dict[int, torch.Tensor] = {}
        self._final: torch.Tensor | None = None
        self._handles: list[Any] = []

    def __enter__(self) -> "LayerTap":
        for i in self.layer_ids:
            self._handles.append(self.decoder.layers[i].register_forward_pre_hook(
                self._entering(i), with_kwargs=True))
        self._handles.append(self.decoder.norm.register_forward_hook(self._on_final))
        return self

    def __exit__(self, *exc: object) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self._states.clear()
        self._final = None

    def _entering(self, i: int):
        def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
            self._states[i] = args[0] if args else kwargs["hidden_states"]
        return hook

    def _on_final(self, module: nn.Module, args: tuple, output: torch.Tensor) -> None:
        self._final = output

    def take(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(aux [B, L, 3H]: the tapped layers concatenated in layer order, final [B, L, H]) of the
        last forward; forgets them, so the next forward cannot be confused with this one."""
        if self._final is None or len(self._states) != len(self.layer_ids):
            raise RuntimeError("no complete forward was recorded")
        aux = torch.cat([self._states[i] for i in self.layer_ids], dim=-1)
        final = self._final
        self._states.clear()
        self._final = None
        return aux, final
