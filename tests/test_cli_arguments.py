"""The command line refuses bad arguments with a usage error naming the argument, the value and what is allowed:
never a traceback, never a run."""

from __future__ import annotations

import subprocess
import sys

import pytest


@pytest.mark.parametrize("args, message", [
    (["--users", "0"], "argument --users: 0 is below 1; give a whole number >= 1"),
    (["--partitions", "0"], "argument --partitions: 0 is below 1"),
    (["--batches-per-phase", "0"], "argument --batches-per-phase: 0 is below 1"),
    (["--events", "-5"], "argument --events: -5 is below 1"),
    (["--events", "many"], "argument --events: 'many' is not a whole number"),
    (["--phases", "4,x"], "argument --phases: '4,x' is not a comma-separated list of whole numbers, e.g. 4,2,8"),
    (["--phases", "4,0"], "argument --phases: parallelism 0 is below 1 in '4,0'"),
    (["--max-parallelism", "0"], "argument --max-parallelism: 0 is below 1"),
    (["--max-parallelism", "40000"], "argument --max-parallelism: 40000 is above 32768"),
])
def test_demo_refuses_bad_arguments_with_a_usage_error(args, message):
    result = subprocess.run([sys.executable, "-m", "keygroups", "demo", *args], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 2
    assert message in result.stderr
    assert "Traceback" not in result.stderr and result.stdout == ""


def test_demo_refuses_a_parallelism_above_max_parallelism():
    result = subprocess.run([sys.executable, "-m", "keygroups", "demo", "--phases", "4,200"], capture_output=True,
                            text=True, timeout=120)
    assert result.returncode != 0
    assert "--phases: parallelism 200 is outside [1, --max-parallelism=128]" in result.stderr
    assert "Traceback" not in result.stderr
