"""The driver's half of a micro-batch: check that every subtask reported, then build the checkpoint's metadata."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from keygroups.checkpoint import CheckpointMetadata, KeyedStateHandle, OperatorStateHandle
from keygroups.errors import KeyGroupsError


def _exactly_one_per_subtask(reports: Sequence[dict[str, Any]], parallelism: int, what: str,
                             checkpoint_id: int) -> list[dict[str, Any]]:
    ordered = sorted(reports, key=lambda r: r["subtask"])
    got = [r["subtask"] for r in ordered]
    if got != list(range(parallelism)):
        raise KeyGroupsError(
            f"checkpoint {checkpoint_id}: {what} reports came from subtasks {got}, but exactly one from each of "
            f"0..{parallelism - 1} is needed; nothing was committed"
        )
    return ordered


def checkpoint_metadata(
    *,
    job_name: str,
    checkpoint_id: int,
    max_parallelism: int,
    parallelism: int,
    keyed_reports: Sequence[dict[str, Any]],
    source_reports: Sequence[dict[str, Any]] = (),
    properties: dict[str, Any] | None = None,
) -> CheckpointMetadata:
    """The metadata of a batch whose subtasks all succeeded: their keyed and operator handles, output files and
    figures. Refuses (raises) unless each subtask reported exactly once."""
    keyed = _exactly_one_per_subtask(keyed_reports, parallelism, "keyed", checkpoint_id)
    sources = _exactly_one_per_subtask(source_reports, parallelism, "source", checkpoint_id) if source_reports else []
    return CheckpointMetadata(
        checkpoint_id=checkpoint_id,
        job_id=job_name,
        timestamp_ms=int(time.time() * 1000),
        max_parallelism=max_parallelism,
        parallelism=parallelism,
        keyed_handles=[KeyedStateHandle.from_json(r["keyed_handle"]) for r in keyed if r.get("keyed_handle")],
        operator_handles=[OperatorStateHandle.from_json(r["operator_handle"]) for r in sources
                          if r.get("operator_handle")],
        properties={
            **(properties or {}),
            "outputs": [r["output_file"] for r in keyed],
            "inputs": [r["input_file"] for r in sources if r.get("input_file")],
            "reports": [{k: v for k, v in r.items() if k != "keyed_handle"} for r in keyed],
            "source_reports": [{k: v for k, v in r.items() if k != "operator_handle"} for r in sources],
        },
    )
