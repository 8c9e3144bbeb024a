"""Kafka as a replayable source: FLIP-8's own example, read by the job's source subtasks with librdkafka.

Each source subtask owns some *splits* — ``(topic, partition, offset)``, the offset being the next record to read —
and keeps them in a split-distribute operator state, as Flink's ``KafkaSource`` keeps its ``KafkaPartitionSplit``s:
after a rescale the splits are dealt out evenly again, so 2 → 1 continues every partition and 2 → 4 leaves no
subtask idle. The offsets commit with the keyed state in the batch's checkpoint, so a batch that fails (a killed
driver, task or broker) commits nothing and the next run reads exactly the same records again; Kafka's own
consumer-group offsets are written only *after* a checkpoint is complete, for monitoring, and never read back for
correctness.

Discovery. On the driver, once per batch, :meth:`KafkaSource.prepare` lists the subscribed topics (a list, or a
regular expression that must match a whole topic name), their partition counts and topic ids. Each subtask also
restores a *union* state holding every split's ``(topic, partition, topic id)``, so it knows which partitions the
job already reads; a partition nobody reads yet (a topic that matches the pattern now, or partitions added to a
topic) goes to the subtask Flink's ``KafkaSourceEnumerator.getSplitOwner`` names for it, starting from its earliest
offset (at the job's very first batch: ``starting_offsets``).

Reading. A subtask assigns its splits to a consumer and reads until every partition reached its end (librdkafka's
partition-EOF, from the fetch answer's high watermark) or ``max_records`` records; offsets skipped by transaction
markers or compaction are passed over. Values are decoded as JSON objects (parsed by Arrow against the record
schema, as the file log's) or by a user decoder from raw bytes. Each staged record carries its position and
metadata in the columns ``_topic``, ``_partition``, ``_offset``, ``_timestamp`` (the record's timestamp in epoch
milliseconds, as Kafka keeps it — a long, not a timestamp: the keyed stage hands every column to Python, where a
zoned datetime costs tens of microseconds a record and a long next to nothing; event time from the record:
``timestamp_column="_timestamp"``) and ``_key``.

What can go wrong, and what happens (each error names the topic, the partition and the offset):

* **the broker is gone or does not answer** mid-batch: the batch fails (:class:`KafkaSourceError`) once all brokers
  are down or ``fetch_timeout`` passes; nothing is committed, and the rerun reads the same records again;
* **a record that cannot be decoded** (not JSON, not an object, a field of the wrong type, a null value, a decoder
  that raised): :class:`KafkaDecodeError` (``on_decode_error="fail"``, the default), or the record is skipped,
  counted in the batch's source report and logged (``"skip"``);
* **a position that no longer exists** — an offset before the partition's start (retention deleted it) or past
  its end, a topic deleted, or deleted and created again (its topic id changed): :class:`KafkaPositionError`
  (``on_position_lost="fail"``, the default), or the split continues from the earliest offset the broker has
  (a deleted topic's splits are dropped), logged and reported (``"earliest"``, Kafka's ``auto.offset.reset``);
* **a listed topic that does not exist** is refused on the driver before any task runs (a pattern just matches
  what there is).

Transactions: the consumer reads committed records only (librdkafka's default ``isolation.level``); see
:mod:`keygroups.sources.local_broker` for what the tansu broker does and does not do.
"""

from __future__ import annotations

import json
import logging
import re
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import pyarrow as pa

from keygroups.errors import KeyGroupsError

if TYPE_CHECKING:
    from keygroups.sources.kafka_reader import KafkaSplitReader

__all__ = [
    "KafkaSource",
    "KafkaSourceError",
    "KafkaPositionError",
    "KafkaDecodeError",
    "BrokerView",
    "split_owner",
    "KAFKA_SPLITS_STATE",
    "KAFKA_PARTITIONS_STATE",
    "POSITION_COLUMNS",
]

