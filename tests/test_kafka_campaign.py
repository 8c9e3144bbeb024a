"""The Kafka fault campaign, one trial of each kind with fixed seeds (benchmarks/bench_kafka_campaign.py runs 50+
kills of each): the driver process SIGKILLed and restarted, source and keyed workers that die and are retried, and
the broker SIGKILLed mid-batch and started again; each checked for exactly-once state and outputs against the
plain reference (kafka_campaign.py)."""

from __future__ import annotations

import pytest

from kafka_broker import persistent_broker
from kafka_campaign import broker_kill_trial, driver_kill_trial, make_workload, worker_kill_trial

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def campaign(s3_server):
    with persistent_broker(s3_server) as broker:
        yield broker, make_workload(broker, n_events=900, n_users=80)


def explain(trial):
    return f"seed {trial.seed} ({trial.kind}, {trial.backend}, kills {dict(trial.kills)}): lost {trial.lost}, " \
           f"duplicated {trial.duplicated}, {trial.problems}"


def test_killed_and_restarted_drivers_read_kafka_exactly_once(campaign, tmp_path):
    _, workload = campaign
    trial = driver_kill_trial(workload, tmp_path, 2, backend="rocksdb")
    assert trial.passed, explain(trial)
    assert sum(trial.kills.values()) >= 1


def test_source_and_keyed_workers_that_die_are_retried_and_apply_their_records_once(campaign, tmp_path):
    _, workload = campaign
    trial = worker_kill_trial(workload, tmp_path, 4)
    assert trial.passed, explain(trial)
    assert sum(v for k, v in trial.kills.items() if k.startswith("source-")) >= 1


def test_a_broker_killed_and_restarted_loses_and_duplicates_nothing(campaign, tmp_path):
    broker, workload = campaign
    trial = broker_kill_trial(workload, broker, tmp_path, 1)
    assert trial.passed, explain(trial)
    assert sum(trial.kills.values()) >= 1
