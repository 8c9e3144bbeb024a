"""The source function of one Kafka source subtask: its splits in operator state, discovery of new partitions,
lost positions, and the fetch loop (see :mod:`keygroups.sources.kafka` for the whole story)."""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa

from keygroups.sources.kafka import (
    KAFKA_PARTITIONS_STATE,
    KAFKA_SPLITS_STATE,
    LOG,
    POSITION_FIELDS,
    RAW_VALUE_COLUMN,
    KafkaDecodeError,
    KafkaPositionError,
    KafkaSource,
    KafkaSourceError,
    split_owner,
)
from keygroups.sources.kafka_decode import decode_json, decode_with, preview
from keygroups.state.checkpointed import (
    CheckpointedFunction,
    FunctionInitializationContext,
    FunctionSnapshotContext,
)

__all__ = ["KafkaSplitReader"]

#: Records one consume call returns at most, and how long it waits for them.
_MAX_CONSUME = 10_000
_POLL_SECONDS = 0.05


@dataclass
class _Split:
    topic: str
    partition: int
    offset: int             # the next record to read; < 0: resolve from the broker (a logical starting offset)
    topic_id: str = ""

    @property
    def key(self) -> tuple[str, int]:
        return (self.topic, self.partition)


def _where(topic: str, partition: int, offset: int) -> str:
    return f"topic {topic!r} partition {partition} offset {offset}"


