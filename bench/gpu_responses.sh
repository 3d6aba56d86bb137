#!/usr/bin/env bash
# Issue 13's comparison on a GPU server: the same conversations and training budget, once with
# the dataset's own answers and once with answers the target wrote itself; the ratio of their
# held-out acceptance lengths is printed last.
#
#   bench/gpu_responses.sh MODEL.gguf CONVERSATIONS OUTDIR [LIMIT] [EPOCHS] [WHICH...]
# WHICH: "target", "dataset" or both (default), run in that order.
set -euo pipefail
here=$(dirname "$(realpath "$0")")
model=$1; source=$2; out=$3; limit=${4:-3000}; epochs=${5:-3}; shift $(( $# < 5 ? $# : 5 ))
for responses in "${@:-target dataset}"; do
  for r in $responses; do "$here/gpu_pipeline.sh" "$model" "$source" "$out/$r" "$limit" "$epochs" "$r"; done
done
python3 - "$out" <<'PY'
import json, os, sys
runs = {r: json.load(open(f"{sys.argv[1]}/{r}/summary.json"))["eval"]["acceptance_length"]
        for r in ("target", "dataset") if os.path.exists(f"{sys.argv[1]}/{r}/summary.json")}
print("acceptance length: " + ", ".join(f"{r} {a:.3f}" for r, a in runs.items()))
if len(runs) == 2:
    print(f"target-written / dataset answers: {runs['target'] / runs['dataset']:.2f}x (goal >= 1.3)")
PY
