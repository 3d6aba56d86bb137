"""Generation throughput of the generate stage's writer, as a ratio to a plain batched
`generate` of the same model with the same settings.

Both arms answer the same prompts, in the same batches, greedily, --new-tokens per answer (random
weights almost never pick the end token, and a batch decodes until its last answer ends),
alternating writer / plain for --rounds rounds. The writer is capture/generator.py's `Writer`: the chat
template, left padding, stop tokens and the bookkeeping of each turn; plain is one
`model.generate` call per batch on the already-padded ids. Judged by

    ratio = writer new tokens/s / plain new tokens/s        (goal: >= 0.9)

printed last. The model is a Llama-3.1-8B-shaped one with random weights on a GPU; `--tiny`
swaps in a tiny one so the script runs anywhere (on CPU in the tests).

    python bench/gpu_generate.py                # on a GPU server
    python bench/gpu_generate.py --tiny         # anywhere
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from transformers import PreTrainedTokenizerFast
from tokenizers import Tokenizer, models, pre_tokenizers

from eagle3d.capture.engines.transformers.decoder import TransformersDecoder
from eagle3d.capture.generator import Writer
from eagle3d.statemachine.config_schema import GenerateConfig
from eagle3d.target.loading import stop_tokens
from gpu_extract import LLAMA_8B, TINY, build_model

TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def word_tokenizer(vocab: int) -> PreTrainedTokenizerFast:
    """A word-level tokenizer over `vocab` ids with a chat template: the writer's text side at
    the cost of a split on spaces."""
    words = {f"w{i}": i for i in range(vocab - 2)}
    words.update({"<unk>": vocab - 2, "<|end|>": vocab - 1})
    tok = Tokenizer(models.WordLevel(words, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    out = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<|end|>",
                                  pad_token="<unk>")
    out.chat_template = TEMPLATE
    return out


def prompts(n: int, words: int, vocab: int, seed: int = 0) -> list[list[dict]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(words // 2, words + 1, (n,), generator=g).tolist()
    def text(k: int) -> str:
        return " ".join(f"w{int(t)}" for t in torch.randint(0, vocab - 2, (k,), generator=g))
    return [[{"role": "user", "content": text(k)}] for k in lengths]


def timed(fn) -> float:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    started = time.perf_counter()
    fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - started


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--batches", type=int, default=2)
    p.add_argument("--words", type=int, default=256, help="longest prompt, in tokens")
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    if args.tiny:
        args.batch, args.batches, args.words, args.new_tokens, args.rounds = 4, 2, 24, 8, 2
    device = "cuda" if torch.cuda.is_available() else "cpu"
    shape = TINY if args.tiny else LLAMA_8B
    model = build_model(shape, torch.bfloat16 if device == "cuda" else torch.float32, device)
    tokenizer = word_tokenizer(shape["vocab_size"])
    batches = [prompts(args.batch, args.words, shape["vocab_size"], seed=b)
               for b in range(args.batches)]
    settings = GenerateConfig(max_new_tokens=args.new_tokens)
    eos = stop_tokens(tokenizer, model.generation_config)
    writer = Writer(TransformersDecoder(model, tokenizer.pad_token_id, eos, settings), tokenizer,
                    eos, settings, max_tokens=args.words * 4 + args.new_tokens)
    # The plain arm gets the writer's own padded ids, so both decode exactly the same inputs.
    padded = [[tokenizer(tokenizer.apply_chat_template(p, tokenize=False,
                                                       add_generation_prompt=True),
                         add_special_tokens=False)["input_ids"] for p in batch]
              for batch in batches]

    def plain() -> None:
        for ids in padded:
            width = max(len(i) for i in ids)
            x = torch.tensor([[tokenizer.pad_token_id] * (width - len(i)) + i for i in ids],
                             device=device)
            mask = (torch.arange(width, device=device)[None] >= torch.tensor(
                [width - len(i) for i in ids], device=device)[:, None]).long()
            with torch.inference_mode():
                model.generate(input_ids=x, attention_mask=mask, max_new_tokens=args.new_tokens,
                               min_new_tokens=args.new_tokens, do_sample=False,
                               pad_token_id=tokenizer.pad_token_id)

    def written() -> None:
        for batch in batches:
            writer.answer(batch, seed=0)

    tokens = args.batch * args.batches * args.new_tokens
    timed(plain)  # warm-up: kernels, allocator, caches
    rates: dict[str, list[float]] = {"writer": [], "plain": []}
    for _ in range(args.rounds):
        rates["writer"].append(tokens / timed(written))
        rates["plain"].append(tokens / timed(plain))
    for arm, values in rates.items():
        print(f"{arm:>6}: median {statistics.median(values):,.0f} new tokens/s over "
              f"{args.rounds} rounds ({', '.join(f'{v:,.0f}' for v in values)})")
    ratio = statistics.median(w / p for w, p in zip(rates["writer"], rates["plain"]))
    print(f"device {device}, {args.batches} batches of {args.batch}, {args.new_tokens} new "
          f"tokens each")
    print(f"writer/plain generate throughput ratio: {ratio:.2f} (goal >= 0.9)")


if __name__ == "__main__":
    main()
