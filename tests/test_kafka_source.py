"""KafkaSource against a real broker (tansu on 127.0.0.1, confluent-kafka): FLIP-8's example with Kafka's own
partitions, discovery, decoding, lost positions and the consumer-group report; the keyed stage through the same
driver the Spark job uses (tests/shop_runtime.py), without Spark."""

from __future__ import annotations

import dataclasses
import json
import tempfile
from collections import Counter

import pyarrow as pa
import pytest

from kafka_broker import kafka_broker, new_topic, produce  # noqa: F401  (the fixture)
from keygroups.checkpoint import CheckpointMetadata, CheckpointStorage
from keygroups.cli import shop
from keygroups.runtime import begin_batch
from keygroups.runtime.report import SourceReport, SplitPosition
from keygroups.runtime.source import as_source, run_source_subtask
from keygroups.serializers import Int64Serializer, StrSerializer, TupleSerializer
from keygroups.sources import (
    KAFKA_PARTITIONS_STATE,
    KAFKA_SPLITS_STATE,
    KafkaDecodeError,
    KafkaPositionError,
    KafkaSource,
    KafkaSourceError,
    KafkaSplitReader,
    source_positions,
    split_owner,
)
from keygroups.state import ListStateDescriptor, OperatorStateStore, checkpoint_function, initialize_function
from shop_runtime import final_states, rows, run_batch

SCHEMA = pa.schema([("p", pa.int64()), ("seq", pa.int64()), ("text", pa.string())])


def records(partition: int, n: int, start: int = 0) -> list[dict]:
    return [{"p": partition, "seq": i, "text": "é" * (i % 4)} for i in range(start, n)]


class Job:
    """The source subtasks of one batch at one parallelism, reading a prepared KafkaSource and checkpointing into
    real storage (the FLIP-8 plan without the keyed stage)."""

    def __init__(self, source, storage, parallelism, metadata=None):
        self.storage = storage
        prepared = source.prepare(metadata)
        self.stores, self.readers = [], []
        for i in range(parallelism):
            store = OperatorStateStore(i, parallelism)
            if metadata is not None:
                store.restore(storage, metadata)
            reader = prepared.create_reader()
            initialize_function(reader, store)
            self.stores.append(store)
            self.readers.append(reader)

    def poll(self, max_records=None):
        got = []
        for reader in self.readers:
            table = reader.poll_arrow(max_records, SCHEMA)
            got += list(zip(table.column("p").to_pylist(), table.column("seq").to_pylist()))
        return got

    def checkpoint(self, checkpoint_id):
        handles = [checkpoint_function(r, s, checkpoint_id, 1000 * checkpoint_id, self.storage).result(timeout=60)
                   for r, s in zip(self.readers, self.stores)]
        for r in self.readers:
            r.close()
        self.storage.commit(CheckpointMetadata(
            checkpoint_id=checkpoint_id, job_id="kafka-tests", timestamp_ms=1000 * checkpoint_id,
            max_parallelism=128, parallelism=len(self.stores), keyed_handles=[], operator_handles=handles,
            properties={}))
        return self.storage.load(checkpoint_id)


@pytest.fixture
def four(kafka_broker):
    topic = new_topic(kafka_broker, 4)
    produce(kafka_broker, topic, {p: records(p, 10 + p) for p in range(4)})
    return KafkaSource(topic, bootstrap_servers=kafka_broker.bootstrap_servers), topic


def everything(n_partitions=4, base=10):
    return Counter((p, i) for p in range(n_partitions) for i in range(base + p))


# ---- FLIP-8 with Kafka partitions ---------------------------------------------------------------------------------


def test_split_owner_is_flinks_get_split_owner():
    # Java: "hello".hashCode() == 99162322, "topic".hashCode() == 110546223 (the JDK's String.hashCode)
    assert ((99162322 * 31) & 0x7FFFFFFF) % 4 == split_owner("hello", 0, 4)
    assert [split_owner("topic", p, 3) for p in range(6)] == [((110546223 * 31 & 0x7FFFFFFF) % 3 + p) % 3
                                                             for p in range(6)]
    # one topic's partitions go round the subtasks: 4 partitions over 4 subtasks, one each
    assert sorted(split_owner("orders", p, 4) for p in range(4)) == [0, 1, 2, 3]
    # wrap-around of Java's int arithmetic: a long name whose hash overflows
    assert 0 <= split_owner("x" * 1000, 7, 5) < 5


