"""The training curves, as a PNG next to metrics.jsonl."""

from __future__ import annotations

import json
from pathlib import Path


def read_metrics(path: Path) -> list[dict]:
    rows = []
    for line in Path(path).read_text().splitlines():
        if line.strip():
            rows.append(json.loads(line))
    return rows


def plot_metrics(metrics_path: Path, png_path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_metrics(metrics_path)
    steps = [r["step"] for r in rows]
    fig, (loss_ax, acc_ax, lr_ax) = plt.subplots(3, 1, figsize=(8, 9), sharex=True)
    ttt = len(rows[0]["loss_per_step"]) if rows else 0
    for k in range(ttt):
        loss_ax.plot(steps, [r["loss_per_step"][k] for r in rows], label=f"TTT step {k}")
        acc_ax.plot(steps, [r["acc"][k] for r in rows], label=f"TTT step {k}")
    loss_ax.set_ylabel("loss (soft cross-entropy)")
    acc_ax.set_ylabel("accuracy (argmax = target's)")
    lr_ax.plot(steps, [r["lr"] for r in rows])
    lr_ax.set_ylabel("learning rate")
    lr_ax.set_xlabel("optimizer step")
    for ax in (loss_ax, acc_ax):
        if ttt:
            ax.legend(fontsize="small")
        ax.grid(alpha=0.3)
    fig.suptitle("EAGLE-3 drafter training")
    fig.tight_layout()
    tmp = Path(png_path).with_name(f".{Path(png_path).name}.tmp.png")
    fig.savefig(tmp, dpi=100)
    plt.close(fig)
    tmp.replace(png_path)
