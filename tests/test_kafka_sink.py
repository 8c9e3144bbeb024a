"""KafkaSink against a real broker: each committed checkpoint's output produced once per delivery, keyed by the
job's key, with a dedup id that is the same every time the same output is delivered; progress kept in a consumer
group so that a restarted driver delivers what is pending; transactions as far as tansu goes."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from kafka_broker import consume_all, kafka_broker, new_topic, produce  # noqa: F401  (the fixture)
from keygroups.checkpoint import CheckpointStorage
from keygroups.cli import shop
from keygroups.sources import KafkaSink, KafkaSource
from keygroups.sources import kafka_sink as sink_module
from keygroups.sources.kafka_sink import CHECKPOINT_HEADER, RECORD_ID_HEADER
from shop_runtime import read_outputs, rows, run_batch


@pytest.fixture
def committed_job(kafka_broker, tmp_path):
    """Three committed checkpoints of the shop job read from Kafka; their storage and outputs."""
    topic = new_topic(kafka_broker, 2)
    events = shop.generate_events(600, 30, 2, seed=2)
    produce(kafka_broker, topic, events, key="user")
    source = KafkaSource(topic, bootstrap_servers=kafka_broker.bootstrap_servers)
    location = str(tmp_path / "chk")
    for parallelism, max_records in [(2, 100), (1, 150), (2, None)]:
        run_batch(location, source, shop.CartFunction(), parallelism, max_records, retain=5)
    storage = CheckpointStorage(location)
    outputs = {cid: rows(read_outputs(storage, storage.load(cid))) for cid in storage.checkpoint_ids()}
    assert sum(map(len, outputs.values())) > 20
    return storage, outputs


def _records(kafka_broker, topic, isolation="read_committed"):
    out = []
    for m in consume_all(kafka_broker, topic, isolation=isolation):
        headers = dict(m.headers() or [])
        row = json.loads(m.value())
        out.append((headers[RECORD_ID_HEADER].decode(), int(headers[CHECKPOINT_HEADER]), m.key(), m.partition(),
                    tuple(row[c] for c in shop.ORDER_SCHEMA.names)))
    return out


def _dedup(records):
    seen, out = set(), []
    for record_id, *rest in records:
        if record_id not in seen:
            seen.add(record_id)
            out.append((record_id, *rest))
    return out


@pytest.mark.parametrize("transactional", [False, True], ids=["at-least-once", "transactional"])
def test_each_checkpoint_is_delivered_once_keyed_by_the_job_key(kafka_broker, committed_job, transactional):
    storage, outputs = committed_job
    topic = new_topic(kafka_broker, 3, prefix="out")
    sink = KafkaSink(topic, key_columns="user", bootstrap_servers=kafka_broker.bootstrap_servers,
                     transactional=transactional)
    first = sink.deliver(storage, storage.load(1))
    assert (first.checkpoint_id, first.records, first.skipped) == (1, len(outputs[1]), False)
    assert sink.last_delivered("carts") == 1
    assert sink.deliver(storage, storage.load(1)).skipped          # a replayed batch is not delivered again
    pending = sink.deliver_pending(storage)                         # a restarted driver: 2 and 3
    assert [d.checkpoint_id for d in pending] == [2, 3] and sink.last_delivered("carts") == 3
    sink.close()
    got = _records(kafka_broker, topic)
    assert len(got) == sum(map(len, outputs.values()))              # once each
    for cid, expected in outputs.items():
        assert sorted(r[4] for r in got if r[1] == cid) == sorted(expected)
    by_key = {}
    for _, _, key, partition, row in got:
        assert key == row[0].encode()                               # keyed by the job's key, "user"
        assert by_key.setdefault(key, partition) == partition       # one key, one partition
    assert len(set(by_key.values())) > 1


def test_a_driver_that_dies_before_recording_progress_delivers_again_with_the_same_ids(kafka_broker, committed_job,
                                                                                        monkeypatch):
    storage, outputs = committed_job
    topic = new_topic(kafka_broker, 2, prefix="out")
    sink = KafkaSink(topic, key_columns="user", bootstrap_servers=kafka_broker.bootstrap_servers)
    sink.deliver(storage, storage.load(1))

    def die(self, job, checkpoint_id):
        raise SystemExit("the driver dies after producing checkpoint 2, before recording it")

    monkeypatch.setattr(sink_module.KafkaSink, "_record_progress", die)
    with pytest.raises(SystemExit):
        sink.deliver(storage, storage.load(2))
    monkeypatch.undo()
    restarted = KafkaSink(topic, key_columns="user", bootstrap_servers=kafka_broker.bootstrap_servers)
    assert [d.checkpoint_id for d in restarted.deliver_pending(storage)] == [2, 3]
    got = _records(kafka_broker, topic)
    duplicated = Counter(r[0] for r in got)
    assert {c for c in duplicated.values()} == {1, 2}                # at-least-once: checkpoint 2 twice
    assert all(cid == 2 for rid, cid, *_ in got if duplicated[rid] == 2)
    unique = _dedup(got)
    assert sorted(r[4] for r in unique) == sorted(o for out in outputs.values() for o in out)   # exactly, by id


def test_a_transaction_that_dies_is_aborted_and_tansu_still_shows_it(kafka_broker, committed_job, monkeypatch):
    storage, outputs = committed_job
    topic = new_topic(kafka_broker, 2, prefix="out")
    sink = KafkaSink(topic, key_columns="user", bootstrap_servers=kafka_broker.bootstrap_servers,
                     transactional=True)
    sink.deliver(storage, storage.load(1))

    def die(self, producer, job, cid, errors):
        producer.flush(30)
        raise RuntimeError("the driver fails between producing and committing checkpoint 2")

    monkeypatch.setattr(sink_module.KafkaSink, "_commit_transaction", die)
    with pytest.raises(RuntimeError):
        sink.deliver(storage, storage.load(2))
    monkeypatch.undo()
    assert sink.last_delivered("carts") == 1                        # the progress went with the aborted transaction
    assert [d.checkpoint_id for d in sink.deliver_pending(storage)] == [2, 3]
    sink.close()
    got = _records(kafka_broker, topic)
    # on Apache Kafka a read-committed consumer would see every record once; tansu 0.6 shows the aborted ones too
    assert len(got) == sum(map(len, outputs.values())) + len(outputs[2])
    assert sorted(r[4] for r in _dedup(got)) == sorted(o for out in outputs.values() for o in out)


def test_sink_arguments_and_missing_columns(kafka_broker, committed_job):
    storage, _ = committed_job
    with pytest.raises(ValueError, match="'enable.idempotence' belongs to the sink"):
        KafkaSink("t", key_columns="user", bootstrap_servers="x:1", producer_options={"enable.idempotence": False})
    with pytest.raises(ValueError, match="key_columns"):
        KafkaSink("t", key_columns=[], bootstrap_servers="x:1")
    sink = KafkaSink(new_topic(kafka_broker, 1), key_columns="customer",
                     bootstrap_servers=kafka_broker.bootstrap_servers)
    with pytest.raises(ValueError, match=r"\['customer'\] are not in checkpoint 1's output"):
        sink.deliver(storage, storage.load(1))