def test_flip8_scale_down_2_to_1_continues_every_partition(four, tmp_path):
    source, topic = four
    storage = CheckpointStorage(tmp_path / "chk")
    job = Job(source, storage, 2)
    assert sorted(p for r in job.readers for _, p in r.partitions) == [0, 1, 2, 3]
    consumed = job.poll(3) + job.poll(4)
    positions = sorted(s for r in job.readers for s in r.splits)
    md = job.checkpoint(1)
    resumed = Job(source, storage, 1, md)
    (one,) = resumed.readers
    assert one.splits == positions                 # all four partitions, each at its stored offset
    consumed += resumed.poll(None)
    assert Counter(consumed) == everything()       # nothing skipped, nothing twice
    assert one.splits == [(topic, p, 10 + p) for p in range(4)]


def test_flip8_scale_up_2_to_4_gives_each_subtask_one_partition(four, tmp_path):
    source, _ = four
    storage = CheckpointStorage(tmp_path / "chk")
    job = Job(source, storage, 2)
    consumed = job.poll(5)
    md = job.checkpoint(1)
    four_subtasks = Job(source, storage, 4, md)
    assert sorted(len(r.partitions) for r in four_subtasks.readers) == [1, 1, 1, 1]
    consumed += four_subtasks.poll(None)
    assert Counter(consumed) == everything()
    md = four_subtasks.checkpoint(2)
    assert sorted((p.topic, p.partition, p.offset) for p in source_positions(storage, md)) == \
        [(source.topics[0], p, 10 + p) for p in range(4)]
    assert {p.subtask for p in source_positions(storage, md)} == {0, 1, 2, 3}


def test_a_batch_that_is_not_committed_is_read_again(four, tmp_path):
    source, _ = four
    storage = CheckpointStorage(tmp_path / "chk")
    job = Job(source, storage, 3)
    first = job.poll(4)
    md = job.checkpoint(1)
    lost = Job(source, storage, 2, md).poll(5)     # a batch that dies before its checkpoint commits
    again = Job(source, storage, 2, md).poll(5)
    assert sorted(lost) == sorted(again) and lost
    rest = Job(source, storage, 1, md).poll(None)
    assert Counter(first + rest) == everything()


def test_a_savepoint_restarts_the_source_at_its_positions_at_any_parallelism(four, tmp_path):
    source, _ = four
    storage = CheckpointStorage(tmp_path / "chk")
    job = Job(source, storage, 2)
    job.poll(4)
    md = job.checkpoint(1)
    storage.savepoint(md, "before-the-rest")
    job = Job(source, storage, 3, md)
    rest = job.poll(None)
    job.checkpoint(2)
    again = Job(source, storage, 1, storage.load_savepoint("before-the-rest"))   # Flink's -s, at parallelism 1
    assert sorted(again.poll(None)) == sorted(rest) and rest


def test_more_subtasks_than_partitions(kafka_broker, tmp_path):
    topic = new_topic(kafka_broker, 2)
    produce(kafka_broker, topic, {0: records(0, 3), 1: records(1, 2)})
    source = KafkaSource(topic, bootstrap_servers=kafka_broker.bootstrap_servers)
    storage = CheckpointStorage(tmp_path / "chk")
    job = Job(source, storage, 5)
    assert sorted(len(r.partitions) for r in job.readers) == [0, 0, 0, 1, 1]
    consumed = job.poll(1)
    job = Job(source, storage, 3, job.checkpoint(1))
    consumed += job.poll(None)
    assert Counter(consumed) == Counter([(0, 0), (0, 1), (0, 2), (1, 0), (1, 1)])


# ---- the keyed job on Kafka, exactly once, both backends -------------------------------------------------------


