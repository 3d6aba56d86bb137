"""Acceptance length of an exported drafter with the real target, drafting as SGLang drafts:
`steps` draft steps of `topk` candidates each, `num_draft_tokens` tokens verified per target
forward (SGLang's --speculative-num-steps, --speculative-eagle-topk and
--speculative-num-draft-tokens). Top-k 1 is a chain: the drafter proposes `steps` tokens, the
target checks them in one forward, the matching prefix and the target's own next token are kept.
Top-k above 1 is SGLang's draft tree (`draft_tree`), verified against the target's greedy
continuation: the longest root-to-node path that matches it is kept, and the target's next token.

`python -m eagle3d.drafter.evaluate -c CONFIG [--drafter DIR] [--source S | --prompts FILE
[--every-turn]] [--first N --limit M] [--steps K --topk K --num-draft-tokens N]
[--max-new-tokens T] [--batch-size B] [--json] [--out FILE]`

The acceptance length is the mean number of tokens each verifying target forward produces (the
prefill, which every decoder pays, is not counted). Every output must be the target's greedy
decoding of its prompt (checked by one forward over the whole output, and by a plain decode, one
token per forward, where that disagrees): speculation that changes the greedy output is a bug,
reported as such (exit code DIVERGED, statemachine/entry.py).
"""

from __future__ import annotations

import argparse
import functools
import inspect
import json
import os
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, NamedTuple

import torch

from eagle3d.drafter.export import load_export
from eagle3d.drafter.model import KV, Eagle3Drafter
from eagle3d.drafter.vocab import DraftVocab
from eagle3d.statemachine import layout, train_files
from eagle3d.statemachine.config_schema import Config, resolve_location
from eagle3d.statemachine.entry import DIVERGED, OK, Refusal, child_main
from eagle3d.target.taps import LayerTap, decoder_of


@dataclass
class Decoded:
    tokens: list[int]
    accepted: list[int] = field(default_factory=list)  # per verifying forward: drafts kept


def _finish(tokens: list[int], max_new: int, eos: set[int]) -> list[int]:
    out = []
    for t in tokens[:max_new]:
        out.append(t)
        if t in eos:
            break
    return out


@functools.cache
def _cache_name(cls: type) -> str:
    """What `cls.forward` calls its key/value cache: newer transformers name it `cache` (the
    older `past_key_values` warns on every call and is to go in 5.40), earlier releases know
    only `past_key_values`. Read once per class, not on every decoded token."""
    return "cache" if "cache" in inspect.signature(cls.forward).parameters else "past_key_values"


def cache_kwargs(module: Any, cache: Any) -> dict[str, Any]:
    return {_cache_name(type(module)): cache, "use_cache": True}


@torch.inference_mode()
def greedy(target: Any, prompt: list[int], max_new: int, eos: set[int]) -> list[int]:
    from transformers import DynamicCache
    cache = DynamicCache()
    logits = target(input_ids=torch.tensor([prompt], device=target.device),
                    **cache_kwargs(target, cache)).logits
    tokens = [int(logits[0, -1].argmax())]
    while len(tokens) < max_new and tokens[-1] not in eos:
        logits = target(input_ids=torch.tensor([[tokens[-1]]], device=target.device),
                        **cache_kwargs(target, cache)).logits
        tokens.append(int(logits[0, -1].argmax()))
    return tokens


class Answered(NamedTuple):
    """One forward of the target over a prompt and its answer."""
    choices: list[int]  # the target's greedy pick for each answer token, given all before it
    aux: torch.Tensor   # [1, T, 3H]: the captured features of every position


@torch.inference_mode()
def read_answer(target: Any, tap: LayerTap, prompt: list[int],
                answer: list[int]) -> Answered:
    """What both checks of a decoded answer read, from one forward: the greedy check's choices
    and teacher_forced's features."""
    ids = torch.tensor([list(prompt) + list(answer)], device=target.device)
    hidden = target.model(input_ids=ids).last_hidden_state
    # The head over the answer only: over the prompt too it would cost a tenth of the forward.
    choices = target.lm_head(hidden[0, len(prompt) - 1:-1]).argmax(-1).tolist()
    return Answered(choices, tap.take()[0])


