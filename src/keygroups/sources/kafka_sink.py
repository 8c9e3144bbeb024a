"""A Kafka sink for a job's output: each committed checkpoint's output records, once the checkpoint is complete.

The sink reads a committed checkpoint's output files (through the checkpoint storage, on the driver) and produces
every row as one record to ``topic``: keyed by the job's key columns (so one key's records stay in one partition, in
order, placed by librdkafka's ``murmur2_random`` partitioner, as the Java client places them), the row as a compact
JSON object for the value. The producer is idempotent: its own retries never write a record twice.

Progress: after a checkpoint is delivered, the sink records its id as the committed offset of partition 0 of
``topic`` in its own consumer group (``progress_group``, default ``keygroups-sink.<job>``), so a restarted driver
knows what was delivered: :meth:`KafkaSink.deliver` skips a checkpoint at or before it, and
:meth:`KafkaSink.deliver_pending` delivers every retained checkpoint after it. (The group never consumes anything;
lag monitors may list it.)

The guarantee, plainly:

* ``transactional=False`` (the default) — **at-least-once**. A driver that dies after producing a checkpoint's
  records but before recording its progress delivers that checkpoint again when it restarts. Every record carries
  the header ``keygroups-record-id`` = ``<job>/<checkpoint id>/<output file index>/<row>``, the same each time the
  same committed output is delivered: consumers that must see each record once drop a record whose id they have
  seen (ids of one checkpoint are contiguous, so remembering the last checkpoint id per job is enough for an
  ordered consumer of one partition).
* ``transactional=True`` — the records and the progress offset go in one Kafka transaction (``transactional_id``,
  default ``keygroups-sink.<job>.<topic>``; a restarted driver fences the dead one's producer and aborts its open
  transaction). On a broker that implements transactions fully (Apache Kafka 0.11 and later) this is
  **exactly-once** for consumers with ``isolation.level=read_committed``. **tansu 0.6 does not**: it commits,
  aborts and fences transactions, and hides an open one, but a read-committed consumer still receives the records of
  an *aborted* transaction (tests/test_kafka_sink.py checks this), so on tansu the sink is at-least-once either way
  and consumers deduplicate by ``keygroups-record-id``.
"""

from __future__ import annotations

import base64
import datetime
import decimal
import json
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from keygroups.checkpoint import CheckpointMetadata, CheckpointStorage
from keygroups.errors import KeyGroupsError
from keygroups.sources.kafka import QUIET_CLIENT

__all__ = ["KafkaSink", "KafkaSinkError", "SinkDelivery", "RECORD_ID_HEADER", "CHECKPOINT_HEADER"]

LOG = logging.getLogger("keygroups.kafka")

#: The header holding a record's dedup key, ``<job>/<checkpoint id>/<output file index>/<row>``.
RECORD_ID_HEADER = "keygroups-record-id"
#: The header holding the id of the checkpoint a record comes from.
CHECKPOINT_HEADER = "keygroups-checkpoint"
_NO_OFFSET = -1001


class KafkaSinkError(KeyGroupsError):
    """Records of a checkpoint could not be delivered; its progress was not recorded, so delivering again
    (``deliver_pending``) writes them again (with the same record ids)."""


@dataclass(frozen=True)
class SinkDelivery:
    """What one :meth:`KafkaSink.deliver` did: the checkpoint, how many records it produced (0 when ``skipped``:
    the checkpoint had been delivered before), and whether it went in a transaction."""

    checkpoint_id: int
    records: int
    skipped: bool
    transactional: bool


def _json_default(value: Any) -> Any:
    if isinstance(value, (datetime.datetime, datetime.date, datetime.time)):
        return value.isoformat()
    if isinstance(value, decimal.Decimal):
        return str(value)
    if isinstance(value, (bytes, bytearray, memoryview)):
        return base64.b64encode(bytes(value)).decode()
    if isinstance(value, datetime.timedelta):
        return value.total_seconds()
    raise TypeError(f"{type(value).__name__} is not JSON-serializable")


