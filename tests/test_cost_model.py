"""The serve bench's cost model (bench/sglang_h200/cost_model.py): the speedup speculative
decoding predicts from what a decode step, a verify forward and a draft step cost, and the
Kimi-K2.5 shape it projects to."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

_spec = importlib.util.spec_from_file_location(
    "cost_model", Path(__file__).resolve().parents[1] / "bench" / "sglang_h200" / "cost_model.py")
cost_model = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(cost_model)
Costs = cost_model.Costs


def test_speedup_is_tokens_per_round_over_the_rounds_cost_in_decode_steps():
    costs = Costs(decode_s=0.010, verify_s=0.012, draft_s=0.001)
    # 4 draft forwards and a verify: 16 ms a round, 3 tokens a round against 10 ms a token.
    assert cost_model.predicted_speedup(3.0, 4, costs) == pytest.approx(3.0 * 10 / 16)
    assert cost_model.break_even_tau(4, costs) == pytest.approx(1.6)
    assert cost_model.predicted_speedup(1.6, 4, costs) == pytest.approx(1.0)


def test_a_small_target_loses_where_draft_steps_cost_as_much_as_its_decode_step():
    """A 135M target's decode step is mostly fixed per-forward cost, which a one-layer draft
    step shares: with 4 draft steps at a third of a decode step each and a verify forward a
    little dearer than a decode step, an acceptance length of 1.5 halves the speed."""
    costs = Costs(decode_s=1.0, verify_s=1.1, draft_s=0.33)
    assert cost_model.predicted_speedup(1.534, 4, costs) == pytest.approx(0.63, abs=0.01)
    assert cost_model.break_even_tau(4, costs) > 2.4


def test_verifying_more_tokens_reads_more_experts_on_kimi_k25():
    assert cost_model.experts_touched(1) == pytest.approx(8)
    assert 8 < cost_model.experts_touched(8) < 64 < cost_model.experts_touched(64) <= 384
    decode, verify8 = cost_model.kimi_forward_bytes(1), cost_model.kimi_forward_bytes(8)
    # bf16 attention and shared weights, int4 experts, split over 8 GPUs: a few GB a step.
    assert 2e9 < decode < 6e9 and 1 < verify8 / decode < 8
    assert cost_model.kimi_draft_bytes() / decode < 0.15  # one dense layer beside 61 MoE ones
    kimi = cost_model.kimi_costs(4e12, 8)
    assert kimi.decode_s == pytest.approx(decode / 4e12)
    assert cost_model.predicted_speedup(4.0, 5, kimi) > 1
