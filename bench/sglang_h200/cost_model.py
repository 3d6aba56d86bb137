"""What speculative decoding should gain, from what its parts cost: the serve bench predicts its
measured speedup with this, and projects it to a Kimi-K2.5-sized target.

A round of EAGLE drafting runs `steps` draft forwards (the draft extend over the accepted tokens
and steps - 1 draft steps, each over top-k rows) and one target forward over the k verified
tokens, and yields τ tokens (the acceptance length); plain decoding yields one token per target
decode step. So, per output token, speculation costs (steps·t_draft + t_verify(k)) / τ against
t_decode, and the speedup is τ·t_decode / (steps·t_draft + t_verify(k)).
"""

from __future__ import annotations

from typing import NamedTuple


class Costs(NamedTuple):
    decode_s: float   # one target decode step, one token
    verify_s: float   # one target forward over the k tokens a round verifies
    draft_s: float    # one draft forward (top-k rows)


def predicted_speedup(tau: float, steps: int, costs: Costs) -> float:
    return tau * costs.decode_s / (steps * costs.draft_s + costs.verify_s)


def break_even_tau(steps: int, costs: Costs) -> float:
    """The acceptance length below which speculation is slower than plain decoding."""
    return (steps * costs.draft_s + costs.verify_s) / costs.decode_s


# Kimi-K2.5's language model (moonshotai/Kimi-K2.5 config.json, text_config: the DeepSeek-V3
# architecture of Kimi-K2): MLA attention, one dense layer, then MoE layers of 384 routed
# experts (8 per token, native INT4) and one shared expert.
KIMI_K25 = {"hidden": 7168, "layers": 61, "dense_layers": 1, "intermediate": 18432,
            "experts": 384, "experts_per_token": 8, "moe_intermediate": 2048, "heads": 64,
            "q_lora": 1536, "kv_lora": 512, "qk_nope": 128, "qk_rope": 64, "v_head": 128,
            "vocab": 163840}
BF16, INT4 = 2.0, 0.5  # bytes per weight


def experts_touched(tokens: int, experts: int = 384, per_token: int = 8) -> float:
    """Distinct routed experts that `tokens` tokens read in one layer, expected where each
    token's experts fall independently and uniformly: a verify forward of k tokens reads more
    expert weights than a decode step, which a dense target does not."""
    return experts * (1 - (1 - per_token / experts) ** tokens)


def kimi_forward_bytes(tokens: int, gpus: int = 8, m: dict = KIMI_K25) -> float:
    """Weight bytes one GPU of `gpus` reads in a Kimi-K2.5 forward over `tokens` tokens (weights
    split evenly, by tensor or expert parallelism): the floor of its time at small batch."""
    h = m["hidden"]
    attention = (h * m["q_lora"] + m["q_lora"] * m["heads"] * (m["qk_nope"] + m["qk_rope"])
                 + h * (m["kv_lora"] + m["qk_rope"])
                 + m["kv_lora"] * m["heads"] * (m["qk_nope"] + m["v_head"])
                 + m["heads"] * m["v_head"] * h)
    expert = 3 * h * m["moe_intermediate"]
    moe_layers = m["layers"] - m["dense_layers"]
    dense = (m["layers"] * attention + m["dense_layers"] * 3 * h * m["intermediate"]
             + moe_layers * expert + h * m["vocab"])  # + the shared expert, + lm_head
    routed = moe_layers * experts_touched(tokens, m["experts"], m["experts_per_token"]) * expert
    return (dense * BF16 + routed * INT4) / gpus


def kimi_draft_bytes(gpus: int = 8, draft_vocab: int = 32000, m: dict = KIMI_K25) -> float:
    """Weight bytes one GPU reads in a draft step of eagle3d's EAGLE-3 drafter at Kimi-K2.5's
    shape (drafter/model.py's DraftConfig.from_target): fc [H, 3H], one decoder layer whose
    q, k and v read 2H features, an MLP as wide as the target's dense one, the draft head."""
    h = m["hidden"]
    params = 3 * h * h + 2 * h * 3 * h + h * h + 3 * h * m["intermediate"] + h * draft_vocab
    return params * BF16 / gpus


def kimi_costs(bandwidth: float, k: int, gpus: int = 8) -> Costs:
    """Kimi-K2.5's costs from its weight bytes over `bandwidth` (bytes/s one GPU reads, measured
    on the H200): a floor that leaves out attention over the cache, all-reduces and launches,
    which every forward pays alike; so it is the pessimistic end for speculation on a MoE
    target, where verifying k tokens reads more experts than decoding one."""
    return Costs(decode_s=kimi_forward_bytes(1, gpus) / bandwidth,
                 verify_s=kimi_forward_bytes(k, gpus) / bandwidth,
                 draft_s=kimi_draft_bytes(gpus) / bandwidth)
