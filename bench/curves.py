"""Training runs side by side: each run's first-draft training accuracy (a 50-step mean) against
its optimizer step, and, dashed in the same colour, the teacher-forced first-draft accuracy its
drafter reached on held-out answers (eval.json), so the gap between what training sees and what
held-out text gives is read off one picture. Prints each run's figures last.

    bench/curves.py OUT.png "TITLE" "LABEL=METRICS.jsonl[,EVAL.json]" ...

METRICS.jsonl is a train folder's metrics.jsonl; EVAL.json the `eagle3ctl eval --out` of its
drafter (optional). Runs retrained by bench/retrain.sh keep both in their OUT folder.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from eagle3d.drafter.plots import read_metrics

WINDOW = 50  # steps averaged per point: one step's accuracy swings with its batch


def smoothed(values: list[float], window: int = WINDOW) -> list[float]:
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v - (values[i - window] if i >= window else 0.0)
        out.append(total / min(i + 1, window))
    return out


def main(argv: list[str]) -> int:
    if len(argv) < 3:
        print(__doc__, file=sys.stderr)
        return 2
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out, title, runs = Path(argv[0]), argv[1], argv[2:]
    fig, ax = plt.subplots(figsize=(8, 4.5))
    lines = []
    for i, run in enumerate(runs):
        label, _, files = run.partition("=")
        metrics, _, eval_path = files.partition(",")
        rows = read_metrics(Path(metrics))
        colour = f"C{i}"
        acc = smoothed([r["acc"][0] for r in rows])
        ax.plot([r["step"] for r in rows], acc, color=colour, label=f"{label}: training")
        line = (f"{label}: {len(rows)} steps, first-draft training accuracy over the last "
                f"{WINDOW} steps {acc[-1]:.3f}")
        if eval_path:
            ev = json.loads(Path(eval_path).read_text())
            forced = ev["teacher_forced_accuracy"][0]
            ax.axhline(forced, color=colour, linestyle="--", label=f"{label}: held-out")
            line += (f", held out {forced:.3f} (teacher-forced); acceptance length "
                     f"{ev['acceptance_length']:.3f}")
        lines.append(line)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel(f"first-draft accuracy ({WINDOW}-step mean)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize="x-small", ncol=2)
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
