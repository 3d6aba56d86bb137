"""Smoke runs of the bench scripts at tiny sizes, as whole processes: each finishes, prints its
judged figure last, and leaves nothing behind. No timing is asserted (the figures are only
meaningful at full size)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def run_bench(script: str, *args: str, timeout: float = 300) -> list[str]:
    out = subprocess.run([sys.executable, str(ROOT / "bench" / script), *args], cwd=ROOT,
                         capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip().splitlines()


def ratio(line: str, label: str) -> float:
    match = re.match(rf"{re.escape(label)}.*?: (\d+\.\d+) \(goal", line)
    assert match, f"last line is not the judged ratio: {line!r}"
    return float(match.group(1))


@pytest.fixture
def shm():
    folder = Path("/dev/shm") / f"eagle3d-test-bench-{uuid.uuid4().hex[:8]}"
    folder.mkdir()
    yield folder
    os.rmdir(folder)  # fails the test if the bench left its spool behind


def test_ingest_bench_ratio_last_and_spool_and_dataset_removed(tmp_path, shm):
    lines = run_bench("ingest.py", "--quick", "--dir", str(tmp_path), "--spool-dir", str(shm),
                      "--also-threads", "3")
    assert ratio(lines[-1], "ingest/cp throughput ratio") > 0
    assert any(line.startswith("experiment: ingest x3/cp") for line in lines)
    rounds = [line for line in lines if re.match(r"\s+\d+\s", line)]
    assert len(rounds) == 2 and all(len(r.split()) == 5 for r in rounds)  # round + 4 arms
    assert not list(tmp_path.iterdir()) and not list(shm.iterdir())


def test_status_bench_runs_under_a_live_ingest_load(tmp_path, shm):
    lines = run_bench("status.py", "--quick", "--dir", str(tmp_path), "--spool-dir", str(shm))
    assert ratio(lines[-1], "eagle3ctl status / python -c pass") > 0
    loaded = next(line for line in lines if line.startswith("meanwhile the load ingested"))
    assert float(loaded.split()[4]) > 0, "the background ingest load ingested nothing"
    assert not list(tmp_path.iterdir()) and not list(shm.iterdir())
    lines = run_bench("status.py", "--quick", "--idle", "--dir", str(tmp_path), "--spool-dir",
                      str(shm))
    assert "pairs at rest" in lines[-1] and ratio(lines[-1], "eagle3ctl status / python") > 0
    assert not any(line.startswith("meanwhile the load ingested") for line in lines)


def test_verify_and_ledger_benches_still_run(tmp_path):
    lines = run_bench("verify.py", "--quick", "--dir", str(tmp_path))
    assert ratio(lines[-1], "verify/cat throughput ratio") > 0
    env_dir = {"BENCH_DIR": str(tmp_path)}
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "ledger.py"), "--sizes",
                          "500,1000", "--rounds", "1", "--batch", "100"], cwd=ROOT,
                         capture_output=True, text=True, timeout=300,
                         env={**os.environ, **env_dir})
    assert out.returncode == 0, out.stderr
    assert "status at 1,000 rows" in out.stdout.strip().splitlines()[-1]
    assert not list(tmp_path.iterdir())


def test_generate_bench_prints_the_writer_to_plain_ratio_last():
    lines = run_bench("gpu_generate.py", "--tiny")
    assert ratio(lines[-1], "writer/plain generate throughput ratio") > 0
    assert [line.split(":")[0].strip() for line in lines[:2]] == ["writer", "plain"]


def test_cpu_precision_bench_times_each_kind_of_work_and_prints_the_lowest_ratio_last():
    lines = run_bench("cpu_bf16.py", "--quick")
    assert ratio(lines[-1], "bf16 / float32 throughput, lowest of write, capture, train") > 0
    assert [line.split(" ")[0] for line in lines[1:4]] == ["write", "capture", "train"]


def test_train_bench_compares_fp8_with_bf16_storage_and_prints_the_ratio_last():
    lines = run_bench("gpu_train.py", "--tiny", "--compare-storage", "--seq-lens", "32",
                      "--steps", "2", "--warmup", "1", "--repeats", "2", "--batches", "2")
    assert ratio(lines[-1], "fp8 / bf16 tokens/s, lowest over T=32") > 0
    assert "(goal >= 0.98)" in lines[-1]
    rows = [line.split() for line in lines if re.match(r"\s+32\s", line)]
    assert [row[1] for row in rows] == ["bf16", "fp8"], lines
    assert not any("SpecForge skipped" in line for line in lines)


def test_curves_draws_runs_side_by_side_and_prints_each_runs_figures(tmp_path):
    def metrics(name: str, accs: list[float]) -> Path:
        path = tmp_path / f"{name}.jsonl"
        path.write_text("".join(f'{{"step": {i + 1}, "acc": [{a}, 0.1]}}\n'
                                for i, a in enumerate(accs)))
        return path
    short = metrics("short", [0.1] * 60 + [0.4] * 50)
    long = metrics("long", [0.2] * 200)
    held_out = tmp_path / "eval.json"
    held_out.write_text('{"teacher_forced_accuracy": [0.35, 0.2], "acceptance_length": 1.7}')
    png = tmp_path / "curves.png"
    lines = run_bench("curves.py", str(png), "two runs", f"short={short},{held_out}",
                      f"long={long}")
    assert lines == ["short: 110 steps, first-draft training accuracy over the last 50 steps "
                     "0.400, held out 0.350 (teacher-forced); acceptance length 1.700",
                     "long: 200 steps, first-draft training accuracy over the last 50 steps 0.200"]
    assert png.stat().st_size > 10_000


def test_shard_status_bench_times_the_training_nodes_status(tmp_path):
    lines = run_bench("shard_status.py", "--quick", "--dir", str(tmp_path))
    assert ratio(lines[-1], "eagle3ctl status over 3 shards x 2,000 samples") > 0
    assert not list(tmp_path.iterdir())


@pytest.mark.slow
def test_shards_bench_runs_all_four_daemons_and_judges_nothing_from_a_smoke_run(tmp_path, shm):
    """The bench runs on any machine before a 16-core machine's time is spent on it: one daemon
    and three shards, ballast on the cores of a shard that finished first."""
    lines = run_bench("shards.py", "--quick", "--dir", str(tmp_path), "--spool-dir", str(shm),
                      timeout=900)
    assert lines[-1].endswith("(goal <= 0.4: smoke run, too small to judge)"), lines[-1]
    assert [line.split(maxsplit=2)[:2] for line in lines[1:4]] == \
        [["shard", str(i)] for i in range(3)] and lines[0].startswith("single ")
    shares = [float(line.split(", ")[1].split("%")[0]) for line in lines[1:4]]
    assert abs(sum(shares) - 100) < 0.5
    # Each daemon's fixed start and pace, from its ledger: what separates cost from split.
    assert all(" first dump after " in line and line.endswith(" tokens/s)") for line in lines[:4])
    assert not list(tmp_path.iterdir()) and not list(shm.iterdir())
