#!/usr/bin/env bash
# Training recipes compared on one finished dataset: retrains the dataset a finished run left
# once per setting, each with only [train] keys changed and its own train_dir, and prints each
# one's held-out acceptance length last. The run's dataset, ledger and drafter are only read.
# Training is seeded, so the run's own recipe reproduces the run's figure.
#   bench/retrain.sh CONFIG OUT "batch_tokens=2048 lr=1e-3" "max_steps=2400" ...
# CONFIG is the config the run's children ran with (<state_dir>/config.toml: var/demo/state/
# config.toml after `make demo`); each setting's config, logs and eval.json go to OUT.
# PYTHON (default: the checkout's .venv) runs eagle3d.
set -euo pipefail
repo=$(dirname "$(realpath "$0")")/..
py=${PYTHON:-$repo/.venv/bin/python}
in_force=$(realpath "$1"); out=$(realpath -m "$2"); shift 2
mkdir -p "$out"
for setting in "$@"; do
  name=$(echo "$setting" | tr ' =' '_-')
  "$py" - "$in_force" "$out/$name.toml" "$out/$name" $setting <<'PY'
import re, sys
source, target, train_dir, *changes = sys.argv[1:]
head, train = open(source).read().split("[train]", 1)
head = re.sub(r'(?m)^train_dir = .*$', f'train_dir = "{train_dir}"', head)
for change in changes:
    key, value = change.split("=", 1)
    train, n = re.subn(rf"(?m)^{key} = .*$", f"{key} = {value}", train, count=1)
    if not n:
        sys.exit(f"[train] has no key {key}")
open(target, "w").write(head + "[train]" + train)
PY
  "$py" -m torch.distributed.run --standalone --nproc_per_node=1 -m eagle3d.drafter.train \
    -c "$out/$name.toml" > "$out/$name.train.log" 2>&1
  "$py" -m eagle3d.drafter.evaluate -c "$out/$name.toml" --json --out "$out/$name.eval.json" \
    > "$out/$name.eval.log" 2>&1 || true  # exit 1 (not greedy) still writes its figures
done
for setting in "$@"; do
  name=$(echo "$setting" | tr ' =' '_-')
  "$py" -c 'import json, sys; e = json.load(open(sys.argv[1])); low, high = e["acceptance_length_ci95"]
per = [round(a, 3) for a in e["per_position_acceptance"]]
print("%s: acceptance length %.3f (%.3f-%.3f), per position %s, identical to greedy %s"
      % (sys.argv[2], e["acceptance_length"], low, high, per, e["identical_to_greedy"]))' \
    "$out/$name.eval.json" "$setting"
done
