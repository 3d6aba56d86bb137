#!/usr/bin/env bash
# Follows a run that outlasts one device command (run.sh under setsid/nohup, output in
# WORK/run.log): every 20 s, each arm's `eagle3ctl status`, the logs' tails, the summaries so far,
# disk and GPU use go to DEST, until both arms' summaries exist or SECONDS have passed. DEST is the
# device command's $OUT, so a command cut off by its time limit still brings back the latest.
#   bench/sglang_h200/follow.sh WORK SECONDS DEST
set -uo pipefail
here=$(dirname "$(realpath "$0")"); work=$(realpath "$1"); dest=$3
export PYTHONPATH="$work/site:$here/stubs"
end=$((SECONDS + $2))
while :; do
  for arm in pipeline target; do
    # Its exit code last: 4 is a pipeline waiting for an operator (retry or exclude).
    [ -e "$work/$arm/sglang.toml" ] && { timeout 20 python3 -c \
      'import sys; from eagle3d.daemon.ctl import main; sys.exit(main())' \
      -c "$work/$arm/sglang.toml" status > "$dest/status-$arm.txt" 2>&1
      echo "exit $?" >> "$dest/status-$arm.txt"; }
    [ -e "$work/$arm/train/metrics.jsonl" ] && cp "$work/$arm/train/metrics.jsonl" "$dest/$arm-metrics.jsonl"
  done
  tail -n 40 "$work/run.log" > "$dest/run.tail" 2>&1
  grep -v "POST /generate" "$work/out/target.log" 2>/dev/null | tail -n 40 > "$dest/target.tail"
  cp "$work"/out/*.json "$dest"/ 2>/dev/null
  df -h "$work" /dev/shm > "$dest/df.txt"
  echo "$(date -u +%T) $(nvidia-smi --query-gpu=memory.used,utilization.gpu --format=csv,noheader)" \
    >> "$dest/gpu.txt"
  [ -e "$work/out/pipeline.json" ] && [ -e "$work/out/target.json" ] && break
  [ $SECONDS -ge $end ] && break
  sleep 20
done
exit 0