@pytest.mark.parametrize("backend", ["heap", "rocksdb"])
def test_shop_job_on_kafka_rescaled_ends_at_the_reference(kafka_broker, tmp_path, backend):
    topic = new_topic(kafka_broker, 4)
    events = shop.generate_events(1200, 90, 4, seed=5)
    produce(kafka_broker, topic, events, key="user")
    expected_state, expected_orders = shop.reference(events)
    source = KafkaSource(topic, bootstrap_servers=kafka_broker.bootstrap_servers)
    location = str(tmp_path / "chk")
    orders, read = [], 0
    for parallelism, max_records in [(2, 150), (1, 200), (4, 60), (3, None)]:
        metadata, table, n = run_batch(location, source, shop.CartFunction(), parallelism, max_records,
                                       backend=backend, local_dir=str(tmp_path / "local"))
        orders += rows(table)
        read += n
    assert read == 1200
    assert sorted(orders) == sorted(expected_orders)
    assert final_states(location) == expected_state


# ---- discovery ----------------------------------------------------------------------------------------------------


def test_a_new_topic_matching_the_pattern_is_discovered_from_its_earliest_offset(kafka_broker, tmp_path):
    prefix = f"disc-{tempfile.mktemp(dir='').strip('/').replace('/', '')[-8:]}"
    first = f"{prefix}-a"
    kafka_broker.create_topic(first, 2)
    produce(kafka_broker, first, {0: records(0, 3), 1: records(1, 2)})
    source = KafkaSource(pattern=rf"{prefix}-.*", bootstrap_servers=kafka_broker.bootstrap_servers)
    storage = CheckpointStorage(tmp_path / "chk")
    job = Job(source, storage, 3)
    consumed = job.poll(None)
    md = job.checkpoint(1)
    second = f"{prefix}-b"
    kafka_broker.create_topic(second, 3)
    produce(kafka_broker, second, {p: records(10 + p, 4) for p in range(3)})
    job = Job(source, storage, 2, md)
    discovered = sorted(tuple(d) for r in job.readers for d in r.discovered)
    assert discovered == [(second, p) for p in range(3)]
    for reader in job.readers:   # each new partition went to the subtask Flink's enumerator names
        assert all(split_owner(t, p, 2) == job.readers.index(reader) for t, p in reader.discovered)
    consumed += job.poll(None)
    expected = Counter([(0, i) for i in range(3)] + [(1, i) for i in range(2)]
                       + [(10 + p, i) for p in range(3) for i in range(4)])
    assert Counter(consumed) == expected
    md = job.checkpoint(2)
    # rescaled afterwards: the union state knows every partition, so nothing is "discovered" twice
    again = Job(source, storage, 4, md)
    assert not any(r.discovered for r in again.readers) and again.poll(None) == []


def test_a_topic_no_longer_subscribed_keeps_its_position_unread(four, kafka_broker, tmp_path):
    source, topic = four
    other = new_topic(kafka_broker, 1)
    produce(kafka_broker, other, {0: records(9, 5)})
    storage = CheckpointStorage(tmp_path / "chk")
    both = KafkaSource([topic, other], bootstrap_servers=kafka_broker.bootstrap_servers)
    job = Job(both, storage, 2)
    job.poll(1)
    md = job.checkpoint(1)
    held = sorted(s for r in job.readers for s in r.splits)
    only_other = KafkaSource(other, bootstrap_servers=kafka_broker.bootstrap_servers)
    job = Job(only_other, storage, 2, md)
    got = job.poll(None)
    assert {p for p, _ in got} == {9}
    md = job.checkpoint(2)
    kept = sorted(s for r in job.readers for s in r.splits if s[0] == topic)
    assert kept == [s for s in held if s[0] == topic]      # carried, unread: subscribing again resumes there


