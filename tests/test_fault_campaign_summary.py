"""The fault campaign's summary is JSON: its failed trials are printed with ``json.dumps`` (the benchmark does), kills
counted by point included."""

from __future__ import annotations

import json
from collections import Counter

from fault_campaign import Trial, summarize


def test_failed_trials_are_summarized_as_json_with_their_kills_by_point():
    failed = Trial("driver", 7, backend="rocksdb", kills=Counter({"task": 2, "publish-tmp": 1}), lost=1,
                   problems=["state of key 3 is 5, expected 6"])
    passed = Trial("task", 8, kills=Counter({"exit": 1}))
    counts = summarize([failed, passed])
    assert counts["kills"] == {"driver:publish-tmp": 1, "driver:task": 2, "task:exit": 1}
    back = json.loads(json.dumps(counts))
    (record,) = back["failed trials"]
    assert record["kills"] == {"task": 2, "publish-tmp": 1}
    assert (record["kind"], record["seed"], record["backend"], record["lost"], record["problems"]) == \
        ("driver", 7, "rocksdb", 1, ["state of key 3 is 5, expected 6"])
    assert back["lost updates"] == 1 and back["trials"] == {"driver": 1, "task": 1}
