"""Faults of the Kafka source against a real broker whose topics survive it (tansu on SeaweedFS's S3): the broker
killed mid-batch fails the batch, nothing commits, and the rerun — at another parallelism, after the broker is
back — continues exactly; a broker that is down at the start of a batch is refused on the driver."""

from __future__ import annotations

import pytest

from kafka_broker import persistent_broker, produce
from keygroups.checkpoint import CheckpointStorage
from keygroups.cli import shop
from keygroups.sources import KafkaSource, KafkaSourceError
from keygroups.sources import kafka_reader as kafka_module
from shop_runtime import final_states, rows, run_batch

pytestmark = pytest.mark.slow

#: Small fetches, so that a batch needs many round trips to the broker and a kill mid-batch lands before its end.
SMALL_FETCHES = {"max.partition.fetch.bytes": 512, "fetch.max.bytes": 2048, "message.max.bytes": 2048,
                 "queued.max.messages.kbytes": 1}


def test_broker_killed_mid_batch_fails_it_and_the_rerun_continues_exactly(s3_server, tmp_path, monkeypatch):
    with persistent_broker(s3_server) as broker:
        broker.create_topic("events", 4)
        events = shop.generate_events(1200, 90, 4, seed=21)
        produce(broker, "events", events, key="user")
        expected_state, expected_orders = shop.reference(events)
        source = KafkaSource("events", bootstrap_servers=broker.bootstrap_servers, consumer_options=SMALL_FETCHES,
                             fetch_timeout=30)
        location = str(tmp_path / "chk")
        metadata, table, read = run_batch(location, source, shop.CartFunction(), 2, 150)
        orders = rows(table)

        add = kafka_module._Fetched.add
        seen = []

        def add_then_kill(fetched, *args):
            add(fetched, *args)
            seen.append(1)
            if len(seen) == 40:
                broker.kill()               # SIGKILL, mid-fetch: the batch has more partitions to read

        monkeypatch.setattr(kafka_module._Fetched, "add", add_then_kill)
        with pytest.raises(KafkaSourceError) as err:
            run_batch(location, source, shop.CartFunction(), 3, None)
        monkeypatch.undo()
        assert "nothing was committed" in str(err.value).lower() and "topic 'events' partition" in str(err.value)
        assert CheckpointStorage(location).checkpoint_ids() == [1]   # the failed batch left no checkpoint
        broker.start()                      # back, with every record (S3 storage)
        for parallelism, limit in [(4, 200), (1, None)]:
            metadata, table, n = run_batch(location, source, shop.CartFunction(), parallelism, limit)
            orders += rows(table)
            read += n
        assert read == 1200
        assert sorted(orders) == sorted(expected_orders)
        assert final_states(location) == expected_state


def test_a_broker_that_is_down_is_refused_before_any_task(s3_server, tmp_path):
    with persistent_broker(s3_server) as broker:
        broker.create_topic("events", 2)
        source = KafkaSource("events", bootstrap_servers=broker.bootstrap_servers, fetch_timeout=5)
        broker.kill()
        with pytest.raises(KafkaSourceError, match="did not list its topics within 5 s.*nothing was read"):
            run_batch(str(tmp_path / "chk"), source, shop.CartFunction(), 2, None)
        assert CheckpointStorage(str(tmp_path / "chk")).checkpoint_ids() == []
