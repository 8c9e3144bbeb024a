"""Flink savepoints in and out: read a Flink canonical savepoint (``read_savepoint``), import an operator's state
into a keygroups savepoint, and export keygroups state as a Flink savepoint Flink restores.

Flink's formats are read the way asyncpg reads the Postgres protocol: one checked cursor, one small reader per Flink
record type (named after the Flink class it mirrors), every tag and version in one table, anything else refused by
name. Nothing is deserialized with pickle, nothing is read outside the savepoint's directory unless the caller allows
it, and an error never echoes what a file holds beyond a short, escaped name.
"""

from keygroups.flink.exporter import ExportReport, export_savepoint
from keygroups.flink.importer import ImportReport, import_savepoint, parse_watermark
from keygroups.flink.metadata import UnsupportedSavepointError
from keygroups.flink.savepoint import (
    FlinkSavepoint,
    FlinkStateInfo,
    KeyGroupData,
    OperatorNotFoundError,
    PathOutsideSavepointError,
    operator_id_for_uid,
    read_savepoint,
)
from keygroups.flink.types import TtlValue, UnsupportedFlinkTypeError, state_serializer
from keygroups.flink.windows import FlinkWindows

__all__ = [
    "read_savepoint",
    "import_savepoint",
    "export_savepoint",
    "ImportReport",
    "ExportReport",
    "FlinkWindows",
    "FlinkSavepoint",
    "FlinkStateInfo",
    "KeyGroupData",
    "TtlValue",
    "operator_id_for_uid",
    "state_serializer",
    "parse_watermark",
    "UnsupportedFlinkTypeError",
    "UnsupportedSavepointError",
    "PathOutsideSavepointError",
    "OperatorNotFoundError",
]
