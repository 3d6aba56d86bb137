"""bench/gpu_train.py at a tiny shape on CPU, as whole processes: it trains, prints its table,
says when SpecForge is missing, and finds our package even where the editable install is not
there (the GPU machine). No timing is asserted."""

from __future__ import annotations

import importlib.util
import math
import re
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "bench" / "gpu_train.py"
ROW = re.compile(r"^\s*(\d+)\s+ours\s+(\d+)\s+(\d+\.\d+)\s+(\d+\.\d+)\s+(\d+\.\d+)$")


def run(*args: str, python: list[str] | None = None, env: dict | None = None,
        cwd: Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run([*(python or [sys.executable]), *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300)


def test_tiny_run_trains_ours_and_says_specforge_was_skipped():
    if importlib.util.find_spec("specforge") is not None:
        pytest.skip("specforge is installed here: the comparison would run instead")
    out = run(str(SCRIPT), "--tiny", "--steps", "2", "--warmup", "1", "--repeats", "1",
              "--batches", "2")
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.strip().splitlines()
    rows = {int(m.group(1)): m for m in map(ROW.match, lines) if m}
    assert sorted(rows) == [32, 64], out.stdout
    for m in rows.values():
        assert int(m.group(2)) > 0 and math.isfinite(float(m.group(4))) and float(m.group(4)) > 0
        # MFU against the bf16 matmul peak measured in the run (on CPU the model trains in
        # float32, which can outrun CPU bf16 matmuls: no upper bound here)
        assert float(m.group(5)) > 0
    assert re.search(r"MFU: .* measured here, [\d.e+-]+ TFLOP/s", out.stdout), out.stdout
    assert lines[-1].startswith("comparison with SpecForge skipped (ModuleNotFoundError")


def test_the_kimi_shape_is_selectable_and_not_with_tiny():
    out = run(str(SCRIPT), "--tiny", "--shape", "kimi-k2.5")
    assert out.returncode == 2 and "give --tiny or --shape" in out.stderr
    sys.path.insert(0, str(SCRIPT.parent))
    import gpu_train
    kimi = gpu_train.SHAPES["kimi-k2.5"]
    assert (kimi.hidden, kimi.intermediate, kimi.heads, kimi.kv_heads, kimi.head_dim) == (
        7168, 18432, 64, 64, 128)
    cfg = gpu_train.draft_config(kimi, 4096)
    assert cfg.rope_parameters["rope_theta"] == 1e6 and cfg.draft_vocab_size == 32000


def test_bad_lengths_are_refused_with_a_reason():
    out = run(str(SCRIPT), "--tiny", "--seq-lens", "4", "--no-specforge")
    assert out.returncode == 2
    assert "sequence lengths must exceed --ttt 7" in out.stderr


def test_finds_eagle3d_without_the_editable_install(tmp_path):
    """`python -S` skips the .pth files, so only the site-packages on PYTHONPATH (torch, ...)
    are there and `eagle3d` is not: the script maps the repo's folders itself, as pyproject
    does, and removes its temporary folder at exit."""
    probe = ("import importlib, os, sys; sys.path.insert(0, sys.argv[1]); import gpu_train; "
             "print(*[os.path.realpath(importlib.import_module(f'eagle3d.{p}').__path__[0]) "
             "for p in ('statemachine', 'daemon', 'capture', 'drafter')])")
    env = {"PYTHONPATH": sysconfig.get_paths()["purelib"], "PATH": "/usr/bin:/bin"}
    out = run("-c", probe, str(ROOT / "bench"), python=[sys.executable, "-S"], env=env,
              cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    note = re.search(r"eagle3d is not installed: importing it from (\S+) through (\S+)",
                     out.stderr)
    assert note and Path(note.group(1)) == ROOT, out.stderr
    mapped = [Path(p).resolve() for p in out.stdout.split()]
    assert mapped == [ROOT / "statemachine", ROOT / "daemon", ROOT / "capture", ROOT / "drafter"]
    assert not Path(note.group(2)).exists()  # removed at exit


def test_a_stored_feed_holds_the_dump_encoding_on_the_host_and_decodes_it_per_step():
    """--compare-storage's fp8 run really trains on fp8: the batch it keeps is e4m3 with its
    scales, and what a step trains on is that, decoded (close to the bf16 states, not them)."""
    sys.path.insert(0, str(SCRIPT.parent))
    import gpu_train
    cpu, tiny = torch.device("cpu"), gpu_train.TINY
    batch = gpu_train.random_batches(tiny, 32, 1, cpu)[0]
    target = gpu_train.random_target(tiny, cpu)
    weights = gpu_train.initial_weights(tiny, target, 40, cpu)
    trainer = gpu_train.StoredTrainer("float8_e4m3fn", tiny, target, weights, 40, 0.0, 3, cpu)
    trainer.prepare([batch])
    stored = trainer.stored[id(batch)]
    assert stored.states["aux_hidden_states"].dtype == torch.float8_e4m3fn
    assert stored.states["aux_hidden_states_scale"].shape == (1, 32, 3)
    fed = stored.to(cpu)
    error = (fed.aux.float() - batch.aux.float()).norm() / batch.aux.float().norm()
    assert 0 < error < 2 ** -4
    assert torch.equal(fed.targets, batch.targets) and fed.tokens == 32
    assert math.isfinite(trainer.step(batch).item())


def test_profile_says_where_a_step_spends_its_time_by_kind_and_kernel():
    out = run(str(SCRIPT), "--tiny", "--profile", "--seq-lens", "32", "--steps", "2",
              "--warmup", "1", "--batches", "1")
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.splitlines()
    head = next(i for i, line in enumerate(lines) if line.startswith("T=32: "))
    total = float(re.match(r"T=32: ([\d.]+) ms of operators per step", lines[head]).group(1))
    kinds = [re.match(r"^  (\S.*?)\s+([\d.]+) ms\s+([\d.]+)%$", line)
             for line in lines[head + 1:] if re.match(r"^  \S", line)]
    assert {m.group(1) for m in kinds} >= {"matmul"}
    assert sum(float(m.group(2)) for m in kinds) == pytest.approx(total, rel=0.01)
    assert sum(float(m.group(3)) for m in kinds) == pytest.approx(100, abs=0.5)
    top = [line for line in lines[head + 1:] if line.startswith("    ")]
    assert 0 < len(top) <= 15 and any("aten::mm" in line for line in top)


def test_kernels_are_told_apart_by_kind():
    sys.path.insert(0, str(SCRIPT.parent))
    import gpu_train
    kinds = {name: gpu_train.kernel_kind(name) for name in (
        "nvjet_tst_256x128_64x4_1x2_h_bz_coopA_NTN", "triton_tem_fused_0",
        "triton_tem_fused_mm_3", "triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_1",
        "void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>>",
        "Memcpy HtoD (Pinned -> Device)", "void flash::flash_fwd_kernel<...>",
        "cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16_knob_26_64x64x128_1x4x1")}
    assert list(kinds.values()) == ["matmul", "fused (compiled)", "matmul", "fused (compiled)",
                                    "elementwise / reduction", "copy", "attention", "attention"]


def test_idle_gaps_are_the_spaces_between_kernels_longest_first():
    sys.path.insert(0, str(SCRIPT.parent))
    import gpu_train
    span, gaps = gpu_train.idle_gaps([(10.0, 12.0, "b"), (0.0, 4.0, "a"), (12.0, 13.0, "c"),
                                      (20.0, 21.0, "d")])
    assert span == 21.0
    assert gaps == [gpu_train.Gap(7.0, "c", "d"), gpu_train.Gap(6.0, "a", "b")]
    assert gpu_train.idle_gaps([]) == (0.0, [])
