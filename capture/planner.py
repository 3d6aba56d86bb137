"""The plan child: `python -m eagle3d.capture.planner -c CONFIG`.

Turns the configured slice of the conversation source into ledger rows: one `pending` sample per
usable conversation (its token ids and loss mask, as the target's tokenizer and chat template
produce them) and one `skipped` row, with the reason, per conversation that cannot be used. Every
source index in the slice ends up in exactly one of the two, so the counts always add up.
Where the target writes the answers ([data] responses = "target"), a conversation is planned as
an `ungenerated` sample holding its system and user turns, [generate] answers times (each its
own sample, `row_index`); the generator (capture/generator.py) writes the assistant turns and
tokenizes the result with `plan_batch`, as here.

It also writes the dataset's capture contract (`<dataset_dir>/capture.toml`) on first run, and
refuses (CONTRACT_MISMATCH) to plan into a dataset whose contract differs from the config's.

Resumable: each batch of ~256 conversations is one ledger transaction, and a restart begins after
the highest source index already recorded (all of a conversation's answers are in one batch).
The daemon reads progress from the ledger meta keys `plan.*`; this process never decides on its
own that the plan is complete.

Exit codes (statemachine/entry.py): OK, REFUSED (bad config or unreadable input),
CONTRACT_MISMATCH.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Sequence

import numpy as np

from eagle3d.capture import engines
from eagle3d.dataset import contract, dumpformat
from eagle3d.target import identity, loading
from eagle3d.dataset.conversations import Conversation, iter_conversations
from eagle3d.statemachine import digests, layout, shards
from eagle3d.statemachine.config_schema import Config
from eagle3d.statemachine.config_validation import ConfigError
from eagle3d.statemachine.entry import OK, ContractMismatch, Refusal, child_main
from eagle3d.statemachine.ledger import Ledger, PlannedSample, Prompt
from eagle3d.statemachine.plan_meta import PlanMeta

log = logging.getLogger("eagle3d.planner")

BATCH = 256
PROGRESS_EVERY_S = 5.0
# A conversation whose rendered text is longer than this many characters per allowed token is
# first tokenized by its head only: most such conversations are far over max_tokens, and
# tokenizing megabytes to learn that costs most of the planning time.
HEAD_CHARS_PER_TOKEN = 5
# BPE on a cut text can differ from the full text only around the cut; this margin covers that.
HEAD_MARGIN = 64
# Where the target writes the answers: an answer shorter than MIN_ANSWER is not worth starting,
# and END_MARGIN tokens stay free after it for the end-of-turn marker the chat template adds.
MIN_ANSWER = 16
END_MARGIN = 8


def room_for_answer(prompt_tokens: int, max_tokens: int) -> bool:
    """Whether a prompt leaves room for an answer within [data] max_tokens: the planner skips a
    conversation whose first prompt does not, and the generator ends one at the turn that
    does not (one rule, or a conversation planned is one the generator cannot start)."""
    return prompt_tokens + MIN_ANSWER + END_MARGIN <= max_tokens


def architecture(model_config: Any) -> str:
    """The target's model class name. GGUF configs carry no `architectures`; the causal-LM class
    transformers picks for the model type is the one that will be loaded."""
    if getattr(model_config, "architectures", None):
        return model_config.architectures[0]
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    return MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_config.model_type, model_config.model_type)


def build_contract(cfg: Config, tokenizer: Any, model_config: Any) -> dict[str, Any]:
    text_config = model_config.get_text_config() if hasattr(model_config, "get_text_config") \
        else model_config
    num_layers = text_config.num_hidden_layers
    try:
        layer_ids = list(cfg.target.aux_layers or contract.default_layer_ids(num_layers))
    except ValueError as exc:
        raise ConfigError(f"{cfg.path}: [target.aux_layers] {exc}") from None
    bad = [i for i in layer_ids if not 1 <= i < num_layers]
    if bad:
        raise ConfigError(f"{cfg.path}: [target.aux_layers] {layer_ids}: ids must be between 1 and "
                          f"{num_layers - 1} for this {num_layers}-layer target (id i is the hidden "
                          f"state entering layer i)")
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise ConfigError(f"{cfg.path}: [target.model] the planner needs a fast (Rust) tokenizer; "
                          f"{type(tokenizer).__name__} is not one")
    template = tokenizer.chat_template
    if template is None:
        raise ConfigError(f"{cfg.path}: [target.model] the tokenizer has no chat template")
    return {
        "format": dumpformat.FORMAT,
        "target": cfg.target.model,
        "target_fingerprint": loading.fingerprint_file_or_folder(cfg.target.model_path),
        "tokenizer_fingerprint": digests.hex_digest(backend.to_str().encode()),
        "chat_template_fingerprint": digests.json_digest(template),
        "layer_ids": layer_ids,
        "layer_convention": contract.LAYER_CONVENTION,
        "final_state": contract.FINAL_STATE,
        "dtype": cfg.target.dtype,
        "dump_dtype": cfg.extract.dump_dtype,
        "hidden_size": text_config.hidden_size,
        "num_layers": num_layers,
        "vocab_size": text_config.vocab_size,
        "architecture": architecture(model_config),
        "engine": engines.get(cfg.target.engine).name,
        **contract.generate_record(cfg),
        # Not binding: every shard of one dataset has the same contract fingerprint.
        **({"shard": {"index": cfg.shard.index, "count": cfg.shard.count}}
           if cfg.shard.count > 1 else {}),
    }


def ensure_contract(dataset_dir: Path, wanted: dict[str, Any]) -> dict[str, Any]:
    """The dataset's contract: the existing one if it matches `wanted`, else a new file."""
    existing = contract.read(dataset_dir)
    if existing is None:
        Path(dataset_dir).mkdir(parents=True, exist_ok=True)
        return contract.write(dataset_dir, wanted)
    identity.require(existing, wanted["target_fingerprint"], wanted["target"])
    diff = contract.differences(existing, wanted)
    if diff:
        raise ContractMismatch(
            f"{layout.contract_file(dataset_dir)} was made with other settings ({'; '.join(diff)});"
            " put them back, or reload the daemon with them (systemctl reload eagle3d): other "
            "settings are another run, in its own folders")
    return existing