LOG = logging.getLogger("keygroups.kafka")
#: librdkafka's log through ``LOG``, warnings and worse: its informational lines are served from a queue that a
#: closing client may still hold, and librdkafka then prints them on stderr itself ("Purging 1 unserved events").
QUIET_CLIENT: dict[str, Any] = {"logger": LOG, "log_level": 4}

#: The split-distribute operator state of ``(topic, partition, next offset)`` per split.
KAFKA_SPLITS_STATE = "kafka-splits"
#: The union operator state of ``(topic, partition, topic id)`` of every split of the job.
KAFKA_PARTITIONS_STATE = "kafka-partitions"
#: The columns a staged Kafka record carries beside its value's.
POSITION_COLUMNS = ("_topic", "_partition", "_offset", "_timestamp", "_key")
POSITION_FIELDS = [pa.field("_topic", pa.string()), pa.field("_partition", pa.int32()),
                    pa.field("_offset", pa.int64()), pa.field("_timestamp", pa.int64()),
                    pa.field("_key", pa.binary())]
#: The record column of ``value_format="raw"`` without a decoder.
RAW_VALUE_COLUMN = "value"

ValueFormat = Literal["json", "raw"]
StartingOffsets = Literal["earliest", "latest", "committed"]
DecodeErrorPolicy = Literal["fail", "skip"]
PositionLostPolicy = Literal["fail", "earliest"]

# Consumer settings the source owns: they decide what is read and what happens to positions.
_OWNED_OPTIONS = {
    "enable.auto.commit": "offsets are committed with the job's checkpoints (commit_offsets reports them to the "
                          "consumer group afterwards, for monitoring)",
    "enable.auto.offset.store": "offsets are kept in the job's operator state",
    "auto.offset.reset": "a lost position is handled by on_position_lost ('fail' or 'earliest')",
    "enable.partition.eof": "the source reads each partition to its end and needs the end-of-partition events",
    "group.id": "give group_id= instead",
}


class KafkaSourceError(KeyGroupsError):
    """Reading Kafka failed (the broker is unreachable or answered with an error); nothing of the batch was
    committed, and running it again reads the same records."""


class KafkaPositionError(KafkaSourceError):
    """A stored position no longer exists on the broker: its offset is out of the partition's range (retention, a
    truncated log), or its topic was deleted or created again. ``topic``, ``partition`` and ``offset`` name it."""

    def __init__(self, message: str, *, topic: str, partition: int, offset: int) -> None:
        super().__init__(message)
        self.topic, self.partition, self.offset = topic, partition, offset


class KafkaDecodeError(KafkaSourceError):
    """A record's value cannot be decoded with the source's value format; ``topic``, ``partition`` and ``offset``
    name the record."""

    def __init__(self, message: str, *, topic: str, partition: int, offset: int) -> None:
        super().__init__(message)
        self.topic, self.partition, self.offset = topic, partition, offset


def _java_string_hash(text: str) -> int:
    """Java's ``String.hashCode()`` (UTF-16 code units, 32-bit wrap), as a signed int."""
    h = 0
    data = text.encode("utf-16-be")
    for i in range(0, len(data), 2):
        h = (31 * h + ((data[i] << 8) | data[i + 1])) & 0xFFFFFFFF
    return h - (1 << 32) if h >= 1 << 31 else h


def split_owner(topic: str, partition: int, parallelism: int) -> int:
    """The subtask a newly discovered partition goes to: Flink's ``KafkaSourceEnumerator.getSplitOwner``
    (``((topic.hashCode() * 31) & 0x7FFFFFFF) % parallelism``, plus the partition, modulo the parallelism), so that
    one topic's partitions go round the subtasks from a topic-dependent start."""
    start = ((_java_string_hash(topic) * 31) & 0x7FFFFFFF) % parallelism
    return (start + partition) % parallelism


@dataclass(frozen=True)
class TopicInfo:
    """One topic as the broker described it: its id (base64, "" where the broker has none) and partition count."""

    topic_id: str
    partitions: int


