"""Acceptance length of an exported drafter with the real target, by greedy chain speculative
decoding: the drafter proposes k tokens, the target checks them in one forward, the matching
prefix and the target's own next token are kept.

`python -m eagle3d.drafter.evaluate -c CONFIG [--drafter DIR] [--source S --first N --limit M]
[--steps K] [--max-new-tokens T] [--batch-size B] [--json] [--out FILE]`

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
from typing import Any, NamedTuple

import torch

from eagle3d.drafter.export import load_export
from eagle3d.drafter.model import KV, Eagle3Drafter
from eagle3d.drafter.vocab import DraftVocab
from eagle3d.statemachine import layout, train_files
from eagle3d.statemachine.config import Config, resolve_location
from eagle3d.statemachine.entry import DIVERGED, OK, Refusal, child_main


class AuxCapture:
    """The hidden states entering the target's decoder layers `layer_ids` (the capture
    contract's convention), taken by forward pre-hooks, concatenated in id order."""

    def __init__(self, target: Any, layer_ids: list[int]) -> None:
        layers = target.model.layers
        self.seen: dict[int, torch.Tensor] = {}
        self.layer_ids = list(layer_ids)
        self.handles = [layers[i].register_forward_pre_hook(self._hook(i), with_kwargs=True)
                        for i in self.layer_ids]

    def _hook(self, i: int):
        def hook(module: Any, args: tuple, kwargs: dict) -> None:
            self.seen[i] = args[0] if args else kwargs["hidden_states"]
        return hook

    def take(self) -> torch.Tensor:
        out = torch.cat([self.seen[i] for i in self.layer_ids], dim=-1)
        self.seen.clear()
        return out

    def close(self) -> None:
        for h in self.handles:
            h.remove()


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


def _cached(module: Any, cache: Any) -> dict[str, Any]:
    return {_cache_name(type(module)): cache, "use_cache": True}


@torch.inference_mode()
def greedy(target: Any, prompt: list[int], max_new: int, eos: set[int]) -> list[int]:
    from transformers import DynamicCache
    cache = DynamicCache()
    logits = target(input_ids=torch.tensor([prompt], device=target.device),
                    **_cached(target, cache)).logits
    tokens = [int(logits[0, -1].argmax())]
    while len(tokens) < max_new and tokens[-1] not in eos:
        logits = target(input_ids=torch.tensor([[tokens[-1]]], device=target.device),
                        **_cached(target, cache)).logits
        tokens.append(int(logits[0, -1].argmax()))
    return tokens


class Answered(NamedTuple):
    """One forward of the target over a prompt and its answer."""
    choices: list[int]  # the target's greedy pick for each answer token, given all before it
    aux: torch.Tensor   # [1, T, 3H]: the captured features of every position


@torch.inference_mode()
def read_answer(target: Any, capture: AuxCapture, prompt: list[int],
                answer: list[int]) -> Answered:
    """What both checks of a decoded answer read, from one forward: the greedy check's choices
    and teacher_forced's features."""
    ids = torch.tensor([list(prompt) + list(answer)], device=target.device)
    hidden = target.model(input_ids=ids).last_hidden_state
    # The head over the answer only: over the prompt too it would cost a tenth of the forward.
    choices = target.lm_head(hidden[0, len(prompt) - 1:-1]).argmax(-1).tolist()
    return Answered(choices, capture.take())


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
def speculative(target: Any, capture: AuxCapture, drafter: Eagle3Drafter, vocab: DraftVocab,
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
                          **_cached(target.model, cache)).last_hidden_state
    newest = target.lm_head(hidden[rows, held.sum(1) - 1]).argmax(-1)  # [B]: not yet cached
    results = [Decoded(tokens=[int(t)]) for t in newest.tolist()]
    active = [max_new > 1 and r.tokens[0] not in eos for r in results]
    # The drafter reads, at position i, the target's feature of i and the token i + 1.
    pending, pending_held = capture.take(), held  # target features not yet fed to the drafter
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
                         **_cached(target, cache)).logits.argmax(-1)  # [B, k + 1]
        hits = (proposal[:, 1:] == checked[:, :k]).long().cumprod(1).sum(1)  # drafts accepted
        kept = torch.arange(k + 1, device=dev)[None, :] <= hits[:, None]
        held[:, -(k + 1):] = kept  # the rejected drafts leave every row's view of the cache
        newest = checked[rows, hits]
        pending, pending_held, pending_pos = capture.take(), kept, step_pos
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
    ids: list[list[int]]       # the prompts used, token ids with the generation prompt
    asked: int                 # conversations read from the source
    skipped: dict[str, int]    # why the others were left out, and how many each


