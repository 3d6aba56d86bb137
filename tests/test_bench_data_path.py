"""bench/data_path.py at a tiny size, as a whole process: it writes a dump dataset, reads it
through the trainer's reader and trains from it, prints the judged ratios last, says how the
page cache was kept out, and leaves nothing behind. No timing is asserted."""

from __future__ import annotations

from test_bench import ratio, run_bench

TINY = ("--tiny", "--steps", "3", "--warmup", "1", "--dataset-gib", "0.002")


def test_trains_from_disk_and_from_memory_and_prints_both_ratios_last(tmp_path):
    lines = run_bench("data_path.py", *TINY, "--dump-dtype", "fp8", "--dir", str(tmp_path))
    assert ratio(lines[-2], "tokens/s from disk / from memory") > 0
    assert ratio(lines[-1], "reader bytes/s / disk sequential bytes/s") > 0
    assert "fp8 dumps" in lines[0] and "posix_fadvise DONTNEED" in lines[0]
    assert any(line.startswith("train from disk:") and "waiting for data" in line
               for line in lines)
    assert not list(tmp_path.iterdir())


def test_several_reader_processes_each_read_their_share_and_report_the_aggregate(tmp_path):
    lines = run_bench("data_path.py", *TINY, "--dump-dtype", "bf16", "--readers", "3",
                      "--dir", str(tmp_path))
    assert ratio(lines[-1], "reader bytes/s / disk sequential bytes/s, 3 processes") > 0
    assert lines[-2].startswith("3 processes, each its rank's share")
    assert not list(tmp_path.iterdir())
