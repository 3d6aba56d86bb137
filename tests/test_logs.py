"""A child's log lines under journald: named after the process, with the journal's priority."""

from __future__ import annotations

import os
import subprocess
import sys


def test_a_warning_is_a_log_line_of_its_process_at_warning_priority():
    code = ("import warnings\n"
            "from eagle3d.statemachine.logs import setup_logging\n"
            "setup_logging('trainer')\n"
            "warnings.warn('training attention materialises its scores')\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env={**os.environ, "JOURNAL_STREAM": "8:1"}, timeout=60, check=True)
    [line] = done.stderr.splitlines()
    assert line.startswith("<4>trainer: ")
    assert line.endswith("UserWarning: training attention materialises its scores")


def log_a_line(env: dict[str, str]) -> str:
    code = ("import logging\n"
            "from eagle3d.statemachine.logs import setup_logging\n"
            "setup_logging('daemon')\n"
            "logging.getLogger('eagle3d').info('stage extract: 3 samples to extract')\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env={k: v for k, v in {**os.environ, **env}.items() if v is not None},
                          timeout=60, check=True)
    [line] = done.stderr.splitlines()
    return line


def test_a_line_outside_the_journal_carries_its_date_and_zone():
    """A SLURM job's log of several days: a time without a date cannot be placed."""
    import re
    line = log_a_line({"JOURNAL_STREAM": None, "EAGLE3D_LOG_FORMAT": None})
    assert re.match(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d[+-]\d{4} INFO    daemon: stage extract",
                    line), line


def test_the_json_format_is_one_object_a_line_for_log_collectors():
    import json
    record = json.loads(log_a_line({"JOURNAL_STREAM": "8:1", "EAGLE3D_LOG_FORMAT": "json"}))
    assert record["level"] == "info" and record["process"] == "daemon"
    assert record["message"] == "stage extract: 3 samples to extract"
    assert record["time"][:4].isdigit() and "T" in record["time"]
