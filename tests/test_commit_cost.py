"""The commit and its retention cost what the batch changed (issue 32, item 4), and keep their guarantees: the chains
a commit checks and carries forward from its restore point's are those a full recomputation gives; a restore point
that lost a file is refused naming the file and the checkpoint; retention reads each retained ``_metadata`` at most
once per storage object."""

from __future__ import annotations

import os

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from keygroups import KeyGroupRange
from keygroups.checkpoint import CheckpointStorage
from keygroups.checkpoint.metadata import decode_metadata, encode_metadata, keyed_handles_by_range
from keygroups.checkpoint.planning import _ChainIndex, baseless_deltas, chain_breaks, key_group_chains
from keygroups.errors import CorruptSnapshotError
from keygroups.runtime import KeyedProcessFunction
from keygroups.runtime.batch import JobDriver, JobOptions, pickle_function
from keygroups.runtime.local import LocalExecutor
from keygroups.serializers import Int64Serializer
from keygroups.state import ValueStateDescriptor

OUTPUT = pa.schema([("key", pa.int64()), ("sum", pa.int64())])
SUM = ValueStateDescriptor("sum", Int64Serializer())


class Sum(KeyedProcessFunction):
    def open(self, context):
        self.sum = context.get_state(SUM)

    def process_element(self, record, context):
        total = (self.sum.value() or 0) + record["value"]
        self.sum.update(total)
        return ((record["key"], total),)


def _driver(storage: CheckpointStorage, max_parallelism: int = 32, **kwargs) -> JobDriver:
    options = JobOptions(name="job", key_columns=("key",), function=pickle_function(Sum()), output_schema=OUTPUT,
                         max_parallelism=max_parallelism)
    return JobDriver(options, storage, fence=False, **kwargs)


def _batch(keys) -> LocalExecutor:
    keys = np.asarray(keys, dtype=np.int64)
    return LocalExecutor(pa.table({"key": pa.array(keys), "value": pa.array(np.ones(len(keys), np.int64))}))


def _needed(handles, max_parallelism: int):
    """The handles some key group's chain needs, worked out in full from ``handles`` (the definition)."""
    ordered = keyed_handles_by_range(list(handles))
    chains = key_group_chains(ordered, KeyGroupRange(0, max_parallelism - 1))
    return {id(h) for chain in chains.values() for h in chain}


@settings(max_examples=15)
@given(batches=st.lists(st.lists(st.integers(0, 400), min_size=0, max_size=30), min_size=2, max_size=12),
       parallelism=st.sampled_from([1, 2, 3]))
def test_carried_handles_and_checked_chains_equal_a_full_recomputation(tmp_path_factory, batches, parallelism):
    """Each commit extends its restore point's chains by the new handles only; what it carries forward is exactly
    what every key group's chain needs (plus the new files), its chains are whole by the full check, and a
    restarted driver (which works them out in full) restores the same sums."""
    storage = CheckpointStorage(tmp_path_factory.mktemp("chains"), retain=2)
    driver = _driver(storage, max_parallelism=16, background_retention=False)
    model: dict[int, int] = {}
    previous = None
    for keys in batches:
        batch = driver.run(_batch(keys), parallelism=parallelism)
        for k in keys:
            model[k] = model.get(k, 0) + 1
        md = batch.metadata
        new = [h for h in md.keyed_handles if h.checkpoint_id == md.checkpoint_id]
        old = list(previous.keyed_handles) if previous is not None else []
        assert {id(h) for h in md.keyed_handles} == _needed(old + new, 16) | {id(h) for h in new}
        index = _ChainIndex.build(keyed_handles_by_range(list(md.keyed_handles)), 16)
        assert index.verify() == ([], [])
        previous = md
    restarted = _driver(CheckpointStorage(storage.location, retain=2), max_parallelism=16,
                        background_retention=False)
    probe = sorted(model)[:5]
    out = restarted.run(_batch(probe), parallelism=1)
    sums = {r["key"]: r["sum"] for t in _outputs(storage, out.metadata) for r in t.to_pylist()}
    assert sums == {k: model[k] + 1 for k in probe}


def _outputs(storage: CheckpointStorage, metadata):
    import pyarrow.parquet as pq

    return [pq.read_table(os.path.join(storage.location, f)) for f in metadata.outputs]