def prompts_from(source: Path, fmt: str, first: int, limit: int, tokenizer: Any,
                 max_tokens: int) -> Prompts:
    """Each conversation's first user turn (with a system turn before it, if any), wherever it
    stands: assistant turns before it are dropped. A conversation with no user turn, or whose
    prompt is longer than `max_tokens`, is skipped and counted with its reason."""
    from eagle3d.dataset.conversations import iter_conversations
    ids: list[list[int]] = []
    skipped: dict[str, int] = {}
    asked = 0
    for conv in iter_conversations(source, fmt, first, limit):
        asked += 1
        why = None
        turns = [m for m in conv.messages or () if m["role"] == "system"][:1]
        first_user = next((m for m in conv.messages or () if m["role"] == "user"), None)
        if conv.messages is None:
            why = conv.problem or "unusable"
        elif first_user is None:
            why = "no user turn"
        else:
            text = tokenizer.apply_chat_template(turns + [first_user], tokenize=False,
                                                 add_generation_prompt=True)
            prompt = tokenizer(text, add_special_tokens=False)["input_ids"]
            if len(prompt) > max_tokens:
                why = f"prompt over {max_tokens} tokens"
            else:
                ids.append(prompt)
        if why:
            skipped[why] = skipped.get(why, 0) + 1
    return Prompts(ids, asked, skipped)


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


def evaluate(target: Any, drafter: Eagle3Drafter, vocab: DraftVocab, layer_ids: list[int],
             prompts: list[list[int]], steps: int, max_new_tokens: int, eos: set[int],
             batch_size: int) -> dict[str, Any]:
    started = time.monotonic()
    capture = AuxCapture(target, layer_ids)
    accepted_per_prompt: list[list[int]] = []  # drafts kept by each verifying forward
    identical, new_tokens, plain_decodes = True, 0, 0
    hits, drafted = torch.zeros(steps), torch.zeros(steps)  # teacher-forced, per chain step
    chains, chains_as_forced = 0, 0
    # Prompts of like length share a batch: a batch pads every row to its longest prompt.
    ordered = sorted(prompts, key=len)
    try:
        for first in range(0, len(ordered), batch_size):
            batch = ordered[first:first + batch_size]
            decoded = speculative(target, capture, drafter, vocab, batch, steps, max_new_tokens,
                                  eos)
            for prompt, spec in zip(batch, decoded):
                answered = read_answer(target, capture, prompt, spec.tokens)
                same, plain = is_greedy(target, prompt, spec.tokens, max_new_tokens, eos,
                                        answered.choices)
                identical &= same
                plain_decodes += plain
                accepted_per_prompt.append(spec.accepted)
                new_tokens += len(spec.tokens)
                forced = teacher_forced(drafter, vocab, prompt, spec.tokens, answered.aux,
                                        steps)
                n = len(spec.tokens)
                hits += forced.sum(1)
                drafted += (n - 1 - torch.arange(steps)).clamp(min=0)
                for start, kept in zip(chain_starts(spec.accepted), spec.accepted):
                    if start + steps <= n - 1:  # the whole chain's tokens lie in the answer
                        chains += 1
                        chains_as_forced += kept == int(forced[:, start].long().cumprod(0).sum())
    finally:
        capture.close()
    rounds = [kept for accepted in accepted_per_prompt for kept in accepted]
    # (tokens from verifying forwards, forwards) of each prompt
    per_prompt = [(sum(accepted) + len(accepted), len(accepted))
                  for accepted in accepted_per_prompt]
    forwards = len(rounds)
    return {"acceptance_length": (sum(rounds) + forwards) / max(1, forwards),
            "acceptance_length_ci95": list(confidence_interval(per_prompt)),
            "per_position_acceptance": [sum(a > j for a in rounds) / max(1, forwards)
                                        for j in range(steps)],
            "acceptance_length_by_depth": by_depth(accepted_per_prompt),
            # Every answer position, as training counts: rounds see only chain starts.
            "teacher_forced_accuracy": (hits / drafted.clamp(min=1)).tolist(),
            "chains_as_teacher_forced": chains_as_forced / max(1, chains),
            "prompts": len(prompts), "new_tokens": new_tokens, "target_forwards": forwards,
            "identical_to_greedy": identical, "plain_decodes": plain_decodes,
            "batch_size": batch_size, "seconds": time.monotonic() - started}


