"""docs/guide.md runs as written: its ```python blocks, in order, in one namespace, on the shared Spark session
(blocks marked ```python no-run are skipped, and must stay few)."""

from __future__ import annotations

import pathlib
import re

import pytest

pytestmark = pytest.mark.spark

GUIDE = pathlib.Path(__file__).parents[1] / "docs" / "guide.md"
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


def test_the_fence_parser_finds_blocks_and_skips_no_run():
    text = "x\n```python\na = 1\n```\n```sh\nls\n```\n```python no-run\nb = 2\n```\n```python\nc = a\n```\n"
    assert python_blocks(text) == ([(3, "a = 1\n"), (12, "c = a\n")], 1)


def test_every_python_block_of_the_guide_runs_in_order(spark):
    blocks, skipped = python_blocks(GUIDE.read_text(encoding="utf-8"))
    assert len(blocks) >= 8 and skipped <= MAX_SKIPPED
    namespace: dict = {"__name__": "__guide__"}   # not importable: cloudpickle ships the guide's classes by value
    for line, source in blocks:
        # padded to the block's place, so a failure's traceback names the guide's own line
        exec(compile("\n" * (line - 1) + source, str(GUIDE), "exec"), namespace)
    assert namespace["spark"] is spark   # the guide's getOrCreate() found the shared session