def _key_bytes(values: Sequence[Any]) -> bytes | None:
    """A record key from the key columns' values: one str as UTF-8, one bytes as it is, one int as its decimal
    digits, anything else (several columns) as a compact JSON array."""
    if len(values) == 1:
        (v,) = values
        if v is None:
            return None
        if isinstance(v, str):
            return v.encode()
        if isinstance(v, (bytes, bytearray)):
            return bytes(v)
        if isinstance(v, int) and not isinstance(v, bool):
            return str(v).encode()
    return json.dumps(list(values), separators=(",", ":"), ensure_ascii=False, default=_json_default).encode()


def _output_sink(metadata: CheckpointMetadata) -> str | None:
    """The name of the in-task sink that took checkpoint ``metadata``'s output instead of its output files (a job
    given ``sink=`` without ``checkpoint_output``; its subtask reports, in the properties, hold the sink's
    committables), None when the checkpoint holds its output."""
    if metadata.outputs or not isinstance(metadata.properties, Mapping):
        return None
    reports = metadata.properties.get("reports")
    for report in reports if isinstance(reports, list) else ():
        committable = report.get("sink_committable") if isinstance(report, Mapping) else None
        if isinstance(committable, Mapping):
            return str(committable.get("sink"))
    return None


class KafkaSink:
    """Writes a job's committed output to Kafka topic ``topic`` (see the module's docs for the guarantee).

    ``key_columns`` name the output columns that make the record key (the job's key); ``bootstrap_servers`` and
    ``producer_options`` (librdkafka producer settings) say where and how; ``timestamp_column`` (optional) names an
    output column whose value (a timestamp, or epoch ms) becomes the record's timestamp. Call
    :meth:`deliver` with each committed batch (``sink.deliver(job.storage, result.metadata)``), or give
    ``sink.batch_sink(job.storage)`` to ``KeyedJob.foreach_batch``."""

    def __init__(self, topic: str, *, key_columns: Sequence[str] | str, bootstrap_servers: str | None = None,
                 producer_options: Mapping[str, Any] | None = None, transactional: bool = False,
                 transactional_id: str | None = None, progress_group: str | None = None,
                 timestamp_column: str | None = None) -> None:
        try:
            import confluent_kafka  # noqa: F401
        except ImportError:
            raise ImportError("keygroups.sources.KafkaSink writes Kafka with librdkafka through confluent-kafka, "
                              "which is not installed: pip install 'keygroups[kafka]'") from None
        if not isinstance(topic, str) or not topic:
            raise ValueError(f"topic must be a topic name (a non-empty str), got {topic!r}")
        self.topic = topic
        self.key_columns = (key_columns,) if isinstance(key_columns, str) else tuple(key_columns)
        if not self.key_columns or not all(isinstance(c, str) and c for c in self.key_columns):
            raise ValueError(f"key_columns must name the output columns of the job's key, got {key_columns!r}")
        options = dict(producer_options or {})
        for owned in ("enable.idempotence", "transactional.id"):
            if owned in options:
                raise ValueError(f"producer option {owned!r} belongs to the sink (it is always idempotent; give "
                                 "transactional= and transactional_id= for transactions)")
        if bootstrap_servers is not None:
            options["bootstrap.servers"] = bootstrap_servers
        if not options.get("bootstrap.servers"):
            raise ValueError("give bootstrap_servers (host:port of a broker), or 'bootstrap.servers' in "
                             "producer_options")
        options.setdefault("partitioner", "murmur2_random")
        self.producer_options = options
        self.transactional = bool(transactional)
        self.transactional_id = transactional_id
        self.progress_group = progress_group
        self.timestamp_column = timestamp_column
        self._producer: Any = None
        self._producer_job: str | None = None

    @property
    def bootstrap_servers(self) -> str:
        return str(self.producer_options["bootstrap.servers"])

    def _group(self, job: str) -> str:
        return self.progress_group or f"keygroups-sink.{job}"

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_producer": None, "_producer_job": None}

    # ---- progress -----------------------------------------------------------------------------------------------

    def last_delivered(self, job: str) -> int | None:
        """The id of the last checkpoint of job ``job`` this sink delivered (None: none yet)."""
        from confluent_kafka import Consumer, KafkaException, TopicPartition

        consumer = Consumer({"bootstrap.servers": self.bootstrap_servers, "group.id": self._group(job),
                             "enable.auto.commit": False, "logger": LOG,
                             **{k: v for k, v in self.producer_options.items()
                                if k.startswith(("security.", "sasl.", "ssl."))}})
        try:
            (tp,) = consumer.committed([TopicPartition(self.topic, 0)], timeout=30)
        except KafkaException as e:
            raise KafkaSinkError(f"the sink's progress (consumer group {self._group(job)!r}, topic {self.topic!r}) "
                                 f"could not be read: {e.args[0] if e.args else e}") from None
        finally:
            consumer.close()
        return None if tp.offset == _NO_OFFSET or tp.offset < 0 else int(tp.offset)

    def _record_progress(self, job: str, checkpoint_id: int) -> None:
        from confluent_kafka import Consumer, TopicPartition

        consumer = Consumer({"bootstrap.servers": self.bootstrap_servers, "group.id": self._group(job),
                             "enable.auto.commit": False, "logger": LOG})
        try:
            consumer.commit(offsets=[TopicPartition(self.topic, 0, checkpoint_id)], asynchronous=False)
        finally:
            consumer.close()

    # ---- producing ----------------------------------------------------------------------------------------------

    def _producer_for(self, job: str) -> Any:
        from confluent_kafka import Producer

        if self._producer is not None and self._producer_job == job:
            return self._producer
        options = {**QUIET_CLIENT, **self.producer_options, "enable.idempotence": True, "logger": LOG}
        if self.transactional:
            options["transactional.id"] = self.transactional_id or f"keygroups-sink.{job}.{self.topic}"
        producer = Producer(options)
        if self.transactional:
            producer.init_transactions(60)   # fences a dead driver's producer, aborting its open transaction
        self._producer, self._producer_job = producer, job
        return producer

    def _rows(self, storage: CheckpointStorage, metadata: CheckpointMetadata) -> Any:
        from keygroups._parquet import read_parquet

        for index, relpath in enumerate(metadata.outputs):
            table = read_parquet(storage.read_bytes(relpath))   # Arrow's copy: see keygroups._parquet
            missing = [c for c in (*self.key_columns, *([self.timestamp_column] if self.timestamp_column else []))
                       if c not in table.column_names]
            if missing:
                raise ValueError(f"the sink's columns {missing} are not in checkpoint {metadata.checkpoint_id}'s "
                                 f"output (its columns: {table.column_names})")
            for row_index, row in enumerate(table.to_pylist()):
                yield index, row_index, row

    def deliver(self, storage: CheckpointStorage, metadata: CheckpointMetadata) -> SinkDelivery:
        """Produce the output of the committed checkpoint ``metadata`` (in ``storage``), unless this sink already
        delivered it or a later one; then record it as delivered. KafkaSinkError if a record is refused (nothing is
        recorded: delivering again writes the checkpoint again)."""
        job, cid = metadata.job_id, metadata.checkpoint_id
        elsewhere = _output_sink(metadata)
        if elsewhere is not None:
            raise KafkaSinkError(f"checkpoint {cid} of job {job!r} holds no output files: its output went to the job's "
                                 f"in-task sink {elsewhere!r} (KeyedJob(sink=...)), which this sink cannot read. "
                                 "Give the job checkpoint_output=True to keep the output in the checkpoint too, or "
                                 "write to Kafka from the job's own sink")
        last = self.last_delivered(job)
        if last is not None and cid <= last:
            return SinkDelivery(cid, 0, True, self.transactional)
        producer = self._producer_for(job)
        errors: list[str] = []

        def delivered(error: Any, message: Any) -> None:
            if error is not None:
                errors.append(f"{message.topic()}[{message.partition()}]: {error.str()}")

        if self.transactional:
            producer.begin_transaction()
        n = 0
        try:
            for file_index, row_index, row in self._rows(storage, metadata):
                kwargs: dict[str, Any] = {
                    "value": json.dumps(row, separators=(",", ":"), ensure_ascii=False,
                                        default=_json_default).encode(),
                    "key": _key_bytes([row[c] for c in self.key_columns]),
                    "headers": [(RECORD_ID_HEADER, f"{job}/{cid}/{file_index}/{row_index}".encode()),
                                (CHECKPOINT_HEADER, str(cid).encode())],
                    "on_delivery": delivered,
                }
                if self.timestamp_column is not None and row[self.timestamp_column] is not None:
                    ts = row[self.timestamp_column]
                    kwargs["timestamp"] = (int(ts.timestamp() * 1000) if isinstance(ts, datetime.datetime)
                                           else int(ts))
                while True:
                    try:
                        producer.produce(self.topic, **kwargs)
                        break
                    except BufferError:
                        producer.poll(0.05)
                n += 1
            if self.transactional:
                self._commit_transaction(producer, job, cid, errors)
            else:
                left = producer.flush(60)
                if left or errors:
                    raise KafkaSinkError(f"checkpoint {cid} of job {job!r} to topic {self.topic!r}: {left} records "
                                         f"not delivered, errors {errors[:5]}; its progress was not recorded")
                self._record_progress(job, cid)
        except BaseException:
            if self.transactional:
                self._abort(producer)
            raise
        LOG.info("sink %s: checkpoint %d of job %s delivered, %d records", self.topic, cid, job, n)
        return SinkDelivery(cid, n, False, self.transactional)

    def _commit_transaction(self, producer: Any, job: str, cid: int, errors: list[str]) -> None:
        from confluent_kafka import Consumer, TopicPartition

        consumer = Consumer({"bootstrap.servers": self.bootstrap_servers, "group.id": self._group(job),
                             "enable.auto.commit": False, "logger": LOG})
        try:
            producer.send_offsets_to_transaction([TopicPartition(self.topic, 0, cid)],
                                                 consumer.consumer_group_metadata(), 60)
        finally:
            consumer.close()
        producer.commit_transaction(60)
        if errors:   # a record refused inside a committed transaction cannot happen: commit fails first
            raise KafkaSinkError(f"checkpoint {cid}: records refused: {errors[:5]}")

    def _abort(self, producer: Any) -> None:
        try:
            producer.abort_transaction(30)
        except Exception as e:
            LOG.warning("sink %s: aborting the transaction failed (%s); the next producer fences it", self.topic, e)
        self._producer = None   # a fresh producer (and init_transactions) for the next delivery

    def deliver_pending(self, storage: CheckpointStorage, job: str | None = None) -> list[SinkDelivery]:
        """Deliver every retained complete checkpoint of ``storage`` after the last one delivered (a restarted
        driver calls this first). ``job`` defaults to the latest checkpoint's job."""
        ids = storage.checkpoint_ids()
        if not ids:
            return []
        latest = storage.load(ids[-1])
        last = self.last_delivered(job or latest.job_id)
        out = []
        for cid in ids:
            if last is None or cid > last:
                out.append(self.deliver(storage, latest if cid == ids[-1] else storage.load(cid)))
        return out

    def batch_sink(self, storage: CheckpointStorage) -> Any:
        """A ``KeyedJob.foreach_batch`` sink, ``(output, batch_id, result) -> None``, that delivers each batch's
        committed checkpoint of ``storage`` (the job's, ``job.storage``)."""
        def sink(output: Any, batch_id: int, result: Any) -> None:
            self.deliver(storage, result.metadata)

        return sink

    def close(self) -> None:
        if self._producer is not None:
            self._producer.flush(30)
            self._producer = None

    def __repr__(self) -> str:
        mode = "transactional" if self.transactional else "at-least-once"
        return f"KafkaSink({self.topic!r} at {self.bootstrap_servers}, {mode})"
