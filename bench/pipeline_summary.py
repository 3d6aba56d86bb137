"""The figures of one whole-pipeline run (bench/gpu_pipeline.sh, bench/sglang_h200/pipeline.sh),
read from its ledger and train folder: each stage's wall time, the dataset's samples, tokens and
bytes, the training curve and the held-out acceptance length, printed with the acceptance length
last and written to OUTDIR/summary.json.

    python bench/pipeline_summary.py OUTDIR WALL_S LABEL

OUTDIR holds state/ and train/ as those scripts lay them out; LABEL names the run in the last
line (e.g. its responses, "target" or "dataset")."""

from __future__ import annotations

import json
import sqlite3
import sys
from pathlib import Path
from typing import Any

CURVE_POINTS = 25


def stage_seconds(db: sqlite3.Connection) -> dict[str, int]:
    """Each stage's wall time, from the event that entered it to the one that entered the next
    (train includes the export and the evaluation)."""
    entered = [(t, detail.split(":")[0]) for t, detail in
               db.execute("SELECT t, detail FROM events WHERE kind = 'stage' ORDER BY seq")]
    return {stage: round(t1 - t0) for (t0, stage), (t1, _) in zip(entered, entered[1:])}


def summarize(out: Path, wall_s: int, label: str) -> dict[str, Any]:
    db = sqlite3.connect(f"file:{out}/state/ledger.sqlite?mode=ro", uri=True)
    curve = [json.loads(line) for line in open(out / "train" / "metrics.jsonl")]
    rates = sorted(r["tokens_per_s"] for r in curve if r.get("tokens_per_s"))
    verified = db.execute("SELECT n, tokens, bytes FROM counts WHERE status = 'verified'").fetchone()
    every = max(1, len(curve) // CURVE_POINTS)
    return {
        "run": label, "wall_s": wall_s, "stage_s": stage_seconds(db),
        "samples": {status: n for status, n in db.execute("SELECT status, n FROM counts") if n},
        "dataset": {"samples": verified[0], "tokens": verified[1], "bytes": verified[2],
                    "bytes_per_token": verified[2] / max(1, verified[1])},
        "generation": [line.strip() for line in open(out / "daemon.log")
                       if "generation done" in line] if (out / "daemon.log").exists() else [],
        "train_steps": len(curve),
        "train_tokens_per_s_median": rates[len(rates) // 2] if rates else None,
        "train_curve": [{k: r[k] for k in ("step", "epoch", "loss", "acc")}
                        for r in curve[every - 1::every]],
        "eval": json.load(open(out / "train" / "eval.json")),
    }


def main() -> None:
    out, wall_s, label = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    summary = summarize(out, wall_s, label)
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    d, ev = summary["dataset"], summary["eval"]
    print(f"stages (s): {summary['stage_s']}, wall {wall_s} s")
    print(f"dataset: {d['samples']} samples, {d['tokens']:,} tokens, {d['bytes']:,} bytes "
          f"({d['bytes_per_token']:,.1f} per token)")
    print(f"training: {summary['train_steps']} steps, median "
          f"{summary['train_tokens_per_s_median'] or 0:,.0f} tokens/s, last acc "
          f"{[round(a, 3) for a in summary['train_curve'][-1]['acc']]}")
    print(f"[{label}] acceptance length {ev['acceptance_length']:.3f} "
          f"(95% {ev['acceptance_length_ci95'][0]:.3f}-{ev['acceptance_length_ci95'][1]:.3f}) over "
          f"{ev['prompts']} held-out prompts, per position "
          f"{[round(a, 3) for a in ev['per_position_acceptance']]}, "
          f"identical to greedy: {ev['identical_to_greedy']}")


if __name__ == "__main__":
    main()
