"""The demo-sized run end to end (~200 real ShareGPT samples of SmolLM2, the demo's [train]
settings, then speculative decoding on held-out prompts with the real target), and the check that
holds speculation to the target's greedy output."""

import json
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any, NamedTuple

import pytest
import torch

from drafter_fixtures import MODEL, cached_dataset, write_config
from eagle3d.drafter.evaluate import (AuxCapture, by_depth, evaluate, greedy, is_greedy,
                                      read_answer, speculative)
from eagle3d.drafter.model import DraftConfig, Eagle3Drafter
from eagle3d.drafter.vocab import from_counts
from eagle3d.statemachine.config import resolve_location
from eagle3d.target import loading

# The demo's own [train] and [eval], on ShareGPT's answers rather than the target's.
DEMO = tomllib.loads((Path(__file__).resolve().parents[1] / "etc" / "demo.toml").read_text())


@pytest.mark.slow
@pytest.mark.long
@pytest.mark.timeout(1800)  # the demo's training and evaluation: ~15 min on 2 idle cores
def test_demo_sized_drafter_accepts_more_than_one_token_and_keeps_greedy_output(tmp_path):
    data_root = cached_dataset(200, 0, 1024)
    config = write_config(tmp_path, data_root, DEMO["train"], DEMO["eval"], max_tokens=1024)
    run = subprocess.run([sys.executable, "-m", "eagle3d.drafter.train", "-c", str(config)],
                         capture_output=True, text=True, timeout=1200)
    assert run.returncode == 0, run.stderr[-3000:]
    ev = subprocess.run([sys.executable, "-m", "eagle3d.drafter.evaluate", "-c", str(config),
                         "--json"], capture_output=True, text=True, timeout=1200)
    assert ev.returncode == 0, ev.stderr[-3000:]
    report = json.loads(ev.stdout.splitlines()[-1])
    print(report)
    assert report["identical_to_greedy"] is True
    # Measured 1.25 with 2 epochs on 8 prompts of 48 tokens (2026-11-30); untrained: 1.00.
    assert report["acceptance_length"] > 1.1
    acc = report["per_position_acceptance"]
    assert acc[0] > 0.1 and acc[0] >= acc[-1]  # positions compound


def test_the_greedy_check_catches_one_changed_token_and_passes_the_real_decode():
    path = resolve_location(MODEL, Path("."))
    target = loading.load_model(path, "float32", "cpu")
    tokenizer = loading.load_tokenizer(path)
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Name three colours."}],
                                           add_generation_prompt=True, tokenize=False)
    prompt = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    eos = loading.stop_tokens(tokenizer, target.generation_config)
    capture = AuxCapture(target, [2, 15, 29])

    def check(tokens: list[int]) -> tuple[bool, bool]:
        return is_greedy(target, prompt, tokens, 24, eos,
                         read_answer(target, capture, prompt, tokens).choices)
    tokens = greedy(target, prompt, 24, eos)
    assert check(tokens) == (True, False)  # one forward decided
    changed = tokens[:10] + [(tokens[10] + 1) % 49152] + tokens[11:]
    assert check(changed) == (False, True)  # a plain decode decided


def _echo_drafter(target) -> tuple[Eagle3Drafter, object]:
    """A drafter that proposes, at every draft, the token it was just fed: its output is the
    feature entering the target's last layer (the third captured layer, 29), read by the
    target's own norm and head, and that feature predicts the token that follows it, which is
    the one fed. It is right where the target repeats one token, so rows accept 0 to k drafts,
    which is what decoding rows together must keep apart."""
    cfg = DraftConfig.from_target(target.config, target.config.vocab_size)
    drafter = Eagle3Drafter(cfg, target.get_input_embeddings().weight.detach().float())
    H = cfg.hidden_size
    with torch.no_grad():
        drafter.fc.weight.zero_()
        drafter.fc.weight[:, 2 * H:] = torch.eye(H)
        drafter.midlayer.self_attn.o_proj.weight.zero_()
        drafter.midlayer.mlp.down_proj.weight.zero_()
        drafter.norm.weight.copy_(target.model.norm.weight)
        drafter.lm_head.weight.copy_(target.get_output_embeddings().weight)
    return drafter, from_counts(torch.ones(cfg.vocab_size), cfg.vocab_size)


class Echo(NamedTuple):
    target: Any
    eos: set[int]
    prompts: list[list[int]]
    drafter: Eagle3Drafter
    vocab: Any


@pytest.fixture(scope="module")
def echo() -> Echo:
    """The real target, the echo drafter, and three prompts of unlike lengths: one repeats a
    token throughout, one the drafter rarely guesses, one in between."""
    path = resolve_location(MODEL, Path("."))
    target = loading.load_model(path, "float32", "cpu")
    tokenizer = loading.load_tokenizer(path)
    texts = ["ha ha ha ha ha ha ha ha", "The capital of France is", "A B C D E F G"]
    return Echo(target, loading.stop_tokens(tokenizer, target.generation_config),
                [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts],
                *_echo_drafter(target))


def test_prompts_decoded_together_each_decode_as_alone_and_as_plain_greedy(echo):
    target, eos, prompts, drafter, vocab = echo
    capture = AuxCapture(target, [2, 15, 29])
    together = speculative(target, capture, drafter, vocab, prompts, 3, 40, eos)
    alone = [speculative(target, capture, drafter, vocab, [p], 3, 40, eos)[0] for p in prompts]
    capture.close()
    for prompt, t, a in zip(prompts, together, alone):
        assert (t.tokens, t.accepted) == (a.tokens, a.accepted)
        assert t.tokens == greedy(target, prompt, 40, eos)
    # Rows of different lengths, rounds that keep every draft beside rounds that keep none, and
    # rows that end (at 40 tokens, at the end-of-turn token) at different rounds.
    accepted = [n for t in together for n in t.accepted]
    assert len({len(p) for p in prompts}) == 3 and 0 in accepted and 3 in accepted
    assert len({len(t.accepted) for t in together}) > 1


def test_every_chain_keeps_the_drafts_training_would_make_at_its_start(echo):
    """Training's unroll over the held-out answer (real features everywhere) and the decoder's
    chains are the same drafts: each forward keeps exactly the leading hits of the unroll at its
    chain's start. Were the two to see different inputs (a shifted position, a stale cache), the
    decoder would accept what training never measured."""
    target, eos, prompts, drafter, vocab = echo
    report = evaluate(target, drafter, vocab, [2, 15, 29], prompts, 3, 40, eos, batch_size=3)
    assert report["identical_to_greedy"] is True
    assert report["chains_as_teacher_forced"] == 1.0
    forced = report["teacher_forced_accuracy"]
    assert len(forced) == 3 and 0 < forced[0] < 1


def test_acceptance_by_depth_counts_each_forward_where_it_starts_in_the_answer():
    # One answer: the prefill's token, then forwards keeping 3, 3, 3, 0, 0 drafts (+ the
    # target's own token each) start at depths 1, 5, 9, 13, 14. Another keeps none from depth 1.
    buckets = by_depth([[3, 3, 3, 0, 0], [0, 0]], block=8)
    assert buckets == [{"from": 0, "acceptance_length": (4 + 4 + 1 + 1) / 4, "forwards": 4},
                       {"from": 8, "acceptance_length": (4 + 1 + 1) / 3, "forwards": 3}]
