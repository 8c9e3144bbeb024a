"""The guides run as written: each guide's ```python blocks, in order, in one namespace, on the shared Spark session
(blocks marked ```python no-run are skipped, and must stay few). docs/guide.md walks through the API;
docs/streaming-job.md builds a streaming job from a file source to a cluster. tests/test_typing.py type-checks the
same blocks."""

from __future__ import annotations

import pathlib
import re

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


def test_every_python_block_of_the_guide_runs_in_order(spark):
    assert len(python_blocks(GUIDE.read_text(encoding="utf-8"))[0]) >= 8
    namespace = run_guide(GUIDE)
    assert namespace["spark"] is spark   # the guide's getOrCreate() found the shared session


def test_the_streaming_job_page_runs_in_order(spark):
    namespace = run_guide(STREAMING_JOB)
    assert namespace["spark"] is spark
    assert len(namespace["sessions"]) == 4   # four sessions ended, the late click reached none of them