# ---- one conversation -------------------------------------------------------------------------

def owned(conv: Conversation, shard: shards.Shard, responses: str) -> bool:
    """Whether this shard plans the conversation: by the id its (first) sample will carry, so
    that two records of one sample id land in one shard, whose ledger plans it once; by its
    index where it has no messages (an unusable record, skipped by whichever shard owns it)."""
    if shard.count == 1:
        return True
    if conv.messages is None:
        key = digests.hex_digest(str(conv.idx).encode())
    else:
        key = sample_id(prompt_turns(conv.messages) if responses == "target" else conv.messages)
    return shards.owner(key, shard.count) == shard.index


def sample_id(messages: Sequence[dict]) -> str:
    # Not json_digest: the ids written so far keep non-ASCII text as it is.
    return digests.hex_digest(json.dumps(list(messages), sort_keys=True,
                                         ensure_ascii=False).encode())


def prompt_turns(messages: Sequence[dict]) -> list[dict]:
    """Where the target writes the answers: what it answers, the system and user turns (the
    source's assistant turns are not part of the sample, nor of its id)."""
    return [dict(m) for m in messages if m["role"] != "assistant"]


def assistant_spans(tokenizer: Any, messages: list[dict], text: str) -> list[tuple[int, int]]:
    """Character spans of `text` (the rendered conversation) that the assistant wrote, each with
    the template's end-of-turn marker: the drafter must learn to predict the end of a turn too.

    Found by rendering prefixes, which works for templates without {% generation %} markers: the
    turn is what `messages[:i+1]` adds to `messages[:i]` rendered with the generation prompt. A
    template that renders earlier turns differently once later ones follow (or an assistant
    turn first) falls back to locating the content itself."""
    spans = []
    cursor = 0
    for i, m in enumerate(messages):
        if m["role"] != "assistant" or not m["content"]:
            continue
        span = None
        if i > 0:
            before = tokenizer.apply_chat_template(messages[:i], tokenize=False,
                                                   add_generation_prompt=True)
            upto = tokenizer.apply_chat_template(messages[:i + 1], tokenize=False)
            if upto.startswith(before) and text.startswith(upto) and len(before) >= cursor:
                span = (len(before), len(upto))
        if span is None:
            at = text.find(m["content"], cursor)
            if at < 0:
                raise ValueError("the chat template does not render an assistant turn verbatim")
            span = (at, at + len(m["content"]))
        spans.append(span)
        cursor = span[1]
    return spans


def loss_mask_for(offsets: Sequence[tuple[int, int]], spans: Iterable[tuple[int, int]]) -> np.ndarray:
    """One byte per token: 1 where the token overlaps an assistant span."""
    where = np.asarray(offsets, dtype=np.int64).reshape(-1, 2)
    mask = np.zeros(len(where), dtype=bool)
    for s, e in spans:
        mask |= (where[:, 0] < e) & (where[:, 1] > s)
    return mask.astype(np.uint8)


@dataclass
class _Rendered:
    conv: Conversation
    messages: list[dict]
    text: str


