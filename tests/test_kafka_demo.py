"""``keygroups demo --source kafka`` end to end in its own process: it starts a tansu broker itself, writes each
batch's events to a topic, runs the self-verifying job with its rescales; ``keygroups inspect`` then shows the
topic's positions from the checkpoint's operator state."""

from __future__ import annotations

import re

import pytest

from background import background_fixture
from kafka_broker import require_kafka
from test_cli import KEYGROUPS, KEYGROUPS_ENV, keygroups

pytestmark = [pytest.mark.spark, pytest.mark.slow]


# started in the background when collection ends (tests/background.py), in a directory of its own ({dir})
kafka_demo_run = background_fixture(
    "kafka_demo_run", [*KEYGROUPS, "demo", "--source", "kafka", "--events", "3000", "--users", "300", "--partitions",
                       "4", "--phases", "2,1,3", "--batches-per-phase", "1", "--max-parallelism", "16", "--dir",
                       "{dir}"],
    env=KEYGROUPS_ENV)


def test_demo_on_kafka_matches_the_reference_and_inspect_shows_the_offsets(kafka_demo_run):
    require_kafka()
    result = kafka_demo_run
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    assert "4 partitions of a Kafka topic" in out and re.search(r"a tansu broker at 127\.0\.0\.1:\d+", out)
    assert "phase 1 p=2" in out and "phase 2 p=1" in out and "phase 3 p=3" in out
    assert re.search(r"^OK: all [\d,]+ users' state and timers, all [\d,]+ abandoned carts and all [\d,]+ orders "
                     r"equal the reference$", out, re.MULTILINE)
    assert result.stderr == ""
    inspected = keygroups("inspect", str(result.directory / "checkpoints"))
    assert inspected.returncode == 0, inspected.stderr
    line = next(x for x in inspected.stdout.splitlines() if x.startswith("source positions, Kafka topic"))
    splits = re.findall(r" (\d+):(\d+)@(\d+)", line)
    assert sorted(int(p) for p, _, _ in splits) == [0, 1, 2, 3]          # every partition, once
    assert sorted({int(s) for _, _, s in splits}) == [0, 1, 2]           # spread over the last run's 3 subtasks
    assert sum(int(o) for _, o, _ in splits) == 3000                      # every event read, none twice
