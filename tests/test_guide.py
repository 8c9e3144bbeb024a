"""The guides run as written: each guide's ```python blocks, in order, in one namespace, on the shared Spark session
(blocks marked ```python no-run are skipped, and must stay few). docs/guide.md walks through the API;
docs/streaming-job.md builds a streaming job from a file source to a cluster. tests/test_typing.py type-checks the
same blocks."""

from __future__ import annotations

import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile

import pytest

pytestmark = pytest.mark.spark

DOCS = pathlib.Path(__file__).parents[1] / "docs"
GUIDE = DOCS / "guide.md"
STREAMING_JOB = DOCS / "streaming-job.md"
#: Every guide whose Python runs (here) and type-checks (tests/test_typing.py).
GUIDES = (GUIDE, STREAMING_JOB)
#: A fenced block: its info string and its body (fences of three backticks at the start of a line).
FENCE = re.compile(r"^```([^\n`]*)\n(.*?)^```[ \t]*$", re.MULTILINE | re.DOTALL)
MAX_SKIPPED = 2


def python_blocks(text: str) -> tuple[list[tuple[int, str]], int]:
    """The runnable python blocks as (line number, source), and how many python blocks are marked no-run."""
    runnable, skipped = [], 0
    for m in FENCE.finditer(text):
        info = m.group(1).split()
        if not info or info[0] != "python":
            continue
        if "no-run" in info[1:]:
            skipped += 1
        else:
            runnable.append((text.count("\n", 0, m.start(2)) + 1, m.group(2)))
    return runnable, skipped


def file_block(text: str, name: str) -> str:
    """The body of the fenced block whose info string names ``file=<name>`` (a script the guide shows whole)."""
    for m in FENCE.finditer(text):
        if f"file={name}" in m.group(1).split():
            return m.group(2)
    raise LookupError(f"no block with file={name}")


def padded_source(text: str) -> str:
    """The runnable blocks as one module, each at its line in the guide (so messages name the guide's lines)."""
    source = ""
    for line, block in python_blocks(text)[0]:
        source += "\n" * (line - 1 - source.count("\n")) + block
    return source


def run_guide(path: pathlib.Path) -> dict:
    """Run a guide's blocks in order in one fresh namespace; the namespace afterwards."""
    blocks, skipped = python_blocks(path.read_text(encoding="utf-8"))
    assert skipped <= MAX_SKIPPED
    namespace: dict = {"__name__": "__guide__"}   # not importable: cloudpickle ships the guide's classes by value
    for line, source in blocks:
        # padded to the block's place, so a failure's traceback names the guide's own line
        exec(compile("\n" * (line - 1) + source, str(path), "exec"), namespace)
    return namespace


def test_the_fence_parser_finds_blocks_and_skips_no_run():
    text = "x\n```python\na = 1\n```\n```sh\nls\n```\n```python no-run\nb = 2\n```\n```python\nc = a\n```\n"
    assert python_blocks(text) == ([(3, "a = 1\n"), (12, "c = a\n")], 1)
    assert padded_source(text) == "\n\na = 1\n" + "\n" * 8 + "c = a\n"


