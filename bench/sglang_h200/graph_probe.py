"""Does a server of this bundle start with decode CUDA graphs? The serve bench's servers (its
flags, serve.py's COMMON) started one at a time with decode graphs on: plain SGLang, then the
exported drafter as an EAGLE-3 chain ([eval] steps, top-k 1) and SGLang's tree for Llama (5
steps, top-k 4, 8 draft tokens). Each that comes up answers one greedy request; each server's
whole log is kept, for the reason when it does not come up (serve.py then falls back to eager
servers, and says only "server did not come up").

    python3 graph_probe.py CONFIG OUT_DIR [SERVER_ARG...]

CONFIG is a finished run's (pipeline.sh's): its target and exported drafter. Writes
OUT_DIR/graphs-NAME.log per server and OUT_DIR/graphs.json: per server whether it came up, in
how many seconds, the log's last error lines, and the request's tokens.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from serve import SGLANG_TREE, post, server, speculative_flags
from eagle3d.statemachine import layout
from eagle3d.statemachine.config_validation import load_config

# The lines of a log that say why a start failed.
MARKS = ("Error", "error", "Traceback", "raise ", "Exception", "failed", "Failed", "CUDA graph",
         "cuda graph", "Capture", "capture")


def why(log: Path, keep: int = 60) -> list[str]:
    lines = log.read_text(errors="replace").splitlines() if log.exists() else []
    marked = [line for line in lines if any(m in line for m in MARKS)]
    return (marked or lines)[-keep:]


def main() -> int:
    cfg, out, extra = load_config(sys.argv[1]), Path(sys.argv[2]), sys.argv[3:]
    out.mkdir(parents=True, exist_ok=True)
    export = layout.export_dir(cfg.paths.train_dir)
    steps = cfg.eval.steps
    arms = {"plain": [], "chain": speculative_flags(steps, 1, steps + 1, export),
            "tree": speculative_flags(*SGLANG_TREE, export)}
    result = {}
    for port, (name, spec) in enumerate(arms.items(), 30851):
        log = out / f"graphs-{name}.log"
        started = time.monotonic()
        entry: dict = {"flags": [*extra, *spec]}
        try:
            with server(cfg.target.model_path, port, ["--dtype", "bfloat16", *extra, *spec],
                        log, deadline_s=240):
                entry["up_s"] = round(time.monotonic() - started, 1)
                answer = post(port, "/generate", {"input_ids": [1, 2, 3, 4, 5, 6, 7, 8],
                              "sampling_params": {"temperature": 0.0, "max_new_tokens": 32}})
                entry["output_tokens"] = len(answer["output_ids"])
                entry["meta"] = {k: v for k, v in answer["meta_info"].items()
                                 if "spec" in k or k == "completion_tokens"}
        except (RuntimeError, OSError) as exc:
            entry["error"] = str(exc)
        entry["came_up"] = "up_s" in entry
        entry["seconds"] = round(time.monotonic() - started, 1)
        entry["log_tail"] = why(log)
        result[name] = entry
        (out / "graphs.json").write_text(json.dumps(result, indent=1))
        print(f"{name}: {'came up' if entry['came_up'] else 'did not come up'} "
              f"({entry['seconds']} s)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
