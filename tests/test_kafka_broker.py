"""What the tansu broker does and does not do, as keygroups.sources.local_broker documents it: each claim the source,
the sink and their docs rely on, checked against the real binary (so that a tansu upgrade that changes one shows
here, not as a puzzling failure elsewhere)."""

from __future__ import annotations

import json

import pytest

from kafka_broker import consume_all, kafka_broker, new_topic, produce  # noqa: F401  (the fixture)
from keygroups.sources import LocalKafkaBroker


def test_a_broker_starts_on_a_free_loopback_port_and_stops(kafka_broker):
    other = LocalKafkaBroker().start()
    try:
        assert other.port != kafka_broker.port and other.pid is not None
        assert other.bootstrap_servers.startswith("127.0.0.1:")
    finally:
        other.stop()
    assert other.pid is None


def test_transactions_commit_fence_and_hide_open_ones_but_not_aborted_ones(kafka_broker):
    from confluent_kafka import KafkaException, Producer

    topic = new_topic(kafka_broker, 1)
    servers = kafka_broker.bootstrap_servers
    producer = Producer({"bootstrap.servers": servers, "transactional.id": f"tx-{topic}"})
    producer.init_transactions(30)
    producer.begin_transaction()
    producer.produce(topic, value=b"committed", partition=0)
    producer.commit_transaction(30)
    producer.begin_transaction()
    producer.produce(topic, value=b"aborted", partition=0)
    producer.flush(30)
    producer.abort_transaction(30)
    producer.begin_transaction()
    producer.produce(topic, value=b"open", partition=0)
    producer.flush(30)
    seen = [m.value() for m in consume_all(kafka_broker, topic)]
    assert b"open" not in seen                      # the last stable offset holds back an open transaction
    assert b"committed" in seen
    assert b"aborted" in seen                       # tansu 0.6: an aborted transaction stays visible
    zombie_fencer = Producer({"bootstrap.servers": servers, "transactional.id": f"tx-{topic}"})
    zombie_fencer.init_transactions(30)
    with pytest.raises(KafkaException, match="fences"):
        producer.produce(topic, value=b"zombie", partition=0)
        producer.commit_transaction(30)


def test_no_create_partitions_no_delete_records_and_no_retention(kafka_broker):
    from confluent_kafka import KafkaException, TopicPartition
    from confluent_kafka.admin import AdminClient, NewPartitions

    topic = new_topic(kafka_broker, 2)
    admin = AdminClient({"bootstrap.servers": kafka_broker.bootstrap_servers})
    with pytest.raises(KafkaException, match="CreatePartitions"):
        admin.create_partitions([NewPartitions(topic, 4)])[topic].result(30)
    produce(kafka_broker, topic, {0: [{"i": i} for i in range(3)]})
    with pytest.raises(KafkaException):
        admin.delete_records([TopicPartition(topic, 0, 2)], request_timeout=10)[TopicPartition(topic, 0, 2)].result(15)


def test_list_offsets_latest_lags_a_multi_record_batch_but_fetch_answers_have_the_end(kafka_broker):
    from confluent_kafka import Consumer, TopicPartition

    topic = new_topic(kafka_broker, 1)
    produce(kafka_broker, topic, {0: [{"i": i} for i in range(10)]}, options={"linger.ms": 50})
    consumer = Consumer({"bootstrap.servers": kafka_broker.bootstrap_servers, "group.id": "probe"})
    _, listed_end = consumer.get_watermark_offsets(TopicPartition(topic, 0), timeout=10, cached=False)
    consumer.close()
    assert listed_end < 10                          # one produce request of 10 records: "latest" is 1
    assert len(consume_all(kafka_broker, topic)) == 10   # reading to the fetch answer's high watermark


def test_a_fetch_past_the_end_gets_no_answer_not_offset_out_of_range(kafka_broker):
    from confluent_kafka import Consumer, TopicPartition

    topic = new_topic(kafka_broker, 1)
    produce(kafka_broker, topic, {0: [json.dumps({"i": 1}).encode()]}, raw=True)
    consumer = Consumer({"bootstrap.servers": kafka_broker.bootstrap_servers, "group.id": "probe",
                         "auto.offset.reset": "error", "enable.partition.eof": True})
    consumer.assign([TopicPartition(topic, 0, 50)])
    messages = consumer.consume(10, timeout=2)
    _, high = consumer.get_watermark_offsets(TopicPartition(topic, 0), cached=True)
    consumer.close()
    assert messages == [] and high == 1             # no error, no end-of-partition; the cached end says 1
