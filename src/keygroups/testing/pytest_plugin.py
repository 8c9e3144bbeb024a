"""The ``keygroups_harness`` pytest fixture, registered through the ``pytest11`` entry point: installing keygroups
gives it to every test suite, with nothing to import or configure.

Loading this module at pytest's start imports nothing of the harness (nor of the runtime): that waits until a test
asks for the fixture, so a suite that never uses it starts as fast as before."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from keygroups.testing.harness import KeyedFunctionHarness


@pytest.fixture
def keygroups_harness() -> Iterator[Callable[..., KeyedFunctionHarness]]:
    """A factory of :class:`~keygroups.testing.KeyedFunctionHarness`: call it as the class
    (``keygroups_harness(MyFunction(), "user", output_schema=...)``). Every harness it made, and every harness
    restored from them, is closed after the test (its checkpoints deleted)."""
    from keygroups.testing.harness import KeyedFunctionHarness

    made: list[KeyedFunctionHarness] = []

    def make(*args: Any, **kwargs: Any) -> KeyedFunctionHarness:
        harness = KeyedFunctionHarness(*args, **kwargs)
        made.append(harness)
        return harness

    yield make
    for harness in made:
        for member in list(harness._family):
            member.close()