@dataclass(frozen=True)
class BrokerView:
    """The subscribed topics as the driver found them at the start of a batch, the same for every subtask."""

    topics: Mapping[str, TopicInfo]
    taken_ms: int = 0

    def partitions(self) -> list[tuple[str, int]]:
        return sorted((t, p) for t, info in self.topics.items() for p in range(info.partitions))


class KafkaSource:
    """A Kafka topic (or several) as a job's replayable source; give it to ``KeyedJob.run_source_batch``.

    ``topics`` names the topics (a name or a list), or ``pattern`` a regular expression a whole topic name must
    match (new matching topics are picked up as they appear). ``bootstrap_servers`` goes to librdkafka as
    ``bootstrap.servers``; ``consumer_options`` are any other librdkafka consumer settings (security, fetch sizes,
    ``isolation.level``; the ones the source owns are refused by name). ``value_format`` is ``"json"`` (each value a
    JSON object, parsed by Arrow against the batch's ``record_schema``: fields not in it are ignored, missing ones
    are null) or ``"raw"``: with a ``decoder`` (``bytes -> dict``, or None to drop the record) the dicts are
    converted to ``record_schema``; without one, the record is one binary column ``value``. (Avro values: a decoder
    around fastavro's ``schemaless_reader``, after the 5-byte header of Confluent's wire format if there is one.)

    ``starting_offsets`` is where the job's first batch starts in each partition: ``"earliest"`` (the default),
    ``"latest"`` or ``"committed"`` (``group_id``'s committed offsets, earliest where there are none); partitions
    found later always start at their earliest offset. ``group_id`` names the consumer group the job's positions
    are reported to after each complete checkpoint, when ``commit_offsets`` is true (the default when a group is
    given): for monitoring tools (lag), never read back. ``on_decode_error`` and ``on_position_lost`` are the
    policies for undecodable records and lost positions (see the module's docs). ``fetch_timeout`` is how many
    seconds a batch waits for its partitions to reach their ends before it fails."""

    def __init__(self, topics: str | Sequence[str] | None = None, *, pattern: str | None = None,
                 bootstrap_servers: str | None = None, consumer_options: Mapping[str, Any] | None = None,
                 value_format: ValueFormat = "json", decoder: Callable[[bytes], Mapping[str, Any] | None] | None = None,
                 starting_offsets: StartingOffsets = "earliest", group_id: str | None = None,
                 commit_offsets: bool | None = None, on_decode_error: DecodeErrorPolicy = "fail",
                 on_position_lost: PositionLostPolicy = "fail", fetch_timeout: float = 60.0) -> None:
        if (topics is None) == (pattern is None):
            raise ValueError("give either topics (a topic name or a list of them) or pattern (a regular expression "
                             f"a whole topic name must match), not {'both' if topics is not None else 'neither'}")
        if topics is not None:
            names = [topics] if isinstance(topics, str) else list(topics)
            bad = [t for t in names if not isinstance(t, str) or not t]
            if not names or bad:
                raise ValueError(f"topics must be a topic name or a non-empty list of names, got {topics!r}")
            self.topics: tuple[str, ...] | None = tuple(dict.fromkeys(names))
            self.pattern: str | None = None
        else:
            if not isinstance(pattern, str) or not pattern:
                raise ValueError(f"pattern must be a regular expression (a non-empty str), got {pattern!r}")
            try:
                re.compile(pattern)
            except re.error as e:
                raise ValueError(f"pattern {pattern!r} is not a regular expression: {e}") from None
            self.topics, self.pattern = None, pattern
        options = dict(consumer_options or {})
        for key in options:
            if key in _OWNED_OPTIONS:
                raise ValueError(f"consumer option {key!r} belongs to the source: {_OWNED_OPTIONS[key]}")
        if bootstrap_servers is not None:
            options["bootstrap.servers"] = bootstrap_servers
        if not options.get("bootstrap.servers"):
            raise ValueError("give bootstrap_servers (host:port of a broker), or 'bootstrap.servers' in "
                             "consumer_options")
        self.consumer_options = options
        if value_format not in ("json", "raw"):
            raise ValueError(f"value_format must be 'json' (JSON objects) or 'raw' (bytes, with an optional "
                             f"decoder), got {value_format!r}")
        if decoder is not None and value_format != "raw":
            raise ValueError("a decoder decodes raw bytes: give value_format='raw' with it")
        if decoder is not None and not callable(decoder):
            raise TypeError(f"decoder must be a callable bytes -> dict (or None to drop a record), got {decoder!r}")
        self.value_format = value_format
        self.decoder = decoder
        _check_choice("starting_offsets", starting_offsets, ("earliest", "latest", "committed"))
        _check_choice("on_decode_error", on_decode_error, ("fail", "skip"))
        _check_choice("on_position_lost", on_position_lost, ("fail", "earliest"))
        if starting_offsets == "committed" and group_id is None:
            raise ValueError("starting_offsets='committed' reads the committed offsets of a consumer group: give "
                             "group_id too")
        self.starting_offsets = starting_offsets
        if group_id is not None and (not isinstance(group_id, str) or not group_id):
            raise ValueError(f"group_id must be a consumer group name (a non-empty str) or None, got {group_id!r}")
        self.group_id = group_id
        self.commit_offsets = group_id is not None if commit_offsets is None else bool(commit_offsets)
        if self.commit_offsets and group_id is None:
            raise ValueError("commit_offsets reports the job's positions to a consumer group: give group_id too")
        self.on_decode_error = on_decode_error
        self.on_position_lost = on_position_lost
        if isinstance(fetch_timeout, bool) or not isinstance(fetch_timeout, (int, float)) or fetch_timeout <= 0:
            raise ValueError(f"fetch_timeout must be a number of seconds > 0, got {fetch_timeout!r}")
        self.fetch_timeout = float(fetch_timeout)
        #: What :meth:`prepare` found on the broker (None until then).
        self.view: BrokerView | None = None
        self._check_options()

    def _check_options(self) -> None:
        """Refuse, here on the driver, settings librdkafka refuses (it checks them when a client is created; a
        client connects only once it is used)."""
        try:
            from confluent_kafka import Consumer, KafkaException
        except ImportError:
            raise ImportError("keygroups.sources.KafkaSource reads Kafka with librdkafka through confluent-kafka, "
                              "which is not installed: pip install 'keygroups[kafka]'") from None

        try:
            Consumer(self._consumer_settings()).close()
        except KafkaException as e:
            error = e.args[0] if e.args else e
            text = error.str() if hasattr(error, "str") else str(error)
            raise ValueError(f"consumer_options: librdkafka refuses them: {text}") from None

    # ---- what the job sees ------------------------------------------------------------------------------------

    @property
    def bootstrap_servers(self) -> str:
        return str(self.consumer_options["bootstrap.servers"])

    def subscribes(self, topic: str) -> bool:
        """Whether ``topic`` is one this source reads."""
        if self.topics is not None:
            return topic in self.topics
        assert self.pattern is not None
        return re.fullmatch(self.pattern, topic) is not None

    def record_schema_for(self, record_schema: pa.Schema | None) -> pa.Schema:
        """The records' own columns: ``record_schema``, or ``value: binary`` for raw values without a decoder."""
        if self.value_format == "raw" and self.decoder is None:
            if record_schema is not None and record_schema != pa.schema([(RAW_VALUE_COLUMN, pa.binary())]):
                raise ValueError(f"value_format='raw' without a decoder stages each value as one binary column "
                                 f"{RAW_VALUE_COLUMN!r}; give no record_schema, or a decoder for {record_schema}")
            return pa.schema([(RAW_VALUE_COLUMN, pa.binary())])
        if record_schema is None:
            raise ValueError(f"a Kafka source with value_format={self.value_format!r} needs the record_schema its "
                             "values decode to (a pyarrow Schema)")
        clash = [n for n in record_schema.names if n in POSITION_COLUMNS]
        if clash:
            raise ValueError(f"record_schema has columns {clash}, which the Kafka source adds to every record "
                             f"({', '.join(POSITION_COLUMNS)}); rename them")
        return record_schema

    def staged_schema(self, record_schema: pa.Schema | None) -> pa.Schema:
        """The schema of a batch's staged input: the records' columns, then ``_topic``, ``_partition``,
        ``_offset``, ``_timestamp`` and ``_key``."""
        return pa.schema(list(self.record_schema_for(record_schema)) + POSITION_FIELDS)

    def describe(self) -> str:
        what = f"topics {list(self.topics)}" if self.topics is not None else f"pattern {self.pattern!r}"
        return f"Kafka {what} at {self.bootstrap_servers}"

    def __repr__(self) -> str:
        return f"KafkaSource({self.describe()}, {self.value_format})"

    # ---- the driver's side ------------------------------------------------------------------------------------

    def _client_options(self) -> dict[str, Any]:
        """Options for an admin client or a producer: the connection settings of ``consumer_options``."""
        consumer_only = ("fetch.", "isolation.level", "max.partition.fetch.bytes", "queued.", "check.crcs",
                         "session.timeout.ms", "heartbeat.interval.ms", "partition.assignment.strategy",
                         "max.poll.interval.ms", "auto.commit.interval.ms", "group.instance.id")
        return {k: v for k, v in self.consumer_options.items() if not k.startswith(consumer_only)}

    def prepare(self, previous: Any = None) -> KafkaSource:
        """On the driver, once per batch: this source with :attr:`view` set to the subscribed topics as the broker
        lists them now (partition counts, topic ids). A listed topic that does not exist is refused here, before
        any task runs, naming the positions the restore point ``previous`` (a CheckpointMetadata) holds in it."""
        from confluent_kafka import KafkaException, TopicCollection
        from confluent_kafka.admin import AdminClient

        options = {**self._client_options(), "logger": LOG}
        admin = AdminClient(options)
        try:
            listed = admin.list_topics(timeout=self.fetch_timeout)
        except KafkaException as e:
            raise KafkaSourceError(f"{self.describe()}: the broker did not list its topics within "
                                   f"{self.fetch_timeout:g} s: {e.args[0] if e.args else e}; nothing was read or "
                                   "committed") from None
        counts = {name: len(t.partitions) for name, t in listed.topics.items()
                  if t.error is None and self.subscribes(name)
                  and (self.topics is not None or not name.startswith("__"))}
        if self.topics is not None:
            missing = [t for t in self.topics if t not in counts]
            if missing:
                raise KafkaSourceError(_missing_topics_message(self, missing, sorted(listed.topics), previous))
        ids: dict[str, str] = {}
        if counts:
            try:
                described = admin.describe_topics(TopicCollection(sorted(counts)), request_timeout=self.fetch_timeout)
                for name, future in described.items():
                    topic_id = future.result(self.fetch_timeout).topic_id
                    ids[name] = str(topic_id) if topic_id is not None else ""
            except Exception as e:   # a broker without topic ids (before Kafka 2.8): recreated topics go unnoticed
                LOG.debug("%s: no topic ids (%s); a topic deleted and created again is noticed only by its offsets",
                          self.describe(), e)
        prepared = self._copy()
        prepared.view = BrokerView({name: TopicInfo(ids.get(name, ""), n) for name, n in counts.items()},
                                   int(time.time() * 1000))
        return prepared

    def _copy(self) -> KafkaSource:
        clone = object.__new__(KafkaSource)
        clone.__dict__.update(self.__dict__)
        return clone

    def create_reader(self) -> KafkaSplitReader:
        """In a source subtask: the reader of this subtask's splits (a CheckpointedFunction)."""
        from keygroups.sources.kafka_reader import KafkaSplitReader

        return KafkaSplitReader(self)

    def notify_checkpoint_complete(self, metadata: Any) -> None:
        """On the driver, once the batch's checkpoint is complete: report its positions to ``group_id`` (if
        ``commit_offsets``), so that lag monitors see the job's progress. A failure here is logged, never raised:
        these offsets are for monitoring only."""
        if not self.commit_offsets or self.group_id is None:
            return
        from confluent_kafka import Consumer, TopicPartition

        positions = sorted({(t, int(p), int(o)) for report in metadata.properties.get("source_reports", [])
                            for t, p, o in report.get("positions", [])})
        if not positions:
            return
        try:
            consumer = Consumer({**self._consumer_settings(), "group.id": self.group_id})
            try:
                consumer.commit(offsets=[TopicPartition(t, p, o) for t, p, o in positions], asynchronous=False)
            finally:
                consumer.close()
        except Exception as e:
            LOG.warning("%s: checkpoint %s is complete, but its positions could not be reported to consumer group "
                        "%r (for monitoring only; nothing is lost): %s", self.describe(), metadata.checkpoint_id,
                        self.group_id, e)

    def _consumer_settings(self) -> dict[str, Any]:
        # a partition at its end answers a fetch after fetch.wait.max.ms (librdkafka's default: 500 ms): a batch
        # waits that long for its end-of-partition events, so wait less unless told otherwise
        return {"fetch.wait.max.ms": 20, **self.consumer_options, "group.id": self.group_id or "keygroups-source",
                "enable.auto.commit": False, "enable.auto.offset.store": False, "enable.partition.eof": True,
                "auto.offset.reset": "error", "logger": LOG}


