"""The state file's facts as Prometheus metrics, in the text format node_exporter's textfile
collector reads: `eagle3d_` names, base units (seconds, bytes, ratios), a run label on every
series and a shard label where the run is sharded. Rendered from the snapshot that state.toml
publishes, so the two never disagree, and written by the atomic writer (a scrape sees the last
file or the new one, never half of one).

The daemon never imports prometheus_client: the format is a few lines of text, and the daemon
stays light (tests parse what this writes with prometheus_client's own parser)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Iterator

from eagle3d.statemachine.atomic import atomic_write_bytes
from eagle3d.statemachine.ledger import STATUSES
from eagle3d.statemachine.stages import ORDER
from eagle3d.statemachine.version import VERSION

# Every stage a state file can name: the pipeline's, and the daemon's own conditions.
STAGES = (*ORDER, "paused", "failed", "switching", "stopping", "stopped")
CHILDREN = ("planner", "generate", "engine", "trainer")
Sample = tuple[str, dict[str, str], float]  # name, its own labels, value


def render(state: dict[str, Any], shard: str = "") -> str:
    """The metrics of one state snapshot (daemon/snapshot.py), as the text exposition format."""
    base = {"run": str(state.get("run", {}).get("id", ""))}
    if shard:
        base["shard"] = shard
    families: dict[str, list[str]] = {}  # the format wants each family's lines together
    for name, labels, value in _samples(state):
        if not isinstance(value, (int, float)) or not math.isfinite(value):
            continue  # a figure not known yet (no rate before the first dump) is left out
        family = name.removesuffix("_total")
        lines = families.setdefault(family, [
            f"# HELP {family} {HELP[family]}",
            f"# TYPE {family} {'counter' if name.endswith('_total') else 'gauge'}"])
        lines.append(f"{name}{{{_labels({**base, **labels})}}} {_number(value)}")
    out = [line for lines in families.values() for line in lines]
    return "\n".join(out) + "\n"


def write(path: Path, state: dict[str, Any], shard: str = "") -> None:
    """Replace the textfile whole, readable by node_exporter (mode 0644: it runs as its own
    user, and nothing in it is secret that `eagle3ctl status` does not already show). Not
    fsynced: it is rewritten every second, and two fsyncs a second on node_exporter's disk would
    tie the loop to that disk's latency for figures the next second replaces."""
    atomic_write_bytes(path, render(state, shard).encode(), mode=0o644, durable=False)


def _samples(state: dict[str, Any]) -> Iterator[Sample]:
    daemon, gate = state.get("daemon", {}), state.get("gate", {})
    yield "eagle3d_build_info", {"version": VERSION}, 1
    yield "eagle3d_up", {}, 1 if daemon.get("alive") else 0
    yield "eagle3d_heartbeat_timestamp_seconds", {}, daemon.get("heartbeat")
    yield "eagle3d_start_time_seconds", {}, daemon.get("started")
    for stage in STAGES:
        yield "eagle3d_stage", {"stage": stage}, 1 if state.get("stage") == stage else 0
    yield "eagle3d_stage_since_timestamp_seconds", {}, state.get("since")
    yield "eagle3d_waiting_for_operator", {}, 1 if _waits_for_operator(state) else 0
    yield "eagle3d_config_refused", {}, 1 if state.get("config", {}).get("problem") else 0
    stale = state.get("state_stale")
    yield "eagle3d_loop_condition", {}, 1 if state.get("condition") or stale else 0
    yield ("eagle3d_state_not_written", {"reason": stale["problem"] if stale else ""},
           1 if stale else 0)
    yield "eagle3d_gate_open", {}, 1 if gate.get("open") else 0
    samples = state.get("samples", {})
    for status in (*STATUSES, "skipped"):
        yield "eagle3d_samples", {"status": status}, samples.get(status, 0)
    yield "eagle3d_tokens_done", {}, state.get("tokens", {}).get("done")
    yield "eagle3d_tokens_planned", {}, state.get("tokens", {}).get("total")
    yield "eagle3d_ingest_tokens_per_second", {}, state.get("rate", {}).get("tokens_per_s")
    yield "eagle3d_eta_seconds", {}, state.get("eta_s")
    written = state.get("bytes", {})
    yield "eagle3d_dataset_written_bytes", {}, written.get("written")
    yield "eagle3d_dataset_projected_bytes", {}, written.get("projected")
    yield "eagle3d_spool_bytes", {}, written.get("spool")
    for disk in state.get("disk", []):
        where = {"role": str(disk["role"]), "path": str(disk["path"])}
        yield "eagle3d_disk_free_bytes", where, disk.get("free")
        yield "eagle3d_disk_size_bytes", where, disk.get("total")
    for child in CHILDREN:
        if child in state:
            yield ("eagle3d_child_restart_budget_used", {"child": child},
                   state[child].get("restarts"))
            yield ("eagle3d_child_restarts_total", {"child": child},
                   state[child].get("restarts_total"))
    yield from _trainer(state.get("trainer", {}))


