"""Plain readers (issue 14): stores that zarr-python and xarray open as they are.

Every array carries ``dimension_names``; an unbounded table's arrays record exactly its committed
rows after each commit (a ring's: its capacity, in physical order); the dataset description is
in the root attributes.  Each test reads a real store with ``zarr.open_group`` (consolidated and
not) and ``xarray.open_zarr`` and compares with trajstore's own reads.  A SIGKILLed writer that
grows and shrinks its store leaves, at every instant, shapes that name committed, whole rows only.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import zarr
from gymnasium.spaces import Box, Dict, Discrete

xr = pytest.importorskip("xarray")

HERE = str(Path(__file__).resolve().parent)
if HERE not in sys.path:
    sys.path.insert(0, HERE)

import _plain_workers as P  # noqa: E402
import _workers as W  # noqa: E402
from conftest import leaf_items  # noqa: E402

from trajstore import ReplayBuffer, TrajectoryReplayBuffer, verify_store  # noqa: E402
from trajstore.metadata import get_dataset_info, set_dataset_info  # noqa: E402
from trajstore.storage.published import dimension_names  # noqa: E402

SPACE = Dict({
    "vec": Box(-1, 1, (3,), np.float32),
    "image": Box(0, 255, (6, 5, 3), np.uint8),
    "action": Discrete(5),
    "goal": Dict({"pos": Box(-5, 5, (2,), np.float64), "id": Discrete(3)}),
})
EPISODE_SPACE = Dict({"seed": Discrete(1000), "ret": Box(-np.inf, np.inf, (), np.float32)})


def _batch(seq: np.ndarray) -> dict[str, Any]:
    """Rows of SPACE determined by their sequence numbers ``seq`` (B,)."""
    s = np.asarray(seq, np.int64)
    return {"vec": np.stack([s, -s, 2 * s], 1).astype(np.float32) / 1e4,
            "image": ((s[:, None, None, None] + np.arange(90).reshape(6, 5, 3)) % 251).astype(np.uint8),
            "action": s % 5, "goal": {"pos": np.stack([s, s + 0.5], 1) / 1e3, "id": s % 3}}


def _arrays(value: Any, table: str) -> dict[str, np.ndarray]:
    """Array path -> rows, for a nested batch read from table ``table``."""
    return {(f"{table}/{p}" if p else table): np.asarray(v) for p, v in leaf_items(value)}


def _groups(paths: list[str]) -> dict[str, list[str]]:
    """Group path -> array names directly in it ("" is the root)."""
    out: dict[str, list[str]] = {}
    for p in paths:
        g, _, name = p.rpartition("/")
        out.setdefault(g, []).append(name)
    return out


def _check_plain(path: Path | str, expected: dict[str, np.ndarray], storage_options: dict | None = None) -> None:
    """``expected`` (array path -> rows in physical order) is exactly what zarr-python (through the
    consolidated metadata and through each array's own zarr.json) and xarray read."""
    kw = {"storage_options": storage_options} if storage_options else {}
    for consolidated in (True, False):
        g = zarr.open_group(str(path), mode="r", use_consolidated=consolidated, **kw)
        for p, want in expected.items():
            a = g[p]
            assert isinstance(a, zarr.Array)
            assert a.shape == want.shape, (p, consolidated, a.shape, want.shape)
            assert a.metadata.dimension_names == tuple(dimension_names(p, want.ndim - 1)), p
            np.testing.assert_array_equal(a[...], want, err_msg=p)
    for group, names in _groups(list(expected)).items():
        ds = xr.open_zarr(str(path), group=group or None, **kw)
        for name in names:
            p = f"{group}/{name}" if group else name
            assert ds[name].dims == tuple(dimension_names(p, expected[p].ndim - 1)), p
            np.testing.assert_array_equal(ds[name].values, expected[p], err_msg=p)


def _physical(logical: np.ndarray, capacity: int, offset: int) -> np.ndarray:
    """A full ring's rows in physical order (logical row i is physical (offset + i) % capacity)."""
    assert len(logical) == capacity
    return np.roll(logical, offset, axis=0)


@pytest.mark.parametrize("layout", ["raw", "lz4"])
def test_unbounded_store_grows_and_shrinks_for_plain_readers(tmp_path: Path, layout: str) -> None:
    """Box vector, image, Discrete and nested Dict leaves: after every commit each array records
    exactly the committed rows (growth past the allocation, remove_at, clear), and zarr and xarray
    read what trajstore reads."""
    opts = {"compressor": "lz4"} if layout == "lz4" else {}
    path = tmp_path / "rb"
    rb = ReplayBuffer.create(SPACE, cache_path=path, chunk_rows=64, **opts)
    try:
        _check_plain(path, {p: v[:0] for p, v in _arrays(_batch(np.zeros(1)), "step_data").items()} | {})
        rb.extend(_batch(np.arange(100)))
        rb.flush()
        _check_plain(path, _arrays(rb[:], "step_data"))
        rb.extend(_batch(np.arange(100, 400)))  # past the first allocation (64 rows)
        rb.flush()
        assert len(rb) == 400
        _check_plain(path, _arrays(rb[:], "step_data"))
        rb.remove_at(np.arange(0, 400, 3))
        assert len(rb) == 266
        _check_plain(path, _arrays(rb[:], "step_data"))
        assert verify_store(path, deep=True).ok
    finally:
        rb.close()
    with ReplayBuffer.load_from(path) as rb:
        rb.clear()
        rb.flush()
        _check_plain(path, {p: v[:0] for p, v in _arrays(_batch(np.zeros(1)), "step_data").items()})
        rb.extend(_batch(np.arange(7)))
    _check_plain(path, _arrays(_batch(np.arange(7)), "step_data"))  # close commits
    assert W.orphans(str(path)) == []  # the files kept for publishing are gone with the writer


def test_metadata_changed_after_a_writer_opened_is_read_again(tmp_path: Path) -> None:
    """A writer's open reads every array's zarr.json before it takes the lock, and its first
    publish reuses what it read (``Publisher.seed``) only while each file is still the one read.
    Here an array's file is replaced between the open and the first commit (as a writer that
    published in that window would): it now names rows that are not committed.  The commit at
    close must see that and publish the committed rows again; with the stale copy it would skip
    the file, and plain readers would see 99 rows of which 10 exist."""
    path = tmp_path / "rb"
    with ReplayBuffer.create(SPACE, cache_path=path, chunk_rows=64) as rb:
        rb.extend(_batch(np.arange(10)))
    key = path / "step_data" / "vec" / "zarr.json"
    rb = ReplayBuffer.load_from(path)
    try:
        meta = json.loads(key.read_text())
        assert meta["shape"][0] == 10
        meta["shape"][0] = 99
        tmp = key.with_name("zarr.json.new")
        tmp.write_text(json.dumps(meta))
        os.replace(tmp, key)
    finally:
        rb.close()
    assert json.loads(key.read_text())["shape"][0] == 10
    with ReplayBuffer.load_from(path, read_only=True) as rb:
        _check_plain(path, _arrays(rb[:], "step_data"))


def test_ring_reads_in_physical_order(tmp_path: Path) -> None:
    """A wrapped ring: arrays keep their capacity; rows are physical; ``offset`` and ``count`` of
    the commit record (docs/format.md) put them in logical order."""
    path = tmp_path / "ring"
    with ReplayBuffer.create(SPACE, cache_path=path, capacity=50, chunk_rows=16) as rb:
        rb.extend(_batch(np.arange(130)))
        rb.flush()
        assert rb.offset == 30 and len(rb) == 50
        logical = _arrays(rb[:], "step_data")
        _check_plain(path, {p: _physical(v, 50, rb.offset) for p, v in logical.items()})
    head = json.loads((path / "trajstore.head.json").read_text())["tables"]["step_data"]
    offset, count = head["start"] % 50, head["end"] - head["start"]
    ds = xr.open_zarr(path, group="step_data")
    in_order = ds.isel(row=(offset + np.arange(count)) % 50)
    np.testing.assert_array_equal(in_order["vec"].values, logical["step_data/vec"])
    np.testing.assert_array_equal(in_order["action"].values, logical["step_data/action"])


@pytest.mark.parametrize("capacity", [None, 40])
def test_trajectory_buffer_with_episode_data(tmp_path: Path, capacity: int | None) -> None:
    """Step rows, their episode ids and the episode table, as plain readers see them, against
    trajstore's get_at_with_metadata; xarray opens the root (steps and ids share the row axis)
    and the episode_data group (axis 'episode')."""
    path = tmp_path / "tb"
    tb = TrajectoryReplayBuffer.create(Box(-1, 1, (4,), np.float32), step_data_capacity=capacity,
                                       episode_data_instance_space=EPISODE_SPACE, cache_path=path, chunk_rows=8)
    try:
        for e in range(7):
            n = 9 + e
            tb.extend(np.full((n, 4), e / 10, np.float32))
            tb.set_current_episode_data({"seed": e * 11, "ret": np.float32(e / 2)})
            tb.mark_episode_end()
        tb.flush()
        item, meta = tb.get_at_with_metadata(slice(None))
        steps = {"step_data": np.asarray(item["step_data"]), "step_episode_ids": np.asarray(meta["episode_ids"])}
        if capacity is not None:
            steps = {p: _physical(v, capacity, tb.offset) for p, v in steps.items()}
        ids = np.asarray(meta["episode_ids"])
        # trajstore's episode data of every step is its episode's (seed 11 * id, ret id / 2) ...
        np.testing.assert_array_equal(np.asarray(item["episode_data"]["seed"]), 11 * ids)
        np.testing.assert_array_equal(np.asarray(item["episode_data"]["ret"]), (ids / 2).astype(np.float32))
        # ... and the episode table holds one row per episode in insertion order; rows of episodes
        # whose steps left the ring stay below the record's start (docs/format.md)
        ep = np.arange(7)
        episodes = {"episode_data/_episode_id": ep, "episode_data/ret": (ep / 2).astype(np.float32),
                    "episode_data/seed": 11 * ep}
        _check_plain(path, steps | episodes)
        assert xr.open_zarr(path).sizes["row"] == (capacity or sum(9 + e for e in range(7)))
        assert xr.open_zarr(path, group="episode_data").sizes["episode"] == 7
    finally:
        tb.close()


def test_dataset_description_in_root_attributes(tmp_path: Path) -> None:
    path = tmp_path / "rb"
    with ReplayBuffer.create(SPACE, cache_path=path) as rb:
        set_dataset_info(rb, name="demo", author="me")
        rb.extend(_batch(np.arange(5)))
        rb.flush()  # the commit republishes the root zarr.json: the description stays
        assert zarr.open_group(str(path), mode="r").attrs["dataset"] == {"author": "me", "name": "demo"}
    set_dataset_info(path, author=None, env_id="CartPole-v1")  # by path, a key removed
    assert get_dataset_info(path) == {"env_id": "CartPole-v1", "name": "demo"}
    assert xr.open_zarr(path).attrs["dataset"] == {"env_id": "CartPole-v1", "name": "demo"}
    with ReplayBuffer.load_from(path, read_only=True) as ro:  # copies carry it: a folder and a zip
        ro.dumps(tmp_path / "copy")
        ro.dumps(tmp_path / "copy.zip")
    assert zarr.open_group(str(tmp_path / "copy"), mode="r").attrs["dataset"] == {"env_id": "CartPole-v1", "name": "demo"}
    with zarr.storage.ZipStore(tmp_path / "copy.zip", mode="r") as zs:
        assert zarr.open_group(zs, mode="r").attrs["dataset"] == {"env_id": "CartPole-v1", "name": "demo"}
    set_dataset_info(path, replace=True)
    assert "dataset" not in zarr.open_group(str(path), mode="r").attrs
    assert verify_store(path).ok


def _strip_to_old_format(path: Path, allocated: int) -> None:
    """Rewrite a store's metadata as trajstore wrote it before plain-reader publishing: no
    dimension names, every unbounded array's shape its allocation (not its rows)."""
    root = json.loads((path / "zarr.json").read_text())
    entries = root["consolidated_metadata"]["metadata"]
    for p, meta in entries.items():
        if meta["node_type"] != "array":
            continue
        for m in (meta, own := json.loads((path / p / "zarr.json").read_text())):
            m.pop("dimension_names", None)
            m["shape"][0] = allocated
        (path / p / "zarr.json").write_text(json.dumps(own))
    (path / "zarr.json").write_text(json.dumps(root))


def test_old_store_without_dimension_names(tmp_path: Path) -> None:
    """A store written before this format change opens, verifies and reads as before; its first
    commit gives it dimension names and the committed shapes."""
    path = tmp_path / "old"
    with ReplayBuffer.create(SPACE, cache_path=path, chunk_rows=64) as rb:
        rb.extend(_batch(np.arange(100)))
    _strip_to_old_format(path, 128)
    assert zarr.open_group(str(path), mode="r")["step_data/vec"].shape == (128, 3)
    assert verify_store(path, deep=True).ok
    with ReplayBuffer.load_from(path, read_only=True) as ro:
        want = _arrays(ro[:], "step_data")
    np.testing.assert_array_equal(want["step_data/vec"], _batch(np.arange(100))["vec"])
    with ReplayBuffer.load_from(path) as rb:
        assert len(rb) == 100
        rb.extend(_batch(np.arange(100, 150)))  # within the old allocation, then past it
        rb.extend(_batch(np.arange(150, 300)))
        rb.flush()
        _check_plain(path, _arrays(rb[:], "step_data"))
    assert verify_store(path, deep=True).ok


def test_remote_store_memory(tmp_path: Path) -> None:
    """An fsspec store (memory://) publishes its shapes too; zarr and xarray open it by URL."""
    url = f"memory://plain-{os.getpid()}-{time.monotonic_ns()}"
    rb = ReplayBuffer.create(SPACE, cache_path=url, chunk_rows=32)
    try:
        rb.extend(_batch(np.arange(70)))
        rb.flush()
        _check_plain(url, _arrays(rb[:], "step_data"))
        rb.remove_at([0, 5, 69])
        _check_plain(url, _arrays(rb[:], "step_data"))
    finally:
        rb.close()


def test_sigkilled_writer_leaves_shapes_of_committed_rows(tmp_path: Path) -> None:
    """A writer that grows, removes rows and clears (committing on every write) is SIGKILLed at
    random instants.  After each kill, before any writer reopens: every array's shape (its own
    zarr.json and the consolidated copy) is at most the committed rows, plain zarr reads those
    rows whole and equal to trajstore's (while a rewrite is being moved into place, the rows before
    its first chunk), xarray opens the table, and verify finds no fault.  A writer reopening then
    publishes the committed rows exactly."""
    path = tmp_path / "k"
    ReplayBuffer.create(W.SPACE, cache_path=path, chunk_rows=256).close()
    rng = np.random.default_rng(0)
    names = ["step_data/obs", "step_data/img", "step_data/d"]
    pending_seen = 0
    for round_ in range(12):
        ready = str(tmp_path / f"ready{round_}")
        p = W.start(P.shrink_grow_program, str(path), ready, round_ + 1)
        W.wait_for_file(ready, p)
        time.sleep(rng.uniform(0.0, 0.25))
        W.kill(p)
        head = W.read_head(str(path))
        end = head["tables"]["step_data"]["end"]
        root = json.loads((path / "zarr.json").read_text())["consolidated_metadata"]["metadata"]
        g = zarr.open_group(str(path), mode="r", use_consolidated=False)
        for name in names:
            assert g[name].shape[0] <= end and root[name]["shape"][0] <= end, (round_, name, end)
        rep = verify_store(path, deep=True)
        assert rep.ok, [f.message for f in rep.faults]
        with ReplayBuffer.load_from(path, read_only=True) as ro:
            n = min(g[name].shape[0] for name in names)
            ours = ro[:n]
        plain = {"obs": g["step_data/obs"][:n], "img": g["step_data/img"][:n], "d": g["step_data/d"][:n]}
        assert W.decode(plain)[1].all(), f"round {round_}: a row plain zarr reads is not whole"
        for k in plain:  # (a pending rewrite: its chunks are not named yet, the rows before them are the same)
            np.testing.assert_array_equal(plain[k], ours[k], err_msg=f"round {round_}: {k}")
        pending_seen += head["pending"] is not None
        xr.open_zarr(path, group="step_data").load()
        with ReplayBuffer.load_from(path) as rb:
            rb.flush()
            expected = _arrays(rb[:], "step_data")
        _check_plain(path, expected)
    print("kills that left a rewrite pending:", pending_seen)
