"""Loading the target model and its tokenizer with Hugging Face transformers: an HF model folder,
a GGUF file (dequantized by transformers), or a hub name where the hub is reachable. The one
place that knows how; the planner, the transformers engine and the drafter's trainer and
evaluation all load the target through it.
"""

from __future__ import annotations

import functools
import logging
import os
from pathlib import Path
from typing import Any

from eagle3d.statemachine import digests
from eagle3d.statemachine.atomic import share_with_group

log = logging.getLogger("eagle3d.target")

TORCH_DTYPES = ("float32", "bfloat16", "float16")


def _source(model_path: Path) -> tuple[str, dict[str, Any]]:
    path = Path(model_path)
    if path.is_file() and path.suffix == ".gguf":
        converted = converted_gguf(path)
        return (str(converted), {}) if converted else (str(path.parent), {"gguf_file": path.name})
    return str(path), {}


def cache_dir() -> Path:
    """Where conversions are kept: $XDG_CACHE_HOME/eagle3d, else ~/.cache/eagle3d (under the
    service, its home is its StateDirectory)."""
    root = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(root) / "eagle3d"


def converted_gguf(gguf: Path) -> Path | None:
    """The GGUF file converted once to a Hugging Face folder (float32 weights, config, tokenizer).

    transformers parses the whole GGUF file again for the config, the tokenizer and the weights
    of every load: about 40 s for SmolLM2 on a CPU, paid by the planner, the engine, the trainer
    and the evaluation each. The folder is keyed by the file's weights fingerprint, so an edited
    file is converted anew, and it is moved into place whole, so a crash mid-conversion leaves
    no half folder behind. Where the cache is not writable, None: load from the file itself."""
    import logging
    import shutil
    import tempfile
    folder = cache_dir() / "gguf" / f"{gguf.stem}-{fingerprint_file_or_folder(gguf)}"
    if folder.is_dir():
        return folder
    log = logging.getLogger("eagle3d.target")
    try:
        folder.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=".converting-", dir=folder.parent))
    except OSError as e:
        log.warning("cannot cache the conversion of %s (%s): loading from the GGUF file", gguf, e)
        return None
    try:
        log.info("converting %s to a model folder in %s (once)", gguf.name, folder.parent)
        from transformers import AutoModelForCausalLM, AutoTokenizer
        where, kw = str(gguf.parent), {"gguf_file": gguf.name}
        model = AutoModelForCausalLM.from_pretrained(where, **kw)
        # The weights are dequantized already; only the quantizer's marker forbids saving them.
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.save_pretrained(staging)
        AutoTokenizer.from_pretrained(where, **kw).save_pretrained(staging)
        share_with_group(staging)  # mkdtemp's and safetensors' modes: the target is served
        # from here, by an operator of the service's group
        staging.rename(folder)
    except OSError:
        if not folder.is_dir():  # another process won the same conversion: use its folder
            raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return folder


def pick_device(device: str) -> str:
    import torch
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


@functools.cache
def cpu_computes_bf16() -> bool:
    """Whether this CPU has bfloat16 units (AVX512-BF16 or AMX). With them bfloat16 runs about
    twice as fast as float32 (SmolLM2's forward and the drafter's training on the 2-core VM,
    2026-12-03); without them it is converted in software, about three times slower."""
    import torch
    return torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()


def load_tokenizer(model_path: Path) -> Any:
    from transformers import AutoTokenizer
    where, kw = _source(model_path)
    return AutoTokenizer.from_pretrained(where, **kw)


def load_config(model_path: Path) -> Any:
    """The target's architecture config, without its weights."""
    from transformers import AutoConfig
    where, kw = _source(model_path)
    return AutoConfig.from_pretrained(where, **kw)


def load_model(model_path: Path, dtype: str, device: str) -> Any:
    import torch
    from transformers import AutoModelForCausalLM
    where, kw = _source(model_path)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import transformers
    # Its weight-loading progress bar is noise in a journal, and in `eagle3ctl eval`'s answer.
    transformers.utils.logging.disable_progress_bar()
    # transformers renamed `torch_dtype` to `dtype` in 4.56; GPU images often carry older ones.
    major, minor = (int(x) for x in transformers.__version__.split(".")[:2])
    key = "dtype" if (major, minor) >= (4, 56) else "torch_dtype"
    model = AutoModelForCausalLM.from_pretrained(where, **{key: getattr(torch, dtype)}, **kw)
    device = pick_device(device)
    if device == "cpu" and dtype == "bfloat16" and not cpu_computes_bf16():
        log.warning("[target] dtype = \"bfloat16\" on a CPU without bfloat16 units runs about "
                    "three times slower here than dtype = \"float32\"")
    return model.to(device).eval()


def load_generation_config(model_path: Path) -> Any:
    """The target's generation defaults (its end-of-answer tokens), without its weights: what
    a loaded model carries as `generation_config`."""
    from transformers import GenerationConfig
    where, kw = _source(model_path)
    try:
        return GenerationConfig.from_pretrained(where, **kw)
    except OSError:  # no generation_config.json: transformers derives it from the config
        return GenerationConfig.from_model_config(load_config(model_path))


def stop_tokens(tokenizer: Any, generation_config: Any) -> set[int]:
    """The token ids that end an answer: the tokenizer's end of sequence and the model's."""
    ids = getattr(generation_config, "eos_token_id", None)
    ids = ids if isinstance(ids, list) else [ids]
    return {t for t in [tokenizer.eos_token_id, *ids] if isinstance(t, int)}


# The weights fingerprint reads a few MiB per file, spread over all of it: hashing terabytes at
# every start would be the slow part, while a model edited anywhere in the bulk of a file (a
# fine-tune of the same shape) must not pass for the original.
_EDGE = 1 << 20
_PROBES = 64
_PROBE = 64 << 10


def fingerprint_file_or_folder(model_path: Path) -> str:
    """A cheap identity of the target's weights: each weight file's name and size, its first
    and last MiB and 64 blocks spread evenly between them."""
    path = Path(model_path)
    h = digests.hasher()
    files = [path] if path.is_file() else sorted(
        p for p in path.rglob("*") if p.is_file() and p.suffix in (".safetensors", ".bin", ".gguf",
                                                                    ".json", ".pt"))
    for f in files:
        size = f.stat().st_size
        h.update(f"{f.name}:{size}".encode())
        with open(f, "rb") as fh:
            if size <= 2 * _EDGE + _PROBES * _PROBE:
                h.update(fh.read())
                continue
            offsets = [0] + [_EDGE + i * (size - 2 * _EDGE - _PROBE) // (_PROBES - 1)
                             for i in range(_PROBES)] + [size - _EDGE]
            for offset, length in zip(offsets, [_EDGE] + [_PROBE] * _PROBES + [_EDGE]):
                fh.seek(offset)
                h.update(fh.read(length))
    return h.hexdigest()