def _render(tokenizer: Any, conv: Conversation,
            generation_prompt: bool = False) -> _Rendered | str:
    """The rendered conversation, or why it cannot be used."""
    if conv.messages is None:
        return conv.problem or "unusable"
    messages = [dict(m) for m in conv.messages]
    try:
        for m in messages:
            m["content"].encode("utf-8")
    except UnicodeEncodeError:
        return "not valid Unicode text (lone surrogates)"
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False,
                                             add_generation_prompt=generation_prompt)
    except Exception as exc:  # a template may raise on any shape of conversation
        return f"chat template failed: {exc}"
    if not isinstance(text, str) or not text:
        return "chat template rendered nothing"
    return _Rendered(conv, messages, text)


def plan_batch(tokenizer: Any, convs: Sequence[Conversation],
               max_tokens: int) -> tuple[list[PlannedSample], list[tuple[int, str]]]:
    """Samples and (index, reason) skips for a batch of conversations; every one lands in one."""
    backend = tokenizer.backend_tokenizer
    skipped: list[tuple[int, str]] = []
    rendered: list[_Rendered] = []
    for conv in convs:
        r = _render(tokenizer, conv)
        if isinstance(r, str):
            skipped.append((conv.idx, r))
        else:
            rendered.append(r)

    head_chars = max_tokens * HEAD_CHARS_PER_TOKEN
    long = [r for r in rendered if len(r.text) > head_chars]
    if long:
        heads = _encode(backend, [r.text[:head_chars] for r in long], offsets=False)
        over = set()
        for r, enc in zip(long, heads):
            if isinstance(enc, str):
                continue  # the full encoding below reports it
            if len(enc.ids) > max_tokens + HEAD_MARGIN:
                over.add(id(r))
                skipped.append((r.conv.idx, f"over max_tokens (more than "
                                            f"{len(enc.ids) - HEAD_MARGIN} tokens)"))
        rendered = [r for r in rendered if id(r) not in over]

    samples: list[PlannedSample] = []
    for r, enc in zip(rendered, _encode(backend, [r.text for r in rendered], offsets=True)):
        if isinstance(enc, str):
            skipped.append((r.conv.idx, enc))
            continue
        n = len(enc.ids)
        if n > max_tokens:
            skipped.append((r.conv.idx, f"over max_tokens ({n} tokens)"))
            continue
        try:
            mask = loss_mask_for(enc.offsets, assistant_spans(tokenizer, r.messages, r.text))
        except Exception as exc:
            skipped.append((r.conv.idx, f"cannot find the assistant turns: {exc}"))
            continue
        loss_tokens = int(mask.sum())
        if loss_tokens == 0:
            skipped.append((r.conv.idx, "no loss tokens"))
            continue
        ids = np.asarray(enc.ids, dtype="<i4").tobytes()
        samples.append(PlannedSample(id=sample_id(r.messages), idx=r.conv.idx, tokens=n,
                                     loss_tokens=loss_tokens, ids_hash=dumpformat.ids_hash(ids),
                                     input_ids=ids, loss_mask=mask.tobytes()))
    return samples, skipped


def plan_prompts(tokenizer: Any, convs: Sequence[Conversation], max_tokens: int,
                 answers: int = 1) -> tuple[list[Prompt], list[tuple[int, str]]]:
    """Where the target writes the answers: each conversation's system and user turns, kept for
    the generator `answers` times, or one (index, reason) skip; every conversation lands in one
    of the two. The rows' indices are row_index(source index, answer)."""
    prompts: list[Prompt] = []
    skipped: list[tuple[int, str]] = []
    for conv in convs:
        if conv.messages is None:
            skipped.append((conv.idx, conv.problem or "unusable"))
            continue
        kept = prompt_turns(conv.messages)
        users = [i for i, m in enumerate(kept) if m["role"] == "user"]
        if not users:
            skipped.append((conv.idx, "no user turn for the target to answer"))
            continue
        first = _render(tokenizer, Conversation(conv.idx, tuple(kept[:users[0] + 1])),
                        generation_prompt=True)
        if isinstance(first, str):
            skipped.append((conv.idx, first))
            continue
        n = len(tokenizer.backend_tokenizer.encode(first.text, add_special_tokens=False).ids)
        if not room_for_answer(n, max_tokens):
            skipped.append((conv.idx, f"first prompt over max_tokens ({n} tokens)"))
            continue
        turns, first_id = json.dumps(kept, ensure_ascii=False), sample_id(kept)
        prompts += [Prompt(answer_id(first_id, k), row_index(conv.idx, answers, k), turns)
                    for k in range(answers)]
    return prompts, [(row_index(idx, answers), why) for idx, why in skipped]


