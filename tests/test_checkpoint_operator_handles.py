"""Typed operator state handles: one validation at the JSON boundary, JSON round trips, DistributionMode values that
checkpoints written before the handles were typed still carry."""

from __future__ import annotations

import copy
import dataclasses
import json
import pathlib
import shutil

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from keygroups.checkpoint import (
    CheckpointMetadata,
    CheckpointStorage,
    DistributionMode,
    OperatorStateHandle,
    OperatorStateMeta,
)
from keygroups.checkpoint.metadata import SERIALIZER_KEYS, decode_metadata, encode_metadata
from keygroups.errors import CorruptDataError, CorruptLogError, CorruptSnapshotError
from keygroups.serializers import Int64Serializer, StrSerializer, ValueSerializer
from keygroups.state import ListStateDescriptor, MapStateDescriptor, OperatorStateStore

OLD_CHECKPOINT = pathlib.Path(__file__).parent / "data" / "operator-checkpoint-v1"
POSITIONS = ListStateDescriptor("positions", Int64Serializer())
SEEN = ListStateDescriptor("seen", StrSerializer())
CONFIG = MapStateDescriptor("config", StrSerializer(), ValueSerializer())


def valid_json() -> dict:
    """A handle's JSON as the writer produces it: a 3-element list state in two checksum blocks, and an empty
    broadcast state."""
    return {
        "format": "keygroups-operator-state", "version": 1, "operator_id": "source", "subtask": 1,
        "file": "chk-4/operator-1-abc", "size": 38,
        "states": {
            "offsets": {"mode": "SPLIT_DISTRIBUTE", "serializer": {"identifier": "int64"},
                        "offsets": [8, 18, 28], "end": 38, "blocks": [[0, 11], [2, 4294967295]]},
            "config": {"mode": "BROADCAST", "key_serializer": {"identifier": "str"},
                       "value_serializer": {"identifier": "value"}, "offsets": [], "end": 38, "blocks": []},
        },
    }


def test_round_trip_through_json_and_metadata():
    handle = OperatorStateHandle.from_json(valid_json())
    meta = handle.states["offsets"]
    assert (handle.file, handle.subtask, handle.size, handle.operator_id) == ("chk-4/operator-1-abc", 1, 38, "source")
    assert meta.mode is DistributionMode.SPLIT_DISTRIBUTE
    assert meta.serializers == {"serializer": {"identifier": "int64"}}
    assert (len(meta), meta.bound(1), meta.bound(3), meta.block_starts) == (3, 18, 38, [0, 2])
    assert handle.states["config"].serializers == {"key_serializer": {"identifier": "str"},
                                                   "value_serializer": {"identifier": "value"}}
    assert handle.to_json() == valid_json()
    assert OperatorStateHandle.from_json(json.loads(json.dumps(handle.to_json()))) == handle
    md = CheckpointMetadata(4, "job", 0, 128, 2, [], [handle], {})
    assert decode_metadata(encode_metadata(md, "chk-4"), "chk-4", "test").operator_handles == [handle]


def test_handles_without_an_operator_id_belong_to_the_default_operator():
    raw = valid_json()
    del raw["operator_id"]
    assert OperatorStateHandle.from_json(raw).operator_id == "operator"


def _set(path: str, value):
    """A change to a valid handle's JSON: ``path`` is a /-separated key path; value ``...`` deletes the key."""
    def change(raw: dict) -> None:
        *parents, last = path.split("/")
        target = raw
        for key in parents:
            target = target[int(key)] if isinstance(target, list) else target[key]
        if value is ...:
            del target[last]
        elif isinstance(target, list):
            target[int(last)] = value
        else:
            target[last] = value
    return change


