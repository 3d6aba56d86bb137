"""[data] responses = "target": the target writes the assistant turns before extraction, with the
real SmolLM2, the real generator child and the real daemon."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import psutil
import pytest
import torch
from safetensors.torch import load_file

from eagle3d.capture import engines
from eagle3d.capture.engines.transformers.decoder import TransformersDecoder
from eagle3d.capture.generator import Writer
from eagle3d.capture.planner import plan_batch, plan_prompts
from eagle3d.capture.engines.sglang.plugin import CaptureSettings
from eagle3d.dataset.conversations import Conversation
from eagle3d.statemachine import layout
from eagle3d.statemachine.config_schema import GenerateConfig
from eagle3d.statemachine.config_validation import load_config
from eagle3d.statemachine.ledger import Ledger
from eagle3d.target import loading
from tests.pipeline import DaemonProcess, ctl, messages_config, status, wait_for
from tests.test_sglang_engine import fake_sglang_python, free_port

pytestmark = pytest.mark.slow


def target_config(config_factory, tmp_path, n: int, **generate):
    return messages_config(config_factory, tmp_path, n, data={"responses": "target",
                                                              "max_tokens": 256},
                           generate={"max_new_tokens": 24, "batch_size": 4, **generate})


def transformers_writer(model, tokenizer, settings: GenerateConfig, max_tokens: int) -> Writer:
    eos = loading.stop_tokens(tokenizer, model.generation_config)
    return Writer(TransformersDecoder(model, tokenizer.pad_token_id, eos, settings), tokenizer, eos,
                  settings, max_tokens)


def events(config, kind: str) -> list[str]:
    cfg = load_config(config)
    with Ledger(layout.ledger(cfg.paths.state_dir), readonly=True) as ledger:
        return [sid for _, k, sid in ledger.db.execute(
            "SELECT seq, kind, sample FROM events WHERE kind = ? ORDER BY seq", (kind,))]


def test_the_generated_conversations_are_what_training_reads(config_factory, tmp_path):
    config = target_config(config_factory, tmp_path, 6)
    with DaemonProcess(config, "--until", "train") as d:
        st = d.status_until(lambda s: s["stage"] == "generate", 300, "the generate stage")
        assert st["samples"]["ungenerated"] + st["samples"]["generating"] == 6
        assert d.wait(900) == 0, d.output()[-4000:]
    cfg = load_config(config)
    tokenizer = loading.load_tokenizer(cfg.target.model_path)
    source = [json.loads(line)["messages"] for line in open(cfg.data.source_path)]
    with Ledger(layout.ledger(cfg.paths.state_dir), readonly=True) as ledger:
        samples = ledger.samples()
        assert len(samples) == 6 and all(s.status == "verified" for s in samples)
        for sample in samples:
            messages, settings = ledger.generated(sample.id)
            assert settings["max_new_tokens"] == 24 and settings["model"] == cfg.target.model
            assert [m["role"] for m in messages] == ["user", "assistant"]
            assert messages[0] == source[sample.idx][0]  # the user's turn is kept
            assert messages[1]["content"] != source[sample.idx][1]["content"]
            dump = load_file(str(cfg.paths.dataset_dir / sample.path))
            rendered = tokenizer.apply_chat_template(messages, tokenize=False)
            assert dump["input_ids"].tolist() == tokenizer(rendered, add_special_tokens=False)[
                "input_ids"]
    assert status(config)["samples"]["verified"] == 6


def test_two_answers_per_conversation_are_two_samples_sampled_apart(config_factory, tmp_path):
    """[generate] answers = 2: the target writes each conversation twice, sampled, and each
    answer is a sample of its own (rows 2i and 2i+1 for source index i)."""
    config = target_config(config_factory, tmp_path, 3, answers=2, temperature=1.0)
    with DaemonProcess(config, "--until", "extract") as d:
        assert d.wait(600) == 0, d.output()[-4000:]
    cfg = load_config(config)
    source = [json.loads(line)["messages"] for line in open(cfg.data.source_path)]
    with Ledger(layout.ledger(cfg.paths.state_dir), readonly=True) as ledger:
        samples = ledger.samples()
        assert sorted(s.idx for s in samples) == list(range(6))
        assert all(s.status == "pending" and s.tokens > 0 for s in samples)
        pairs = [[ledger.generated(s.id)[0] for s in samples if s.idx // 2 == i] for i in range(3)]
    for i, (first, second) in enumerate(pairs):
        assert first[0] == second[0] == source[i][0]  # one user turn, answered twice
    assert any(first[1] != second[1] for first, second in pairs)


def test_the_target_writes_in_its_configured_dtype(config_factory, tmp_path):
    """On a CPU too: the answers come from the target that extract then captures (a CPU with
    bfloat16 units writes about twice as fast in it)."""
    for dtype in ("bfloat16", "float32"):
        cfg = load_config(messages_config(config_factory, tmp_path, 1,
                                          target={"dtype": dtype, "device": "cpu"},
                                          data={"responses": "target"}))
        decoder, _ = engines.get(cfg.target.engine).decoder(cfg, loading.load_tokenizer(cfg.target.model_path))
        assert decoder.model.dtype == getattr(torch, dtype)


def test_a_bfloat16_target_on_a_cpu_without_bfloat16_units_is_warned_about(
        config_factory, tmp_path, monkeypatch, caplog):
    """There it runs three times slower than float32: the operator must hear why and what to
    set. This CPU has the units, so their absence is what the test stands in for."""
    cfg = load_config(messages_config(config_factory, tmp_path, 1,
                                      target={"dtype": "bfloat16", "device": "cpu"}))
    for units, warned in ((True, False), (False, True)):
        monkeypatch.setattr(loading, "cpu_computes_bf16", lambda: units)
        caplog.clear()
        loading.load_model(cfg.target.model_path, "bfloat16", "cpu")
        assert ('dtype = "float32"' in caplog.text) == warned


def test_kill_9_during_generation_loses_and_duplicates_nothing(config_factory, tmp_path):
    config = target_config(config_factory, tmp_path, 12, batch_size=2)
    with DaemonProcess(config) as d:
        st = d.status_until(lambda s: s["samples"]["pending"] >= 2 and
                            s["generate"].get("pid"), 600, "some conversations generated")
        subprocess.run(["kill", "-9", str(st["generate"]["pid"])], check=True)
        d.proc.kill()
        d.proc.wait()
    with DaemonProcess(config, "--until", "extract") as d:
        assert d.wait(900) == 0, d.output()[-4000:]
    generated = events(config, "generated")
    assert sorted(generated) == sorted(set(generated)) and len(generated) == 12
    st = status(config)
    assert st["samples"]["ungenerated"] == st["samples"]["generating"] == 0
    assert st["samples"]["pending"] + st["samples"]["inflight"] + st["samples"]["extracted"] + \
        st["samples"]["verified"] == 12


def test_a_conversation_that_keeps_killing_the_generator_fails_with_its_reason(config_factory,
                                                                                tmp_path):
    config = target_config(config_factory, tmp_path, 2, batch_size=2, max_attempts=2)
    with DaemonProcess(config) as d:
        for _ in range(2):
            st = d.status_until(lambda s: s["samples"]["generating"] == 2 and
                                s["generate"].get("pid"), 600, "the generator at work")
            subprocess.run(["kill", "-9", str(st["generate"]["pid"])], check=True)
            wait_for(lambda: status(config)["samples"]["generating"] == 0, 60, "the requeue")
        # The ledger counts the failures before the daemon's next step moves the stage on.
        st = d.status_until(lambda s: s["samples"]["failed"] == 2 and s["stage"] != "generate",
                            120, "two failed samples and the stage moved on")
        assert st["stage"] == "verify" and "retry" in st["reason"]
        failed = ctl(config, "samples", "--status", "failed", "--json")
        assert all("generator exited with code -9" in row["error"]
                   for row in json.loads(failed.stdout))
        assert ctl(config, "retry", "--failed").returncode == 0
        d.status_until(lambda s: s["samples"]["pending"] + s["samples"]["inflight"] +
                       s["samples"]["extracted"] + s["samples"]["verified"] == 2, 600,
                       "the retried conversations generated")


def test_max_turns_ends_each_conversation_after_that_many_answers(config_factory, tmp_path):
    cfg = load_config(target_config(config_factory, tmp_path, 1))
    model = loading.load_model(cfg.target.model_path, "float32", "cpu")
    tokenizer = loading.load_tokenizer(cfg.target.model_path)
    prompt = [{"role": "user", "content": "Name a colour."},
              {"role": "user", "content": "And a fruit?"}]
    for max_turns, roles in ((0, ["user", "assistant", "user", "assistant"]),
                             (1, ["user", "assistant"])):
        writer = transformers_writer(model, tokenizer,
                                     GenerateConfig(max_new_tokens=8, max_turns=max_turns), 256)
        assert [m["role"] for m in writer.answer([prompt], seed=0)[0]] == roles


def test_every_planned_prompt_gets_an_answer_and_a_prompt_without_room_is_skipped(
        config_factory, tmp_path):
    """Around the limit, the planner and the generator agree: a first prompt that leaves no room
    for an answer is skipped at planning with its reason; the one a token shorter is answered
    (the demo once planned a 490-token prompt at max_tokens 512 that the generator could not
    start: a sample failed three times and the training gate stayed closed)."""
    cfg = load_config(target_config(config_factory, tmp_path, 1))
    model = loading.load_model(cfg.target.model_path, "float32", "cpu")
    tokenizer = loading.load_tokenizer(cfg.target.model_path)
    conv = Conversation(0, ({"role": "user", "content": "Say yes. " * 40},))
    rendered = tokenizer.apply_chat_template(list(conv.messages), tokenize=False,
                                             add_generation_prompt=True)
    prompt_tokens = len(tokenizer(rendered, add_special_tokens=False)["input_ids"])
    for max_tokens in range(prompt_tokens + 20, prompt_tokens + 30):
        prompts, skipped = plan_prompts(tokenizer, [conv], max_tokens)
        answered = transformers_writer(model, tokenizer, GenerateConfig(max_new_tokens=4),
                                       max_tokens).answer([list(conv.messages)], seed=0)[0]
        if prompts:
            assert [m["role"] for m in answered] == ["user", "assistant"], max_tokens
        else:
            assert skipped == [(0, f"first prompt over max_tokens ({prompt_tokens} tokens)")]
            assert answered == []
    assert plan_prompts(tokenizer, [conv], prompt_tokens + 20)[0] == []
    assert plan_prompts(tokenizer, [conv], prompt_tokens + 30)[0] != []



# In SmolLM2's vocabulary: two bytes of a three-byte character. Written without its third byte it
# decodes to U+FFFD twice, which encodes to two tokens.
BROKEN_PIECE = 45644


class StrayBytes:
    """A decoder writing what a small model sometimes writes: pieces of characters, as many as
    each answer has room for."""

    def __call__(self, prompts: list[list[int]], rooms: list[int], seed: int) -> list[list[int]]:
        return [[BROKEN_PIECE] * room for room in rooms]


def test_a_written_conversation_whose_text_takes_more_tokens_is_shortened_to_fit(
        config_factory, tmp_path):
    """An answer's text can take more tokens than the target wrote it with; the conversation
    then still becomes a sample within max_tokens, its last answer shortened, instead of failing
    on every retry and closing the training gate (2 of 15,088 did on the H200)."""
    cfg = load_config(target_config(config_factory, tmp_path, 1))
    tokenizer = loading.load_tokenizer(cfg.target.model_path)
    piece_text = tokenizer.decode([BROKEN_PIECE])
    assert len(tokenizer(piece_text, add_special_tokens=False)["input_ids"]) == 2
    prompt = [{"role": "user", "content": "Write in Japanese."},
              {"role": "user", "content": "And more."}]
    writer = Writer(StrayBytes(), tokenizer, {tokenizer.eos_token_id},
                    GenerateConfig(max_new_tokens=64, max_turns=2), max_tokens=256)
    written = writer.answer([prompt], seed=0)[0]
    assert [m["role"] for m in written] == ["user", "assistant", "user", "assistant"]
    planned, skipped = plan_batch(tokenizer, [Conversation(0, tuple(written))], 256)
    assert planned == [] and skipped[0][1].startswith("over max_tokens")

    sample, messages, why = writer.sample(0, written)
    assert sample is not None, why
    assert sample.tokens <= 256 and sample.loss_tokens > 0
    assert messages[:3] == written[:3]
    assert 0 < len(messages[3]["content"]) < len(written[3]["content"])


def sglang_config(config_factory, tmp_path, n: int) -> Path:
    """Answers by the SGLang engine; the stand-in server decodes with the real SmolLM2."""
    return messages_config(config_factory, tmp_path, n, target={"engine": "sglang"},
                           data={"responses": "target", "max_tokens": 256},
                           generate={"max_new_tokens": 16, "batch_size": 2, "max_restarts": 0},
                           extract={"engine_max_restarts": 0},
                           sglang={"python": str(fake_sglang_python(tmp_path)),
                                   "port": free_port(), "startup_timeout_s": 120.0})


def test_the_sglang_engine_writes_the_answers_the_target_writes(config_factory, tmp_path):
    """The generate stage's own SGLang server (no capture in it), asked turn by turn, gives each
    conversation exactly the answers the target writes in transformers; the server is down
    before the capture engine starts on the same port."""
    config = sglang_config(config_factory, tmp_path, 3)
    with DaemonProcess(config) as d:
        st = d.status_until(lambda s: s["generate"].get("server_pid"), 120,
                            "the generation server")
        server = psutil.Process(st["generate"]["server_pid"])
        assert "--disable-radix-cache" not in server.cmdline()
        # No capture settings: the plugin stays inert (its API key is the only eagle3d variable).
        assert CaptureSettings.from_env(server.environ()) is None
        wait_for(lambda: "started engine" in d.output() or "stage failed" in d.output(), 600,
                 "the capture engine's start")
        log = d.output()
    assert "stage failed" not in log, log[-4000:]
    assert log.index("stopped generation-server") < log.index("started engine"), log[-4000:]
    cfg = load_config(config)
    writer = transformers_writer(loading.load_model(cfg.target.model_path, "float32", "cpu"),
                                 loading.load_tokenizer(cfg.target.model_path), cfg.generate,
                                 cfg.data.max_tokens)
    with Ledger(layout.ledger(cfg.paths.state_dir), readonly=True) as ledger:
        samples = ledger.samples()
        assert len(samples) == 3
        for sample in samples:
            messages, settings = ledger.generated(sample.id)
            assert settings["engine"] == "sglang" and messages[-1]["role"] == "assistant"
            assert messages[-1]["content"]
            (prompt,), = ledger.db.execute("SELECT messages FROM prompts WHERE id = ?",
                                           (sample.id,))
            assert messages == writer.answer([json.loads(prompt)], seed=0)[0]


def test_a_slow_answer_holds_up_no_other_conversation(config_factory, tmp_path):
    """With SGLang, conversations go through the server each on its own: while one answer
    takes long, the other conversations' turns and the next conversations go on, keeping
    SGLang's batch full (in lockstep every turn of a batch waited for its slowest answer). The
    stand-in server holds the first request until two others have been answered."""
    config = sglang_config(config_factory, tmp_path, 3)
    released = tmp_path / "released"
    with DaemonProcess(config, env={"FAKE_SGLANG": "hold-first",
                                    "FAKE_SGLANG_LOG": str(released)}) as d:
        wait_for(lambda: "started engine" in d.output() or "stage failed" in d.output(), 600,
                 "the capture engine's start")
        log = d.output()
    assert "stage failed" not in log, log[-4000:]
    assert released.read_text() == "released by 2 other answers\n"
    cfg = load_config(config)
    with Ledger(layout.ledger(cfg.paths.state_dir), readonly=True) as ledger:
        assert all(ledger.generated(s.id)[0][-1]["content"] for s in ledger.samples())


def test_a_generation_server_that_dies_stops_the_stage_with_its_reason(config_factory,
                                                                      tmp_path):
    config = sglang_config(config_factory, tmp_path, 2)
    with DaemonProcess(config, env={"FAKE_SGLANG": "die-generating"}) as d:
        st = d.status_until(lambda s: s["generate"].get("blocked"), 300,
                            "the generate stage's problem")
    assert "the SGLang generation server exited with code 3" in st["generate"]["blocked"]
    assert st["samples"]["generating"] == 0 and st["samples"]["ungenerated"] == 2
