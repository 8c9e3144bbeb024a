"""``keygroups inspect --plot``: a valid PNG, SVG or self-contained HTML file, the loads and skew printed, bad
arguments refused as usage errors, and a clear error naming the extra when matplotlib is missing."""

from __future__ import annotations

import html.parser
import json
import pathlib
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET

import pytest

from keygroups.checkpoint import CheckpointStorage
from keygroups.checkpoint.stats import checkpoint_figures, size_history
from test_checkpoint_stats import write_two_checkpoints

pytest.importorskip("matplotlib")

from keygroups.cli import plot  # noqa: E402  (after the skip: drawing needs matplotlib)

DATA = pathlib.Path(__file__).parent / "data"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def keygroups(*args: object, prelude: str = "") -> subprocess.CompletedProcess:
    code = f"{prelude}\nimport sys\nfrom keygroups.cli import main\nsys.exit(main(sys.argv[1:]))"
    return subprocess.run([sys.executable, "-c", code, *map(str, args)], capture_output=True, text=True, timeout=120)


@pytest.fixture
def v1(tmp_path):
    shutil.copytree(DATA / "keyed-checkpoint-v1" / "chk-1", tmp_path / "chk-1")
    return tmp_path


class Tags(html.parser.HTMLParser):
    def __init__(self):
        super().__init__()
        self.tags = []

    def handle_starttag(self, tag, attrs):
        self.tags.append((tag, dict(attrs)))


def test_png_with_loads_and_skew_at_a_proposed_parallelism(v1):
    out = v1 / "state.png"
    result = keygroups("inspect", v1, "--plot", out, "--parallelism", "5", "--keys")
    assert result.returncode == 0, result.stderr
    figures = checkpoint_figures(CheckpointStorage(v1), CheckpointStorage(v1).latest(), with_keys=True)
    lines = result.stdout.splitlines()
    assert f"load per subtask at p=2: bytes skew {figures.skew(2):.2f}" in result.stdout
    assert any(line.startswith(f"load per subtask at p=5: bytes skew {figures.skew(5):.2f}") and
               f"keys skew {figures.skew(5, 'keys'):.2f}" in line for line in lines)
    assert "keys: 200 in 16 of 16 key groups" in lines
    assert lines[-1] == f"picture written to {out}"
    assert out.read_bytes()[:8] == PNG_MAGIC and out.stat().st_size > 10_000


def test_html_is_one_self_contained_file(v1):
    out = v1 / "state.html"
    result = keygroups("inspect", v1, "--plot", out, "--parallelism", "3")
    assert result.returncode == 0, result.stderr
    text = out.read_text(encoding="utf-8")
    parser = Tags()
    parser.feed(text)
    parser.close()
    tags = [t for t, _ in parser.tags]
    assert tags[0] == "html" and "table" in tags and "svg" in tags
    assert "script" not in tags and "link" not in tags   # nothing to run, nothing fetched
    assert not any(v.startswith(("http:", "https:", "//")) for _, attrs in parser.tags
                   for k, v in attrs.items() if k in ("src", "href") and v)
    svg = text[text.index("<svg"):text.index("</svg>") + len("</svg>")]
    assert ET.fromstring(svg).tag.endswith("svg")
    storage = CheckpointStorage(v1)
    figures = checkpoint_figures(storage, storage.latest())
    assert f"<td>current</td><td>2</td><td>{figures.skew(2):.2f}</td>" in text
    assert f"<td>proposed</td><td>3</td><td>{figures.skew(3):.2f}</td><td>not counted (--keys)</td>" in text


def test_a_written_incremental_checkpoint_draws_with_its_history(tmp_path):
    storage = CheckpointStorage(tmp_path / "chk", retain=10)
    write_two_checkpoints(storage)
    figures = checkpoint_figures(storage, storage.latest(), with_keys=True)
    history = size_history(storage)
    for name, proposed in (("a.png", 32), ("a.svg", None), ("a.html", 4)):
        plot.save_plot(str(tmp_path / name), figures, history, proposed)
    assert (tmp_path / "a.png").read_bytes()[:8] == PNG_MAGIC
    assert ET.parse(tmp_path / "a.svg").getroot().tag.endswith("svg")
    assert "<td>proposed</td><td>4</td>" in (tmp_path / "a.html").read_text(encoding="utf-8")
    with pytest.raises(ValueError, match=r"'x\.jpg' does not end in \.png, \.svg, \.html"):
        plot.save_plot("x.jpg", figures, history)


def test_json_output_stays_json_with_a_plot(v1):
    out = v1 / "state.svg"
    result = keygroups("inspect", v1, "--json", "--plot", out, "--parallelism", "4")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["checkpoint_id"] == 1
    assert ET.parse(out).getroot().tag.endswith("svg")


@pytest.mark.parametrize("args, message", [
    (["--plot", "{dir}/state.txt"], "argument --plot: '{dir}/state.txt' does not end in .png, .svg, .html"),
    (["--plot", "{dir}/nowhere/state.png"], "argument --plot: the directory '{dir}/nowhere' of "),
    (["--parallelism", "0"], "argument --parallelism: 0 is below 1"),
    (["--parallelism", "two"], "argument --parallelism: 'two' is not a whole number"),
])
def test_bad_arguments_are_usage_errors(v1, args, message):
    result = keygroups("inspect", v1, *[a.format(dir=v1) for a in args])
    assert result.returncode == 2 and result.stdout == ""
    errors = [line for line in result.stderr.splitlines() if not line.startswith(("usage:", " "))]
    assert len(errors) == 1 and errors[0].startswith(f"keygroups inspect: error: {message.format(dir=v1)}")
    assert not list(v1.glob("state.*"))


def test_a_parallelism_above_max_parallelism_is_one_line(v1):
    result = keygroups("inspect", v1, "--parallelism", "17", "--plot", v1 / "state.png")
    assert result.returncode == 2
    assert result.stderr.splitlines() == ["keygroups inspect: --parallelism 17 is above checkpoint 1's max "
                                          "parallelism 16; give a parallelism from 1 to 16"]
    assert not (v1 / "state.png").exists()


NO_MATPLOTLIB = "import sys; sys.modules['matplotlib'] = None"   # then importing it raises ImportError


def test_without_matplotlib_the_error_names_the_extra(v1):
    result = keygroups("inspect", v1, "--plot", v1 / "state.png", prelude=NO_MATPLOTLIB)
    assert result.returncode == 2
    assert result.stderr.splitlines() == ["keygroups inspect: drawing a checkpoint needs matplotlib, which is not "
                                          "installed: install the plot extra, pip install 'keygroups[plot]'"]
    assert not (v1 / "state.png").exists()
    # the figures need no matplotlib
    skew = keygroups("inspect", v1, "--parallelism", "3", prelude=NO_MATPLOTLIB)
    assert skew.returncode == 0 and "load per subtask at p=3: bytes skew" in skew.stdout