S = "states/offsets"
MALFORMED = {
    # case: (change, a regex the message must match: it names the field)
    "format": (_set("format", "keyed"), r"not an operator state handle"),
    "newer version": (_set("version", 2), r"version 2 is not one this library reads"),
    "version not int": (_set("version", "1"), r"version '1'"),
    "no file": (_set("file", ...), r"no 'file' field"),
    "absolute file": (_set("file", "/etc/passwd"), r"OperatorStateHandle\.file"),
    "escaping file": (_set("file", "chk-4/../../x"), r"OperatorStateHandle\.file"),
    "negative subtask": (_set("subtask", -1), r"OperatorStateHandle\.subtask"),
    "subtask as str": (_set("subtask", "1"), r"OperatorStateHandle\.subtask"),
    "no size": (_set("size", ...), r"no 'size' field"),
    "size as bool": (_set("size", True), r"OperatorStateHandle\.size"),
    "empty operator id": (_set("operator_id", ""), r"OperatorStateHandle\.operator_id"),
    "states as list": (_set("states", []), r"OperatorStateHandle\.states must be"),
    "state as list": (_set(S, []), r"states\['offsets'\] must be a JSON object"),
    "unknown mode": (_set(f"{S}/mode", "SHUFFLE"), r"states\['offsets'\]\.mode: unknown mode 'SHUFFLE'"),
    "no mode": (_set(f"{S}/mode", ...), r"\.mode: unknown mode None"),
    "no serializer": (_set(f"{S}/serializer", ...), r"states\['offsets'\] lacks serializer"),
    "serializer as str": (_set(f"{S}/serializer", "int64"), r"states\['offsets'\]\.serializers"),
    "no offsets": (_set(f"{S}/offsets", ...), r"lacks offsets"),
    "offsets as dict": (_set(f"{S}/offsets", {}), r"states\['offsets'\]\.offsets must be a list of ints"),
    "float offset": (_set(f"{S}/offsets/1", 18.0), r"\.offsets must be a list of ints"),
    "offset past end": (_set(f"{S}/offsets/2", 39), r"\.offsets must lie in \[0, end=38\]"),
    "negative offset": (_set(f"{S}/offsets/0", -8), r"\.offsets must lie in"),
    "end past size": (_set(f"{S}/end", 39), r"states\['offsets'\]\.end = 39 must be an int in \[0, size=38\]"),
    "end as str": (_set(f"{S}/end", "38"), r"\.end = '38'"),
    "no blocks": (_set(f"{S}/blocks", ...), r"lacks blocks"),
    "blocks as dict": (_set(f"{S}/blocks", {}), r"\.blocks must be a list of \[first element, CRC32C\] pairs"),
    "block of three": (_set(f"{S}/blocks/0", [0, 1, 2]), r"\.blocks must be a list of \[first element"),
    "first block not at 0": (_set(f"{S}/blocks/0", [1, 11]), r"\.blocks must start at element 0"),
    "blocks descending": (_set(f"{S}/blocks/1", [0, 4]), r"\.blocks\[1\] = \(0, 4\)"),
    "block past the elements": (_set(f"{S}/blocks/1", [3, 4]), r"\.blocks\[1\] = \(3, 4\)"),
    "crc beyond u32": (_set(f"{S}/blocks/1", [2, 1 << 32]), r"\.blocks\[1\]"),
    "negative crc": (_set(f"{S}/blocks/0", [0, -1]), r"\.blocks\[0\]"),
    "block without elements": (_set("states/config/blocks", [[0, 1]]), r"states\['config'\]\.blocks\[0\]"),
    "list state with map serializers": (_set(f"{S}/mode", "BROADCAST"), r"lacks key_serializer, value_serializer"),
}


@pytest.mark.parametrize("case", list(MALFORMED), ids=list(MALFORMED))
def test_each_malformed_field_is_corrupt_snapshot_naming_the_field(case):
    change, message = MALFORMED[case]
    raw = copy.deepcopy(valid_json())
    change(raw)
    with pytest.raises(CorruptSnapshotError, match=message):
        OperatorStateHandle.from_json(raw)


@pytest.mark.parametrize("not_a_handle", [None, [], "handle", 3])
def test_json_that_is_not_an_object_is_corrupt(not_a_handle):
    with pytest.raises(CorruptSnapshotError, match="not an operator state handle"):
        OperatorStateHandle.from_json(not_a_handle)


def test_built_handles_are_validated_too():
    good = OperatorStateHandle.from_json(valid_json())
    with pytest.raises(ValueError, match=r"OperatorStateHandle\.size"):
        dataclasses.replace(good, size=-1)
    meta = good.states["offsets"]
    with pytest.raises(TypeError, match=r"\.mode must be a DistributionMode"):
        dataclasses.replace(good, states={"offsets": dataclasses.replace(meta, mode="UNION")})
    with pytest.raises(ValueError, match=r"\.blocks\[0\]"):
        dataclasses.replace(good, states={"offsets": dataclasses.replace(meta, blocks=[[0, 11]])})
    with pytest.raises(TypeError, match="OperatorStateHandle objects"):
        CheckpointMetadata(4, "job", 0, 128, 2, [], [valid_json()], {}).validate()


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(list(DistributionMode)), st.lists(st.integers(0, 50), max_size=12),
                          st.data()), max_size=4),
       st.integers(0, 1000), st.text(min_size=1, max_size=8))
