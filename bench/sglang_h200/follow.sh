#!/usr/bin/env bash
# Follows a run that outlasts one device command (run.sh under setsid/nohup, output in
# WORK/run.log): every 20 s it rewrites DEST/follow.txt (each arm's `eagle3ctl status` with its
# exit code, the logs' tails, disk and GPU use) and copies each arm's training metrics and the
# summaries so far, until every arm started has its summary and every step run.sh started is done,
# or run.sh has ended, or SECONDS have passed. DEST is the device command's $OUT, so a command cut
# off by its time limit still brings back the latest; seven files at most, because a device
# command brings back eight: with the ttt step, its second arm's curve, and WORK/out as
# results.tgz (evaluations, the graph probe, the serve bench, logs).
#   bench/sglang_h200/follow.sh WORK SECONDS DEST
set -uo pipefail
here=$(dirname "$(realpath "$0")"); work=$(realpath "$1"); dest=$3
export PYTHONPATH="$work/site:$here/stubs"
end=$((SECONDS + $2))
report() {
  for arm in pipeline target; do
    [ -e "$work/$arm/sglang.toml" ] || continue
    echo "== $arm status"
    timeout 20 python3 -c 'import sys; from eagle3d.ctl.main import main; sys.exit(main())' \
      -c "$work/$arm/sglang.toml" status 2>&1
    # 4 is a pipeline waiting for an operator (retry or exclude).
    echo "exit $?"
  done
  echo "== run.log"; grep -v "POST /generate" "$work/run.log" 2>/dev/null | tail -n 30
  echo "== target.log"; grep -v "POST /generate" "$work/out/target.log" 2>/dev/null | tail -n 30
  for log in "$work"/out/ttt?.log "$work"/out/ttt?-train.log "$work/out/graphs.log"; do
    [ -e "$log" ] && { echo "== $(basename "$log")"; tail -n 12 "$log"; }
  done
  echo "== disk"; df -h "$work" /dev/shm
  echo "== gpu"; nvidia-smi --query-gpu=memory.used,utilization.gpu --format=csv,noheader
}
while :; do
  report > "$dest/follow.txt.tmp" 2>&1; mv "$dest/follow.txt.tmp" "$dest/follow.txt"
  for arm in pipeline target; do
    [ -e "$work/$arm/train/metrics.jsonl" ] && cp "$work/$arm/train/metrics.jsonl" "$dest/$arm-metrics.jsonl"
  done
  # The ttt step's second arm: its curve, and every figure and log so far in one file.
  for m in "$work"/ttt?/train/metrics.jsonl; do
    [ -e "$m" ] && cp "$m" "$dest/$(basename "$(dirname "$(dirname "$m")")")-metrics.jsonl"
  done
  # (target.log, the daemon's output with SGLang's, is in follow.txt's tail; tar exits 1 when a
  # file changed while read, which leaves a usable archive.)
  if [ -e "$work/out/run.ended" ] || ls "$work"/out/*.started >/dev/null 2>&1; then
    tar czf "$dest/results.tgz.tmp" -C "$work/out" --exclude ./target.log . 2>/dev/null
    [ $? -le 1 ] && mv "$dest/results.tgz.tmp" "$dest/results.tgz"
  fi
  started=0 finished=1
  for arm in pipeline target; do
    [ -e "$work/$arm/sglang.toml" ] || continue
    started=1
    if [ -e "$work/out/$arm.json" ]; then cp "$work/out/$arm.json" "$dest/"; else finished=0; fi
  done
  for mark in "$work"/out/*.started; do
    [ -e "$mark" ] && [ ! -e "${mark%.started}.done" ] && finished=0
  done
  [ $started = 1 ] && [ $finished = 1 ] && break
  [ -e "$work/out/run.ended" ] && break
  [ $SECONDS -ge $end ] && break
  sleep 20
done
exit 0
