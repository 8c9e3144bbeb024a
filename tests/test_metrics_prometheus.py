"""The driver's metrics as a real Prometheus server sees them: Debian's ``prometheus``, started once for the module
(tests/prometheus_server.py) with a scrape config naming two exporters of this process (every key group's series;
the default, the hottest few), queried through its HTTP API after batches and rescales of the test harness (the
subtask code a job runs). Skipped, saying why, when the binary is not installed."""

from __future__ import annotations

import uuid
from datetime import timedelta

import numpy as np
import pyarrow as pa
import pytest

import keygroups as kg
from keygroups.metrics import PrometheusExporter, job_metrics
from keygroups.runtime import KeyedProcessFunction, WatermarkStrategy
from keygroups.serializers import Int64Serializer
from keygroups.state import ValueStateDescriptor
from keygroups.testing import KeyedFunctionHarness

from prometheus_server import PrometheusServer, binary

pytestmark = pytest.mark.skipif(binary() is None, reason="Prometheus is not installed (Debian: apt-get install "
                                                         "prometheus; or set PROMETHEUS to its binary)")
MP = 16
TOP = 3


class Count(KeyedProcessFunction):
    def open(self, context):
        self.count = context.get_state(ValueStateDescriptor("count", Int64Serializer()))

    def process_element(self, record, context):
        n = (self.count.value() or 0) + 1
        self.count.update(n)
        return [(context.current_key, n)]


@pytest.fixture(scope="module")
def prometheus():
    every, top = PrometheusExporter(key_groups=True).start(0, "127.0.0.1"), \
        PrometheusExporter(top_key_groups=TOP).start(0, "127.0.0.1")
    try:
        with PrometheusServer.start({"keygroups-all": [f"127.0.0.1:{every.port}"],
                                     "keygroups-top": [f"127.0.0.1:{top.port}"]}) as server:
            yield server
    finally:
        every.stop()
        top.stop()


def test_every_batch_and_rescale_reaches_prometheus(prometheus):
    name = f"prom-{uuid.uuid4().hex[:8]}"
    strategy = WatermarkStrategy.for_bounded_out_of_orderness(timedelta(milliseconds=10))
    h = KeyedFunctionHarness(Count(), "k", output_schema="k long, n long", max_parallelism=MP, parallelism=2,
                             timestamp_column="t", watermark_strategy=strategy, name=name)
    harnesses, recorded = [h], []
    keys_seen = np.zeros(MP, dtype=np.int64)
    stamp, late = 0, 0
    try:
        for parallelism, batches in ((2, 3), (3, 2), (1, 2)):
            if parallelism != h.parallelism:
                h = h.restore(h.snapshot(), parallelism=parallelism)
                harnesses.append(h)
            recorder = job_metrics(h)
            for b in range(batches):
                keys = [7] * 40 + list(range(b * 10, b * 10 + 30))
                stamps = [stamp + i for i in range(len(keys))]
                on_time = keys
                if stamp:
                    stamps[:3] = [0, 1, 2]   # three late records a batch once the watermark has moved
                    late += 3
                    on_time = keys[3:]
                stamp += len(keys) + 100
                h.process(pa.table({"k": pa.array(keys, pa.int64()), "t": pa.array(stamps, pa.int64())}))
                recorded.append(recorder.latest)
                keys_seen += np.bincount(kg.assign_key_groups(np.asarray(on_time, dtype=np.int64), MP, "long"),
                                         minlength=MP)
    finally:
        for x in harnesses:
            x.close()
    assert len(recorded) == 7
    rescales = [m for m in recorded if m.rescaled]
    assert len(rescales) == 2 and all(m.moved_bytes > 0 for m in rescales)

    job = f'job_name="{name}"'
    for target in ("keygroups-all", "keygroups-top"):
        prometheus.wait_for(f'keygroups_batches_total{{{job},job="{target}"}}', len(recorded))
    top = f'{job},job="keygroups-top"'
    assert prometheus.value(f"keygroups_rescales_total{{{top}}}") == 2
    assert prometheus.value(f"keygroups_moved_bytes_total{{{top}}}") == sum(m.moved_bytes for m in rescales)
    assert prometheus.value(f"keygroups_moved_key_groups_total{{{top}}}") == sum(m.moved_key_groups for m in rescales)
    assert prometheus.value(f"sum(keygroups_records_in_total{{{top}}})") == sum(m.records_in for m in recorded)
    assert prometheus.value(f"sum(keygroups_records_late_total{{{top}}})") == late
    assert {s["labels"]["subtask_index"] for s in prometheus.query(f"keygroups_records_in_total{{{top}}}")} == {
        "0", "1", "2"}
    assert prometheus.value(f"keygroups_parallelism{{{top}}}") == 1
    assert prometheus.value(f"keygroups_last_checkpoint_id{{{top}}}") == recorded[-1].checkpoint_id
    assert prometheus.value(f'keygroups_batch_seconds_total{{{top},part="wall"}}') == pytest.approx(
        sum(m.wall_seconds for m in recorded))

    # key groups: every one where asked for, the hottest few always
    every = prometheus.query(f'keygroups_key_group_records_total{{{job},job="keygroups-all"}}')
    per_group = {int(s["labels"]["key_group"]): s["value"] for s in every}
    assert sorted(per_group) == list(range(MP))
    assert [per_group[g] for g in range(MP)] == keys_seen.tolist()
    hottest = prometheus.query(f"keygroups_key_group_records_total{{{top}}}")
    assert len(hottest) == TOP
    assert str(kg.assign_to_key_group(7, MP, "long")) in {s["labels"]["key_group"] for s in hottest}
    shares = prometheus.query(f"keygroups_key_group_load_share{{{top}}}")
    assert len(shares) == TOP and 0 < max(s["value"] for s in shares) <= 1
