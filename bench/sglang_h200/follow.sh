#!/usr/bin/env bash
# Follows a run that outlasts one device command (run.sh under setsid/nohup, output in
# WORK/run.log): every 20 s it rewrites DEST/follow.txt (each arm's `eagle3ctl status` with its
# exit code, the logs' tails, disk and GPU use) and copies each arm's training metrics and the
# summaries so far, until every arm started has its summary or SECONDS have passed. DEST is the
# device command's $OUT, so a command cut off by its time limit still brings back the latest; five
# files at most, because a device command brings back only a few.
#   bench/sglang_h200/follow.sh WORK SECONDS DEST
set -uo pipefail
here=$(dirname "$(realpath "$0")"); work=$(realpath "$1"); dest=$3
export PYTHONPATH="$work/site:$here/stubs"
end=$((SECONDS + $2))
report() {
  for arm in pipeline target; do
    [ -e "$work/$arm/sglang.toml" ] || continue
    echo "== $arm status"
    timeout 20 python3 -c 'import sys; from eagle3d.daemon.ctl import main; sys.exit(main())' \
      -c "$work/$arm/sglang.toml" status 2>&1
    # 4 is a pipeline waiting for an operator (retry or exclude).
    echo "exit $?"
  done
  echo "== run.log"; grep -v "POST /generate" "$work/run.log" 2>/dev/null | tail -n 30
  echo "== target.log"; grep -v "POST /generate" "$work/out/target.log" 2>/dev/null | tail -n 30
  echo "== disk"; df -h "$work" /dev/shm
  echo "== gpu"; nvidia-smi --query-gpu=memory.used,utilization.gpu --format=csv,noheader
}
while :; do
  report > "$dest/follow.txt.tmp" 2>&1; mv "$dest/follow.txt.tmp" "$dest/follow.txt"
  for arm in pipeline target; do
    [ -e "$work/$arm/train/metrics.jsonl" ] && cp "$work/$arm/train/metrics.jsonl" "$dest/$arm-metrics.jsonl"
  done
  started=0 finished=1
  for arm in pipeline target; do
    [ -e "$work/$arm/sglang.toml" ] || continue
    started=1
    if [ -e "$work/out/$arm.json" ]; then cp "$work/out/$arm.json" "$dest/"; else finished=0; fi
  done
  [ $started = 1 ] && [ $finished = 1 ] && break
  [ $SECONDS -ge $end ] && break
  sleep 20
done
exit 0
