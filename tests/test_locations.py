"""Where stores live (memory, local folder, memory:// URL, zip), the on-disk format as a plain
zarr reader sees it, read-only opens that write nothing, and metadata-only load_from / dumps."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numcodecs
import numpy as np
import pytest
import zarr
from conftest import (
    SPACES,
    assert_same,
    box_space,
    changed,
    leaf_items,
    random_batch,
    random_rows,
    ring_model,
    snapshot,
    stack,
)
from gymnasium.spaces import Box

from trajstore import ReplayBuffer
from trajstore.errors import BadValueError, ReadOnlyError

HEAD = "trajstore.head.json"
PREV = "trajstore.head.prev.json"  # the copy of the last record that repair can fall back to

# ---------------------------------------------------------------------------- locations


def test_in_memory_store(buffers):
    rb = buffers.create(SPACES["nested"](), "memory", capacity=6)
    assert rb.cache_path is None and not rb.read_only
    rows = random_rows(rb.single_space, 9, 0)
    rb.extend(stack(rows))
    rb.dumps()  # its own "path": a commit, nothing to copy
    assert list(buffers.tmp_path.iterdir()) == []  # nothing on disk
    path = buffers.path()
    rb.dumps(path)
    assert_same(buffers.load(path, read_only=True)[:], stack(rows[-6:]))
    rb.append(rows[0])  # still open and writable
    assert_same(rb[-1], rows[0])


@pytest.mark.parametrize("as_type", [str, Path, lambda p: f"file://{p}"])
def test_local_folder(buffers, as_type):
    path = buffers.path()
    rb = buffers.create(SPACES["tuple"](), cache_path=as_type(path))
    assert rb.cache_path is not None and Path(rb.cache_path.removeprefix("file://")) == path
    rows = random_rows(rb.single_space, 5, 1)
    rb.extend(stack(rows))
    rb.close()
    assert (path / "zarr.json").is_file() and (path / HEAD).is_file()
    assert_same(buffers.load(as_type(path))[:], stack(rows))


def test_memory_url(buffers):
    url = buffers.memory_url()
    rb = buffers.create(SPACES["nested"](), "memory", cache_path=url, capacity=5)
    assert rb.cache_path == url
    rows = random_rows(rb.single_space, 7, 2)
    rb.extend(stack(rows))
    rb.dumps()
    ro = buffers.load(url, read_only=True)
    assert ro.read_only and (len(ro), ro.offset, ro.capacity) == (5, 2, 5)
    assert_same(ro[:], stack(rows[-5:]))
    assert ro.single_space == rb.single_space
    rb.close()
    rw = buffers.load(url)
    rw.extend(stack(rows[:2]))
    rw.close()
    assert_same(buffers.load(url, read_only=True)[:], stack(ring_model(rows[-5:], rows[:2], 5)))


def test_dumps_local_to_memory_url_and_back(buffers):
    rb = buffers.create(SPACES["dict"](), capacity=4)
    rows = random_rows(rb.single_space, 6, 3)
    rb.extend(stack(rows))
    url = buffers.memory_url()
    rb.dumps(url)
    assert_same(buffers.load(url, read_only=True)[:], stack(rows[-4:]))
    back = buffers.path()
    buffers.load(url, read_only=True).dumps(back)
    assert_same(buffers.load(back)[:], stack(rows[-4:]))


@pytest.mark.parametrize("layout", ["raw", "lz4", "memory"])
def test_dumps_to_zip_and_read_it(buffers, layout):
    rb = buffers.create(SPACES["nested"](), layout, capacity=6)
    rows = random_rows(rb.single_space, 10, 4)
    rb.extend(stack(rows))
    zip_path = buffers.path("copy.zip")
    rb.dumps(zip_path)
    assert zip_path.is_file()
    before = snapshot(zip_path)
    ro = buffers.load(zip_path, read_only=True)
    assert (len(ro), ro.offset, ro.capacity) == (6, 4, 6)
    assert ro.single_space == rb.single_space
    assert_same(ro[:], stack(rows[-6:]))
    assert_same(ro[-2], rows[-2])
    ro.sample(3, rng=0)
    ro.close()
    assert snapshot(zip_path) == before
    rb.append(rows[0])  # the original stays open and writable
    assert len(rb) == 6


def test_dumps_to_another_folder_leaves_the_original_open(buffers):
    rb = buffers.create(SPACES["tuple"]())
    rows = random_rows(rb.single_space, 8, 5)
    rb.extend(stack(rows[:5]))
    other = buffers.path("other")
    rb.dumps(other)
    rb.extend(stack(rows[5:]))  # still writable
    rb.set_at(0, rows[7])
    assert len(rb) == 8
    copy = buffers.load(other)  # a writer: the copy is a store of its own, not locked by rb
    assert_same(copy[:], stack(rows[:5]))
    copy.append(rows[6])
    assert len(copy) == 6 and len(rb) == 8
    path = rb.cache_path
    rb.close()
    assert_same(buffers.load(path, read_only=True)[:], stack([rows[7]] + rows[1:]))


# ---------------------------------------------------------------------------- format


def _head(path: Path) -> dict[str, Any]:
    with open(path / HEAD) as f:
        return json.load(f)


FORMAT_CASES = {
    "raw": {},
    "raw_chunk_rows": {"chunk_rows": 3},
    "lz4": {"compressor": "lz4"},
    "zstd_chunk_rows": {"compressor": "zstd", "chunk_rows": 3},
    "numcodecs_zstd": {"compressor": numcodecs.Zstd(level=1), "chunk_rows": 4},
}


@pytest.mark.filterwarnings("ignore:Numcodecs codecs are not in the Zarr version 3 specification")
@pytest.mark.parametrize("capacity", [None, 7])
@pytest.mark.parametrize("space_name", ["box", "nested"])
@pytest.mark.parametrize("case", list(FORMAT_CASES))
def test_plain_zarr_reader_sees_committed_rows(buffers, case, space_name, capacity):
    opts = FORMAT_CASES[case]
    path = buffers.path()
    rb = buffers.create(SPACES[space_name](), cache_path=path, capacity=capacity, **opts)
    rows = random_rows(rb.single_space, 18, 6)
    for lo, hi in ((0, 5), (5, 6), (6, 18)):  # several extends; a ring of 7 wraps twice
        rb.extend(stack(rows[lo:hi]))
    rb.dumps()
    model = ring_model([], rows, capacity)

    group = zarr.open_group(path, mode="r")
    meta = group.attrs["trajstore"]
    assert isinstance(meta["format_version"], int) and meta["format_version"] >= 1
    assert meta["kind"] == "ReplayBuffer" and "trajstore" in meta["created_by"]
    state = _head(path)["tables"]["step_data"]
    assert state["end"] - state["start"] == len(model)
    absolute = np.arange(state["start"], state["end"])
    physical = absolute if capacity is None else absolute % capacity

    root = json.loads((path / "zarr.json").read_text())
    consolidated = root["consolidated_metadata"]["metadata"]
    expected = stack(model)
    for leaf, values in leaf_items(expected):
        name = f"step_data/{leaf}" if leaf else "step_data"
        arr = group[name]
        assert isinstance(arr, zarr.Array), name
        assert arr.dtype == values.dtype and arr.dtype.fields is None, name
        assert arr.shape[1:] == values.shape[1:], name
        if capacity is not None:
            assert arr.shape[0] == capacity, name
        np.testing.assert_array_equal(arr.oindex[physical], values, err_msg=name)
        assert consolidated[name]["shape"] == list(arr.shape), f"{name}: stale consolidated metadata"
        codecs = json.dumps(consolidated[name]["codecs"])
        if "compressor" in opts:
            assert "zstd" in codecs if "zstd" in case else "lz4" in codecs, codecs
            assert arr.chunks[0] == opts.get("chunk_rows", arr.chunks[0])
        else:
            assert "zstd" not in codecs and "blosc" not in codecs, codecs
    # consolidated metadata lists every array, and opening through it gives the same shapes
    cgroup = zarr.open_group(path, mode="r", use_consolidated=True)
    for name, node in consolidated.items():
        if node["node_type"] == "array":
            assert cgroup[name].shape == group[name].shape
    rb.close()


def test_format_documents_every_leaf_and_no_structured_dtypes(buffers):
    path = buffers.path()
    rb = buffers.create(SPACES["dict"](), cache_path=path)
    rb.extend(random_batch(rb.single_space, 3, np.random.default_rng(0)))
    rb.close()
    group = zarr.open_group(path, mode="r")
    arrays = {name for name, _ in group["step_data"].arrays()}
    assert arrays == {"img", "vec", "act", "mb"}
    expected = {"img": ((84, 84, 4), np.uint8), "vec": ((17,), np.float32), "act": ((), np.int64),
                "mb": ((6,), np.int8)}
    for name, (shape, dtype) in expected.items():
        arr = group[f"step_data/{name}"]
        assert arr.shape[1:] == shape and arr.dtype == dtype


# ---------------------------------------------------------------------------- read_only writes nothing


def _exercise_reader(ro: ReplayBuffer, rows: list[Any], backend: str = "numpy") -> None:
    """Every read a user might do, and every write (refused)."""
    n = len(ro)
    assert ro.read_only and n == len(rows) and ro.count == n
    ro.offset, ro.capacity, ro.full, ro.cache_path  # noqa: B018
    assert_same(ro[:], stack(rows), backend)
    assert_same(ro[-1], rows[-1], backend)
    ro[[0, n - 1]], ro[np.arange(n) % 2 == 0], ro[::-2], ro[...]  # noqa: B018
    ro.get_flattened_at(slice(None)), ro.get_flattened_at(0)  # noqa: B018
    ro.sample(16, rng=0)
    ro.get_slice(slice(1, None))[:], ro.get_column(["obs", "pos"])[::2], ro.to_numpy()  # noqa: B018
    list(ro.get_slice(slice(0, 2)))
    row = rows[0]
    writes = {
        "append": lambda: ro.append(row),
        "extend": lambda: ro.extend(stack([row])),
        "set_at": lambda: ro.set_at(0, row),
        "setitem": lambda: ro.__setitem__(slice(0, 1), stack([row])),
        "remove_at": lambda: ro.remove_at(0),
        "delitem": lambda: ro.__delitem__(-1),
        "clear": lambda: ro.clear(),
        "append_flattened": lambda: ro.append_flattened(ro.get_flattened_at(0)),
        "extend_flattened": lambda: ro.extend_flattened(ro.get_flattened_at(slice(0, 2))),
        "set_flattened_at": lambda: ro.set_flattened_at(0, ro.get_flattened_at(0)),
        "extend_from": lambda: ro.extend_from(ro),
        "slice_view_set_at": lambda: ro.get_slice(slice(0, 2)).set_at(0, row),
    }
    for name, write in writes.items():
        with pytest.raises(ReadOnlyError):
            write()
    assert len(ro) == n
    ro.flush()
    ro.dumps()  # own path: nothing to commit


@pytest.mark.parametrize("layout", ["raw", "lz4"])
@pytest.mark.parametrize("capacity", [None, 5])
def test_read_only_writes_nothing(buffers, layout, capacity):
    rb = buffers.create(SPACES["nested"](), layout, capacity=capacity)
    rows = random_rows(rb.single_space, 8, 7)
    rb.extend(stack(rows))
    path = Path(rb.cache_path)
    rb.close()
    model = ring_model([], rows, capacity)
    before = snapshot(path)
    for backend in ("numpy", "torch"):
        ro = buffers.load(path, read_only=True, backend=backend)
        _exercise_reader(ro, model, backend)
        ro.close()
    with ReplayBuffer.load_from(path, read_only=True) as ro:
        len(ro)
    assert snapshot(path) == before, changed(before, snapshot(path), files_only=False)


def test_read_only_while_a_writer_is_open_writes_nothing(buffers):
    rb = buffers.create(SPACES["nested"](), capacity=6)
    rows = random_rows(rb.single_space, 9, 8)
    rb.extend(stack(rows))
    rb.flush()
    before = snapshot(rb.cache_path)
    ro = buffers.load(rb.cache_path, read_only=True)
    _exercise_reader(ro, rows[-6:])
    ro.close()
    assert snapshot(rb.cache_path) == before, changed(before, snapshot(rb.cache_path), files_only=False)


# ---------------------------------------------------------------------------- metadata-only load_from / dumps


def _chunk_files(keys: set[str]) -> set[str]:
    return {k for k in keys if "/c/" in k.replace(os.sep, "/") and not k.endswith("/")}


def _touched_by_dumps_and_open(buffers, n: int, compressor: Any) -> dict[str, Any]:
    """Fill a (17,) float32 store with ``n`` rows, then record what dumps / load_from change."""
    path = buffers.path(f"n{n}")
    rb = buffers.create(Box(-1.0, 1.0, (17,), np.float32), cache_path=path, chunk_rows=1024,
                        compressor=compressor)
    data = np.random.default_rng(n).standard_normal((n + 3, 17)).astype(np.float32)
    rb.extend(data[:n])
    rb.dumps()
    out: dict[str, Any] = {}
    s0 = snapshot(path)
    out["n_chunk_files"] = len(_chunk_files(set(s0)))
    rb.dumps()  # nothing new
    s1 = snapshot(path)
    out["dumps_nothing_new"] = changed(s0, s1)
    rb.append(data[n])
    rb.extend(data[n + 1:])
    rb.dumps()
    s2 = snapshot(path)
    out["dumps_after_3_rows"] = changed(s1, s2)
    out["bytes_after_3_rows"] = sum(s2[k][0] for k in out["dumps_after_3_rows"] if k in s2)
    rb.close()
    s3 = snapshot(path)
    with ReplayBuffer.load_from(path, read_only=True) as ro:
        assert len(ro) == n + 3
        np.testing.assert_array_equal(ro[-4:], data[-4:])
    out["load_read_only"] = changed(s3, snapshot(path))
    w = buffers.load(path)
    out["load_writer"] = changed(s3, snapshot(path))
    assert len(w) == n + 3
    w.close()
    return out


@pytest.mark.parametrize("compressor", [None, "lz4"])
def test_load_from_and_dumps_do_not_scale_with_size(buffers, compressor):
    small = _touched_by_dumps_and_open(buffers, 1_000, compressor)
    large = _touched_by_dumps_and_open(buffers, 200_000, compressor)
    assert large["n_chunk_files"] >= 190 and small["n_chunk_files"] <= 2  # the large store has many chunks
    chunk_bytes = 1024 * 17 * 4
    for res in (small, large):
        assert res["dumps_nothing_new"] <= {HEAD, PREV}, res["dumps_nothing_new"]
        touched = res["dumps_after_3_rows"]
        assert HEAD in touched
        assert len(_chunk_files(touched)) <= 1, touched  # only the partly filled chunk of the one field
        # the record and its previous copy; the shape published for plain zarr readers (docs/format.md)
        assert touched - _chunk_files(touched) <= {HEAD, PREV, "zarr.json", "step_data/zarr.json"}, touched
        assert res["bytes_after_3_rows"] <= chunk_bytes + 8192, res["bytes_after_3_rows"]
        assert res["load_read_only"] == set(), res["load_read_only"]
        assert res["load_writer"] <= {"trajstore.lock"}, res["load_writer"]
    assert len(small["dumps_after_3_rows"]) == len(large["dumps_after_3_rows"])


def test_bad_chunk_rows_option(buffers):
    with pytest.raises((ValueError, BadValueError)):
        buffers.create(box_space(), chunk_rows=0)
    with pytest.raises(TypeError):
        buffers.create(box_space(), no_such_option=1)


@pytest.mark.parametrize("compressor", [None, "lz4"])
def test_plain_zarr_reads_every_row_after_unbounded_growth(tmp_path, compressor):
    """An unbounded store doubles its arrays as it grows; zarr.json (and the consolidated
    metadata) must follow, or plain zarr readers would stop at the first allocation."""
    import zarr

    space = Box(-np.inf, np.inf, (17,), np.float32)
    data = np.arange(9000 * 17, dtype=np.float32).reshape(9000, 17)
    with ReplayBuffer.create(space, cache_path=tmp_path / "s", chunk_rows=1024, compressor=compressor) as rb:
        for lo in range(0, 9000, 700):
            rb.extend(data[lo:lo + 700])
    for consolidated in (True, False):
        arr = zarr.open_group(tmp_path / "s", mode="r", use_consolidated=consolidated)["step_data"]
        assert arr.shape[0] >= 9000
        np.testing.assert_array_equal(arr[:9000], data)