def is_greedy(target: Any, prompt: list[int], tokens: list[int], max_new: int, eos: set[int],
              choices: list[int]) -> tuple[bool, bool]:
    """Whether `tokens` are the target's greedy continuation of `prompt`, and whether deciding
    it took a plain decode. One forward over the whole sequence gives the target's choice at
    every position at once (`choices`, read_answer's); only where it disagrees (a real
    divergence, or a near-tie that the two ways of computing round differently) is the prompt
    decoded one token per forward, and that decides."""
    if choices == tokens:
        return True, False
    return greedy(target, prompt, max_new, eos) == tokens, True


def _padded(rows: list[list[int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of different lengths as one right-padded [B, T] tensor and its [B, T] mask."""
    width = max(len(r) for r in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.bool)
    for i, r in enumerate(rows):
        ids[i, :len(r)] = torch.tensor(r, dtype=torch.long)
        mask[i, :len(r)] = True
    return ids.to(device), mask.to(device)


@torch.inference_mode()
def speculative(target: Any, tap: LayerTap, drafter: Eagle3Drafter, vocab: DraftVocab,
                prompts: list[list[int]], k: int, max_new: int, eos: set[int]) -> list[Decoded]:
    """Greedy chain speculative decoding of several prompts at once, each row exactly as it
    would be alone. The rows share slots in the target's and the drafter's key/value caches but
    not positions: every forward appends the same number of slots to every row, and a slot a
    row does not use (padding, its rejected drafts) is masked out for that row's later queries,
    so a row never sees another row's length."""
    from transformers import DynamicCache
    dev, dtype = drafter.fc.weight.device, drafter.fc.weight.dtype
    B, rows = len(prompts), torch.arange(len(prompts), device=dev)
    draft_to_target = vocab.target_ids.to(dev)

    ids, held = _padded(prompts, dev)  # held: the target's cache slots each row uses
    positions = (held.cumsum(1) - 1).clamp(min=0)
    cache = DynamicCache()
    # The head only where each prompt ends: over every prompt position, the logits of a batch
    # would take gigabytes.
    hidden = target.model(input_ids=ids, attention_mask=held.long(), position_ids=positions,
                          **cache_kwargs(target.model, cache)).last_hidden_state
    newest = target.lm_head(hidden[rows, held.sum(1) - 1]).argmax(-1)  # [B]: not yet cached
    results = [Decoded(tokens=[int(t)]) for t in newest.tolist()]
    active = [max_new > 1 and r.tokens[0] not in eos for r in results]
    # The drafter reads, at position i, the target's feature of i and the token i + 1.
    pending, pending_held = tap.take()[0], held  # target features not yet fed to the drafter
    pending_ids = torch.cat([ids[:, 1:], ids[:, :1]], 1)
    pending_ids[rows, held.sum(1) - 1] = newest
    pending_pos = positions
    at = held.sum(1)  # the position of each row's newest token
    context: KV | None = None
    context_held = torch.zeros(B, 0, dtype=torch.bool, device=dev)
    while any(active):
        context_held = torch.cat([context_held, pending_held], 1)
        out, kv = drafter.step(pending_ids, drafter.fc(pending.to(dtype)), pending_pos, context,
                               None, context_held)
        context = kv if context is None else (torch.cat([context[0], kv[0]], 2),
                                              torch.cat([context[1], kv[1]], 2))
        feature = out[rows, pending_held.sum(1) - 1][:, None]  # each row's last real position
        drafts: list[KV] = []
        chain = []
        for j in range(k):
            chain.append(draft_to_target[drafter.logits(feature)[:, -1].argmax(-1)])
            if j + 1 < k:
                feature, kv = drafter.step(chain[-1][:, None], feature, (at + j)[:, None],
                                           context, drafts, context_held)
                drafts.append(kv)
        proposal = torch.stack([newest, *chain], 1)  # [B, k + 1]
        step_pos = at[:, None] + torch.arange(k + 1, device=dev)
        held = torch.cat([held, torch.ones(B, k + 1, dtype=torch.bool, device=dev)], 1)
        checked = target(input_ids=proposal, attention_mask=held.long(), position_ids=step_pos,
                         **cache_kwargs(target, cache)).logits.argmax(-1)  # [B, k + 1]
        hits = (proposal[:, 1:] == checked[:, :k]).long().cumprod(1).sum(1)  # drafts accepted
        kept = torch.arange(k + 1, device=dev)[None, :] <= hits[:, None]
        held[:, -(k + 1):] = kept  # the rejected drafts leave every row's view of the cache
        newest = checked[rows, hits]
        pending, pending_held, pending_pos = tap.take()[0], kept, step_pos
        pending_ids = torch.cat([proposal[:, 1:], proposal[:, :1]], 1)
        pending_ids[rows, hits] = newest
        at = at + hits + 1
        for i, (accepted, row) in enumerate(zip(hits.tolist(), pending_ids.tolist())):
            if active[i]:
                new = row[:accepted + 1]
                results[i].tokens += new
                results[i].accepted.append(accepted)
                active[i] = len(results[i].tokens) < max_new and not eos.intersection(new)
    for r in results:
        r.tokens = _finish(r.tokens, max_new, eos)
    return results


class Drafting(NamedTuple):
    """SGLang's drafting settings. Top-k 1 is a chain of `steps` drafts, verified as
    steps + 1 tokens (SGLang sets num_draft_tokens so itself); above 1, a tree."""
    steps: int
    topk: int = 1
    num_draft_tokens: int = 0  # 0: steps + 1 for a chain, else required

    @property
    def chain(self) -> bool:
        return self.topk == 1


def drafting(steps: int, topk: int, num_draft_tokens: int | None) -> Drafting:
    """Drafting from the command line's values, or why they do not make one."""
    if steps < 1 or topk < 1:
        raise ValueError(f"--steps {steps} and --topk {topk} must be 1 or more")
    if topk == 1:
        if num_draft_tokens not in (None, steps + 1):
            raise ValueError(f"a chain (--topk 1) verifies --steps + 1 = {steps + 1} tokens, "
                             f"not --num-draft-tokens {num_draft_tokens}")
        return Drafting(steps, 1, steps + 1)
    candidates = topk + (steps - 1) * topk * topk  # what the tree's draft steps propose
    if num_draft_tokens is None or not 2 <= num_draft_tokens <= candidates + 1:
        raise ValueError(f"a tree (--topk {topk}, --steps {steps}) needs --num-draft-tokens "
                         f"from 2 to {candidates + 1}")
    return Drafting(steps, topk, num_draft_tokens)


class Tree(NamedTuple):
    """The drafted tokens (target ids) beneath the target's newest token, the root, in SGLang's
    order (by draft step, then by rank in it): node i is `tokens[i]`, a child of node
    `parents[i]` (-1: of the root)."""
    tokens: list[int]
    parents: list[int]


def draft_tree(drafter: Eagle3Drafter, vocab: DraftVocab, context: KV, feature: torch.Tensor,
               at: int, d: Drafting) -> Tree:
    """SGLang's EAGLE draft tree (speculative/eagle_utils.py, select_top_k_tokens and
    organize_draft_results): the first step proposes the top-k tokens of `feature` (the
    drafter's output at index `at`, whose next token is the root); each later step expands
    every one of the k best nodes so far (by score, the product of the draft probabilities along
    the path) into its own top k, and keeps the k best of those k·k as the next step's nodes.
    Of every node proposed, the num_draft_tokens - 1 of highest score are the tree.

    The k nodes a step expands are k rows of the drafter: a row's draft keys stay those its row
    made at earlier steps when its node's parent sat in another row, as SGLang keeps a row's
    cache slots (the drafted tokens and the scores are what the tree needs to be right)."""
    k = d.topk
    draft_to_target = vocab.target_ids.to(feature.device)
    probs = torch.softmax(drafter.logits(feature)[:, -1].float(), -1)  # [1, draft vocab]
    p, ids = probs.topk(k, -1)
    scores, frontier = p[0], list(range(k))  # the nodes the next step expands
    all_scores, all_ids, parents = [p[0]], [ids[0]], [-1] * k
    rows = feature.expand(k, 1, -1)
    context = (context[0].expand(k, -1, -1, -1), context[1].expand(k, -1, -1, -1))
    drafts: list[KV] = []
    fed = ids[0]
    for i in range(1, d.steps):
        positions = torch.full((k, 1), at + i, device=feature.device)
        out, kv = drafter.step(draft_to_target[fed][:, None], rows, positions, context, drafts)
        drafts.append(kv)
        p, ids = torch.softmax(drafter.logits(out)[:, -1].float(), -1).topk(k, -1)  # [k, k]
        expanded = (scores[:, None] * p).flatten()
        best = expanded.topk(k).indices
        base = sum(len(t) for t in all_ids)
        all_scores.append(expanded)
        all_ids.append(ids.flatten())
        parents += [frontier[j // k] for j in range(k * k)]
        frontier = [base + int(j) for j in best]
        scores, fed, rows = expanded[best], ids.flatten()[best], out[best // k]
    chosen = sorted(torch.cat(all_scores).topk(d.num_draft_tokens - 1).indices.tolist())
    node_of = {c: n for n, c in enumerate(chosen)}
    tokens = draft_to_target[torch.cat(all_ids)[chosen]].tolist()
    # A node whose parent was not chosen (a tie in score) hangs from nothing: never reached.
    return Tree(tokens, [node_of.get(parents[c], -2) if parents[c] >= 0 else -1
                         for c in chosen])


def longest_match(tree: Tree, greedy_next: list[int]) -> list[int]:
    """The nodes of the longest root-to-node path whose tokens are the target's greedy
    continuation `greedy_next`: what the target's verify forward accepts (SGLang's
    verify_tree_greedy). A node's children have distinct tokens, so the path is unique."""
    path: list[int] = []
    at = -1
    for want in greedy_next:
        child = next((n for n, (t, parent) in enumerate(zip(tree.tokens, tree.parents))
                      if parent == at and t == want), None)
        if child is None:
            break
        path.append(child)
        at = child
    return path


@torch.inference_mode()
def tree_speculative(target: Any, tap: LayerTap, drafter: Eagle3Drafter, vocab: DraftVocab,
                     prompt: list[int], d: Drafting, max_new: int, eos: set[int],
                     verify: Callable[[Tree, list[int]], list[int]] = longest_match) -> Decoded:
    """Tree speculative decoding of one prompt. What a verify forward of the tree computes is
    the target's greedy choice after each node; along the one path that can be accepted, those
    are the target's greedy continuation, which is decoded here first (past `max_new` and any
    end token by the tree's depth, as a real verify forward would see). The drafter drafts each
    tree from the target's features of the accepted text, as SGLang's draft extend does; those
    come from one forward over the continuation. `verify` picks the accepted nodes."""
    dev, dtype = drafter.fc.weight.device, drafter.fc.weight.dtype
    continuation = greedy(target, prompt, max_new + d.steps, set())
    aux = read_answer(target, tap, prompt, continuation).aux
    ids = torch.tensor([list(prompt) + continuation], device=dev)
    # The drafter over every real position at once: index t reads token t + 1 and the target's
    # feature of t, and its keys are the context of a tree drafted after token t + 1.
    n = ids.shape[1] - 1
    out, context = drafter.step(ids[:, 1:], drafter.fc(aux[:, :n].to(dev, dtype)),
                                torch.arange(n, device=dev)[None], None, None)
    tokens, accepted = [continuation[0]], []
    while len(tokens) < max_new and not eos.intersection(tokens):
        at = len(prompt) - 1 + len(tokens) - 1  # the index that reads the newest token
        tree = draft_tree(drafter, vocab, (context[0][:, :, :at + 1], context[1][:, :, :at + 1]),
                          out[:, at:at + 1], at, d)
        want = continuation[len(tokens):len(tokens) + d.steps]
        path = verify(tree, want)
        tokens += [tree.tokens[node] for node in path] + [continuation[len(tokens) + len(path)]]
        accepted.append(len(path))
    return Decoded(_finish(tokens, max_new, eos), accepted)


@torch.inference_mode()
def teacher_forced(drafter: Eagle3Drafter, vocab: DraftVocab, prompt: list[int],
                   answer: list[int], aux: torch.Tensor, steps: int) -> torch.Tensor:
    """The drafts training's unroll makes over the whole answer, with the target's features of
    the real text at every position (`aux`, read_answer's): [steps, len(answer)] bool, entry
    [k, j] whether the k-th draft of a chain started after answer token j is answer token j+1+k
    (False past the end).

    Speculative decoding makes the same drafts where a chain starts (each chain begins from real
    features; a draft it keeps is the real token), so a forward keeps exactly the leading hits
    of column j at its start. This measures the drafter on every position of held-out text, as
    training measures it on its own, where the acceptance length sees only chain starts."""
    dev, dtype = drafter.fc.weight.device, drafter.fc.weight.dtype
    ids = torch.tensor([list(prompt) + list(answer)], device=dev)
    outs = drafter.unroll(ids, aux.to(dev, dtype), steps)
    draft_to_target = vocab.target_ids.to(dev)
    start, n = len(prompt) - 1, len(answer)  # the index that reads answer token 0
    hits = torch.zeros(steps, n, dtype=torch.bool)
    for k, out in enumerate(outs):
        reach = n - 1 - k  # chains whose k-th draft still lies within the answer
        if reach > 0:
            drafts = draft_to_target[drafter.logits(out[0, start:start + reach]).argmax(-1)]
            hits[k, :reach] = (drafts == ids[0, start + 2 + k:start + 2 + k + reach]).cpu()
    return hits


def chain_starts(accepted: list[int]) -> list[int]:
    """The answer token after which each verifying forward's chain was drafted: the prefill
    gives token 0, a forward that keeps `kept` drafts adds kept + 1 tokens."""
    starts, at = [], 0
    for kept in accepted:
        starts.append(at)
        at += kept + 1
    return starts


class Prompts(NamedTuple):
    ids: list[list[int]]            # the prompts used, token ids with the generation prompt
    categories: list[str | None]    # each prompt's category, where the file names one
    asked: int                      # questions read from the source
    skipped: dict[str, int]         # why the others were left out, and how many each
    format: str                     # the source's format, as detected


def _template(tokenizer: Any, messages: list[dict]) -> list[int]:
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def prompts_from(questions: list[Any], fmt: str, tokenizer: Any, max_tokens: int,
                 answer: Callable[[list[int]], list[int]] | None = None) -> Prompts:
    """Each question's first user turn (with a system turn before it, if any); with `answer`
    (the target's answer to a prompt's ids), every later user turn too, after the target's own
    answers to the turns before it, as a user's chat would go on. A question with no user turn,
    or whose prompt is longer than `max_tokens`, is skipped and counted with its reason.
    `questions` are read_source's, of format `fmt`."""
    ids: list[list[int]] = []
    categories: list[str | None] = []
    skipped: dict[str, int] = {}
    asked = 0
    for question in questions:
        asked += 1
        why = question.problem
        messages = list(question.first)
        for follow_up in (None, *(question.follow_ups if answer else ())):
            if why:
                break
            if follow_up is not None:
                reply = tokenizer.decode(answer(ids[-1]), skip_special_tokens=True)
                messages += [{"role": "assistant", "content": reply},
                             {"role": "user", "content": follow_up}]
            prompt = _template(tokenizer, messages)
            if len(prompt) > max_tokens:
                why = f"prompt over {max_tokens} tokens"
            else:
                ids.append(prompt)
                categories.append(question.category)
        if why:
            skipped[why] = skipped.get(why, 0) + 1
    return Prompts(ids, categories, asked, skipped, fmt)


def confidence_interval(per_prompt: list[tuple[int, int]], seed: int = 0,
                        rounds: int = 2000) -> tuple[float, float]:
    """95% bootstrap interval of the acceptance length (tokens over forwards), resampling
    prompts: tokens within a prompt are not independent, prompts are."""
    if len(per_prompt) < 2:
        return (float("nan"), float("nan"))
    rng = random.Random(seed)
    values = []
    for _ in range(rounds):
        draw = [per_prompt[rng.randrange(len(per_prompt))] for _ in per_prompt]
        values.append(sum(t for t, _ in draw) / max(1, sum(f for _, f in draw)))
    values.sort()
    return values[int(0.025 * rounds)], values[int(0.975 * rounds) - 1]


# New tokens per bucket of `acceptance_length_by_depth`.
DEPTH_BLOCK = 32


def by_depth(accepted_per_prompt: list[list[int]],
             block: int = DEPTH_BLOCK) -> list[dict[str, Any]]:
    """The acceptance length of the verifying forwards that start within each `block` new tokens
    of an answer (the prefill's token is the answer's first, at depth 0). Training answers run
    longer than the evaluated ones, and a small model's greedy text grows more predictable as it
    repeats itself, so where in an answer the drafts land is part of what the figure means."""
    tokens: dict[int, int] = {}
    forwards: dict[int, int] = {}
    for accepted in accepted_per_prompt:
        for start, kept in zip(chain_starts(accepted), accepted):
            bucket = (start + 1) // block  # the forward's first new token, at depth start + 1
            tokens[bucket] = tokens.get(bucket, 0) + kept + 1
            forwards[bucket] = forwards.get(bucket, 0) + 1
    return [{"from": b * block, "acceptance_length": tokens[b] / forwards[b],
             "forwards": forwards[b]} for b in sorted(forwards)]


def acceptance(accepted_per_prompt: list[list[int]]) -> dict[str, Any]:
    """The acceptance length of these prompts' verifying forwards (each kept `accepted` drafts
    and the target's own token) and its interval."""
    rounds = [kept for accepted in accepted_per_prompt for kept in accepted]
    # (tokens from verifying forwards, forwards) of each prompt
    per_prompt = [(sum(accepted) + len(accepted), len(accepted))
                  for accepted in accepted_per_prompt]
    return {"acceptance_length": (sum(rounds) + len(rounds)) / max(1, len(rounds)),
            "acceptance_length_ci95": list(confidence_interval(per_prompt)),
            "prompts": len(accepted_per_prompt)}


def by_category(accepted_per_prompt: list[list[int]],
                categories: list[str | None]) -> dict[str, dict[str, Any]]:
    """acceptance() of each category's prompts; none where no prompt names one."""
    named = sorted({c for c in categories if c is not None})
    return {c: acceptance([a for a, of in zip(accepted_per_prompt, categories) if of == c])
            for c in named}


def _decoded(target: Any, tap: LayerTap, drafter: Eagle3Drafter, vocab: DraftVocab,
             batch: list[list[int]], d: Drafting, max_new: int, eos: set[int]) -> list[Decoded]:
    if d.chain:
        return speculative(target, tap, drafter, vocab, batch, d.steps, max_new, eos)
    return [tree_speculative(target, tap, drafter, vocab, p, d, max_new, eos) for p in batch]


def evaluate(target: Any, drafter: Eagle3Drafter, vocab: DraftVocab, layer_ids: list[int],
             prompts: list[list[int]], d: Drafting, max_new_tokens: int, eos: set[int],
             batch_size: int, categories: list[str | None] | None = None) -> dict[str, Any]:
    started = time.monotonic()
    steps = d.steps
    accepted_per_prompt: list[list[int]] = [[] for _ in prompts]  # drafts kept per forward
    identical, new_tokens, plain_decodes = True, 0, 0
    hits, drafted = torch.zeros(steps), torch.zeros(steps)  # teacher-forced, per chain step
    chains, chains_as_forced = 0, 0
    # Prompts of like length share a batch: a batch pads every row to its longest prompt.
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    with LayerTap(decoder_of(target), layer_ids) as tap:
        for first in range(0, len(order), batch_size):
            batch = order[first:first + batch_size]
            decoded = _decoded(target, tap, drafter, vocab, [prompts[i] for i in batch], d,
                               max_new_tokens, eos)
            for i, spec in zip(batch, decoded):
                prompt = prompts[i]
                answered = read_answer(target, tap, prompt, spec.tokens)
                same, plain = is_greedy(target, prompt, spec.tokens, max_new_tokens, eos,
                                        answered.choices)
                identical &= same
                plain_decodes += plain
                accepted_per_prompt[i] = spec.accepted
                new_tokens += len(spec.tokens)
                forced = teacher_forced(drafter, vocab, prompt, spec.tokens, answered.aux,
                                        steps)
                n = len(spec.tokens)
                hits += forced.sum(1)
                drafted += (n - 1 - torch.arange(steps)).clamp(min=0)
                for start, kept in zip(chain_starts(spec.accepted), spec.accepted):
                    if d.chain and start + steps <= n - 1:  # the chain lies in the answer
                        chains += 1
                        chains_as_forced += kept == int(forced[:, start].long().cumprod(0).sum())
    rounds = [kept for accepted in accepted_per_prompt for kept in accepted]
    forwards = len(rounds)
    return {**acceptance(accepted_per_prompt),
            "drafting": d._asdict(),
            "per_position_acceptance": [sum(a > j for a in rounds) / max(1, forwards)
                                        for j in range(steps)],
            "acceptance_length_by_depth": by_depth(accepted_per_prompt),
            "acceptance_length_by_category": by_category(accepted_per_prompt,
                                                         categories or [None] * len(prompts)),
            # Every answer position, as training counts: rounds see only chain starts.
            "teacher_forced_accuracy": (hits / drafted.clamp(min=1)).tolist(),
            # A tree keeps more than its best chain: only a chain's rounds compare.
            "chains_as_teacher_forced": chains_as_forced / max(1, chains) if d.chain else None,
            "new_tokens": new_tokens, "target_forwards": forwards,
            "identical_to_greedy": identical, "plain_decodes": plain_decodes,
            "batch_size": batch_size, "seconds": time.monotonic() - started}


def _reasons(skipped: dict[str, int]) -> str:
    return ", ".join(f"{n} {why}" for why, n in skipped.items()) or "none"


def _arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--drafter", type=Path, help="export folder (default: <train_dir>/export)")
    where = p.add_mutually_exclusive_group()
    where.add_argument("--source", help="conversations (default: [eval] source, from [eval] "
                                        "first, [eval] limit of them)")
    where.add_argument("--prompts", help="a file of prompts, all of them: MT-bench questions, "
                                         "OpenAI-style messages or ShareGPT (detected)")
    p.add_argument("--every-turn", action="store_true",
                   help="every user turn, after the target's own answers to those before it "
                        "(default: the first)")
    p.add_argument("--first", type=int)
    p.add_argument("--limit", type=int)
    p.add_argument("--steps", type=int, help="draft steps (SGLang's --speculative-num-steps)")
    p.add_argument("--topk", type=int, default=1,
                   help="candidates per draft step: 1 a chain, more a tree "
                        "(SGLang's --speculative-eagle-topk)")
    p.add_argument("--num-draft-tokens", type=int,
                   help="tokens verified per target forward, a tree's size "
                        "(SGLang's --speculative-num-draft-tokens; a chain's is steps + 1)")
    p.add_argument("--max-new-tokens", type=int)
    p.add_argument("--batch-size", type=int, help="prompts decoded together")
    p.add_argument("--json", action="store_true", help="print JSON instead of a summary")
    p.add_argument("--out", type=Path, help="also write the JSON to this file, atomically")


def read_source(cfg: Config, source: str | None, prompts: str | None, first: int | None,
                limit: int | None) -> tuple[Path, str, list[Any]]:
    """The questions that `--source` (from [eval] first, [eval] limit of them) or `--prompts`
    (all of them) name, and their format, read before the target loads: a bad file is one
    error naming it and its line, at once."""
    from eagle3d.dataset.prompts import detect_format, read_questions
    try:
        path = resolve_location(source or prompts, Path.cwd()) if source or prompts \
            else cfg.eval.source_path
        if first is None:
            first = 0 if prompts else cfg.eval.first
        if limit is None:
            limit = None if prompts else cfg.eval.limit
        # A file of prompts the user names is held to what they wrote; a data source may be
        # ShareGPT's, cut off mid-record.
        return path, detect_format(path), list(read_questions(path, first, limit,
                                                              strict=bool(prompts)))
    except ValueError as exc:  # a PromptError, or a location that is not there
        raise Refusal(str(exc)) from None


def _summary(report: dict[str, Any], asked: int, skipped: dict[str, int]) -> str:
    low, high = report["acceptance_length_ci95"]
    d = report["drafting"]
    forced = report["chains_as_teacher_forced"]
    lines = [
        f"acceptance length {report['acceptance_length']:.3f} tokens per target forward, "
        f"95% interval {low:.3f}-{high:.3f} ({report['prompts']} prompts of {asked} asked; "
        f"skipped: {_reasons(skipped)}; {report['new_tokens']} new tokens, "
        f"{report['target_forwards']} verifying forwards, {report['seconds']:.0f} s)",
        f"drafting: {d['steps']} steps, top-k {d['topk']}, {d['num_draft_tokens']} draft "
        f"tokens ({'chain' if d['topk'] == 1 else 'tree'})",
        "per-position acceptance: " + " ".join(f"{a:.2f}"
                                               for a in report["per_position_acceptance"]),
        "teacher-forced accuracy per draft step, every answer position: "
        + " ".join(f"{a:.2f}" for a in report["teacher_forced_accuracy"])
        + ("" if forced is None else
           f" (chains kept as teacher-forced drafts predict: {forced:.1%})"),
        "by depth in the answer (new tokens from: acceptance length): "
        + " ".join(f"{b['from']}: {b['acceptance_length']:.2f}"
                   for b in report["acceptance_length_by_depth"])]
    if report["acceptance_length_by_category"]:
        lines.append("by category (acceptance length, 95% interval, prompts):")
    for category, c in report["acceptance_length_by_category"].items():
        lo, hi = c["acceptance_length_ci95"]
        lines.append(f"  {category}: {c['acceptance_length']:.3f} ({lo:.3f}-{hi:.3f}, "
                     f"{c['prompts']} prompts)")
    trained = report.get("trained_steps")
    if trained is not None and d["steps"] > trained:
        deeper = (f"step {d['steps']}" if d["steps"] == trained + 1
                  else f"steps {trained + 1}-{d['steps']}")
        lines.append(f"note: {d['steps']} draft steps, but training unrolled {trained} ([train] "
                     f"ttt_steps): {deeper} draft at a depth training never reached")
    lines.append(f"identical to greedy decoding: {report['identical_to_greedy']}")
    return "\n".join(lines)


def _run(cfg: Config, args: argparse.Namespace) -> int:
    from eagle3d.dataset import contract
    from eagle3d.target import identity
    from eagle3d.target.loading import load_model, load_tokenizer, pick_device, stop_tokens

    source, fmt, questions = read_source(cfg, args.source, args.prompts, args.first, args.limit)
    try:
        d = drafting(args.steps or cfg.eval.steps, args.topk, args.num_draft_tokens)
    except ValueError as exc:
        raise Refusal(str(exc)) from None
    drafter_dir = args.drafter or layout.export_dir(cfg.paths.train_dir)
    if not (drafter_dir / "config.json").exists():
        raise Refusal(f"no exported drafter in {drafter_dir}")
    captured = contract.read(cfg.paths.dataset_dir)
    if captured is not None:  # the drafter learned this dataset's target: measure against it
        identity.check(captured, cfg.target.model_path, cfg.target.model)
    max_new = args.max_new_tokens or cfg.eval.max_new_tokens
    device = pick_device(cfg.target.device)
    torch.set_num_threads(cfg.train.threads or torch.get_num_threads())
    if device == "cpu":
        # Rows of different lengths share a batch (an attention mask): transformers then copies
        # every KV head once per query head it serves before each SDPA call, the whole cache
        # at every layer and step, unless told to let SDPA group the heads. On a CPU in float32
        # that is faster: the demo's 42 prompts took 130 s instead of 193 (2026-12-03, 2-core
        # VM), the same tokens. Set for this process alone: it loads one target.
        os.environ["TRANSFORMERS_SDPA_FORCE_GQA"] = "1"
    # float32: verifying k+1 drafted tokens in one forward must pick exactly the tokens that k+1
    # one-token forwards pick; in bf16 the two round differently and near-ties flip (seen on an
    # H200). On CPU it is also the fast path for GGUF weights.
    target = load_model(cfg.target.model_path, "float32", device)
    tokenizer = load_tokenizer(cfg.target.model_path)
    embed = target.get_input_embeddings().weight.detach().float().cpu()
    drafter, vocab, config = load_export(drafter_dir, embed)
    drafter.to(target.device)
    layer_ids = config["eagle3d"]["contract_layer_ids"]
    eos = stop_tokens(tokenizer, target.generation_config)
    prompts = prompts_from(questions, fmt, tokenizer,
                           cfg.data.max_tokens - max_new,
                           (lambda ids: greedy(target, ids, max_new, eos)) if args.every_turn
                           else None)
    if not prompts.ids:
        raise Refusal(f"no usable prompt among the {prompts.asked} questions read from {source} "
                      f"({_reasons(prompts.skipped)})")
    report = evaluate(target, drafter, vocab, layer_ids, prompts.ids, d, max_new, eos,
                      args.batch_size or cfg.eval.batch_size, prompts.categories)
    report.update(drafter=str(drafter_dir), source=str(source), source_format=prompts.format,
                  prompts_asked=prompts.asked, prompts_skipped=prompts.skipped,
                  trained_steps=config["eagle3d"].get("ttt_steps"))  # None: older exports
    if args.out:
        train_files.write_eval(args.out, report)
    summary = _summary(report, prompts.asked, prompts.skipped)
    if args.json:
        print(json.dumps(report))
    else:  # with --out (the daemon's evaluation), one line for its log: the rest is in the file
        print(f"{summary.splitlines()[0]}; the whole report: {args.out}" if args.out else summary)
    return OK if report["identical_to_greedy"] else DIVERGED


def main(argv: list[str] | None = None) -> int:
    return child_main("evaluate", "Acceptance length of an exported EAGLE-3 drafter.", _run, argv,
                      _arguments)


if __name__ == "__main__":
    sys.exit(main())
