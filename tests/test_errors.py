"""Errors: opening what is not a (readable) store, locks, existing stores, unsupported spaces,
and bad values, which must raise their specific error before anything is written."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

import gymnasium
import numpy as np
import pytest
import torch
import zarr
from conftest import SPACES, assert_same, box_space, changed, random_rows, ring_model, snapshot, stack
from gymnasium.spaces import Box, Dict, Discrete, Graph, Sequence, Text, Tuple

from trajstore import ReplayBuffer
from trajstore.errors import (
    BadValueError,
    DamagedStoreError,
    FormatVersionError,
    LockedError,
    NotATrajstoreError,
    SpaceMismatchError,
    StoreExistsError,
    StoreNotFoundError,
    TrajstoreError,
    UnsupportedSpaceError,
)
from trajstore.storage.keys import FORMAT_VERSION

HEAD = "trajstore.head.json"


def _closed_store(buffers, n: int = 4) -> tuple[Path, list[Any]]:
    """A committed, closed store of ``n`` Box rows."""
    rb = buffers.create(box_space())
    rows = random_rows(rb.single_space, n, 0)
    rb.extend(stack(rows))
    path = Path(rb.cache_path)
    rb.close()
    return path, rows


def _expect_open_error(buffers, path: Any, error: type[Exception], read_only: bool) -> None:
    """``load_from`` raises ``error`` naming the path, and changes nothing there."""
    before = snapshot(path) if Path(path).exists() else None
    with pytest.raises(error) as info:
        buffers.load(path, read_only=read_only)
    assert str(Path(path).name) in str(info.value), f"the error does not name the path: {info.value}"
    assert isinstance(info.value, TrajstoreError)
    if before is None:
        assert not Path(path).exists(), "a failed open created the store's folder"
    elif read_only:
        assert snapshot(path) == before
    else:  # a writer may have taken (and released) its lock file, nothing else
        assert changed(before, snapshot(path)) <= {"trajstore.lock"}


# ---------------------------------------------------------------------------- opening


@pytest.mark.parametrize("read_only", [True, False])
def test_missing_path(buffers, read_only):
    _expect_open_error(buffers, buffers.path("nowhere"), StoreNotFoundError, read_only)
    with pytest.raises(StoreNotFoundError):
        buffers.load(buffers.path("nowhere.zip"), read_only=read_only)
    with pytest.raises(StoreNotFoundError):
        buffers.load(buffers.memory_url(), read_only=read_only)


@pytest.mark.parametrize("read_only", [True, False])
def test_folder_with_junk(buffers, read_only):
    path = buffers.path("junk")
    (path / "sub").mkdir(parents=True)
    (path / "notes.txt").write_text("hello")
    (path / "sub" / "data.bin").write_bytes(b"\x00\x01")
    _expect_open_error(buffers, path, NotATrajstoreError, read_only)


@pytest.mark.parametrize("read_only", [True, False])
def test_plain_zarr_group(buffers, read_only):
    path = buffers.path("plain")
    group = zarr.open_group(path, mode="w")
    group.create_array("step_data", shape=(4, 3), dtype="f4")[:] = 1.0
    _expect_open_error(buffers, path, NotATrajstoreError, read_only)


def _edit_root_attrs(path: Path, edit: Callable[[dict[str, Any]], None]) -> None:
    """Edit attrs["trajstore"] in the root zarr.json, also inside consolidated metadata."""
    root = json.loads((path / "zarr.json").read_text())
    edit(root["attributes"]["trajstore"])
    for node in (root.get("consolidated_metadata") or {}).get("metadata", {}).values():
        if "trajstore" in node.get("attributes", {}):
            edit(node["attributes"]["trajstore"])
    (path / "zarr.json").write_text(json.dumps(root))


@pytest.mark.parametrize("read_only", [True, False])
def test_newer_format_version(buffers, read_only):
    path, _ = _closed_store(buffers)
    _edit_root_attrs(path, lambda a: a.update(format_version=99))
    _expect_open_error(buffers, path, FormatVersionError, read_only)


def test_version_1_store_opens_and_is_written_as_version_2(buffers):
    """A store of format version 1 (shapes = rows allocated, no dimension names) opens and takes
    rows; the commit records this trajstore writes say 2 (an older trajstore then refuses the store
    by version), its root schema keeps the version it was created with."""
    path, rows = _closed_store(buffers)
    _edit_root_attrs(path, lambda a: a.update(format_version=1))
    head = json.loads((path / HEAD).read_text())
    head["format_version"] = 1
    (path / HEAD).write_text(json.dumps(head))
    with ReplayBuffer.load_from(path, read_only=True) as ro:
        assert_same(ro[: len(rows)], stack(rows))
    rb = buffers.track(ReplayBuffer.load_from(path))
    more = random_rows(rb.single_space, 3, 1)
    rb.extend(stack(more))
    rb.close()
    assert json.loads((path / HEAD).read_text())["format_version"] == FORMAT_VERSION == 2
    assert json.loads((path / "zarr.json").read_text())["attributes"]["trajstore"]["format_version"] == 1
    with ReplayBuffer.load_from(path, read_only=True) as ro:
        assert_same(ro[:], stack(rows + more))


@pytest.mark.parametrize("read_only", [True, False])
def test_other_kind_of_store(buffers, read_only):
    path, _ = _closed_store(buffers)
    _edit_root_attrs(path, lambda a: a.update(kind="SomethingElse"))
    _expect_open_error(buffers, path, NotATrajstoreError, read_only)


@pytest.mark.parametrize("head", [b"{not json", b"", b"[]", b'{"generation": 1}',
                                  b'{"generation":1,"epoch":0,"tables":{"step_data":{"start":5,"end":2,"allocated":8}}}',
                                  None])
@pytest.mark.parametrize("read_only", [True, False])
def test_damaged_head(buffers, read_only, head):
    path, _ = _closed_store(buffers)
    if head is None:
        (path / HEAD).unlink()
    else:
        (path / HEAD).write_bytes(head)
    _expect_open_error(buffers, path, DamagedStoreError, read_only)


def test_damaged_root_metadata(buffers):
    path, _ = _closed_store(buffers)
    (path / "zarr.json").write_text("{ this is not json")
    with pytest.raises((DamagedStoreError, NotATrajstoreError)):
        buffers.load(path, read_only=True)


def test_second_writer_is_locked_out_readers_are_not(buffers):
    rb = buffers.create(SPACES["tuple"]())
    rows = random_rows(rb.single_space, 5, 1)
    rb.extend(stack(rows[:3]))
    rb.flush()
    with pytest.raises(LockedError):
        buffers.load(rb.cache_path)
    with pytest.raises(LockedError):  # overwrite must not erase a store a writer has open
        buffers.create(rb.single_space, cache_path=rb.cache_path, overwrite=True)
    ro = buffers.load(rb.cache_path, read_only=True)
    assert_same(ro[:], stack(rows[:3]))
    rb.extend(stack(rows[3:]))  # the writer is unharmed
    rb.close()
    assert_same(ro[:], stack(rows))  # the reader sees the new commit
    writer = buffers.load(rb.cache_path)  # the lock was released
    assert len(writer) == 5


def test_create_on_an_existing_store(buffers):
    path, rows = _closed_store(buffers)
    before = snapshot(path)
    for space in (box_space(), SPACES["tuple"]()):
        with pytest.raises(StoreExistsError):
            buffers.create(space, cache_path=path)
        with pytest.raises(StoreExistsError):
            buffers.create(space, cache_path=path, capacity=3)
    assert changed(before, snapshot(path)) <= {"trajstore.lock"}
    assert_same(buffers.load(path, read_only=True)[:], stack(rows))
    fresh = buffers.create(SPACES["tuple"](), cache_path=path, overwrite=True)
    assert len(fresh) == 0 and fresh.single_space == SPACES["tuple"]()
    fresh.close()
    reopened = buffers.load(path, read_only=True)
    assert len(reopened) == 0 and reopened.single_space == SPACES["tuple"]()


@pytest.mark.parametrize("space, leaf", [
    (Text(5), None),
    (Dict([("obs", Box(0.0, 1.0, (2,))), ("txt", Text(4))]), "txt"),
    (Dict([("a", Dict([("ok", Discrete(2)), ("b", Sequence(Discrete(3)))]))]), "a/b"),
    (Tuple((Box(0.0, 1.0, (2,)), Graph(Box(0.0, 1.0, (2,)), None))), "1"),
])
@pytest.mark.parametrize("location", ["folder", "memory_url"])
def test_unsupported_space_names_the_leaf_and_creates_nothing(buffers, space, leaf, location):
    path = buffers.path("new") if location == "folder" else buffers.memory_url()
    with pytest.raises(UnsupportedSpaceError) as info:
        buffers.create(space, cache_path=path)
    if leaf is not None:
        assert repr(leaf) in str(info.value) or f"'{leaf}'" in str(info.value), str(info.value)
    if location == "folder":
        assert not path.exists()
    else:
        with pytest.raises(StoreNotFoundError):
            buffers.load(path, read_only=True)


# ---------------------------------------------------------------------------- misuse


def test_bad_index_types(buffers):
    rb = buffers.create(box_space())
    rb.extend(stack(random_rows(rb.single_space, 3, 0)))
    for idx in (1.5, "a", None, np.array([0.5, 1.0]), np.zeros((2, 2), dtype=np.int64)):
        with pytest.raises((TypeError, IndexError)):
            rb[idx]


def test_closed_buffer(buffers):
    rb = buffers.create(box_space())
    rb.extend(stack(random_rows(rb.single_space, 3, 0)))
    rb.close()
    rb.close()  # twice is fine
    with pytest.raises(ValueError):
        rb[0]
    with pytest.raises(ValueError):
        len(rb)


def test_load_with_a_different_space(buffers):
    path, _ = _closed_store(buffers)
    with pytest.raises(SpaceMismatchError):
        buffers.load(path, single_instance_space=Box(-1.0, 1.0, (3, 5, 2), np.float64))
    assert len(buffers.load(path, single_instance_space=box_space())) == 4


# ---------------------------------------------------------------------------- bad values change nothing


def _flatdim(rb: ReplayBuffer) -> int:
    return gymnasium.spaces.flatdim(rb.single_space)


def _row(rb: ReplayBuffer, **override: Any) -> dict[str, Any]:
    """A valid row of the mixed Dict space with some leaves replaced (``None`` removes a key)."""
    row = dict(random_rows(rb.single_space, 1, 42)[0])
    for k, v in override.items():
        if v is None:
            del row[k]
        else:
            row[k] = v
    return row


def _batch(rb: ReplayBuffer, n: int = 3, **override: Any) -> dict[str, Any]:
    batch = dict(stack(random_rows(rb.single_space, n, 43)))
    for k, v in override.items():
        if v is None:
            del batch[k]
        else:
            batch[k] = v
    return batch


# The last leaf of the Dict is "mb": a bad value there comes after three valid leaves, so a
# writer that stored leaf by leaf before checking would leave a partial row.
# Floats into integer fields are refused when they are not whole (whole ones, e.g. SB3's float
# actions, are accepted: tests/test_value_checks.py).
BAD_VALUES: dict[str, tuple[type[Exception], Callable[[ReplayBuffer], None]]] = {
    "append_wrong_shape": (BadValueError, lambda rb: rb.append(_row(rb, mb=np.zeros(5, np.int8)))),
    "append_batched_row": (BadValueError, lambda rb: rb.append(_batch(rb, 1))),
    "append_float_into_discrete": (BadValueError, lambda rb: rb.append(_row(rb, act=np.float64(2.5)))),
    "append_float_into_uint8_box": (BadValueError, lambda rb: rb.append(_row(rb, img=np.full((84, 84, 4), 0.5)))),
    "append_float_into_multibinary": (BadValueError, lambda rb: rb.append(_row(rb, mb=np.full(6, 0.5, np.float32)))),
    "append_missing_key": (SpaceMismatchError, lambda rb: rb.append(_row(rb, mb=None))),
    "append_extra_key": (SpaceMismatchError, lambda rb: rb.append({**_row(rb), "zzz": np.zeros(1)})),
    "append_renamed_key": (SpaceMismatchError, lambda rb: rb.append({**_row(rb, mb=None), "mbx": np.zeros(6, np.int8)})),
    "append_not_a_dict": (SpaceMismatchError, lambda rb: rb.append(np.zeros(4))),
    "extend_wrong_shape": (BadValueError, lambda rb: rb.extend(_batch(rb, mb=np.zeros((3, 7), np.int8)))),
    "extend_unbatched": (BadValueError, lambda rb: rb.extend(_row(rb))),
    "extend_batch_sizes_differ": (BadValueError, lambda rb: rb.extend(_batch(rb, mb=np.zeros((2, 6), np.int8)))),
    "extend_float_into_int": (BadValueError, lambda rb: rb.extend(_batch(rb, mb=np.full((3, 6), 0.5)))),
    "extend_torch_float_into_int": (BadValueError, lambda rb: rb.extend(_batch(rb, act=torch.full((3,), 0.5)))),
    "extend_int_out_of_range": (BadValueError, lambda rb: rb.extend(_batch(rb, mb=np.full((3, 6), 300)))),
    "extend_missing_key": (SpaceMismatchError, lambda rb: rb.extend(_batch(rb, mb=None))),
    "extend_extra_key": (SpaceMismatchError, lambda rb: rb.extend({**_batch(rb), "zzz": np.zeros((3, 1))})),
    "append_flattened_wide": (BadValueError, lambda rb: rb.append_flattened(np.zeros(_flatdim(rb) + 1))),
    "append_flattened_narrow": (BadValueError, lambda rb: rb.append_flattened(np.zeros(_flatdim(rb) - 1))),
    "extend_flattened_wide": (BadValueError, lambda rb: rb.extend_flattened(np.zeros((2, _flatdim(rb) + 3)))),
    "set_at_wrong_shape": (BadValueError, lambda rb: rb.set_at(0, _row(rb, mb=np.zeros(5, np.int8)))),
    "set_at_float_into_int": (BadValueError, lambda rb: rb.set_at(1, _row(rb, act=np.float32(1.5)))),
    "set_at_too_few_rows": (BadValueError, lambda rb: rb.set_at([0, 1, 2, 3], _batch(rb, 3))),
    "set_at_missing_key": (SpaceMismatchError, lambda rb: rb.set_at(slice(0, 3), _batch(rb, mb=None))),
    "set_flattened_at_wide": (BadValueError, lambda rb: rb.set_flattened_at(0, np.zeros(_flatdim(rb) + 1))),
}


@pytest.mark.parametrize("layout", ["raw", "lz4"])
def test_bad_values_raise_before_any_write(buffers, layout):
    rb = buffers.create(SPACES["dict"](), layout, capacity=6)
    rows = random_rows(rb.single_space, 8, 7)  # a wrapped ring: a partial write would show
    rb.extend(stack(rows[:5]))
    rb.extend(stack(rows[5:]))
    model = ring_model([], rows, 6)
    rb.flush()
    path = rb.cache_path
    for name, (error, write) in BAD_VALUES.items():
        before = snapshot(path)
        with pytest.raises(error):
            write(rb)
        assert snapshot(path) == before, (name, changed(before, snapshot(path), files_only=False))
        assert len(rb) == 6 and rb.offset == 2, name
    rb.flush()  # nothing was staged either
    assert_same(rb[:], stack(model))
    rb.append(rows[0])  # and the buffer still works
    assert_same(rb[:], stack(ring_model(model, rows[:1], 6)))


def test_bad_values_on_nested_and_tuple_spaces(buffers):
    nested = buffers.create(SPACES["nested"]())
    row = random_rows(nested.single_space, 1, 0)[0]
    with pytest.raises(SpaceMismatchError):
        nested.append({**row, "obs": {"pos": row["obs"]["pos"]}})  # missing nested key
    with pytest.raises(SpaceMismatchError):
        nested.append({**row, "extra": (row["extra"][0],)})  # Tuple of the wrong length
    with pytest.raises(BadValueError):
        nested.append({**row, "obs": {"pos": row["obs"]["pos"], "cam": np.full((4, 4, 3), 0.5, np.float32)}})
    tup = buffers.create(SPACES["tuple"]())
    trow = random_rows(tup.single_space, 1, 0)[0]
    with pytest.raises(SpaceMismatchError):
        tup.append(trow + (np.zeros(1),))
    with pytest.raises(SpaceMismatchError):
        tup.append({"0": trow[0]})
    assert len(nested) == 0 and len(tup) == 0
    nested.append(row)
    tup.append(list(trow))  # a list is accepted for a Tuple
    assert_same(nested[0], row)
    assert_same(tup[0], trow)


def test_safe_casts_are_accepted(buffers):
    """The other side of "unsafe casts are refused": float64 into a float32 Box, Python ints,
    small ints into wider ints and bools into MultiBinary are normal inputs."""
    rb = buffers.create(SPACES["dict"]())
    row = random_rows(rb.single_space, 1, 0)[0]
    rb.append({"img": row["img"].astype(np.int64), "vec": row["vec"].astype(np.float64), "act": 3,
               "mb": row["mb"].astype(bool)})
    got = rb[0]
    assert got["vec"].dtype == np.float32 and got["img"].dtype == np.uint8 and got["mb"].dtype == np.int8
    np.testing.assert_array_equal(got["img"], row["img"])
    np.testing.assert_array_equal(got["mb"], row["mb"])
    assert int(got["act"]) == 3
