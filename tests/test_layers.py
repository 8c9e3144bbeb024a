"""DESIGN.md's layers: every module imports only its own layer and the ones below; only keygroups.spark and
keygroups.cli import pyspark (so the state library runs without Spark)."""

from __future__ import annotations

import ast
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).parents[1] / "src" / "keygroups"
# Lowest first. A module may import its own layer and any layer listed before it.
LAYERS = [
    {"keygroups", "keygroups._native", "keygroups._hashing", "keygroups._ranges", "keygroups.errors"},
    {"keygroups.serializers"},
    {"keygroups.checkpoint"},
    {"keygroups.state"},
    {"keygroups.sources"},
    {"keygroups.runtime"},
    {"keygroups.sinks"},
    {"keygroups.aggregates"},
    {"keygroups.windows"},
    {"keygroups.metrics"},
    {"keygroups.testing"},
    {"keygroups.flink"},
    {"keygroups.spark"},
    {"keygroups.cli", "keygroups.__main__"},
]
PYSPARK_ALLOWED = {"keygroups.spark", "keygroups.cli", "keygroups.__main__"}


def layer_of(module: str) -> int:
    best, depth = -1, -1
    for i, names in enumerate(LAYERS):
        for name in names:
            if (module == name or module.startswith(name + ".")) and name.count(".") > depth:
                best, depth = i, name.count(".")
    return best


def modules():
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE.parent).with_suffix("")
        name = ".".join(rel.parts)
        yield (name[: -len(".__init__")] if name.endswith(".__init__") else name), path


def imports_of(path: pathlib.Path, module: str):
    tree = ast.parse(path.read_text(encoding="utf-8"))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                yield ".".join(base + ([node.module] if node.module else []))
            elif node.module:
                yield node.module


@pytest.mark.parametrize("module,path", list(modules()), ids=lambda v: str(v) if isinstance(v, str) else "")
def test_module_imports_only_lower_layers(module, path):
    own = layer_of(module)
    assert own >= 0, f"{module} is in no layer of DESIGN.md"
    for imported in imports_of(path, module):
        if imported.split(".")[0] == "pyspark":
            assert any(module == a or module.startswith(a + ".") for a in PYSPARK_ALLOWED), (
                f"{module} imports pyspark; only keygroups.spark and keygroups.cli may")
        if imported.split(".")[0] == "keygroups":
            assert layer_of(imported) <= own, f"{module} (layer {own}) imports {imported} (layer {layer_of(imported)})"


#: The executor side of a batch: what runs inside a task (runtime.local runs tasks in this process).
EXECUTOR_SIDE = {"keygroups.runtime.subtask", "keygroups.runtime.subtask_input", "keygroups.runtime.subtask_state",
                 "keygroups.runtime.local", "keygroups.spark.executor"}
#: The driver side: the batch spine, its plan and commit, and the adapters' drivers. None imports the executor side
#: (an adapter hands its executor to the spine: ``keygroups.spark.job`` builds a SparkExecutor, the harness a
#: LocalExecutor, through the executor modules alone).
DRIVER_SIDE = ["keygroups.runtime.batch", "keygroups.runtime.driver", "keygroups.runtime.properties",
               "keygroups.runtime.report", "keygroups.runtime.spec", "keygroups.runtime.backends",
               "keygroups.runtime.assignment"]


@pytest.mark.parametrize("module", DRIVER_SIDE)
def test_the_driver_never_imports_the_executor_side(module):
    path = PACKAGE.parent / (module.replace(".", "/") + ".py")
    found = sorted({i for i in imports_of(path, module) if any(i == e or i.startswith(e + ".") for e in EXECUTOR_SIDE)})
    assert not found, f"{module} (the driver side) imports {found} (the executor side)"


def test_the_adapters_reach_the_tasks_only_through_their_executors():
    for module, allowed in (("keygroups.spark.job", {"keygroups.spark.executor"}),
                            ("keygroups.testing.harness", {"keygroups.runtime.local",
                                                           "keygroups.runtime.subtask_state"})):
        path = PACKAGE.parent / (module.replace(".", "/") + ".py")
        found = {i for i in imports_of(path, module) if any(i == e or i.startswith(e + ".") for e in EXECUTOR_SIDE)}
        assert found <= allowed, f"{module} imports {sorted(found - allowed)} of the executor side"
