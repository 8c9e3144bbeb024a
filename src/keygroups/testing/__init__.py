"""Unit tests for keyed functions, without Spark: :class:`KeyedFunctionHarness` runs a function through the same
subtask code a ``KeyedJob`` runs on Spark (restore, records by key, late records, timers, snapshot), one micro-batch
per call, with the watermark, the processing time and the parallelism in the test's hands; :meth:`snapshot
<KeyedFunctionHarness.snapshot>` and :meth:`restore <KeyedFunctionHarness.restore>` take a real savepoint and bring
it back at another parallelism, max parallelism or backend.

With pytest, the fixture ``keygroups_harness`` (installed with the package) makes harnesses and closes them after
the test. See "Test your function" in the guide.

The names are imported when first used, so that pytest loading the fixture's plugin at its start
(``keygroups.testing.pytest_plugin``) costs a suite that never uses it nothing of the runtime."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from keygroups.testing.harness import HarnessBatch, HarnessSnapshot, KeyedFunctionHarness, Timer

__all__ = ["KeyedFunctionHarness", "HarnessBatch", "HarnessSnapshot", "Timer"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from keygroups.testing import harness

        return getattr(harness, name)
    raise AttributeError(f"module 'keygroups.testing' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