def test_starting_offsets_latest_and_committed(kafka_broker, tmp_path):
    from confluent_kafka import Consumer, TopicPartition

    topic = new_topic(kafka_broker, 2)
    # one record per produce request: tansu's ListOffsets "latest" is right for single-record batches
    produce(kafka_broker, topic, {0: records(0, 3), 1: records(1, 2)}, options={"linger.ms": 0,
                                                                              "batch.num.messages": 1})
    latest = KafkaSource(topic, bootstrap_servers=kafka_broker.bootstrap_servers, starting_offsets="latest")
    job = Job(latest, CheckpointStorage(tmp_path / "a"), 1)
    assert job.readers[0].splits == [(topic, 0, 3), (topic, 1, 2)] and job.poll(None) == []
    group = f"g-{topic}"
    c = Consumer({"bootstrap.servers": kafka_broker.bootstrap_servers, "group.id": group})
    c.commit(offsets=[TopicPartition(topic, 0, 1)], asynchronous=False)
    c.close()
    committed = KafkaSource(topic, bootstrap_servers=kafka_broker.bootstrap_servers, starting_offsets="committed",
                            group_id=group, commit_offsets=False)
    job = Job(committed, CheckpointStorage(tmp_path / "b"), 1)
    assert job.readers[0].splits == [(topic, 0, 1), (topic, 1, 0)]   # partition 1 has none: earliest
    assert sorted(job.poll(None)) == [(0, 1), (0, 2), (1, 0), (1, 1)]


# ---- records: metadata columns, event time, formats ---------------------------------------------------------------


def test_staged_records_carry_topic_partition_offset_timestamp_and_key(kafka_broker):
    from confluent_kafka import Producer

    topic = new_topic(kafka_broker, 2)
    producer = Producer({"bootstrap.servers": kafka_broker.bootstrap_servers})
    for i in range(4):
        producer.produce(topic, value=json.dumps({"p": i % 2, "seq": i}).encode(), key=f"k{i}".encode(),
                         partition=i % 2, timestamp=1_700_000_000_000 + i)
    producer.produce(topic, value=b'{"p": 1, "seq": 9, "extra": [1, 2]}', partition=1, timestamp=5)
    producer.flush(30)
    source = KafkaSource(topic, bootstrap_servers=kafka_broker.bootstrap_servers)
    reader = Job(source, CheckpointStorage(tempfile.mkdtemp()), 1).readers[0]
    table = reader.poll_arrow(None, SCHEMA)
    assert table.schema == source.staged_schema(SCHEMA)
    got = sorted(table.to_pylist(), key=lambda r: (r["_partition"], r["_offset"]))
    assert [(r["_topic"], r["_partition"], r["_offset"], r["seq"]) for r in got] == \
        [(topic, 0, 0, 0), (topic, 0, 1, 2), (topic, 1, 0, 1), (topic, 1, 1, 3), (topic, 1, 2, 9)]
    assert [r["_key"] for r in got] == [b"k0", b"k2", b"k1", b"k3", None]
    assert [r["_timestamp"] for r in got] == \
        [1_700_000_000_000, 1_700_000_000_002, 1_700_000_000_001, 1_700_000_000_003, 5]
    assert got[-1]["text"] is None                 # missing fields are null; fields not in the schema ignored


def test_raw_values_with_and_without_a_decoder(kafka_broker):
    topic = new_topic(kafka_broker, 1)
    produce(kafka_broker, topic, {0: [b"a,1", b"b,2", b"skip", b"c,3"]}, raw=True)

    def decode(value: bytes):
        if value == b"skip":
            return None
        name, n = value.decode().split(",")
        return {"name": name, "n": int(n)}

    storage = CheckpointStorage(tempfile.mkdtemp())
    plain = KafkaSource(topic, bootstrap_servers=kafka_broker.bootstrap_servers, value_format="raw")
    table = Job(plain, storage, 1).readers[0].poll_arrow(None, None)
    assert table.column("value").to_pylist() == [b"a,1", b"b,2", b"skip", b"c,3"]
    decoded = KafkaSource(topic, bootstrap_servers=kafka_broker.bootstrap_servers, value_format="raw",
                          decoder=decode)
    schema = pa.schema([("name", pa.string()), ("n", pa.int32())])
    reader = Job(decoded, storage, 1).readers[0]
    table = reader.poll_arrow(None, schema)
    assert table.select(["name", "n", "_offset"]).to_pylist() == [
        {"name": "a", "n": 1, "_offset": 0}, {"name": "b", "n": 2, "_offset": 1}, {"name": "c", "n": 3, "_offset": 3}]
    assert reader.splits == [(topic, 0, 4)]         # the dropped record is consumed too