def test_a_new_delta_that_breaks_its_chain_is_refused_by_the_incremental_check(tmp_path):
    """The commit checks only the new handles against its restore point's chains, and still refuses a delta that
    names a block other than its chain's newest, exactly as the full check names it."""
    storage = CheckpointStorage(tmp_path, retain=3)
    driver = _driver(storage, background_retention=False)
    driver.run(_batch(range(100)), parallelism=1)
    md = driver.run(_batch([1, 2, 3]), parallelism=1).metadata
    new = [h for h in md.keyed_handles if h.checkpoint_id == md.checkpoint_id][0]
    base = _ChainIndex.build(keyed_handles_by_range([h for h in md.keyed_handles if h is not new]), 32)
    base.verified = True
    links = new.predecessors
    kg = int(np.flatnonzero(links.checkpoints >= 0)[0]) + new.key_group_range.start
    checksums = links.checksums.copy()
    checksums[kg - new.key_group_range.start] ^= 1   # names a block of the right checkpoint, another checksum
    import dataclasses

    from keygroups.checkpoint.metadata import BlockLinks

    foreign = dataclasses.replace(new, predecessors=BlockLinks(links.start, links.checkpoints, checksums))
    _, baseless, breaks = base.extended([foreign])
    full = chain_breaks(keyed_handles_by_range([*base.handles, foreign]), [KeyGroupRange(0, 31)])
    assert not baseless and [(b.key_group, b.describe()) for b in breaks] == [(b.key_group, b.describe())
                                                                             for b in full]
    assert kg in {b.key_group for b in breaks}
    assert baseless_deltas(key_group_chains(keyed_handles_by_range([*base.handles, foreign]),
                                            KeyGroupRange(0, 31))) == []


def test_encoding_carried_handles_once_gives_the_same_bytes(tmp_path):
    storage = CheckpointStorage(tmp_path, retain=3)
    driver = _driver(storage, background_retention=False)
    for keys in ([*range(50)], [1, 2], [3]):
        md = driver.run(_batch(keys), parallelism=2).metadata
    data = encode_metadata(md, md.base)
    assert data == storage.read_bytes(f"{md.base}/_metadata")
    fresh = decode_metadata(data, md.base, "x")
    assert encode_metadata(fresh, md.base) == data == encode_metadata(md, md.base)


@pytest.mark.parametrize("lost", ["keyed", "output"])
def test_a_restore_point_that_lost_a_file_is_refused_naming_the_file_and_the_checkpoint(tmp_path, lost):
    storage = CheckpointStorage(tmp_path, retain=3)
    driver = _driver(storage, background_retention=False)
    driver.run(_batch(range(60)), parallelism=2)
    md = driver.run(_batch([5, 6]), parallelism=2).metadata
    victim = md.keyed_handles[0].file if lost == "keyed" else md.outputs[1]
    os.remove(os.path.join(storage.location, victim))
    with pytest.raises(CorruptSnapshotError) as e:
        _driver(CheckpointStorage(tmp_path, retain=3)).run(_batch([1]), parallelism=2)   # a restarted driver
    assert f"checkpoint {md.checkpoint_id} in {storage.location} names 1 file(s) that do not exist: {victim!r}" \
        in str(e.value)
    assert storage.checkpoint_ids()[-1] == md.checkpoint_id   # nothing was committed on top of it


def test_a_running_driver_finds_a_carried_base_file_removed_from_outside(tmp_path, monkeypatch):
    """A commit checks only its own new files; every ``_COMPLETENESS_EVERY`` commits the retention thread checks all
    the newest checkpoint names, so a base file removed by hand (or a lifecycle rule) stops the job within that many
    batches, naming the file, instead of checkpoints piling up on a file that is gone."""
    import keygroups.runtime.batch as batch

    monkeypatch.setattr(batch, "_COMPLETENESS_EVERY", 2)
    storage = CheckpointStorage(tmp_path, retain=3)
    driver = _driver(storage)
    base = driver.run(_batch(range(60)), parallelism=2).metadata
    victim = base.keyed_handles[0].file
    driver.run(_batch([5, 6]), parallelism=2)   # a delta: the base stays in its chain
    driver.wait_for_retention()
    os.remove(os.path.join(storage.location, victim))
    with pytest.raises(CorruptSnapshotError, match=f"names 1 file\\(s\\) that do not exist: {victim!r}"):
        for _ in range(2):
            driver.run(_batch([7]), parallelism=2)
            driver.wait_for_retention()
    with pytest.raises(CorruptSnapshotError, match="do not exist"):   # and it stays refused: the location is listed
        driver.run(_batch([8]), parallelism=2)


