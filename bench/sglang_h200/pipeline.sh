#!/usr/bin/env bash
# The daemon with engine = "sglang" on SmolLM2-135M-Instruct: it starts SGLang itself (launcher,
# start watcher, plugin, client) and runs plan → [generate] → extract → verify → train → done;
# then the acceptance length of the exported drafter on 48 held-out prompts. Figures in
# OUTDIR/summary.json (stage times, dataset tokens and bytes, the training curve, eval), the
# daemon's log in OUTDIR/daemon.log.
#   [RESPONSES=target] bench/sglang_h200/pipeline.sh MODEL_DIR CONVERSATIONS OUTDIR [SERVER_ARG...]
# RESPONSES=target has the target write every assistant turn first (2 turns of at most 384
# tokens, greedy) through the generate stage's own SGLang server; the default, dataset, trains
# on the conversations' own answers. LIMIT (default 3200) conversations from the first are
# planned; eval takes 48 from there, EVAL_TOKENS (default 64) new tokens each. GEN_BATCH
# (default 512) conversations are in flight at once ([generate] batch_size). EPOCHS (default 3) of training,
# stopped at MAX_STEPS optimiser steps where set (the same budget for runs of unequal sizes).
# INTERMEDIATE_SIZE (default 0: the target's) is the drafter's MLP width ([train] intermediate_size);
# the best recipe measured (docs/results/drafter-quality.md, "Full scale": 2.553 on all 17,600
# conversations):
# EPOCHS=20 MAX_STEPS=14400 INTERMEDIATE_SIZE=6144.
# DUMP_DTYPE (default bfloat16) is [extract] dump_dtype; LOSS_ON (default answers) is [train]
# loss_on; TTT_STEPS (default 3, what every recorded run used) is [train] ttt_steps: the chain of 4
# and SGLang's tree of 5 steps draft deeper than 3. ANSWERS (default 1) is [generate] answers,
# the target's answers per conversation, sampled at TEMPERATURE (default 0.0: greedy, which
# ANSWERS above 1 needs raised, e.g. 0.7). Two runs side by side on one GPU need their own PORT (default 30555); the spool is
# named after OUTDIR, and each SGLang server takes mem_fraction of the GPU memory free when it
# starts (SGLang sizes its cache that way).
set -euo pipefail
model=$(realpath "$1"); source=$(realpath "$2"); out=$(realpath -m "$3"); shift 3
extra=$(python3 -c 'import json, sys; print(json.dumps(sys.argv[1:]))' "$@")
mkdir -p "$out"
cat > "$out/sglang.toml" <<TOML
[target]
model = "$model"
engine = "sglang"
dtype = "bfloat16"
device = "cuda"
[data]
source = "$source"
format = "auto"
first = 0
limit = ${LIMIT:-3200}
max_tokens = 1024
responses = "${RESPONSES:-dataset}"
[generate]
max_new_tokens = 384
max_turns = 2
batch_size = ${GEN_BATCH:-512}
answers = ${ANSWERS:-1}
temperature = ${TEMPERATURE:-0.0}
[paths]
state_dir = "$out/state"
spool_dir = "/dev/shm/eagle3d-$(basename "$out")"
dataset_dir = "$out/dataset"
train_dir = "$out/train"
[budget]
reserve = "4GiB"
spool_max = "8GiB"
[extract]
dump_dtype = "${DUMP_DTYPE:-bfloat16}"
batch_tokens = 16384
engine_max_restarts = 1
max_inflight_tokens = 131072
max_inflight_samples = 256
[verify]
workers = 8
spot_checks = 2
[train]
device = "cuda"
draft_vocab = 8192
ttt_steps = ${TTT_STEPS:-3}
loss_on = "${LOSS_ON:-answers}"
epochs = ${EPOCHS:-3}
max_steps = ${MAX_STEPS:-0}
intermediate_size = ${INTERMEDIATE_SIZE:-0}
batch_tokens = 8192
lr = 1e-3
warmup_steps = 10
checkpoint_every = 200
[eval]
first = ${LIMIT:-3200}
limit = 48
steps = 4
max_new_tokens = ${EVAL_TOKENS:-64}
[sglang]
python = "python3"
port = ${PORT:-30555}
mem_fraction = 0.3
startup_timeout_s = 600
extra_args = $extra
TOML
started=$(date +%s)
python3 -c 'import sys; from eagle3d.daemon.main import main; sys.exit(main())' \
  run -c "$out/sglang.toml" --until done 2>&1 | tee "$out/daemon.log"
wall=$(( $(date +%s) - started ))
python3 -c 'import sys; from eagle3d.ctl.main import main; sys.exit(main())' \
  -c "$out/sglang.toml" status || true
python3 "$(dirname "$(realpath "$0")")/../pipeline_summary.py" "$out" "$wall" "${RESPONSES:-dataset}"