BAD_VALUES = [
    (b"not json", "not JSON"),
    (b"null", "JSON NoneType, not an object"),
    (b"[1, 2]", "not an object"),
    (b'{"p": 1} {"p": 2}', "not JSON"),
    (b'{"p": "seven"}', "changed from number to string"),
    (b"\xff\xfe{}", "not UTF-8"),
    (None, "null (a tombstone)"),
]


@pytest.mark.parametrize("bad, why", BAD_VALUES, ids=[repr(b)[:20] for b, _ in BAD_VALUES])
def test_an_undecodable_record_fails_the_batch_naming_topic_partition_and_offset(kafka_broker, tmp_path, bad, why):
    topic = new_topic(kafka_broker, 2)
    good = [json.dumps(r).encode() for r in records(1, 5)]
    produce(kafka_broker, topic, {0: [json.dumps(r).encode() for r in records(0, 2)], 1: good[:3] + [bad] + good[3:]},
            raw=True)
    source = KafkaSource(topic, bootstrap_servers=kafka_broker.bootstrap_servers)
    storage = CheckpointStorage(tmp_path / "chk")
    plan = begin_batch(storage, job_name="j", max_parallelism=16, parallelism=1)
    spec = plan.source_task(source, record_schema=SCHEMA)
    with pytest.raises(KafkaDecodeError) as err:
        run_source_subtask(spec, 0)
    assert (err.value.topic, err.value.partition, err.value.offset) == (topic, 1, 3)
    assert f"topic {topic!r} partition 1 offset 3" in str(err.value) and why in str(err.value)
    assert "on_decode_error='skip'" in str(err.value)
    assert storage.checkpoint_ids() == []           # nothing committed; the rerun meets the same record
    skipping = KafkaSource(topic, bootstrap_servers=kafka_broker.bootstrap_servers, on_decode_error="skip")
    report = run_source_subtask(dataclasses.replace(spec, source=skipping.prepare(None)), 0)
    assert report.records == 7 and report.records_skipped == 1
    assert report.notes["skipped"][0]["offset"] == 3
    assert report.positions == (SplitPosition(topic, 0, 2), SplitPosition(topic, 1, 6))
    assert SourceReport.from_json(report.to_json()) == report    # as a Spark task hands it to the driver


def test_a_decoder_that_raises_or_returns_a_non_dict(kafka_broker, tmp_path):
    topic = new_topic(kafka_broker, 1)
    produce(kafka_broker, topic, {0: [b"1", b"2", b"x"]}, raw=True)
    schema = pa.schema([("n", pa.int64())])
    source = KafkaSource(topic, bootstrap_servers=kafka_broker.bootstrap_servers, value_format="raw",
                         decoder=lambda v: {"n": int(v)})
    reader = Job(source, CheckpointStorage(tmp_path / "a"), 1).readers[0]
    with pytest.raises(KafkaDecodeError, match=rf"topic '{topic}' partition 0 offset 2.*ValueError"):
        reader.poll_arrow(None, schema)
    odd = KafkaSource(topic, bootstrap_servers=kafka_broker.bootstrap_servers, value_format="raw",
                      decoder=lambda v: {"n": "many"} if v == b"2" else [1], on_decode_error="skip")
    reader = Job(odd, CheckpointStorage(tmp_path / "b"), 1).readers[0]
    table = reader.poll_arrow(None, schema)
    skipped = reader.report()["skipped"]
    assert table.num_rows == 0 and [s["offset"] for s in skipped] == [0, 1, 2]
    assert "does not fit the record schema" in skipped[1]["why"] and "not a dict" in skipped[2]["why"]


# ---- lost positions -----------------------------------------------------------------------------------------------


