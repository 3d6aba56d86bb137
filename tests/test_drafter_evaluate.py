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
from eagle3d.drafter.evaluate import (Drafting, Tree, _summary, by_depth, evaluate, greedy,
                                      is_greedy, longest_match, read_answer, speculative,
                                      tree_speculative)
from eagle3d.drafter.model import DraftConfig, Eagle3Drafter
from eagle3d.drafter.vocab import from_counts
from eagle3d.statemachine.config_schema import resolve_location
from eagle3d.target import loading
from eagle3d.target.taps import LayerTap, decoder_of

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

    def check(tokens: list[int]) -> tuple[bool, bool]:
        with LayerTap(decoder_of(target), [2, 15, 29]) as tap:
            return is_greedy(target, prompt, tokens, 24, eos,
                             read_answer(target, tap, prompt, tokens).choices)
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
    with LayerTap(decoder_of(target), [2, 15, 29]) as tap:
        together = speculative(target, tap, drafter, vocab, prompts, 3, 40, eos)
        alone = [speculative(target, tap, drafter, vocab, [p], 3, 40, eos)[0] for p in prompts]
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
    report = evaluate(target, drafter, vocab, [2, 15, 29], prompts, Drafting(3, 1, 4), 40, eos,
                      batch_size=3)
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


def test_the_longest_matching_path_is_kept():
    # root ─ 5 ─ 7        want 6, 8, 9: the path 6, 8 matches, and nothing under 8
    #      └ 6 ─ 8
    #          └ 9
    tree = Tree(tokens=[5, 6, 7, 8, 9], parents=[-1, -1, 0, 1, 1])
    assert longest_match(tree, [6, 8, 9]) == [1, 3]
    assert longest_match(tree, [6, 9]) == [1, 4]
    assert longest_match(tree, [4, 5]) == []


def test_a_top_k_one_tree_keeps_exactly_what_the_target_verified_in_the_chain(echo):
    """The tree's verification (the longest path along the target's greedy continuation) and
    the chain's (the target's forward over the drafts) must agree where the tree is a chain:
    were the tree's drafter context, positions or bonus token off by one, they would not."""
    target, eos, prompts, drafter, vocab = echo
    with LayerTap(decoder_of(target), [2, 15, 29]) as tap:
        chain = speculative(target, tap, drafter, vocab, prompts, 3, 40, eos)
        tree = [tree_speculative(target, tap, drafter, vocab, p, Drafting(3, 1, 4), 40, eos)
                for p in prompts]
    assert [(t.tokens, t.accepted) for t in tree] == [(c.tokens, c.accepted) for c in chain]


def one_too_many(tree: Tree, greedy_next: list[int]) -> list[int]:
    """A wrong verification: one node past the matching path, where the tree has one."""
    path = longest_match(tree, greedy_next)
    at = path[-1] if path else -1
    return path + [n for n, parent in enumerate(tree.parents) if parent == at][:1]


def test_tree_drafting_decodes_as_plain_greedy_and_a_wrong_verification_is_caught(echo):
    target, eos, prompts, drafter, vocab = echo
    sglang_default = Drafting(steps=5, topk=4, num_draft_tokens=8)  # SGLang's for Llama
    report = evaluate(target, drafter, vocab, [2, 15, 29], prompts, sglang_default, 24, eos,
                      batch_size=3, categories=["repeats", "prose", "repeats"])
    assert report["identical_to_greedy"] is True
    chain = evaluate(target, drafter, vocab, [2, 15, 29], prompts, Drafting(5, 1, 6), 24, eos,
                     batch_size=3)
    # The tree holds the chain's path, and more beside it.
    assert report["acceptance_length"] >= chain["acceptance_length"] > 1
    assert set(report["acceptance_length_by_category"]) == {"repeats", "prose"}
    assert report["acceptance_length_by_category"]["prose"]["prompts"] == 1
    caught = 0
    with LayerTap(decoder_of(target), [2, 15, 29]) as tap:
        for prompt in prompts:
            wrong = tree_speculative(target, tap, drafter, vocab, prompt, sglang_default, 24,
                                     eos, verify=one_too_many)
            same, _ = is_greedy(target, prompt, wrong.tokens, 24, eos,
                                read_answer(target, tap, prompt, wrong.tokens).choices)
            caught += not same
    assert caught == len(prompts)


def test_eval_of_an_mt_bench_file_as_a_tree_every_turn_keeps_greedy_output(echo, tmp_path):
    """The command a user runs: an exported drafter, a file of MT-bench questions, SGLang's tree
    settings, every turn after the target's own answers; per category, identical to greedy."""
    from eagle3d.drafter.export import export
    from eagle3d.statemachine import layout
    from tests.conftest import make_config, venv_bin
    config = make_config(tmp_path, {"eval": {"max_new_tokens": 12}})
    export(echo.drafter, echo.vocab, {"layer_ids": [2, 15, 29],
                                      "architecture": "LlamaForCausalLM"},
           layout.export_dir(tmp_path / "train"), 2)
    questions = tmp_path / "question.jsonl"
    questions.write_text("".join(json.dumps(q) + "\n" for q in [
        {"question_id": 1, "category": "writing", "turns": ["Say ha ha ha.", "Once more."]},
        {"question_id": 2, "category": "math", "turns": ["What is 2 + 2?"]}]))
    run = subprocess.run([venv_bin("eagle3ctl"), "-c", str(config), "eval", "--prompts",
                          str(questions), "--every-turn", "--steps", "3", "--topk", "4",
                          "--num-draft-tokens", "6", "--json"],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads(run.stdout.splitlines()[-1])
    assert report["identical_to_greedy"] is True
    assert report["drafting"] == {"steps": 3, "topk": 4, "num_draft_tokens": 6}
    assert (report["source_format"], report["prompts"]) == ("mt-bench", 3)
    assert {c: v["prompts"] for c, v in report["acceptance_length_by_category"].items()} == \
        {"writing": 2, "math": 1}
    summary = _summary(report, 2, {})  # what the command prints without --json
    assert "top-k 4, 6 draft tokens (tree)" in summary and "  writing: " in summary
    # 3 steps drafted by a drafter trained to unroll 2: the user is told which steps.
    assert "training unrolled 2 ([train] ttt_steps): step 3 draft" in summary
