"""The command line refuses bad arguments with a usage error naming the argument, the value and what is allowed
(never a traceback, never a run), and ``keygroups verify`` reads every file of a checkpoint."""

from __future__ import annotations

import pathlib
import shutil
import subprocess
import sys

import pytest

DATA = pathlib.Path(__file__).parent / "data"


def keygroups(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "keygroups", *map(str, args)], capture_output=True, text=True,
                          timeout=120)


@pytest.fixture(params=["keyed-checkpoint-v1", "operator-checkpoint-v1"])
def checkpoint(request, tmp_path):
    """A copy of a checkpoint written by keygroups (keyed state; operator state)."""
    shutil.copytree(DATA / request.param / "chk-1", tmp_path / "chk-1")
    return tmp_path


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
    result = keygroups("demo", *args)
    assert result.returncode == 2
    assert message in result.stderr
    assert "Traceback" not in result.stderr and result.stdout == ""


def test_demo_refuses_a_parallelism_above_max_parallelism():
    result = keygroups("demo", "--phases", "4,200")
    assert result.returncode != 0
    assert "--phases: parallelism 200 is outside [1, --max-parallelism=128]" in result.stderr
    assert "Traceback" not in result.stderr


def flip_a_byte(path: pathlib.Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(data)


def test_verify_reads_every_file_and_reports_corruption_by_name(checkpoint):
    good = keygroups("verify", checkpoint)
    files = sorted(p for p in (checkpoint / "chk-1").iterdir() if p.name != "_metadata")
    assert good.returncode == 0, good.stderr
    assert good.stdout.strip() == f"checkpoint 1: {len(files)} files read, 0 corrupt or missing"
    flip_a_byte(files[0])
    bad = keygroups("verify", checkpoint)
    assert bad.returncode == 1
    assert "CORRUPT" in bad.stderr and files[0].name in bad.stderr and "checksum" in bad.stderr
    assert bad.stdout.strip() == f"checkpoint 1: {len(files)} files read, 1 corrupt or missing"
    files[1].unlink()
    worse = keygroups("verify", checkpoint)
    assert worse.returncode == 1 and files[1].name in worse.stderr
    assert worse.stdout.strip() == f"checkpoint 1: {len(files)} files read, 2 corrupt or missing"


@pytest.mark.parametrize("args, message", [
    (["plan", "{dir}", "0"], "argument parallelism: 0 is below 1"),
    (["plan", "{dir}", "x"], "argument parallelism: 'x' is not a whole number"),
    (["inspect", "{dir}", "--checkpoint", "-1"], "argument --checkpoint: -1 is below 0"),
    (["verify", "{dir}", "--checkpoint", "-1"], "argument --checkpoint: -1 is below 0"),
])
def test_inspect_plan_and_verify_refuse_bad_arguments(checkpoint, args, message):
    result = keygroups(*[a.format(dir=checkpoint) for a in args])
    assert result.returncode == 2 and message in result.stderr and "Traceback" not in result.stderr


def test_errors_about_the_location_name_it_without_a_traceback(checkpoint):
    above = keygroups("plan", checkpoint, "129")
    assert above.returncode == 2 and "parallelism 129 is above checkpoint 1's max parallelism" in above.stderr
    scheme = keygroups("inspect", "nosuchscheme://bucket/x")
    assert scheme.returncode == 2 and "keygroups inspect: " in scheme.stderr and "nosuchscheme" in scheme.stderr
    (checkpoint / "chk-7" / "_metadata").mkdir(parents=True)
    directory = keygroups("inspect", checkpoint, "--checkpoint", "7")
    assert directory.returncode == 2 and "_metadata" in directory.stderr
    missing = keygroups("verify", checkpoint, "--checkpoint", "9")
    assert missing.returncode == 2 and "checkpoint 9 does not exist" in missing.stderr
    for result in (above, scheme, directory, missing):
        assert "Traceback" not in result.stderr
