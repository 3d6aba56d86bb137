"""The generate child: `python -m eagle3d.capture.generator -c CONFIG`, where the target writes
the assistant turns itself ([data] responses = "target").

It works through the ledger as the planner does. It claims `ungenerated` conversations (they
become `generating`) and has the target answer their user turns one turn at a time, each answer
conditioned on its own earlier answers: with transformers a batch at a time, decoded together
with a KV cache; with SGLang [generate] batch_size conversations in flight, each on its own
(_write_streaming). It tokenizes each finished conversation with the planner's `plan_batch`
(token ids and the assistant loss mask, exactly as for a source's own answers), and commits it:
the conversation, checksummed, with the settings it was written with, and the sample now pending
extraction.

A conversation stops taking turns when the next answer would not fit in [data] max_tokens; one
whose text still comes out over it has its last answer shortened to fit (Writer.sample). One
that cannot be tokenized counts an attempt (failed, with the reason, after [generate]
max_attempts). Killed, the generator loses only the conversations in hand: the daemon returns
`generating` conversations to `ungenerated`, counting the attempt.

Exit codes: statemachine/entry.py.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import time
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any, Iterator, Protocol

from eagle3d.capture import engines
from eagle3d.capture.planner import END_MARGIN, plan_batch, room_for_answer
from eagle3d.dataset import contract
from eagle3d.dataset.conversations import Conversation
from eagle3d.target import identity, loading
from eagle3d.statemachine import layout
from eagle3d.statemachine.config_schema import Config, GenerateConfig
from eagle3d.statemachine.entry import OK, child_main
from eagle3d.statemachine.ledger import Ledger, PlannedSample, Sample
from eagle3d.statemachine.lifecycle import die_with_parent

log = logging.getLogger("eagle3d.generator")

PROGRESS_EVERY_S = 10.0
# A batch is taken from this many batches' worth of the next conversations, shortest prompts
# first: a batch decodes padded to its longest prompt, and one long prompt among short ones made
# the whole batch pay for it (on 2 CPU cores, a batch of ShareGPT prompts took minutes).
CLAIM_WINDOW = 8
# Shortenings tried on a written conversation whose text comes out over max_tokens (Writer.sample).
FIT_TRIES = 4


class Decoder(Protocol):
    """One batched decode: each prompt's new token ids, at least up to its `room` or a stop
    token (the Writer cuts each answer at its first stop token and at its room)."""

    def __call__(self, prompts: list[list[int]], rooms: list[int], seed: int) -> list[list[int]]:
        ...


@dataclass
class Written:
    """One conversation as the target writes it: its turns so far, the turns still to take, and
    the request it waits on (prompt ids and room for the answer), None once finished."""
    conv: list[dict]
    left: list[dict]
    ask: tuple[list[int], int] | None = None

    @property
    def answered(self) -> int:
        return sum(m["role"] == "assistant" for m in self.conv)


class Writer:
    """The target answering conversations, turn by turn: `begin` a conversation, send its `ask`
    to a decoder, `take` the answer, until `ask` is None. `answer` drives a batch of them in
    lockstep; the generator drives SGLang's one at a time (_write_streaming)."""

    def __init__(self, decode: Decoder, tokenizer: Any, eos: set[int],
                 settings: GenerateConfig, max_tokens: int) -> None:
        self.decode, self.tokenizer, self.eos = decode, tokenizer, eos
        self.settings, self.max_tokens = settings, max_tokens
        self.new_tokens = 0

    def answer(self, prompts: list[list[dict]], seed: int) -> list[list[dict]]:
        """Each prompt (system and user turns) with the target's answer after every user turn
        that fits; the last turn is always an answer. One decode per turn for the whole batch."""
        written = [self.begin(p) for p in prompts]
        turn = 0
        while asks := [w for w in written if w.ask is not None]:
            answers = self.decode([w.ask[0] for w in asks], [w.ask[1] for w in asks], seed + turn)
            for w, answer in zip(asks, answers):
                self.take(w, answer)
            turn += 1
        return [w.conv for w in written]

    def begin(self, prompt: list[dict]) -> Written:
        w = Written([], list(prompt))
        w.ask = self._next_ask(w)
        return w

    def take(self, w: Written, answer: list[int]) -> None:
        """The answer to w.ask (cut at its first stop token and at its room) joins the
        conversation; w.ask becomes the next turn's request, or None."""
        assert w.ask is not None
        room = w.ask[1]
        answer = self._until_stop(answer)[:room]
        self.new_tokens += len(answer)
        text = self.tokenizer.decode(answer, skip_special_tokens=True)
        w.conv.append({"role": "assistant", "content": text.strip()})
        if len(answer) == room < self.settings.max_new_tokens:
            w.left = []  # cut by [data] max_tokens: this conversation ends here
        w.ask = self._next_ask(w)

    def sample(self, idx: int, messages: list[dict]) -> tuple[PlannedSample | None, list[dict],
                                                              str]:
        """A written conversation planned as a sample (token ids and loss mask, as for a source's
        own answers): the sample, the messages it was planned from, and why not where none fits.

        Its text can take more tokens than the target wrote it with: bytes that are not whole
        UTF-8 characters (an answer cut inside one, or stray bytes from a small model) decode to
        U+FFFD, which encodes to more tokens than those bytes took. On the H200's full-scale run
        2 of 15,088 conversations came out 1 and 4 tokens over max_tokens, came out the same on
        every retry, failed and closed the training gate. So one that comes out over has its
        last answer shortened by the excess until it fits. Only the last answer can grow past
        the limit: each earlier one is in the next prompt, whose length the room was taken
        from."""
        why = "nothing to tokenize"
        for _ in range(FIT_TRIES):
            planned, skipped = plan_batch(self.tokenizer, [Conversation(idx, tuple(messages))],
                                          self.max_tokens)
            if planned:
                return planned[0], messages, ""
            why = skipped[0][1] if skipped else why
            excess = self._tokens(messages) - self.max_tokens
            if excess <= 0 or messages[-1]["role"] != "assistant":
                break
            answer = self.tokenizer(messages[-1]["content"], add_special_tokens=False)["input_ids"]
            if excess >= len(answer):
                break
            text = self.tokenizer.decode(answer[:len(answer) - excess], skip_special_tokens=True)
            messages = [*messages[:-1], {"role": "assistant", "content": text.strip()}]
        return None, messages, why

    def _tokens(self, messages: list[dict]) -> int:
        text = self.tokenizer.apply_chat_template(messages, tokenize=False)
        return len(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def _until_stop(self, answer: list[int]) -> list[int]:
        return answer[:next((k for k, t in enumerate(answer) if t in self.eos), len(answer))]

    def _next_ask(self, w: Written) -> tuple[list[int], int] | None:
        """Move the turns up to the next user turn into the conversation and return its prompt
        ids and the room for the answer, or None when it is finished (max_turns answered, no
        user turn left, or no room for an answer)."""
        if self.settings.max_turns and w.answered >= self.settings.max_turns:
            return None
        taken = []
        while w.left:
            taken.append(w.left.pop(0))
            if taken[-1]["role"] == "user":
                break
        if not taken or taken[-1]["role"] != "user":
            return None
        text = self.tokenizer.apply_chat_template(w.conv + taken, tokenize=False,
                                                  add_generation_prompt=True)
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        if not room_for_answer(len(ids), self.max_tokens):
            w.left.clear()
            return None
        w.conv.extend(taken)
        return ids, min(self.settings.max_new_tokens, self.max_tokens - len(ids) - END_MARGIN)


def _write_in_batches(writer: Writer, ledger: Ledger,
                      cfg: Config) -> Iterator[tuple[Sample, list[dict]]]:
    """A batch of conversations at a time, every turn one decode of the whole batch: what a
    model in this process decodes fastest (transformers' batched `generate`)."""
    while batch := ledger.claim_prompts(cfg.generate.batch_size,
                                        window=CLAIM_WINDOW * cfg.generate.batch_size):
        seed = cfg.generate.seed + batch[0][0].idx
        yield from zip((sample for sample, _ in batch),
                       writer.answer([prompt for _, prompt in batch], seed))


def _write_streaming(writer: Writer, ledger: Ledger,
                     cfg: Config) -> Iterator[tuple[Sample, list[dict]]]:
    """[generate] batch_size conversations in flight, each asking its next turn as soon as its
    last answer is back, and a finished one's place going to the next at once: SGLang batches
    whatever requests are in flight, so its batch stays full. In lockstep every turn waited for
    its batch's longest answer (on the H200 a batch of 2,048 drained to 1,556 running requests
    within the first 27 s of a turn). Only the requests wait on threads; the tokenizer and the
    ledger stay on this one. Each request is seeded by its conversation and turn."""
    pool = ThreadPoolExecutor(cfg.generate.batch_size, thread_name_prefix="generate")
    inflight: dict[Future, tuple[Sample, Written]] = {}

    def ask(sample: Sample, w: Written) -> None:
        assert w.ask is not None
        ids, room = w.ask
        seed = cfg.generate.seed + sample.idx + w.answered
        inflight[pool.submit(writer.decode, [ids], [room], seed)] = (sample, w)

    try:
        while True:
            free = cfg.generate.batch_size - len(inflight)
            for sample, prompt in ledger.claim_prompts(free) if free else []:
                w = writer.begin(prompt)
                if w.ask is None:
                    yield sample, w.conv
                else:
                    ask(sample, w)
            if not inflight:
                return
            finished, _ = wait(inflight, return_when=FIRST_COMPLETED)
            for future in finished:
                sample, w = inflight.pop(future)
                writer.take(w, future.result()[0])
                if w.ask is None:
                    yield sample, w.conv
                else:
                    ask(sample, w)
    finally:
        pool.shutdown(wait=False, cancel_futures=True)


def _run(cfg: Config, args: argparse.Namespace) -> int:
    die_with_parent(signal.SIGTERM)
    doc = contract.read_checked(cfg.paths.dataset_dir)
    fingerprint = identity.check(doc, cfg.target.model_path, cfg.target.model)
    tokenizer = loading.load_tokenizer(cfg.target.model_path)
    spec = engines.get(cfg.target.engine)
    decode, eos = spec.decoder(cfg, tokenizer)
    writer = Writer(decode, tokenizer, eos, cfg.generate, cfg.data.max_tokens)
    write = _write_streaming if spec.streaming else _write_in_batches
    settings = {**cfg.generate._asdict(), "model": cfg.target.model,
                "target_fingerprint": fingerprint, "engine": spec.name}
    started, done, last_report = time.monotonic(), 0, 0.0
    with Ledger(layout.ledger(cfg.paths.state_dir)) as ledger:
        for sample, written in write(writer, ledger, cfg):
            planned, messages, why = writer.sample(sample.idx, written)
            if planned:
                ledger.mark_generated(planned._replace(id=sample.id), messages, settings)
                done += 1
            else:
                log.warning("sample %s: the generated conversation cannot be used: %s",
                            sample.id, why)
                ledger.mark_retry(sample.id, f"generate: {why}", cfg.generate.max_attempts,
                                  frm=("generating",))
            now = time.monotonic()
            if now - last_report >= PROGRESS_EVERY_S:
                last_report = now
                log.info("generated %d sample%s, %.0f new tokens/s", done, "s" * (done != 1),
                         writer.new_tokens / (now - started))
    log.info("generation done: %d sample%s, %d new tokens, %.0f s", done, "s" * (done != 1),
             writer.new_tokens, time.monotonic() - started)
    return OK


def main(argv: list[str] | None = None) -> int:
    return child_main("generator", "The target writes the assistant turns (a daemon child).",
                      _run, argv)


if __name__ == "__main__":
    sys.exit(main())
