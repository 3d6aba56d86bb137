"""How a dump stores its hidden states, in one place for every engine, verify and the trainer.

A dump holds the states either as a float type (`float32`, `bfloat16`, `float16`: the values
themselves) or as `float8_e4m3fn` with one float32 scale per token row of each captured layer:
`aux_hidden_states` [T, 3H] F8_E4M3 with `aux_hidden_states_scale` [T, 3] F32, and
`last_hidden_state` [T, H] F8_E4M3 with `last_hidden_state_scale` [T, 1] F32; value = q × scale.
A scale is amax/448 over its row (448 is e4m3's largest finite value), so every row uses the
whole fp8 range. A row of zeros gets the scale 1, which round-trips exactly and keeps every
scale finite and positive (what verify requires of a scale).

Why a scale per captured layer rather than per [T, 3H] row: the three layers differ in
magnitude (SmolLM2's layers 15 and 27 carry outlier features of ~26,000, its layer 2 ~300), and
one shared scale would push the shallow layer's small values into e4m3's subnormal range, where
precision is lost.

Quantizing happens on the device the target runs on, before the copy to the host, so the copy,
the spool and the dataset all carry half the bytes of bf16. The torch functions import torch
when called: the daemon imports this module for the numpy side and must never import torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Mapping

import numpy as np

from eagle3d.dataset.dumpformat import AUX, DTYPE_NAMES, LAST, LAYER_BLOCKS, SCALES, is_scaled
from eagle3d.statemachine.config_schema import FP8

if TYPE_CHECKING:
    import torch

E4M3_MAX = 448.0
# Rounding to e4m3 (3 mantissa bits) moves a normal value by at most half a unit in the last
# place: a relative error of at most 2^-4. Subnormals (below 2^-6 of the row's scale) lose more
# relative precision, but their absolute error is at most 2^-10 × scale, under 2^-18 of the row's
# largest value: negligible in a row's norm.
E4M3_RELATIVE_ERROR = 2.0 ** -4


def spot_tolerance(tolerance: float, safetensors_dtype: str) -> float:
    """The spot check's bound on ‖fresh − stored‖ / ‖stored‖ for dumps of this dtype, where
    `tolerance` is the bound between two float captures ([verify] spot_tolerance).

    Both dumps are quantized: with stored = q(a), fresh = q(b), ‖b − a‖ ≤ t‖a‖ and
    ‖q(x) − x‖ ≤ u‖x‖ (u = 2^-4, above), ‖q(b) − q(a)‖ ≤ u‖b‖ + t‖a‖ + u‖a‖ ≤ (2u + t(1 + u))‖a‖
    and ‖q(a)‖ ≥ (1 − u)‖a‖, so the relative error is at most (2u + t(1 + u)) / (1 − u): 0.190
    for t = 0.05 (the default). Verify applies it to each captured layer apart, where a capture
    of the wrong layer or rows is far off (a one-layer shift of SmolLM2's layer 2: 1.1)."""
    if not is_scaled(safetensors_dtype):
        return tolerance
    u = E4M3_RELATIVE_ERROR
    return (2 * u + tolerance * (1 + u)) / (1 - u)


# ---- torch: the capture side and the trainer --------------------------------------------------

def quantize_rows(x: torch.Tensor, groups: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., groups·H] as (fp8 [..., groups·H], float32 scales [..., groups]), on x's device:
    each row of each group of H columns scaled so that its largest magnitude becomes 448."""
    import torch
    grouped = x.unflatten(-1, (groups, -1))
    amax = grouped.abs().amax(dim=-1, keepdim=True).float()
    scale = amax / E4M3_MAX
    # A zero row (or one so small that amax/448 underflows) divides by 1: exact, and finite.
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    # Clamped: a quotient rounded just above 448 would become NaN, e4m3 has no infinity.
    q = (grouped.float() / scale).clamp_(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return q.flatten(-2), scale.squeeze(-1)


def dequantize_rows(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The inverse of quantize_rows, computed in float32 on q's device, returned as `dtype`."""
    groups = scale.shape[-1]
    return (q.unflatten(-1, (groups, -1)).float() * scale.unsqueeze(-1)).flatten(-2).to(dtype)


def encode_states(aux: torch.Tensor, last: torch.Tensor, dump_dtype: str
                  ) -> dict[str, torch.Tensor]:
    """A dump's hidden-state tensors, by their dump names, on the states' device: aux [..., 3H]
    and last [..., H] cast to `dump_dtype` (a config name), or quantized with their scales."""
    import torch
    if dump_dtype != FP8:
        return {AUX: aux.to(getattr(torch, dump_dtype)), LAST: last.to(getattr(torch, dump_dtype))}
    stored = {}
    for name, states in ((AUX, aux), (LAST, last)):
        stored[name], stored[SCALES[name]] = quantize_rows(states, LAYER_BLOCKS[name])
    return stored


def decode_states(stored: Mapping[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(aux, last) from a dump's hidden-state tensors, on their device: fp8 states are
    dequantized to bfloat16 (what a bf16 dump holds), others come back as stored."""
    import torch
    if stored[AUX].dtype != torch.float8_e4m3fn:
        return stored[AUX], stored[LAST]
    aux, last = (dequantize_rows(stored[name], stored[SCALES[name]], torch.bfloat16)
                 for name in (AUX, LAST))
    return aux, last


def dump_entry(t: torch.Tensor) -> tuple[str, tuple[int, ...], memoryview]:
    """A tensor as dumpformat.write_dump takes it: (safetensors dtype, shape, raw bytes), copied
    to the host if it is not there. Without a copy when the tensor is already contiguous on the
    host (rows of a right-padded batch are); the bytes go through a uint8 view because neither
    bf16 nor fp8 has a numpy type."""
    import torch
    name = DTYPE_NAMES.get(str(t.dtype).removeprefix("torch."))
    if name is None:
        raise ValueError(f"a dump cannot store a {t.dtype} tensor")
    raw = t.detach().to("cpu").contiguous().view(torch.uint8).reshape(-1).numpy()
    return name, tuple(t.shape), memoryview(raw)


# ---- numpy: verify, in the daemon (no torch) --------------------------------------------------

def _e4m3_values() -> np.ndarray:
    """Every e4m3fn byte's value, float32: sign, 4 exponent bits (bias 7), 3 mantissa bits;
    exponent 0 is subnormal, S.1111.111 is NaN, and there is no infinity."""
    b = np.arange(256)
    exponent, mantissa = (b >> 3) & 0xF, (b & 7).astype(np.float64)
    magnitude = np.where(exponent == 0, mantissa / 8 * 2.0 ** -6,
                         (1 + mantissa / 8) * 2.0 ** (exponent - 7))
    magnitude[(b & 0x7F) == 0x7F] = np.nan
    return np.where(b >> 7, -magnitude, magnitude).astype(np.float32)


E4M3_VALUES = _e4m3_values()


def rows_as_float32(raw: bytes, dtype: str, width: int, scale: np.ndarray | None) -> np.ndarray:
    """Whole rows of a stored states tensor as float32 [rows, width]; `scale` holds those rows'
    scales [rows, groups] for an fp8 tensor, None otherwise."""
    if dtype == "BF16":
        # bf16 is the high half of a float32: widening the bits is exact.
        values = (np.frombuffer(raw, np.uint16).astype(np.uint32) << 16).view(np.float32)
    elif is_scaled(dtype):
        values = E4M3_VALUES[np.frombuffer(raw, np.uint8)]
    else:
        values = np.frombuffer(raw, {"F16": np.float16, "F32": np.float32}[dtype]
                               ).astype(np.float32)
    rows = values.reshape(-1, width)
    if scale is None:
        return rows
    return (rows.reshape(len(rows), scale.shape[1], -1) * scale[:, :, None]).reshape(rows.shape)
