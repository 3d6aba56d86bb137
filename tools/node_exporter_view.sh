#!/usr/bin/env bash
# The README's Grafana-free view of a run: a short demo-sized run with [metrics] textfile set,
# node_exporter's textfile collector pointed at that file's folder, and the eagle3d_ lines of
# node_exporter's own /metrics, scraped while the run trains. node_exporter is run by hand in
# the foreground on 127.0.0.1 (never as a service), and stopped with the daemon at the end.
#
#   tools/node_exporter_view.sh [OUTDIR] [LIMIT]     (after `make setup`; needs node_exporter:
#                                                     apt-get install prometheus-node-exporter)
# Writes OUTDIR/metrics.txt (node_exporter's whole /metrics) and prints the eagle3d_ lines and
# node_textfile_scrape_error, which must be 0: node_exporter parsed the file.
set -euo pipefail
cd "$(dirname "$0")/.."
out=$(realpath -m "${1:-var/node-exporter-view}"); limit=${2:-60}
exporter=$(command -v prometheus-node-exporter || command -v node_exporter)
rm -rf "$out"; mkdir -p "$out/textfile"
spool=/dev/shm/eagle3d-view-$$
pids=()
cleanup() {
    for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done
    wait || true
    rm -rf "$spool"
}
trap cleanup EXIT

# etc/demo.toml on this run's folders, cut to a few minutes (ShareGPT's own answers), with the
# metrics file on.
.venv/bin/python - "$out" "$spool" "$limit" <<'PY'
import sys, tomllib, tomli_w
out, spool, limit = sys.argv[1:]
doc = tomllib.load(open("etc/demo.toml", "rb"))
doc["paths"] = {"state_dir": f"{out}/state", "spool_dir": spool,
                "dataset_dir": f"{out}/dataset", "train_dir": f"{out}/train"}
doc["data"].update(limit=int(limit), responses="dataset")  # no generate stage: minutes less
doc["train"].update(epochs=20.0, checkpoint_every=20)
doc["metrics"] = {"textfile": f"{out}/textfile/eagle3d.prom"}
open(f"{out}/view.toml", "wb").write(tomli_w.dumps(doc).encode())
PY
.venv/bin/eagle3d run -c "$out/view.toml" --until done >"$out/daemon.log" 2>&1 &
pids+=($!)

port=$(.venv/bin/python -c "import socket; s = socket.socket(); s.bind(('127.0.0.1', 0))
print(s.getsockname()[1])")
"$exporter" --web.listen-address="127.0.0.1:$port" --collector.disable-defaults \
    --collector.textfile --collector.textfile.directory="$out/textfile" >"$out/exporter.log" 2>&1 &
pids+=($!)

# Training under way, a few steps in: every family the file has is filled by then.
step='^eagle3d_train_step\{[^}]*\} ([5-9]|[1-9][0-9]+)$'
until grep -qE "$step" "$out/textfile/eagle3d.prom" 2>/dev/null; do
    kill -0 "${pids[0]}" || { tail -20 "$out/daemon.log"; exit 1; }
    sleep 2
done
curl -sf "http://127.0.0.1:$port/metrics" >"$out/metrics.txt"
echo "# $(date -u +%Y-%m-%dT%H:%M:%SZ) curl http://127.0.0.1:$port/metrics"
grep -E '^(eagle3d_|node_textfile_scrape_error)' "$out/metrics.txt"
grep -qx 'node_textfile_scrape_error 0' "$out/metrics.txt"
