"""The type variables of the typed public API, shared so that every module's generics read alike: ``T`` a value,
``K``/``V`` a map's keys and values, ``IN``/``ACC``/``OUT`` what an aggregate takes, accumulates and returns (Flink's
names). Type checkers only: nothing is checked at run time."""

from __future__ import annotations

from typing import TypeVar

T = TypeVar("T")
K = TypeVar("K")
V = TypeVar("V")
IN = TypeVar("IN")
ACC = TypeVar("ACC")
OUT = TypeVar("OUT")

__all__ = ["T", "K", "V", "IN", "ACC", "OUT"]
