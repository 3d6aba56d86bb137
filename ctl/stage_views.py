"""What `eagle3ctl status` shows of each stage, in pipeline order: the stage's section of
state.toml (its `status()`) as lines, and the progress bar of the stage at work. Light: status
imports it, the stages themselves (children, engines) never.

Only the stages with something to show have a view; `ctl/status.py`'s `render_status` iterates
them and names none.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Callable, NamedTuple

from eagle3d.daemon.progress import human_s


def bar(fraction: float, width: int = 30) -> str:
    fraction = min(max(fraction, 0.0), 1.0)
    full = int(fraction * width)
    return "[" + "#" * full + "." * (width - full) + f"] {fraction * 100:5.1f}%"


def silent(child: dict[str, Any]) -> str:
    """", SILENT since 12:00:00 (4m 10s; restarted after 15m 00s)" for a child that shows no
    progress: stopped or stuck, not exited."""
    since = child.get("silent")
    if not since:
        return ""
    return (f", SILENT since {time.strftime('%H:%M:%S', time.localtime(since['since']))} "
            f"({human_s(since.get('age_s'))}; restarted after "
            f"{human_s(since['bound_s'])})")


def _nothing(st: dict[str, Any]) -> None:
    return None


class View(NamedTuple):
    key: str       # the stage's section of state.toml (PipelineStage.state_key)
    empty: Any     # what status holds where the daemon has not published the section
    # Its lines, from its section.
    lines: Callable[[dict[str, Any]], list[str]]
    # Its progress bar, from the whole status, while it is the stage at work (None: not).
    progress: Callable[[dict[str, Any]], str | None]
    # What the rate line says instead of the ingest's rate while this stage has none (None).
    rate: Callable[[dict[str, Any]], str | None] = _nothing


def _generating(st: dict[str, Any]) -> bool:
    s = st["samples"]
    return bool(st["stage"] == "generate" or s.get("ungenerated") or s.get("generating"))


def _generate_progress(st: dict[str, Any]) -> str | None:
    if not _generating(st):
        return None
    s = st["samples"]
    left = s.get("ungenerated", 0) + s.get("generating", 0)
    return (f"progress  {bar(1 - left / max(s['total'], 1))}  {s['total'] - left:,}/"
            f"{s['total']:,} samples written by the target")


def _generate_lines(gen: dict[str, Any]) -> list[str]:
    if gen.get("status") != "running" and not gen.get("blocked"):
        return []
    return [f"generator {gen['status']}" + (f", pid {gen['pid']}" if gen.get("pid") else "")
            + f", {gen.get('rate_per_s', 0):.2f} conversations/s, "
            f"{gen.get('restarts', 0)} restarts" + silent(gen)
            + (f": {gen['blocked']}" if gen.get("blocked") else "")]


def _extract_progress(st: dict[str, Any]) -> str | None:
    """The tokens extracted: the bar whenever no other stage claims it."""
    if _generating(st):
        return None
    t = st["tokens"]
    frac = t["done"] / t["total"] if t.get("total") else 0.0
    return f"progress  {bar(frac)}  {t['done']:,}/{t.get('total', 0):,} tokens extracted"


def _engine_lines(e: dict[str, Any]) -> list[str]:
    if not e:
        return []
    extra = f", pid {e['pid']}" if e.get("pid") else ""
    extra += f", {e['device']}" if e.get("device") else ""
    return [f"engine    {e.get('status', '-')} ({e.get('kind', '?')}{extra}), "
            f"{e.get('restarts', 0)} restarts" + silent(e) +
            (f": {e['blocked']}" if e.get("blocked") else "")]


def _verify_progress(st: dict[str, Any]) -> str | None:
    s = st["samples"]
    if _generating(st) or not (st["stage"] == "verify" or (
            s["verified"] and not s["pending"] and not s["inflight"])):
        return None
    return (f"progress  {bar(s['verified'] / max(s['total'] - s['excluded'], 1))}  "
            f"{s['verified']}/{s['total'] - s['excluded']} verified")


def _train_progress(st: dict[str, Any]) -> str | None:
    trainer = st.get("trainer", {})
    if st["stage"] not in ("train", "done") and trainer.get("status") not in ("training",
                                                                              "evaluating"):
        return None
    total = trainer.get("total_steps") or 0
    frac = (trainer.get("step", 0) / total) if total else (1.0 if st["stage"] == "done" else 0.0)
    return f"progress  {bar(frac)}  training step {trainer.get('step', 0)}/{total}"


def _train_rate(st: dict[str, Any]) -> str | None:
    if st.get("trainer", {}).get("status") != "evaluating":
        return None
    return "rate      evaluating the drafter: no rate or ETA until it ends"


def _before_first_step(early: dict[str, Any]) -> str:
    from eagle3d.statemachine import train_files  # only where there is a trainer to show
    return f"{early['status']} for {human_s(early.get('age_s'))}" + (
        " (the first step: on a GPU the fused kernels compile, a minute or more the first time)"
        if early["status"] == train_files.STARTING else "")


def _data_wait(wait: float) -> str:
    from eagle3d.statemachine import train_files
    return f"data wait {wait:.0%} of step time" + (
        " (waiting for the reader: the dataset's disk sets the pace)"
        if wait >= train_files.READER_LIMIT else "")


def _trainer_parts(trainer: dict[str, Any]) -> list[str]:
    parts = [trainer.get("status", "idle")]
    if trainer.get("before_first_step"):
        parts.append(_before_first_step(trainer["before_first_step"]))
    if "loss" in trainer:
        parts.append(f"loss {trainer['loss']:.3f}")
    if trainer.get("acc"):
        parts.append("acc " + "/".join(f"{a:.2f}" for a in trainer["acc"]))
    if "tokens_per_s" in trainer:
        parts.append(f"{trainer['tokens_per_s']:,.0f} tokens/s")
    if trainer.get("status") == "training" and "data_wait" in trainer:
        parts.append(_data_wait(trainer["data_wait"]))
    if "acceptance_length" in trainer:
        parts.append(f"acceptance length {trainer['acceptance_length']:.2f}")
    if trainer.get("silent"):
        parts.append(silent(trainer).lstrip(", "))
    if trainer.get("blocked"):
        parts.append(trainer["blocked"])
    return parts


def _train_lines(trainer: dict[str, Any]) -> list[str]:
    if not trainer:
        return []
    lines = ["trainer   " + " · ".join(_trainer_parts(trainer))]
    if trainer.get("started_over"):
        lines.append(f"retrain   training started over from step 0: {trainer['started_over']}")
    if trainer.get("versions"):  # drafters of other [train] settings, kept beside this one
        kept = [f"{v['key']} " + (f"acceptance length {v['acceptance_length']:.2f}"
                                  if v.get("acceptance_length") is not None else
                                  "not evaluated") for v in trainer["versions"]]
        folder = Path(trainer["versions"][0]["path"]).parent
        lines.append(f"drafters  current {trainer.get('version', '?')} · kept: "
                     + " · ".join(kept) + f" (in {folder})")
    return lines


VIEWS = (
    View("generate", {}, _generate_lines, _generate_progress),
    View("engine", {}, _engine_lines, _extract_progress),
    View("verify", None, lambda verify: [], _verify_progress),
    View("trainer", {}, _train_lines, _train_progress, _train_rate),
)


def progress(st: dict[str, Any]) -> str:
    """The bar of the furthest stage at work: training once it started, else the samples the
    target writes, else those verified, else the tokens extracted."""
    return next(line for view in reversed(VIEWS) if (line := view.progress(st)))


def rate(st: dict[str, Any]) -> str:
    """The ingest's rate and ETA, unless a stage has none to show."""
    r = st.get("rate", {})
    return next((line for view in VIEWS if (line := view.rate(st))),
                f"rate      {r.get('samples_per_s', 0):.2f} samples/s · "
                f"{r.get('tokens_per_s', 0):,.0f} tokens/s · ETA {human_s(st.get('eta_s'))}")