def test_a_restore_point_whose_state_file_changed_size_is_refused(tmp_path):
    storage = CheckpointStorage(tmp_path, retain=3)
    driver = _driver(storage, background_retention=False)
    md = driver.run(_batch(range(60)), parallelism=1).metadata
    victim = md.keyed_handles[0]
    with open(os.path.join(storage.location, victim.file), "ab") as f:
        f.write(b"x")
    with pytest.raises(CorruptSnapshotError, match=rf"names state file '{victim.file}' \(subtask 0\) of "
                                                   rf"{victim.size} bytes, but the file is {victim.size + 1}"):
        _driver(CheckpointStorage(tmp_path, retain=3)).run(_batch([1]), parallelism=1)


def test_a_restarted_driver_s_retention_reads_each_retained_metadata_once(tmp_path, monkeypatch):
    """Retention counts references as checkpoints enter and leave retention: a driver that did not commit the
    retained checkpoints reads each one's _metadata once, not at every batch."""
    storage = CheckpointStorage(tmp_path, retain=6)
    first = _driver(storage, background_retention=False)
    for i in range(8):
        first.run(_batch([i, i + 40]), parallelism=2)
    reads: list[str] = []
    read = CheckpointStorage._read_metadata

    def counting(self, base):
        reads.append(base)
        return read(self, base)

    monkeypatch.setattr(CheckpointStorage, "_read_metadata", counting)
    restarted = _driver(CheckpointStorage(tmp_path, retain=6), background_retention=False)
    per_batch = []
    for i in range(6):
        before = len(reads)
        restarted.run(_batch([i]), parallelism=2)
        per_batch.append(len(reads) - before)
    assert len(reads) == len(set(reads))   # no _metadata read twice
    assert per_batch[1:] == [0] * 5, per_batch   # after the first batch: nothing but what the driver committed
    referenced = {h.file for cid in storage.checkpoint_ids() for h in storage.load(cid).keyed_handles}
    assert set(storage.shared_files()) == referenced   # and the shared files are exactly the referenced ones


def test_orphans_of_a_checkpoint_directory_are_removed_once_it_is_older_than_the_latest(tmp_path):
    storage = CheckpointStorage(tmp_path, retain=4)
    driver = _driver(storage, background_retention=False)
    md = driver.run(_batch(range(10)), parallelism=1).metadata
    orphan = storage.new_file(md.checkpoint_id, "output-0")   # a retried attempt's file of the committed batch
    with storage.open_write(orphan) as f:
        f.write(b"late")
    driver.run(_batch([1]), parallelism=1)
    assert not os.path.exists(os.path.join(storage.location, orphan))
    assert all(os.path.exists(os.path.join(storage.location, f)) for f in md.outputs)


def _framed(version: int, body: dict) -> bytes:
    import json
    import struct

    from crc32c import crc32c

    from keygroups.checkpoint.metadata import METADATA_MAGIC

    text = json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
    head = struct.pack("<4sII", METADATA_MAGIC, version, len(text)) + text
    return head + struct.pack("<I", crc32c(head))


def _delta_metadata(tmp_path, max_parallelism: int = 256):
    storage = CheckpointStorage(tmp_path, retain=3)
    driver = _driver(storage, max_parallelism=max_parallelism, background_retention=False)
    driver.run(_batch(range(300)), parallelism=2)
    for keys in ([1, 2], [3], [4, 5, 6]):
        md = driver.run(_batch(keys), parallelism=2).metadata
    return storage, md


def test_version_7_leaves_out_carried_quiet_blocks_and_versions_5_and_6_still_read(tmp_path):
    import json

    from keygroups.checkpoint.metadata import METADATA_VERSION, _compact_keyed

    storage, md = _delta_metadata(tmp_path)
    data = storage.read_bytes(f"{md.base}/_metadata")
    assert int.from_bytes(data[4:8], "little") == METADATA_VERSION == 7
    body = json.loads(data[12:-4])
    stored = body["keyed_handles"]
    assert all("offsets" not in h and "block_sizes" in h for h in stored)
    # the handles carried from older checkpoints leave out their quiet blocks' links; the checkpoint's own keep all
    carried = [h.checkpoint_id < md.checkpoint_id for h in md.keyed_handles]
    assert [h.get("quiet_unrecorded", False) for h in stored] == carried and any(carried) and not all(carried)
    # the same checkpoint as version 6 wrote it (every link, compressed) and version 5 (every array as in memory)
    v6 = [_compact_keyed(dict(h.to_json(), file=h.file), elide=False) for h in md.keyed_handles]
    v5 = [dict(h.to_json(), file=h.file) for h in md.keyed_handles]
    assert len(json.dumps(stored)) < len(json.dumps(v6)) and len(json.dumps(v6)) * 10 < len(json.dumps(v5)) * 7
    assert decode_metadata(_framed(5, dict(body, keyed_handles=v5)), md.base, "v5") == md
    assert decode_metadata(_framed(6, dict(body, keyed_handles=v6)), md.base, "v6") == md
    read = decode_metadata(data, md.base, "v7")
    for h, back in zip(md.keyed_handles, read.keyed_handles):
        if h.checkpoint_id == md.checkpoint_id:
            assert back == h
            continue
        assert (back.file, back.offsets, back.full_key_groups) == (h.file, h.offsets, h.full_key_groups)
        for kg in h.key_group_range:
            recorded = (h.checksum(kg), h.predecessor(kg))
            assert (back.checksum(kg), back.predecessor(kg)) == (recorded if h.changes(kg) else (None, None))
    # written again (a restarted driver carrying them on), the handles read back store the same bytes
    assert encode_metadata(read, md.base) == data