def _check_choice(name: str, value: Any, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"{name} must be one of {', '.join(map(repr, allowed))}, got {value!r}")


def _missing_topics_message(source: KafkaSource, missing: list[str], existing: list[str], previous: Any) -> str:
    held = []
    if previous is not None:
        for report in previous.properties.get("source_reports", []):
            held += [f"partition {p} at offset {o} of {t!r}" for t, p, o in report.get("positions", [])
                     if t in missing]
    there = ", ".join(repr(t) for t in existing if not t.startswith("__")) or "none"
    text = (f"{source.describe()}: topic{'s' if len(missing) > 1 else ''} {', '.join(map(repr, missing))} "
            f"{'do' if len(missing) > 1 else 'does'} not exist on the broker (its topics: {there}).")
    if held:
        text += (f" The restored checkpoint {previous.checkpoint_id} reads {'; '.join(sorted(held))}: if the topic "
                 "was deleted, those positions are lost; remove it from topics (or subscribe by pattern with "
                 "on_position_lost='earliest') to go on without it.")
    else:
        text += " Create it first, or correct its name."
    return text + " Nothing was read or committed."


def produce_json(bootstrap_servers: str, topic: str, records: Iterable[Mapping[str, Any]], *,
                 partition: int | None = None, key: Callable[[Mapping[str, Any]], bytes | str | None] | None = None,
                 options: Mapping[str, Any] | None = None) -> int:
    """Write ``records`` (dicts of JSON values) to ``topic`` as compact JSON values, with an idempotent producer,
    in order (to ``partition``, or by ``key``'s partitioner); returns how many. For examples, the demo and tests."""
    from confluent_kafka import Producer

    producer = Producer({"bootstrap.servers": bootstrap_servers, "enable.idempotence": True, "linger.ms": 5,
                         **QUIET_CLIENT, **dict(options or {})})
    errors: list[str] = []

    def delivered(error: Any, message: Any) -> None:
        if error is not None:
            errors.append(f"{message.topic()}[{message.partition()}]: {error.str()}")

    n = 0
    for record in records:
        value = json.dumps(record, separators=(",", ":"), ensure_ascii=False).encode()
        record_key = key(record) if key is not None else None
        kwargs: dict[str, Any] = {"value": value, "on_delivery": delivered}
        if record_key is not None:
            kwargs["key"] = record_key.encode() if isinstance(record_key, str) else record_key
        if partition is not None:
            kwargs["partition"] = partition
        while True:
            try:
                producer.produce(topic, **kwargs)
                break
            except BufferError:
                producer.poll(0.05)
        n += 1
    left = producer.flush(60)
    if left or errors:
        raise KafkaSourceError(f"writing to topic {topic!r} at {bootstrap_servers}: {left} records not delivered; "
                               f"errors: {errors[:5]}")
    return n