def test_property_any_valid_handle_round_trips(states, subtask, operator_id):
    pos, metas = 8, {}
    for i, (mode, sizes, data) in enumerate(states):
        offsets = [pos + sum(sizes[:j]) for j in range(len(sizes))]
        end = pos + sum(sizes)
        starts = sorted({0} | set(data.draw(st.lists(st.integers(0, len(sizes) - 1)) if sizes else st.just([]))))
        blocks = [(s, data.draw(st.integers(0, (1 << 32) - 1))) for s in starts] if sizes else []
        metas[f"s{i}"] = OperatorStateMeta(mode, {k: {"identifier": k} for k in SERIALIZER_KEYS[mode]}, offsets,
                                           end, blocks)
        pos = end
    handle = OperatorStateHandle(f"chk-1/operator-{subtask}-x", subtask, pos, operator_id, metas)
    assert OperatorStateHandle.from_json(json.loads(json.dumps(handle.to_json()))) == handle


# ---- a checkpoint written before the handles were typed (tests/data/operator-checkpoint-v1) -----------------------


@pytest.fixture
def old_checkpoint(tmp_path):
    shutil.copytree(OLD_CHECKPOINT, tmp_path / "chk")
    return CheckpointStorage(tmp_path / "chk")


def test_distribution_mode_values_are_the_json_strings():
    assert [m.value for m in DistributionMode] == ["SPLIT_DISTRIBUTE", "UNION", "BROADCAST"]
    assert DistributionMode.UNION == "UNION" and f"{DistributionMode.UNION}" == "UNION"
    assert json.dumps(DistributionMode.BROADCAST) == '"BROADCAST"'


def test_a_checkpoint_of_the_untyped_handles_still_loads_and_restores(old_checkpoint):
    md = old_checkpoint.load(1)
    assert [h.subtask for h in md.operator_handles] == [0, 1]
    for h in md.operator_handles:
        assert {n: m.mode for n, m in h.states.items()} == {"positions": DistributionMode.SPLIT_DISTRIBUTE,
                                                            "seen": DistributionMode.UNION,
                                                            "config": DistributionMode.BROADCAST}
    # the JSON the old code wrote, less the two fields the metadata already holds, is what the handle writes now
    body = json.loads((OLD_CHECKPOINT / "chk-1" / "_metadata").read_bytes()[12:-4])
    for old, handle in zip(body["operator_handles"], md.operator_handles):
        assert (old.pop("checkpoint_id"), old.pop("parallelism")) == (1, 2)
        assert handle.to_json() == dict(old, file=f"chk-1/{old['file']}")
    positions = []
    for i in range(3):
        store = OperatorStateStore(i, 3)
        store.restore(old_checkpoint, md)
        positions.append(store.get_list_state(POSITIONS).get())
        assert sorted(store.get_union_list_state(SEEN).get()) == ["s0", "s1"]
        assert dict(store.get_broadcast_state(CONFIG).items()) == {"rate": 5, "name": "x"}
    assert positions == [[0, 1, 2], [10, 11], [12, 13]]


def test_an_old_checkpoint_saved_again_keeps_its_mode_strings(old_checkpoint):
    where = old_checkpoint.savepoint(1, "again")
    raw = (pathlib.Path(where) / "_metadata").read_bytes()
    modes = {meta["mode"] for h in json.loads(raw[12:-4])["operator_handles"] for meta in h["states"].values()}
    assert modes == {"SPLIT_DISTRIBUTE", "UNION", "BROADCAST"}
    assert old_checkpoint.load_savepoint("again").operator_handles == [
        dataclasses.replace(h, file=h.file.replace("chk-1/", "savepoints/again/"))
        for h in old_checkpoint.load(1).operator_handles]


def test_corrupt_data_is_the_common_base():
    assert issubclass(CorruptLogError, CorruptSnapshotError) and issubclass(CorruptSnapshotError, CorruptDataError)