def row_index(source_idx: int, answers: int, answer: int = 0) -> int:
    """A ledger row's index: its conversation's source index, spread over [generate] answers
    rows, so that each answer of a conversation is a sample of its own, in source order. With
    one answer (every dataset written before answers existed) it is the source index."""
    return source_idx * answers + answer


def answer_id(first_id: str, answer: int) -> str:
    """The sample id of a conversation's answer: the first keeps the conversation's own id."""
    return first_id if answer == 0 else digests.hex_digest(f"{first_id} answer {answer}".encode())


def _encode(backend: Any, texts: list[str], offsets: bool) -> list[Any]:
    """Batch encoding on all cores; when the batch fails, one by one, so that one text the
    tokenizer chokes on costs only itself (its entry becomes the reason)."""
    if not texts:
        return []
    encode = backend.encode_batch if offsets else backend.encode_batch_fast
    try:
        return encode(texts, add_special_tokens=False)
    except Exception:
        out: list[Any] = []
        for t in texts:
            try:
                out.append(encode([t], add_special_tokens=False)[0])
            except Exception as exc:
                out.append(f"tokenizer failed: {exc}")
        return out


# ---- the whole plan ---------------------------------------------------------------------------

def plan(cfg: Config, ledger: Ledger, tokenizer: Any, hidden_size: int) -> None:
    data = cfg.data
    end = data.first + data.limit
    answers = cfg.generate.answers  # 1 unless the target writes the answers (config checks it)
    start = max(data.first, ledger.max_idx() // answers + 1)
    recorded = PlanMeta(source=data.source, first=data.first, max_tokens=data.max_tokens,
                        responses=data.responses, bytes_per_token=dumpformat.bytes_per_token(
                            hidden_size, cfg.extract.dump_dtype))
    if start >= end:
        log.info("plan already covers source indices %d..%d; nothing to do", data.first, end - 1)
        return
    log.info("planning source indices %d..%d of %s", start, end - 1, data.source_path)
    t0 = last_report = time.monotonic()
    read = planned = skipped = 0
    through = start - 1
    batch: list[Conversation] = []

    def flush(exhausted: bool = False) -> None:
        nonlocal planned, skipped
        meta = recorded._replace(through=through, exhausted=exhausted).entries()
        # A duplicate conversation is recorded by the ledger as skipped, not as a sample.
        if data.responses == "target":
            rows, skips = plan_prompts(tokenizer, batch, data.max_tokens, answers)
            added = ledger.add_prompts(rows, skips, meta)
        else:
            rows, skips = plan_batch(tokenizer, batch, data.max_tokens)
            added = ledger.add_planned(rows, skips, meta)
        planned += added
        skipped += len(skips) + len(rows) - added  # the duplicates among the rows too
        batch.clear()

    for conv in iter_conversations(data.source_path, data.format, start, end - start):
        through = conv.idx
        if not owned(conv, cfg.shard, data.responses):
            continue
        batch.append(conv)
        read += 1
        if len(batch) >= BATCH:
            flush()
        now = time.monotonic()
        if now - last_report >= PROGRESS_EVERY_S:
            last_report = now
            log.info("planned %d/%d conversations (%.0f/s): %d samples, %d skipped",
                     through - data.first + 1, data.limit, read / (now - t0), planned, skipped)
    exhausted = through < end - 1
    flush(exhausted)
    if exhausted:
        log.warning("the source ends at index %d, before first + limit = %d: the plan holds what "
                    "the source has", through, end)
    log.info("plan done: %d conversations read, %d samples, %d skipped, %.1f s",
             read, planned, skipped, time.monotonic() - t0)


def _run(cfg: Config, args: argparse.Namespace) -> int:
    try:
        tokenizer = loading.load_tokenizer(cfg.target.model_path)
        model_config = loading.load_config(cfg.target.model_path)
    except OSError as exc:
        raise Refusal(f"cannot read the target: {exc}") from None
    wanted = build_contract(cfg, tokenizer, model_config)
    ensure_contract(cfg.paths.dataset_dir, wanted)
    with Ledger(layout.ledger(cfg.paths.state_dir)) as ledger:
        try:
            plan(cfg, ledger, tokenizer, wanted["hidden_size"])
        except (OSError, ValueError) as exc:
            raise Refusal(f"cannot read the source {cfg.data.source_path}: {exc}") from None
    return OK


def main(argv: list[str] | None = None) -> int:
    return child_main("planner", "Tokenize the configured conversations into the ledger (the "
                      "daemon's plan child).", _run, argv)


if __name__ == "__main__":
    sys.exit(main())