def _state_with_split(storage, topic, partition, offset, topic_id=""):
    """A committed checkpoint whose Kafka split says ``(topic, partition, offset)``, as a job would have left it."""
    store = OperatorStateStore(0, 1)
    ser = TupleSerializer(StrSerializer(), Int64Serializer(), Int64Serializer())
    store.get_list_state(ListStateDescriptor(KAFKA_SPLITS_STATE, ser)).add((topic, partition, offset))
    store.get_union_list_state(ListStateDescriptor(
        KAFKA_PARTITIONS_STATE, TupleSerializer(StrSerializer(), Int64Serializer(), StrSerializer()))
    ).add((topic, partition, topic_id))
    handle = store.snapshot(1, storage).result(timeout=60)
    storage.commit(CheckpointMetadata(checkpoint_id=1, job_id="j", timestamp_ms=0, max_parallelism=16,
                                      parallelism=1, keyed_handles=[], operator_handles=[handle], properties={}))
    return storage.load(1)


def test_a_position_past_the_end_is_refused_or_reset(kafka_broker, tmp_path):
    topic = new_topic(kafka_broker, 1)
    produce(kafka_broker, topic, {0: records(0, 5)})
    storage = CheckpointStorage(tmp_path / "chk")
    md = _state_with_split(storage, topic, 0, 1000)
    source = KafkaSource(topic, bootstrap_servers=kafka_broker.bootstrap_servers, fetch_timeout=20)
    job = Job(source, storage, 1, md)
    with pytest.raises(KafkaPositionError) as err:
        job.poll(None)
    assert (err.value.topic, err.value.partition, err.value.offset) == (topic, 0, 1000)
    assert "out of the partition's range" in str(err.value) and "ends at offset 5" in str(err.value)
    lenient = KafkaSource(topic, bootstrap_servers=kafka_broker.bootstrap_servers, on_position_lost="earliest")
    job = Job(lenient, storage, 1, md)
    assert sorted(job.poll(None)) == [(0, i) for i in range(5)]
    assert job.readers[0].resets[0]["from"] == 1000 and job.readers[0].report()["resets"]


def test_a_topic_deleted_and_created_again_is_noticed_by_its_id(kafka_broker, tmp_path):
    topic = new_topic(kafka_broker, 2)
    produce(kafka_broker, topic, {0: records(0, 3), 1: records(1, 3)})
    source = KafkaSource(topic, bootstrap_servers=kafka_broker.bootstrap_servers)
    storage = CheckpointStorage(tmp_path / "chk")
    job = Job(source, storage, 1)
    job.poll(None)
    md = job.checkpoint(1)
    kafka_broker.delete_topic(topic)
    kafka_broker.create_topic(topic, 3)             # more partitions than before, and more records than offset 3
    produce(kafka_broker, topic, {p: records(20 + p, 6) for p in range(3)})
    with pytest.raises(KafkaPositionError, match="deleted and created again") as err:
        Job(source, storage, 1, md)
    assert err.value.topic == topic and err.value.offset == 3
    lenient = KafkaSource(topic, bootstrap_servers=kafka_broker.bootstrap_servers, on_position_lost="earliest")
    job = Job(lenient, storage, 2, md)
    assert Counter(job.poll(None)) == Counter((20 + p, i) for p in range(3) for i in range(6))
    assert sorted(tuple(d) for r in job.readers for d in r.discovered) == [(topic, 2)]


def test_a_deleted_topic(kafka_broker, tmp_path):
    topic = new_topic(kafka_broker, 2, prefix="gone")
    produce(kafka_broker, topic, {0: records(0, 2), 1: records(1, 2)})
    storage = CheckpointStorage(tmp_path / "chk")
    job = Job(KafkaSource(topic, bootstrap_servers=kafka_broker.bootstrap_servers), storage, 1)
    job.poll(None)
    md = job.checkpoint(1)
    md = dataclasses.replace(md, properties={"source_reports": [{"positions": [list(s) for s in
                                                                               job.readers[0].splits]}]})
    kafka_broker.delete_topic(topic)
    listed = KafkaSource(topic, bootstrap_servers=kafka_broker.bootstrap_servers)
    with pytest.raises(KafkaSourceError, match=rf"'{topic}' does not exist.*partition 0 at offset 2"):
        listed.prepare(md)                          # refused on the driver, before any task
    by_pattern = KafkaSource(pattern=topic, bootstrap_servers=kafka_broker.bootstrap_servers)
    with pytest.raises(KafkaPositionError, match="no longer exists"):
        Job(by_pattern, storage, 1, md)
    lenient = KafkaSource(pattern=topic, bootstrap_servers=kafka_broker.bootstrap_servers,
                          on_position_lost="earliest")
    job = Job(lenient, storage, 1, md)
    assert job.readers[0].splits == [] and len(job.readers[0].dropped) == 2


