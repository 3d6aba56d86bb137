"""`eagle3ctl status` of a sharded dataset: one line per shard, from the state file each shard
published in its folder under the shared dataset root (never another node's ledger)."""

from __future__ import annotations

import time
from typing import Any

from eagle3d.statemachine import layout, shards
from eagle3d.statemachine.config_schema import Config, human_bytes
from eagle3d.statemachine.statefile import read_state


def collect(cfg: Config) -> list[dict[str, Any]]:
    now = time.time()
    out = []
    for name, folder in shards.all_folders(shards.root_of(cfg.paths.dataset_dir),
                                           cfg.shard.count):
        state, problem = read_state(folder, layout.published_state(folder))
        st = state or {}
        beat = st.get("daemon", {}).get("heartbeat")
        out.append({"name": name, "stage": st.get("stage", "not started"),
                    "underlying": st.get("underlying"), "reason": st.get("reason", problem or ""),
                    # What eagle3ctl's exit code judges a shard by (ctl.shard_problem).
                    "alive": st.get("daemon", {}).get("alive", False), "gate": st.get("gate", {}),
                    "paused_by": st.get("paused_by"),
                    "config_problem": st.get("config", {}).get("problem"),
                    "samples": st.get("samples", {}), "rate": st.get("rate", {}),
                    "eta_s": st.get("eta_s"), "disk": st.get("disk", []),
                    "heartbeat_age_s": None if beat is None else round(now - beat, 2),
                    "published": state is not None, "folder": str(folder),
                    "manifest": layout.manifest_file(folder).is_file()})
    return out


def render(view: list[dict[str, Any]]) -> list[str]:
    lines = []
    for sh in view:
        s, rate = sh["samples"], sh["rate"]
        free = min((x["free"] for x in sh["disk"]), default=None)
        beat = sh["heartbeat_age_s"]
        eta = sh["eta_s"]
        lines.append(
            f"shard     {sh['name']}: {sh['stage']} · {s.get('verified', 0):,}/"
            f"{s.get('total', 0):,} verified · {rate.get('samples_per_s', 0):.2f} samples/s · "
            f"ETA {'-' if eta is None else f'{eta:.0f} s'} · "
            f"{'-' if free is None else human_bytes(free)} free · heartbeat "
            f"{'never' if beat is None else f'{beat:.0f} s ago'}"
            f"{' · manifest published' if sh['manifest'] else ''}"
            f"{' · ' + sh['problem'] if sh.get('problem') else ''}")
    return lines
