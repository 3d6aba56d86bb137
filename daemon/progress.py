"""One line of progress for whoever has only the log or `systemctl status`: the stage, its
counts against their total, its rate and ETA, and why. The daemon sends it as its sd_notify
STATUS at every publish and logs it every PROGRESS_EVERY_S, so a SLURM or Kubernetes user, whose
only view is the log, sees every long stage move."""

from __future__ import annotations

from typing import Any

PROGRESS_EVERY_S = 30.0


def line(state: dict[str, Any]) -> str:
    """`extract: 41700/100000 samples, 49.1M/118.3M tokens, 3,100 tokens/s, ETA 6h 12m; why`."""
    stage = state.get("underlying", state["stage"])
    body = _BODY.get(stage, _samples)(state)
    eta = state.get("eta_s")
    head = state["stage"] if state["stage"] == stage else f"{state['stage']} ({stage})"
    return (f"{head}: {body}" + (f", ETA {human_s(eta)}" if eta is not None else "")
            + (f"; {state['reason']}" if state.get("reason") else ""))


def human_s(s: float | None) -> str:
    if s is None:
        return "-"
    s = int(s)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m {s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h {s % 3600 // 60:02d}m"
    return f"{s // 86400}d {s % 86400 // 3600:02d}h"


def _count(n: float) -> str:
    for unit, size in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= size:
            return f"{n / size:.1f}{unit}"
    return f"{n:.0f}"


def _plan(state: dict[str, Any]) -> str:
    s = state["samples"]
    return f"{s['total']} samples planned ({s.get('skipped', 0)} conversations skipped)"


def _generate(state: dict[str, Any]) -> str:
    s = state["samples"]
    written = s["total"] - s.get("ungenerated", 0) - s.get("generating", 0)
    rate = state.get("generate", {}).get("rate_per_s")
    return f"{written}/{s['total']} answers written by the target" + (
        f", {rate:.2f} samples/s" if rate else "")


def _samples(state: dict[str, Any]) -> str:
    s, t = state["samples"], state["tokens"]
    rate = state.get("rate", {}).get("tokens_per_s")
    return (f"{s['extracted'] + s['verified']}/{s['total']} samples, "
            f"{_count(t['done'])}/{_count(t['total'])} tokens"
            + (f", {rate:,.0f} tokens/s" if rate else ""))


def _verify(state: dict[str, Any]) -> str:
    v, s = state.get("verify", {}), state["samples"]
    checked = f"{v['done']}/{v['total']} checked in this pass, " if v.get("total") else ""
    return f"{checked}{s['verified']}/{s['total']} samples verified"


def _train(state: dict[str, Any]) -> str:
    t = state.get("trainer", {})
    if t.get("status") == "evaluating":
        return "evaluating the drafter on held-out prompts"
    if "step" not in t:
        return f"trainer {t.get('status', 'starting')}"
    out = f"step {t['step']}/{t.get('total_steps', '?')}"
    if t.get("loss") is not None:
        out += f", loss {t['loss']:.3f}"
    if t.get("acc"):  # one per TTT step
        out += ", accuracy " + "/".join(f"{a:.2f}" for a in t["acc"])
    return out + (f", {t['tokens_per_s']:,.0f} tokens/s" if t.get("tokens_per_s") else "")


def _done(state: dict[str, Any]) -> str:
    accepted = state.get("trainer", {}).get("acceptance_length")
    return "drafter exported" + (f", acceptance length {accepted:.3f}" if accepted else "")


_BODY = {"plan": _plan, "generate": _generate, "extract": _samples, "verify": _verify,
         "train": _train, "done": _done}
