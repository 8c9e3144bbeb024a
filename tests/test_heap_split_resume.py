"""A rescale on heap reads only what no kept piece in the process holds (issue 34): a subtask that resumes a kept
backend for part of its range leaves the rest parked in the process (split by key-group range) for the other
subtasks of the checkpoint, and assembles its range from every piece there that holds part of it.

A hypothesis model: random batches against a dict model, each committed as a checkpoint, with rescales between
parallelism 1 and 4; each batch's subtasks run in one or two worker processes (registries), in a random order and
placement. Every output row, and the state read back cold at the end, equals the model; every subtask reads at
most the chains of the key groups no kept piece in its worker held when it started (plus, for those held, the blocks
committed after the piece's own snapshot)."""

from __future__ import annotations

import pickle

import pyarrow as pa
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import keygroups as kg
from keygroups import KeyGroupRange
from keygroups.checkpoint import CheckpointStorage
from keygroups.runtime import begin_batch, commit_batch
from keygroups.runtime.subtask import run_keyed_subtask
from keygroups.runtime.subtask_state import HeapBackendRegistry
from keygroups.state import HeapKeyedStateBackend
from test_heap_warm import (INPUT, MP, OUTPUT, Ledger, Model, cold_state, newer_bytes, outputs, state_of,
                            table_of)

JOB = "ledger"


def resumable(storage: CheckpointStorage, restore_point, backend: HeapKeyedStateBackend) -> bool:
    """Whether the snapshot ``backend`` holds is one a resume can trust: its file is committed for the range it was
    written for, in the restore point or in its own checkpoint while that is retained (else it is refused, as an
    attempt that may never have been committed)."""
    n, file = backend._warm_point
    written = backend._snapshot_range or backend.key_group_range
    if any(h.file == file and h.key_group_range == written for h in restore_point.keyed_handles):
        return True
    try:
        own = storage.load(n)
    except Exception:
        return False
    return any(h.file == file and h.key_group_range == written for h in own.keyed_handles)


def held(worker: HeapBackendRegistry, storage: CheckpointStorage, restore_point) -> dict[int, int]:
    """Key group -> the newest checkpoint a kept backend or piece of the job in ``worker`` that a resume can trust
    holds it at."""
    out: dict[int, int] = {}
    for key in worker.keys():
        backend = worker.peek(key)
        if (key[1] != JOB or not isinstance(backend, HeapKeyedStateBackend) or backend._warm_point is None
                or not resumable(storage, restore_point, backend)):
            continue
        for g in range(key[3], key[4] + 1):
            out[g] = max(out.get(g, -1), backend._warm_point[0])
    return out


def allowed_bytes(metadata, own: KeyGroupRange, holds: dict[int, int]) -> int:
    """What the subtask of ``own`` may read: the chains of the key groups no piece holds, and the blocks newer than
    its piece's snapshot of each one held (a piece left behind by an earlier batch catches up)."""
    return sum(newer_bytes(metadata, KeyGroupRange(g, g), holds.get(g, -1)) for g in own)


def run_batch(location, model, records, parallelism, workers, placement, order):
    storage = CheckpointStorage(location)
    previous = storage.latest()
    plan = begin_batch(storage, job_name=JOB, max_parallelism=MP, parallelism=parallelism)
    spec = plan.keyed_task(key_columns=("key",), function=pickle.dumps(Ledger()), input_schema=INPUT,
                           output_schema=OUTPUT, order_columns=("seq",), warm_heap_backends=6)
    table = table_of(records)
    owners = kg.assign_operators(table.column("key"), MP, parallelism)
    reports: dict[int, dict] = {}
    limits: dict[int, int] = {}
    for i in order:
        worker = workers[placement[i]]
        own = kg.key_group_range(MP, parallelism, i)
        if previous is not None:
            limits[i] = allowed_bytes(previous, own, held(worker, storage, previous))
        part = table.filter(pa.array(owners == i))
        reports[i] = run_keyed_subtask(spec, i, part.to_batches(), warm=worker)
    ordered = [reports[i] for i in range(parallelism)]
    metadata = commit_batch(plan, ordered)
    assert outputs(storage, metadata) == sorted(model.apply(records))
    for i, r in reports.items():
        if i in limits:
            assert r.restored.bytes_read <= limits[i], (i, r.restored, limits[i])
    return ordered