def _reasons(skipped: dict[str, int]) -> str:
    return ", ".join(f"{n} {why}" for why, n in skipped.items()) or "none"


def _arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--drafter", type=Path, help="export folder (default: <train_dir>/export)")
    p.add_argument("--source", help="conversations (default: [eval] source)")
    p.add_argument("--first", type=int)
    p.add_argument("--limit", type=int)
    p.add_argument("--steps", type=int, help="draft tokens per target forward")
    p.add_argument("--max-new-tokens", type=int)
    p.add_argument("--batch-size", type=int, help="prompts decoded together")
    p.add_argument("--json", action="store_true", help="print JSON instead of a summary")
    p.add_argument("--out", type=Path, help="also write the JSON to this file, atomically")


def _run(cfg: Config, args: argparse.Namespace) -> int:
    from eagle3d.dataset import contract
    from eagle3d.target import identity
    from eagle3d.target.loading import load_model, load_tokenizer, pick_device, stop_tokens

    try:
        source = resolve_location(args.source, Path.cwd()) if args.source else cfg.eval.source_path
    except ValueError as exc:
        raise Refusal(str(exc)) from None
    drafter_dir = args.drafter or layout.export_dir(cfg.paths.train_dir)
    if not (drafter_dir / "config.json").exists():
        raise Refusal(f"no exported drafter in {drafter_dir}")
    captured = contract.read(cfg.paths.dataset_dir)
    if captured is not None:  # the drafter learned this dataset's target: measure against it
        identity.check(captured, cfg.target.model_path, cfg.target.model)
    steps = args.steps or cfg.eval.steps
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
    prompts = prompts_from(source, cfg.data.format, cfg.eval.first if args.first is None
                           else args.first, cfg.eval.limit if args.limit is None else args.limit,
                           tokenizer, cfg.data.max_tokens - max_new)
    if not prompts.ids:
        raise Refusal(f"no usable prompt among the {prompts.asked} conversations read "
                      f"({_reasons(prompts.skipped)})")
    eos = stop_tokens(tokenizer, target.generation_config)
    report = evaluate(target, drafter, vocab, layer_ids, prompts.ids, steps, max_new, eos,
                      args.batch_size or cfg.eval.batch_size)
    report.update(drafter=str(drafter_dir), prompts_asked=prompts.asked,
                  prompts_skipped=prompts.skipped)
    if args.out:
        train_files.write_eval(args.out, report)
    if args.json:
        print(json.dumps(report))
    else:
        low, high = report["acceptance_length_ci95"]
        print(f"acceptance length {report['acceptance_length']:.3f} tokens per target forward, "
              f"95% interval {low:.3f}-{high:.3f} ({report['prompts']} prompts of "
              f"{prompts.asked} asked; skipped: {_reasons(prompts.skipped)}; "
              f"{report['new_tokens']} new tokens, {report['target_forwards']} verifying "
              f"forwards, {report['seconds']:.0f} s)\n"
              f"per-position acceptance: "
              + " ".join(f"{a:.2f}" for a in report["per_position_acceptance"])
              + "\nteacher-forced accuracy per draft step, every answer position: "
              + " ".join(f"{a:.2f}" for a in report["teacher_forced_accuracy"])
              + f" (chains kept as teacher-forced drafts predict: "
              f"{report['chains_as_teacher_forced']:.1%})"
              + "\nby depth in the answer (new tokens from: acceptance length): "
              + " ".join(f"{d['from']}: {d['acceptance_length']:.2f}"
                         for d in report["acceptance_length_by_depth"])
              + f"\nidentical to greedy decoding: {report['identical_to_greedy']}")
    return OK if report["identical_to_greedy"] else DIVERGED


def main(argv: list[str] | None = None) -> int:
    return child_main("evaluate", "Acceptance length of an exported EAGLE-3 drafter.", _run, argv,
                      _arguments)


if __name__ == "__main__":
    sys.exit(main())