class KafkaSplitReader(CheckpointedFunction):
    """The source function of one subtask: restores its splits, discovers new partitions, reads, and snapshots its
    positions. Drive it with :func:`~keygroups.state.initialize_function` and
    :func:`~keygroups.state.checkpoint_function`, and call :meth:`poll_arrow` once per batch; :meth:`close` it."""

    def __init__(self, source: KafkaSource) -> None:
        if source.view is None:
            raise ValueError("the Kafka source was not prepared: the driver calls source.prepare() once per batch "
                             "and ships the prepared source to the subtasks")
        self.source = source
        self.view = source.view
        self._splits: dict[tuple[str, int], _Split] = {}
        self._split_state: Any = None
        self._partition_state: Any = None
        self._consumer: Any = None
        self._errors: list[Any] = []
        self.skipped: list[dict[str, Any]] = []
        self.resets: list[dict[str, Any]] = []
        self.discovered: list[tuple[str, int]] = []
        self.dropped: list[tuple[str, int, int]] = []

    # ---- state --------------------------------------------------------------------------------------------------

    def initialize_state(self, context: FunctionInitializationContext) -> None:
        from keygroups.serializers import Int64Serializer, StrSerializer, TupleSerializer
        from keygroups.state import ListStateDescriptor

        store = context.operator_state_store
        resumed = context.is_restored and KAFKA_SPLITS_STATE in store.restored_state_names
        self._split_state = store.get_list_state(ListStateDescriptor(
            KAFKA_SPLITS_STATE, TupleSerializer(StrSerializer(), Int64Serializer(), Int64Serializer())))
        self._partition_state = store.get_union_list_state(ListStateDescriptor(
            KAFKA_PARTITIONS_STATE, TupleSerializer(StrSerializer(), Int64Serializer(), StrSerializer())))
        known: dict[tuple[str, int], str] = {}
        if resumed:
            known = {(str(t), int(p)): str(i) for t, p, i in self._partition_state.get()}
            for t, p, o in self._split_state.get():
                key = (str(t), int(p))
                self._splits[key] = _Split(key[0], key[1], int(o), known.get(key, ""))
                known.setdefault(key, "")   # (always there: every split is in the union state too)
        self._check_restored_splits()
        parallelism, index = store.parallelism, store.subtask_index
        new = [(t, p) for t, p in self.view.partitions() if (t, p) not in known
               and split_owner(t, p, parallelism) == index]
        start = -2 if resumed else {"earliest": -2, "latest": -1, "committed": -3}[self.source.starting_offsets]
        for t, p in new:
            self._splits[(t, p)] = _Split(t, p, start, self.view.topics[t].topic_id)
        self.discovered = new if resumed else []
        self._resolve_offsets()

    def _check_restored_splits(self) -> None:
        """Apply ``on_position_lost`` to restored splits whose topic is gone, was created again, or lost the
        partition; carry splits of topics no longer subscribed, unread (subscribing again resumes them)."""
        for key, split in sorted(self._splits.items()):
            if not self.source.subscribes(split.topic):
                continue
            info = self.view.topics.get(split.topic)
            if info is None or split.partition >= info.partitions:
                why = ("its topic no longer exists on the broker (deleted?)" if info is None else
                       f"the topic has {info.partitions} partitions now")
                self._lost(split, why, drop=True)
            elif split.topic_id and info.topic_id and split.topic_id != info.topic_id:
                self._lost(split, f"the topic was deleted and created again (its id was {split.topic_id}, now "
                                  f"{info.topic_id}): the offset belongs to the old topic's records", drop=False)
                split.topic_id = info.topic_id
            elif not split.topic_id:
                split.topic_id = info.topic_id

    def _lost(self, split: _Split, why: str, *, drop: bool) -> None:
        where = _where(split.topic, split.partition, split.offset)
        if self.source.on_position_lost == "fail":
            raise KafkaPositionError(
                f"{self.source.describe()}: the job's position {where} is lost: {why}. Nothing was read or "
                "committed. To go on from the earliest offset the broker has (skipping or re-reading records), run "
                "with on_position_lost='earliest'", topic=split.topic, partition=split.partition, offset=split.offset)
        if drop:
            LOG.warning("%s: dropping the job's position %s: %s", self.source.describe(), where, why)
            self.dropped.append((split.topic, split.partition, split.offset))
            del self._splits[split.key]
        else:
            LOG.warning("%s: position %s is lost (%s); continuing from the earliest offset", self.source.describe(),
                        where, why)
            self.resets.append({"topic": split.topic, "partition": split.partition, "from": split.offset,
                                "why": why})
            split.offset = -2

    def snapshot_state(self, context: FunctionSnapshotContext) -> None:
        splits = sorted(self._splits.values(), key=lambda s: s.key)
        unresolved = [s for s in splits if s.offset < 0]
        if unresolved:   # never: offsets are resolved when a split is taken on
            raise KafkaSourceError(f"splits without an offset at a snapshot: {unresolved}")
        self._split_state.update([(s.topic, s.partition, s.offset) for s in splits])
        self._partition_state.update([(s.topic, s.partition, s.topic_id) for s in splits])

    @property
    def splits(self) -> list[tuple[str, int, int]]:
        """``(topic, partition, next offset)`` of every split this subtask holds."""
        return [(s.topic, s.partition, s.offset) for s in sorted(self._splits.values(), key=lambda s: s.key)]

    @property
    def partitions(self) -> list[tuple[str, int]]:
        return sorted(self._splits)

    def report(self) -> dict[str, Any]:
        """What the batch report keeps of this subtask's source (JSON)."""
        out: dict[str, Any] = {"partitions": [list(k) for k in self.partitions],
                               "positions": [list(s) for s in self.splits]}
        if self.skipped:
            self.skipped.sort(key=lambda s: (s["topic"], s["partition"], s["offset"]))
            out["skipped"] = self.skipped[:100]
            out["records_skipped"] = len(self.skipped)
        for name in ("resets", "discovered", "dropped"):
            value = getattr(self, name)
            if value:
                out[name] = [list(v) if isinstance(v, tuple) else v for v in value]
        return out

    # ---- the broker -----------------------------------------------------------------------------------------------

    def _on_error(self, error: Any) -> None:
        self._errors.append(error)

    def consumer(self) -> Any:
        if self._consumer is None:
            from confluent_kafka import Consumer

            self._consumer = Consumer({**self.source._consumer_settings(), "error_cb": self._on_error})
        return self._consumer

    def close(self) -> None:
        if self._consumer is not None:
            consumer, self._consumer = self._consumer, None
            consumer.close()

    def _watermarks(self, topic: str, partition: int) -> tuple[int, int]:
        from confluent_kafka import KafkaException, TopicPartition

        try:
            low, high = self.consumer().get_watermark_offsets(TopicPartition(topic, partition),
                                                              timeout=self.source.fetch_timeout, cached=False)
        except KafkaException as e:
            raise KafkaSourceError(f"{self.source.describe()}: the offsets of topic {topic!r} partition {partition} "
                                   f"could not be listed: {e.args[0] if e.args else e}; nothing was read or "
                                   "committed") from None
        return int(low), int(high)

    def _resolve_offsets(self) -> None:
        """Logical starting offsets (earliest -2, latest -1, committed -3) of new or reset splits, as offsets."""
        from confluent_kafka import TopicPartition

        pending = [s for s in self._splits.values() if s.offset < 0 and self.source.subscribes(s.topic)]
        committed: dict[tuple[str, int], int] = {}
        if any(s.offset == -3 for s in pending):
            for tp in self.consumer().committed([TopicPartition(s.topic, s.partition) for s in pending
                                                 if s.offset == -3], timeout=self.source.fetch_timeout):
                if tp.error is None and tp.offset >= 0:
                    committed[(tp.topic, tp.partition)] = int(tp.offset)
        for split in pending:
            if split.key in committed:
                split.offset = committed[split.key]
                continue
            low, high = self._watermarks(split.topic, split.partition)
            split.offset = high if split.offset == -1 else low

    # ---- reading ------------------------------------------------------------------------------------------------

    def poll_arrow(self, max_records: int | None = None, record_schema: pa.Schema | None = None) -> pa.Table:
        """Read up to ``max_records`` records (None: until every partition's end), decode them, advance the
        positions past them; the records as one table of the source's staged schema."""
        if max_records is not None and (isinstance(max_records, bool) or not isinstance(max_records, int)
                                        or max_records < 0):
            raise ValueError(f"max_records must be an int >= 0 or None, got {max_records!r}")
        schema = self.source.staged_schema(record_schema)
        records = self._fetch(max_records)
        return self._decode(records, schema)

    def _fetch(self, max_records: int | None) -> _Fetched:
        from confluent_kafka import KafkaError, TopicPartition

        active = {k: s for k, s in self._splits.items() if self.source.subscribes(s.topic)}
        fetched = _Fetched()
        if not active or max_records == 0:
            return fetched
        consumer = self.consumer()
        consumer.assign([TopicPartition(s.topic, s.partition, s.offset) for s in active.values()])
        pending = set(active)
        budget = max_records
        deadline = time.monotonic() + self.source.fetch_timeout
        while pending and (budget is None or budget > 0):
            messages = consumer.consume(num_messages=min(budget or _MAX_CONSUME, _MAX_CONSUME),
                                        timeout=_POLL_SECONDS)
            for m in messages:
                error = m.error()
                key = (m.topic(), m.partition())
                split = active.get(key)
                if split is None:
                    continue
                if error is not None:
                    code = error.code()
                    if code == KafkaError._PARTITION_EOF:
                        split.offset = max(split.offset, int(m.offset()))
                        pending.discard(key)
                        continue
                    if code in (KafkaError._AUTO_OFFSET_RESET, KafkaError.OFFSET_OUT_OF_RANGE):
                        self._out_of_range(split, f"the broker answered {error.str()}")
                        consumer.assign([TopicPartition(s.topic, s.partition, s.offset) for s in active.values()])
                        break
                    raise KafkaSourceError(f"{self.source.describe()}: reading {_where(*key, split.offset)} failed: "
                                           f"{error.str()} ({error.name()}); nothing was committed, and running the "
                                           "batch again reads from the same positions")
                if budget is not None:
                    if budget == 0:
                        break
                    budget -= 1
                offset = int(m.offset())
                fetched.add(key, offset, m.timestamp(), m.key(), m.value())
                split.offset = offset + 1
            self._check_errors(pending, active)
            self._check_beyond_end(consumer, pending, active)
            if pending and time.monotonic() > deadline:
                where = "; ".join(_where(*k, active[k].offset) for k in sorted(pending))
                seen = "; ".join(sorted({e.str() for e in self._errors})) or "none"
                raise KafkaSourceError(
                    f"{self.source.describe()}: {len(pending)} partition(s) did not reach their end within "
                    f"fetch_timeout={self.source.fetch_timeout:g} s ({where}); errors seen: {seen}. Nothing was "
                    "committed, and running the batch again reads from the same positions")
        return fetched

    def _check_errors(self, pending: set[tuple[str, int]], active: Mapping[tuple[str, int], _Split]) -> None:
        from confluent_kafka import KafkaError

        fatal = [e for e in self._errors if e.fatal() or e.code() == KafkaError._ALL_BROKERS_DOWN]
        if fatal and pending:
            where = "; ".join(_where(*k, active[k].offset) for k in sorted(pending))
            raise KafkaSourceError(f"{self.source.describe()}: {fatal[0].str()} while reading ({where}); nothing was "
                                   "committed, and running the batch again reads from the same positions")

    def _check_beyond_end(self, consumer: Any, pending: set[tuple[str, int]],
                          active: Mapping[tuple[str, int], _Split]) -> None:
        """A position past the partition's end (the fetch answers' high watermark): brokers that answer such a fetch
        with nothing, not OFFSET_OUT_OF_RANGE (tansu), are caught here."""
        from confluent_kafka import TopicPartition

        for key in sorted(pending):
            split = active[key]
            try:
                _, high = consumer.get_watermark_offsets(TopicPartition(*key), cached=True)
            except Exception:   # not known yet: no fetch answer for the partition so far
                continue
            if high >= 0 and split.offset > high:
                self._out_of_range(split, f"the partition ends at offset {high}")
                consumer.assign([TopicPartition(s.topic, s.partition, s.offset) for s in active.values()])
                return

    def _out_of_range(self, split: _Split, why: str) -> None:
        low, high = self._watermarks(split.topic, split.partition)
        where = _where(split.topic, split.partition, split.offset)
        if self.source.on_position_lost == "fail":
            raise KafkaPositionError(
                f"{self.source.describe()}: the job's position {where} is out of the partition's range ({why}; the "
                f"broker lists offsets {low} to {high}): records were deleted (retention) or the log was truncated "
                "or recreated. Nothing was committed. To go on from the earliest offset the broker has, run with "
                "on_position_lost='earliest'", topic=split.topic, partition=split.partition, offset=split.offset)
        LOG.warning("%s: position %s is out of range (%s); continuing from the earliest offset, %d",
                    self.source.describe(), where, why, low)
        self.resets.append({"topic": split.topic, "partition": split.partition, "from": split.offset, "to": low,
                            "why": why})
        split.offset = low

    # ---- decoding -----------------------------------------------------------------------------------------------

    def _decode(self, fetched: _Fetched, schema: pa.Schema) -> pa.Table:
        n = len(fetched.values)
        if n == 0:
            return schema.empty_table()
        record_schema = pa.schema(list(schema)[: len(schema) - len(POSITION_FIELDS)])
        if self.source.value_format == "raw" and self.source.decoder is None:
            keep = list(range(n))
            columns = pa.table({RAW_VALUE_COLUMN: pa.array(fetched.values, pa.binary())})
        elif self.source.value_format == "raw":
            assert self.source.decoder is not None
            keep, columns = decode_with(fetched.values, self.source.decoder, record_schema,
                                        lambda i, why: self._bad(fetched, i, why))
        else:
            keep, columns = decode_json(fetched.values, record_schema, lambda i, why: self._bad(fetched, i, why))
        idx = np.asarray(keep, dtype=np.int64)
        topics = pa.array(fetched.topics, pa.string()).take(idx) if len(idx) < n else pa.array(fetched.topics,
                                                                                                   pa.string())
        meta = {
            "_topic": topics,
            "_partition": pa.array(np.asarray(fetched.partitions, np.int32)[idx]),
            "_offset": pa.array(np.asarray(fetched.offsets, np.int64)[idx]),
            "_timestamp": pa.array([fetched.timestamps[i] for i in keep], pa.int64()),
            "_key": pa.array([fetched.keys[i] for i in keep], pa.binary()),
        }
        arrays = [columns.column(f.name) if f.name in columns.column_names else pa.nulls(len(keep), f.type)
                  for f in record_schema]
        arrays += [meta[f.name] for f in POSITION_FIELDS]
        return pa.Table.from_arrays(arrays, schema=schema)

    def _bad(self, fetched: _Fetched, i: int, why: str) -> None:
        topic, partition, offset = fetched.topics[i], fetched.partitions[i], fetched.offsets[i]
        where = _where(topic, partition, offset)
        if self.source.on_decode_error == "fail":
            raise KafkaDecodeError(
                f"{self.source.describe()}: the record at {where} cannot be decoded as {self._format()}: {why}; its "
                f"value: {preview(fetched.values[i])}. Nothing was committed. Fix the record's producer, or run "
                "with on_decode_error='skip' to skip (and count) such records", topic=topic, partition=partition,
                offset=offset)
        LOG.warning("%s: skipping the record at %s: it cannot be decoded as %s: %s", self.source.describe(), where,
                    self._format(), why)
        self.skipped.append({"topic": topic, "partition": partition, "offset": offset, "why": why[:200]})

    def _format(self) -> str:
        if self.source.value_format == "json":
            return "a JSON object of the record schema"
        return "raw bytes by the decoder"


@dataclass
class _Fetched:
    """Records as read, in order, before decoding."""

    topics: list[str] = field(default_factory=list)
    partitions: list[int] = field(default_factory=list)
    offsets: list[int] = field(default_factory=list)
    timestamps: list[int | None] = field(default_factory=list)
    keys: list[bytes | None] = field(default_factory=list)
    values: list[bytes | None] = field(default_factory=list)

    def add(self, key: tuple[str, int], offset: int, timestamp: tuple[int, int], record_key: bytes | None,
            value: bytes | None) -> None:
        self.topics.append(key[0])
        self.partitions.append(key[1])
        self.offsets.append(offset)
        kind, ms = timestamp
        self.timestamps.append(ms if kind != 0 else None)   # 0: TIMESTAMP_NOT_AVAILABLE
        self.keys.append(record_key)
        self.values.append(value)