records = st.lists(st.tuples(st.integers(0, 60), st.sampled_from(["add", "add", "add", "drop", "clear"]),
                             st.integers(0, 1000)), min_size=1, max_size=40)


@st.composite
def batches(draw):
    out = []
    for _ in range(draw(st.integers(2, 6))):
        p = draw(st.integers(1, 4))
        placement = draw(st.lists(st.integers(0, 1), min_size=p, max_size=p))
        order = draw(st.permutations(list(range(p))))
        out.append((draw(records), p, placement, order))
    return out


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(steps=batches())
def test_rescales_with_parked_pieces_match_the_model_and_read_only_what_no_piece_holds(tmp_path_factory, steps):
    location = str(tmp_path_factory.mktemp("split") / "c")
    model, workers = Model(), [HeapBackendRegistry(), HeapBackendRegistry()]
    for recs, p, placement, order in steps:
        run_batch(location, model, recs, p, workers, placement, order)
    keys = set(range(61))
    assert cold_state(location, keys) == ({k: v for k, v in model.total.items()},
                                          {k: v for k, v in model.entries.items()})


def test_a_rescale_in_one_worker_reads_nothing_in_any_order(tmp_path):
    """2 -> 3 -> 2 -> 4 with every subtask in one worker, in reverse order: each range is assembled from the pieces
    of the previous ranges, nothing read, and no piece is left over."""
    location, model, worker = str(tmp_path / "c"), Model(), HeapBackendRegistry()
    recs = [(k, "add", k) for k in range(60)]
    run_batch(location, model, recs, 2, [worker], [0, 0], [0, 1])
    for p in (3, 2, 4):
        reports = run_batch(location, model, recs, p, [worker], [0] * p, list(reversed(range(p))))
        assert [r.restored.bytes_read for r in reports] == [0] * p
        assert {r.restored.mode for r in reports} <= {"moved", "warm"} and "moved" in {r.restored.mode for r in reports}
        assert worker.pieces() == {}
    run_batch(location, model, recs, 4, [worker], [0] * 4, [0, 1, 2, 3])
    assert worker.pieces() == {}
    assert sorted((k[3], k[4]) for k in worker.keys()) == [(0, 3), (4, 7), (8, 11), (12, 15)]


def test_pieces_split_off_a_kept_backend_resume_as_it_would(tmp_path):
    """Pieces of one kept backend, assembled again, hold exactly the committed state and read nothing; pieces of an
    attempt that was never committed are refused, at the checkpoint before it and at a retry's."""
    location, model, worker = str(tmp_path / "c"), Model(), HeapBackendRegistry()
    recs = [(k, "add", k) for k in range(60)]
    run_batch(location, model, recs, 1, [worker], [0], [0])
    storage = CheckpointStorage(location)
    md = storage.latest()
    (key,) = worker.keys()
    whole = worker.take(key)
    assert whole.split_off(KeyGroupRange(0, 15)) is None   # not a part of it
    left, right = whole.split_off(KeyGroupRange(0, 5)), whole.split_off(KeyGroupRange(6, 15))
    stats = right.resume(storage, md, KeyGroupRange(0, 15), pieces=[left])
    assert stats is not None and stats.bytes_read == 0 and stats.restored == () and stats.warm == tuple(range(16))
    assert state_of(right, range(61)) == (model.total, model.entries)

    # an attempt of checkpoint 2 that is never committed: its pieces resume neither at 1 nor at a retry of 2
    stale = HeapBackendRegistry()
    plan = begin_batch(storage, job_name=JOB, max_parallelism=MP, parallelism=1)
    spec = plan.keyed_task(key_columns=("key",), function=pickle.dumps(Ledger()), input_schema=INPUT,
                           output_schema=OUTPUT, order_columns=("seq",), warm_heap_backends=6)
    run_keyed_subtask(spec, 0, table_of([(1, "add", 5)]).to_batches(), warm=stale)
    (key,) = stale.keys()
    attempt = stale.take(key)
    pieces = [attempt.split_off(KeyGroupRange(0, 7)), attempt.split_off(KeyGroupRange(8, 15))]
    assert all(p is not None and p.resume(storage, md, p.key_group_range) is None for p in pieces)
    run_batch(location, model, [(2, "add", 7)], 1, [worker], [0], [0])   # the retry, committed
    retried = storage.latest()
    assert all(p.resume(storage, retried, p.key_group_range) is None for p in pieces)