@pytest.fixture
def guide_tempdir(tmp_path, monkeypatch):
    """The guides make their working directory with ``tempfile.mkdtemp``, as a reader's script would: here in
    pytest's directory, so that a run leaves nothing in /tmp."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))


def test_every_python_block_of_the_guide_runs_in_order(spark, guide_tempdir):
    assert len(python_blocks(GUIDE.read_text(encoding="utf-8"))[0]) >= 8
    namespace = run_guide(GUIDE)
    assert namespace["spark"] is spark   # the guide's getOrCreate() found the shared session


def test_the_streaming_job_page_runs_in_order(spark, guide_tempdir):
    namespace = run_guide(STREAMING_JOB)
    assert namespace["spark"] is spark
    assert len(namespace["sessions"]) == 4   # four sessions ended, the late click reached none of them


CLICKS = [("ann", "2026-11-23T09:00:00Z"), ("bob", "2026-11-23T09:01:00Z"), ("ann", "2026-11-23T09:02:00Z"),
          ("eve", "2026-11-23T09:30:00Z")]
START_MS = 1_795_424_400_000   # 2026-11-23 09:00 UTC in epoch ms


def _spark_submit(tmp_path: pathlib.Path, *options: str) -> list[tuple[str, int, int]]:
    """The page's deployment script through ``spark-submit --master local-cluster[2,1,1024]`` (a master and two
    executors, each its own JVM with its own Python workers; only the directories on the command line are shared)
    over one file of ``CLICKS``: the sessions it wrote."""
    import pyarrow.parquet as pq
    import pyspark

    script = tmp_path / "sessions_job.py"
    script.write_text(file_block(STREAMING_JOB.read_text(encoding="utf-8"), "sessions_job.py"))
    incoming = tmp_path / "incoming"
    incoming.mkdir()
    (incoming / "clicks.json").write_text("".join(json.dumps({"user": u, "page": "home", "ts": t}) + "\n"
                                                  for u, t in CLICKS))
    spark_home = os.path.dirname(os.path.abspath(pyspark.__file__))
    env = {**os.environ, "SPARK_HOME": spark_home, "SPARK_LOCAL_IP": "127.0.0.1"}
    env.pop("PYSPARK_PYTHON", None)
    out = tmp_path / "out"
    work = pathlib.Path(spark_home, "work")   # local-cluster's workers keep each application's files there
    before = set(work.iterdir()) if work.is_dir() else set()
    result = None
    try:
        result = subprocess.run(
            [os.path.join(spark_home, "bin", "spark-submit"), "--master", "local-cluster[2,1,1024]",
             "--conf", "spark.ui.enabled=false", "--conf", f"spark.pyspark.driver.python={sys.executable}",
             *options, str(script), str(incoming), str(tmp_path / "query"), str(tmp_path / "state"), str(out)],
            capture_output=True, text=True, timeout=900, env=env, cwd=tmp_path,
        )
    finally:   # this application's directories (an unpacked environment per executor), and no other's: a test
        # running beside this one may have its own local-cluster there, whose executors work in theirs
        ours = set(re.findall(r"\bapp-\d{14}-\d{4}\b", (result.stdout + result.stderr) if result else ""))
        for app in (set(work.iterdir()) if work.is_dir() else set()) - before:
            if app.name in ours:
                shutil.rmtree(app, ignore_errors=True)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    return sorted((r["user"], r["session_end"], r["clicks"]) for r in pq.read_table(out / "batch=0").to_pylist())


#: eve's session (9:30) is still open when the batch ends; ann's and bob's ended at the watermark (9:25).
SESSIONS_ENDED = [("ann", START_MS + 12 * 60_000, 2), ("bob", START_MS + 11 * 60_000, 1)]


@pytest.mark.cluster
@pytest.mark.slow
def test_the_streaming_job_script_runs_under_spark_submit_with_keygroups_installed_on_the_nodes(tmp_path):
    """The executors' Python is this one, where keygroups is installed: the page's first way."""
    assert _spark_submit(tmp_path, "--conf", f"spark.pyspark.python={sys.executable}") == SESSIONS_ENDED


@pytest.mark.cluster
@pytest.mark.slow
def test_the_streaming_job_script_runs_with_keygroups_shipped_as_an_archive(tmp_path, shipped_environment):
    """The page's second way: a virtualenv holding the keygroups wheel (built from this checkout) and its
    dependencies, packed as a .tar.gz and given to ``--archives``; the executors run ``./environment/bin/python``
    from it, a Python that has no other way to import keygroups. (The fixture builds it: see
    tests/background.py, which starts the build in the background when collection ends.)"""
    sessions = _spark_submit(tmp_path, "--archives", f"{shipped_environment}#environment",
                             "--conf", "spark.pyspark.python=./environment/bin/python")
    assert sessions == SESSIONS_ENDED