def test_a_listed_topic_that_never_existed_is_refused_on_the_driver(kafka_broker):
    with pytest.raises(KafkaSourceError, match="'no-such-topic' does not exist.*Create it first"):
        KafkaSource("no-such-topic", bootstrap_servers=kafka_broker.bootstrap_servers).prepare(None)


# ---- the consumer group, for monitoring ---------------------------------------------------------------------------


def test_positions_are_reported_to_the_consumer_group_after_the_checkpoint(kafka_broker, tmp_path):
    from confluent_kafka import Consumer, TopicPartition

    topic = new_topic(kafka_broker, 2)
    events = shop.generate_events(300, 20, 2, seed=1)
    produce(kafka_broker, topic, events, key="user")
    group = f"monitor-{topic}"
    source = KafkaSource(topic, bootstrap_servers=kafka_broker.bootstrap_servers, group_id=group)
    location = str(tmp_path / "chk")

    def committed():
        c = Consumer({"bootstrap.servers": kafka_broker.bootstrap_servers, "group.id": group})
        try:
            return [tp.offset for tp in c.committed([TopicPartition(topic, 0), TopicPartition(topic, 1)], timeout=10)]
        finally:
            c.close()

    def die(point):
        if point == "reported":
            raise RuntimeError("the driver dies before the commit")

    with pytest.raises(RuntimeError, match="dies"):
        run_batch(location, source, shop.CartFunction(), 2, 40, at=die)
    assert committed() == [-1001, -1001]           # read, but not checkpointed: nothing reported
    metadata, _, n = run_batch(location, source, shop.CartFunction(), 2, 40)
    assert n == 80
    held = {(t, p): o for r in metadata.properties["source_reports"] for t, p, o in r["positions"]}
    assert committed() == [held[(topic, 0)], held[(topic, 1)]]


# ---- arguments ----------------------------------------------------------------------------------------------------


def test_arguments_are_checked_with_clear_messages():
    with pytest.raises(ValueError, match="either topics .* or pattern"):
        KafkaSource(bootstrap_servers="x:1")
    with pytest.raises(ValueError, match="'enable.auto.commit' belongs to the source"):
        KafkaSource("t", bootstrap_servers="x:1", consumer_options={"enable.auto.commit": True})
    with pytest.raises(ValueError, match="librdkafka refuses them: .*fetch.max.bytes"):
        KafkaSource("t", bootstrap_servers="x:1", consumer_options={"fetch.max.bytes": 2000})
    with pytest.raises(ValueError, match="librdkafka refuses them: .*No such configuration property"):
        KafkaSource("t", bootstrap_servers="x:1", consumer_options={"no.such.option": 1})
    with pytest.raises(ValueError, match="on_position_lost"):
        KafkaSource("t", bootstrap_servers="x:1", on_position_lost="latest")
    with pytest.raises(ValueError, match="bootstrap_servers"):
        KafkaSource("t")
    with pytest.raises(ValueError, match="not a regular expression"):
        KafkaSource(pattern="(", bootstrap_servers="x:1")
    with pytest.raises(ValueError, match="value_format='raw'"):
        KafkaSource("t", bootstrap_servers="x:1", decoder=lambda v: {})
    with pytest.raises(ValueError, match="group_id"):
        KafkaSource("t", bootstrap_servers="x:1", starting_offsets="committed")
    with pytest.raises(ValueError, match="columns .*_offset"):
        KafkaSource("t", bootstrap_servers="x:1").staged_schema(pa.schema([("_offset", pa.int64())]))
    with pytest.raises(ValueError, match="not prepared"):
        KafkaSplitReader(KafkaSource("t", bootstrap_servers="x:1"))
    with pytest.raises(TypeError, match="partitioned-log directory"):
        as_source(42)  # type: ignore[arg-type]