def test_a_handle_records_no_checksum_only_for_a_quiet_block(tmp_path):
    import dataclasses

    from keygroups.checkpoint.metadata import NOT_RECORDED

    _, md = _delta_metadata(tmp_path)
    h = next(h for h in md.keyed_handles if h.checkpoint_id == md.checkpoint_id)
    changed = next(kg for kg in h.key_group_range if h.changes(kg))
    quiet = next(kg for kg in h.key_group_range if not h.changes(kg))
    at = h.key_group_range.start
    checksums = list(h.checksums)
    checksums[quiet - at] = NOT_RECORDED
    assert dataclasses.replace(h, checksums=checksums).checksum(quiet) is None
    checksums[changed - at] = NOT_RECORDED
    with pytest.raises(ValueError, match=f"records no checksum for key group {changed}, whose block is full or not "
                                         "empty: only a quiet block"):
        dataclasses.replace(h, checksums=checksums)


@pytest.mark.parametrize("field, match", [
    ("checksums", r"checksums holds \d+ values, not one per block that is not quiet \(\d+\)"),
    ("predecessors", r"predecessors.checksums holds \d+ values, not one per block that is not quiet \(\d+\)"),
])
def test_a_carried_handle_with_links_of_the_wrong_count_is_corrupt(tmp_path, field, match):
    import base64
    import json

    storage, md = _delta_metadata(tmp_path)
    data = storage.read_bytes(f"{md.base}/_metadata")
    body = json.loads(data[12:-4])
    h = next(h for h in body["keyed_handles"] if h.get("quiet_unrecorded") and h.get("predecessors"))
    part = h if field == "checksums" else h["predecessors"]
    part["checksums"] = base64.b64encode(base64.b64decode(part["checksums"]) + bytes(4)).decode()   # one too many
    with pytest.raises(CorruptSnapshotError, match=match):
        decode_metadata(_framed(7, body), md.base, "crafted")


@pytest.mark.parametrize("field, value, match", [
    ("block_sizes", "not base64!", "block_sizes is not base64"),
    ("block_sizes", "eJwDAAAAAAE=", r"block_sizes holds 0 bytes, not the \d+ of \d+ values"),   # zlib of nothing
    ("block_sizes", None, "block_sizes holds more than"),   # a zlib bomb: far more values than key groups
    ("first_offset", -1, r"first_offset must be an int in \[0, 2\*\*62\)"),
    ("first_offset", 1 << 63, r"first_offset must be an int in \[0, 2\*\*62\)"),   # past int64: no OverflowError
    # a range past Flink's 32768 key groups would size the inflation (and overflow zlib's limit): refused first
    ("key_group_range", [0, 10 ** 30], r"key_group_range must be two ints in \[0, 32768\)"),
    ("key_group_range", [0, 1 << 40], r"key_group_range must be two ints in \[0, 32768\)"),
])
def test_a_crafted_compact_handle_is_corrupt_not_a_crash(tmp_path, field, value, match):
    import base64
    import json
    import zlib

    storage, md = _delta_metadata(tmp_path, max_parallelism=64)
    data = storage.read_bytes(f"{md.base}/_metadata")
    body = json.loads(data[12:-4])
    if value is None:
        value = base64.b64encode(zlib.compress(bytes(1 << 26))).decode()
    body["keyed_handles"][0][field] = value
    with pytest.raises(CorruptSnapshotError, match=match):
        decode_metadata(_framed(6, body), md.base, "crafted")
