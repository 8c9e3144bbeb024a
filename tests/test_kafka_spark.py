"""KeyedJob.run_source_batch on a Kafka topic, on local Spark: the source subtasks are Spark tasks reading the broker,
rescaled between batches, on event time from the records' own timestamps; the Kafka positions in
``keygroups inspect``; the sink as a foreach_batch-style delivery of each committed batch."""

from __future__ import annotations

import datetime
import json

import pytest

from kafka_broker import consume_all, kafka_broker, new_topic  # noqa: F401  (the fixture)
from keygroups.cli import main as keygroups_main
from keygroups.cli import shop
from keygroups.runtime import WatermarkStrategy
from keygroups.sources import KafkaSink, KafkaSource
from keygroups.spark import KeyedJob
from shop_runtime import final_states

pytestmark = pytest.mark.spark

MAX_PARALLELISM = 32


def test_kafka_topic_into_a_keyed_job_rescaled_on_record_time(spark, kafka_broker, tmp_path, capsys):
    from confluent_kafka import Consumer, Producer, TopicPartition

    topic = new_topic(kafka_broker, 4)
    arrivals = shop.generate_arrivals(1200, 100, 4, 3, seed=9)      # what the topic gains before each batch
    events = {p: [e for batch in arrivals for e in batch[p]] for p in range(4)}
    expected_state, expected_orders = shop.reference(events)
    producer = Producer({"bootstrap.servers": kafka_broker.bootstrap_servers, "enable.idempotence": True})
    location = str(tmp_path / "chk")
    group = f"carts-{topic}"
    source = KafkaSource(topic, bootstrap_servers=kafka_broker.bootstrap_servers, group_id=group)
    out_topic = new_topic(kafka_broker, 2, prefix="orders")
    sink = KafkaSink(out_topic, key_columns="user", bootstrap_servers=kafka_broker.bootstrap_servers)
    orders, latest = [], 0
    for batch, parallelism in zip(arrivals, [3, 1, 4]):
        for partition, records in batch.items():
            for e in records:   # the record's timestamp is the event's time: the job's event time
                producer.produce(topic, value=json.dumps(e).encode(), key=e["user"].encode(), partition=partition,
                                 timestamp=e["ts"])
        assert producer.flush(60) == 0
        latest = max([latest] + [e["ts"] for records in batch.values() for e in records])
        # a new job object per run: stopped and resumed from the checkpoints, at another parallelism
        job = KeyedJob("carts", "user", shop.CartFunction(), output_schema=shop.ORDER_SCHEMA,
                       max_parallelism=MAX_PARALLELISM, checkpoint_location=location,
                       order_by=("_partition", "_offset"), timestamp_column="_timestamp",
                       watermark_strategy=WatermarkStrategy.for_bounded_out_of_orderness(datetime.timedelta(0)))
        result = job.run_source_batch(spark, source, parallelism=parallelism, record_schema=shop.EVENT_SCHEMA)
        orders += [tuple(r) for r in result.output.collect()]
        sink.deliver(job.storage, result.metadata)
        assert result.watermark == latest - 1 and result.records_late == 0
        # typed from the Spark tasks: the split positions each source subtask holds after the batch
        assert len(result.source_reports) == parallelism
        assert sum(r.records for r in result.source_reports) == sum(len(records) for records in batch.values())
    assert sorted(orders) == sorted(expected_orders)
    assert final_states(location, MAX_PARALLELISM) == expected_state
    consumer = Consumer({"bootstrap.servers": kafka_broker.bootstrap_servers, "group.id": group})
    committed = consumer.committed([TopicPartition(topic, p) for p in range(4)], timeout=10)
    consumer.close()
    assert [tp.offset for tp in committed] == [len(events[p]) for p in range(4)]   # reported after the commit
    held = {k: o for r in result.source_reports for k, o in r.offsets().items()}
    assert held == {(topic, p): len(events[p]) for p in range(4)}
    delivered = sorted(tuple(json.loads(m.value())[c] for c in shop.ORDER_SCHEMA.names)
                       for m in consume_all(kafka_broker, out_topic))
    assert delivered == sorted(expected_orders)
    assert keygroups_main(["inspect", location]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("source positions, Kafka topic"))
    for p in range(4):
        assert f" {p}:{len(events[p])}@" in line
