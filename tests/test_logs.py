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