def _trainer(trainer: dict[str, Any]) -> Iterator[Sample]:
    yield "eagle3d_train_step", {}, trainer.get("step")
    yield "eagle3d_train_steps_planned", {}, trainer.get("total_steps")
    yield "eagle3d_train_loss", {}, trainer.get("loss")
    for k, acc in enumerate(trainer.get("acc") or []):
        yield "eagle3d_train_accuracy_ratio", {"ttt_step": str(k)}, acc
    yield "eagle3d_train_tokens_per_second", {}, trainer.get("tokens_per_s")
    yield "eagle3d_train_data_wait_ratio", {}, trainer.get("data_wait")
    yield "eagle3d_acceptance_length", {}, trainer.get("acceptance_length")


def _waits_for_operator(state: dict[str, Any]) -> bool:
    """What only a person can end: a failed pipeline, a budget's pause, a gate held by failed
    samples, a refused reload. An operator's own pause waits for nobody else."""
    return (state.get("stage") == "failed" or state.get("paused_by") == "budget"
            or bool(state.get("gate", {}).get("waits_for_operator"))
            or bool(state.get("config", {}).get("problem")))


def _labels(labels: dict[str, str]) -> str:
    return ",".join(f'{k}="{_escape(v)}"' for k, v in labels.items())


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _number(value: float) -> str:
    return repr(float(value)) if isinstance(value, float) else str(int(value))


HELP = {
    "eagle3d_build_info": "eagle3d's version (always 1)",
    "eagle3d_up": "1 while the daemon runs; 0 in the state it leaves when it stops",
    "eagle3d_heartbeat_timestamp_seconds": "when the daemon last published (Unix time)",
    "eagle3d_start_time_seconds": "when the daemon started (Unix time)",
    "eagle3d_stage": "1 for the stage the pipeline is in, 0 for the others",
    "eagle3d_stage_since_timestamp_seconds": "when the pipeline entered its stage (Unix time)",
    "eagle3d_waiting_for_operator": "1 when only a person can move the pipeline on",
    "eagle3d_config_refused": "1 while the last reload was refused (the old config in force)",
    "eagle3d_loop_condition": ("1 while the loop's ticks fail and are retried, or the state file "
                               "cannot be written (status exit 9)"),
    "eagle3d_state_not_written": ("1 while the state file cannot be written (its disk read-only or "
                                  "full), the reason in its label; the metrics stay fresh"),
    "eagle3d_gate_open": "1 once every sample is verified or excluded (training may start)",
    "eagle3d_samples": "samples of the run's ledger by status",
    "eagle3d_tokens_done": "tokens of the samples extracted or verified",
    "eagle3d_tokens_planned": "tokens of every planned sample",
    "eagle3d_ingest_tokens_per_second": "tokens per second ingested, recent",
    "eagle3d_eta_seconds": "seconds the current stage still needs, estimated",
    "eagle3d_dataset_written_bytes": "bytes of the run's dataset files",
    "eagle3d_dataset_projected_bytes": "bytes the run's dataset will hold when complete",
    "eagle3d_spool_bytes": "bytes of dumps waiting in the spool",
    "eagle3d_disk_free_bytes": "free bytes of each file system the run writes",
    "eagle3d_disk_size_bytes": "size of each file system the run writes",
    "eagle3d_child_restart_budget_used": "restarts counted against the child's limit now",
    "eagle3d_child_restarts": "the child's restarts since the daemon started",
    "eagle3d_train_step": "the trainer's last step",
    "eagle3d_train_steps_planned": "steps the training will take",
    "eagle3d_train_loss": "the trainer's recent loss",
    "eagle3d_train_accuracy_ratio": "the trainer's top-1 accuracy at each draft (TTT) step",
    "eagle3d_train_tokens_per_second": "tokens per second trained, recent",
    "eagle3d_train_data_wait_ratio": "share of the trainer's recent time spent waiting for data",
    "eagle3d_acceptance_length": "the exported drafter's acceptance length on held-out prompts",
}
