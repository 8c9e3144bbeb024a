"""Model-based: random sequences of produce, batch (at random parallelisms and budgets), batches that die before
their commit, and broker kills (mid-batch, the broker's topics on S3, so it comes back with them), against a plain
model — every produced record applied exactly once to the keyed state and to the committed outputs: 0 lost,
0 duplicated. Both state backends."""

from __future__ import annotations

import uuid
from collections import Counter
from typing import Any

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from kafka_broker import new_producer, persistent_broker, produce
from keygroups.runtime.functions import KeyedProcessFunction
from keygroups.serializers import Int64Serializer
from keygroups.sources import KafkaSource, KafkaSourceError
from keygroups.sources import kafka_reader as kafka_module
from keygroups.state import ValueStateDescriptor
from shop_runtime import run_batch
from state_views import latest_values

pytestmark = pytest.mark.slow

COUNT = ValueStateDescriptor("count", Int64Serializer())
KEYS = 7


class CountPerUser(KeyedProcessFunction):
    """Counts each user's records; emits ``(user, record id, count so far, 0, 0)`` per record (ORDER_SCHEMA)."""

    def open(self, context: Any) -> None:
        self.count = context.get_state(COUNT)

    def process_element(self, event: dict[str, Any], context: Any) -> list[tuple]:
        n = (self.count.value() or 0) + 1
        self.count.update(n)
        return [(context.current_key, event["ts"], n, 0, 0)]


def record(record_id: int) -> dict[str, Any]:
    return {"user": f"u{record_id % KEYS}", "ts": record_id, "kind": "view", "item": "i", "qty": 1, "price": 1}


def final_counts(location: str) -> dict[str, int]:
    """Each user's count in the latest checkpoint's keyed state, restored into one heap backend."""
    return latest_values(location, COUNT, 64, "string")


class Dies(Exception):
    pass


operations = st.lists(st.one_of(
    st.tuples(st.just("produce"), st.integers(0, 3), st.integers(1, 40)),
    st.tuples(st.just("batch"), st.integers(1, 5), st.sampled_from([None, 3, 10, 25])),
    st.tuples(st.just("dies"), st.integers(1, 5), st.sampled_from(["source", "reported"])),
    st.tuples(st.just("broker-killed"), st.integers(1, 5), st.integers(1, 30)),
), min_size=3, max_size=10)


@pytest.fixture(scope="module")
def broker(s3_server):
    with persistent_broker(s3_server) as broker:
        yield broker


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=operations, backend=st.sampled_from(["heap", "rocksdb"]))
@example(ops=[("produce", 0, 40), ("produce", 1, 40), ("batch", 2, 10), ("broker-killed", 3, 5), ("dies", 1, "source"),
              ("produce", 2, 9), ("batch", 4, 3)], backend="rocksdb")   # a kill that lands mid-batch
def test_random_produce_batch_die_and_kill_sequences_apply_every_record_once(broker, tmp_path, ops, backend):
    topic = f"model-{uuid.uuid4().hex[:10]}"
    broker.create_topic(topic, 4)
    source = KafkaSource(topic, bootstrap_servers=broker.bootstrap_servers, fetch_timeout=20,
                         consumer_options={"max.partition.fetch.bytes": 256, "fetch.max.bytes": 1024,
                                           "message.max.bytes": 1024, "queued.max.messages.kbytes": 1})
    location = str(tmp_path / uuid.uuid4().hex)
    local = str(tmp_path / "local")
    produced: list[int] = []
    outputs: Counter[int] = Counter()
    producer = None   # one per example and broker process (a new producer's first flush waits half a second)

    def batch(parallelism: int, max_records: int | None, at: Any = None) -> None:
        _, table, _ = run_batch(location, source, CountPerUser(), parallelism, max_records, backend=backend,
                                local_dir=local, **({"at": at} if at else {}))
        outputs.update(table.column("ts").to_pylist())

    for op in ops:
        if op[0] == "produce":
            _, partition, n = op
            ids = list(range(len(produced), len(produced) + n))
            if producer is None:
                producer = new_producer(broker)
            produce(broker, topic, {partition: [record(i) for i in ids]}, producer=producer)
            produced += ids
        elif op[0] == "batch":
            batch(op[1], op[2])
        elif op[0] == "dies":
            def die(point: str, where: str = op[2]) -> None:
                if point == where:
                    raise Dies(where)
            with pytest.raises(Dies):
                batch(op[1], None, at=die)
        else:
            _, parallelism, nth = op
            producer = None   # not left reconnecting to the killed broker
            add, seen = kafka_module._Fetched.add, []

            def add_then_kill(fetched: Any, *args: Any) -> None:
                add(fetched, *args)
                seen.append(1)
                if len(seen) == nth:
                    broker.kill()
            kafka_module._Fetched.add = add_then_kill  # type: ignore[method-assign]
            try:
                batch(parallelism, None)     # fewer than nth records to read: the batch completes
            except KafkaSourceError:
                pass                        # killed mid-batch: nothing committed
            finally:
                kafka_module._Fetched.add = add  # type: ignore[method-assign]
                broker.start()
    batch(3, None)                          # drain
    lost = set(produced) - set(outputs)
    duplicated = {i: n for i, n in outputs.items() if n > 1}
    assert not lost and not duplicated and set(outputs) == set(produced), (lost, duplicated)
    # the keyed state counted each user's records exactly once
    assert final_counts(location) == dict(Counter(record(i)["user"] for i in produced))
