"""Lazy views: ``get_slice`` and ``get_column`` read nothing until indexed, resolve logical rows
against the buffer's state at read time, chain, refuse or forward writes, and convert to numpy."""

from __future__ import annotations

import gymnasium
import numpy as np
import pytest
from conftest import SPACES, as_numpy, assert_same, empty_batch, random_rows, ring_model, stack, take
from gymnasium.spaces import Box, Dict, Discrete

from trajstore import ColumnView, SliceView
from trajstore.errors import ReadOnlyError, SpaceMismatchError

VIEW_LAYOUTS = [("numpy", "raw"), ("torch", "raw"), ("numpy", "lz4"), ("numpy", "memory")]


@pytest.fixture(params=VIEW_LAYOUTS, ids="-".join)
def setup(request, buffers):
    """(create(capacity, space) -> buffer, of the nested space by default; backend)."""
    backend, layout = request.param

    def create(capacity=None, space=None):
        return buffers.create(space or SPACES["nested"](), layout, capacity=capacity, backend=backend)

    return create, backend


def column(rows, *keys):
    """The sub-value at ``keys`` of every row."""
    out = []
    for r in rows:
        for k in keys:
            r = r[k]
        out.append(r)
    return out


# ---------------------------------------------------------------------------- laziness


def test_slice_view_reads_at_read_time(setup):
    create, backend = setup
    rb = create()
    view = rb.get_slice(slice(2, None))  # created on an empty buffer: nothing to read yet
    tail = rb.get_slice(slice(-3, None))
    everything = rb.get_slice(...)
    assert isinstance(view, SliceView) and view.single_space == rb.single_space
    assert len(view) == 0 and len(everything) == 0
    rows = random_rows(rb.single_space, 6, 0)
    rb.extend(stack(rows))
    assert len(view) == 4 and len(tail) == 3 and len(everything) == 6
    assert_same(view[:], stack(rows[2:]), backend)
    new = random_rows(rb.single_space, 5, 1)
    rb.set_at(3, new[0])  # after the view was made, before it is read
    rb.extend(stack(new[1:]))
    rows = rows[:3] + [new[0]] + rows[4:] + new[1:]
    assert len(view) == 8 and len(everything) == 10  # a slice view's len follows the buffer
    assert_same(view[:], stack(rows[2:]), backend)
    assert_same(view[1], rows[3], backend)
    assert_same(view[-1], rows[-1], backend)
    assert_same(tail[:], stack(rows[-3:]), backend)
    assert_same(everything[::3], stack(rows[::3]), backend)


def test_index_views_resolve_logical_rows_on_a_wrapped_ring(setup):
    create, backend = setup
    rb = create(capacity=5)
    rows = random_rows(rb.single_space, 14, 2)
    rb.extend(stack(rows[:5]))
    views = {
        "array": (rb.get_slice(np.array([0, 2, 4])), [0, 2, 4]),
        "list_negative": (rb.get_slice([-1, 1]), [4, 1]),
        "mask": (rb.get_slice(np.array([True, False, False, True, False])), [0, 3]),
        "int": (rb.get_slice(3), [3]),
        "slice": (rb.get_slice(slice(1, 4)), [1, 2, 3]),
    }
    model = rows[:5]
    for batch, offset in ((rows[5:8], 3), (rows[8:14], 4)):  # wrap the ring under the views, twice
        rb.extend(stack(batch))
        model = ring_model(model, batch, 5)
        assert rb.offset == offset
        for name, (view, logical) in views.items():
            assert len(view) == len(logical), name
            assert_same(view[:], stack([model[i] for i in logical]), backend, name)
            assert_same(view[0], model[logical[0]], backend, name)


def test_column_view_reads_at_read_time(setup):
    create, backend = setup
    rb = create(capacity=4)
    pos = rb.get_column(["obs", "pos"])
    obs = rb.get_column(["obs"])
    act = rb.get_column("act")
    extra1 = rb.get_column(["extra", 1])
    assert isinstance(pos, ColumnView)
    space = rb.single_space
    assert pos.single_space == space["obs"]["pos"] and obs.single_space == space["obs"]
    assert act.single_space == space["act"] and extra1.single_space == space["extra"][1]
    assert len(pos) == 0
    rows = random_rows(space, 7, 3)
    rb.extend(stack(rows))
    model = rows[-4:]
    for view, keys in ((pos, ("obs", "pos")), (obs, ("obs",)), (act, ("act",)), (extra1, ("extra", 1))):
        assert len(view) == 4
        assert_same(view[:], stack(column(model, *keys)), backend, str(keys))
        assert_same(view[-1], column(model, *keys)[-1], backend, str(keys))
        assert_same(view[[2, 0]], stack(column([model[2], model[0]], *keys)), backend, str(keys))


def test_chained_views(setup):
    create, backend = setup
    space = Dict([("obs", Box(-1.0, 1.0, (17,), np.float32)), ("act", Discrete(3))])
    rb = create(space=space)
    rows = random_rows(space, 250, 4)
    rb.extend(stack(rows))
    view = rb.get_slice(slice(0, 1000)).get_column(["obs"])
    assert len(view) == 250
    assert_same(view[::10], stack(column(rows[::10], "obs")), backend)
    chained = rb.get_column("obs").get_slice(slice(10, 200, 3)).get_slice(slice(None, None, -1))
    expected = column(rows[10:200:3], "obs")[::-1]
    assert len(chained) == len(expected)
    assert_same(chained[:], stack(expected), backend)
    assert_same(chained[5], expected[5], backend)
    assert_same(chained[np.array([0, -1])], stack([expected[0], expected[-1]]), backend)
    np.testing.assert_array_equal(np.asarray(chained), stack(expected))
    rb.extend(stack(rows[:50]))  # the first view's slice now covers 300 rows
    assert len(view) == 300
    assert_same(view[-1], rows[49]["obs"], backend)


# ---------------------------------------------------------------------------- writes


def test_column_view_is_read_only(setup):
    create, backend = setup
    rb = create()
    rows = random_rows(rb.single_space, 3, 5)
    rb.extend(stack(rows))
    view = rb.get_column(["obs", "pos"])
    chained = rb.get_slice(slice(0, 2)).get_column("obs")
    value = np.zeros(3)
    for v in (view, chained):
        with pytest.raises(ReadOnlyError):
            v.set_at(0, value)
        with pytest.raises(ReadOnlyError):
            v[0] = value
        with pytest.raises(ReadOnlyError):
            v.extend(value[None])
        with pytest.raises(ReadOnlyError):
            v.append(value)
        with pytest.raises(ReadOnlyError):
            v.remove_at(0)
        with pytest.raises(ReadOnlyError):
            v.extend_flattened(value[None])
    assert len(rb) == 3
    assert_same(rb[:], stack(rows), backend)


def test_slice_view_forwards_set_at_and_refuses_growth(setup):
    create, backend = setup
    rb = create(capacity=6)
    rows = random_rows(rb.single_space, 9, 6)
    rb.extend(stack(rows))
    model = rows[3:]
    view = rb.get_slice(slice(1, 6, 2))  # logical rows 1, 3, 5
    new = random_rows(rb.single_space, 3, 7)
    view.set_at(1, new[0])
    view[[0, -1]] = stack(new[1:])
    model[3], model[1], model[5] = new[0], new[1], new[2]
    assert_same(rb[:], stack(model), backend)
    assert_same(view[:], stack([model[1], model[3], model[5]]), backend)
    for write in (lambda: view.extend(stack(new)), lambda: view.append(new[0]),
                  lambda: view.extend_flattened(np.zeros((1, gymnasium.spaces.flatdim(rb.single_space))))):
        with pytest.raises(ReadOnlyError):
            write()
    assert len(rb) == 6
    with pytest.raises(IndexError):
        view.set_at(3, new[0])
    assert_same(rb[:], stack(model), backend)


# ---------------------------------------------------------------------------- conversion


def test_asarray_and_to_numpy(setup):
    create, backend = setup
    rb = create(capacity=5)
    rows = random_rows(rb.single_space, 8, 8)
    rb.extend(stack(rows))
    model = rows[-5:]
    pos = np.asarray(rb.get_column(["obs", "pos"]))
    np.testing.assert_array_equal(pos, stack(column(model, "obs", "pos")))
    assert isinstance(pos, np.ndarray) and pos.dtype == np.float64
    as32 = np.asarray(rb.get_column(["obs", "pos"]), dtype=np.float32)
    assert as32.dtype == np.float32
    np.testing.assert_array_equal(np.asarray(rb.get_slice(slice(1, 3)).get_column("act")),
                                  stack(column(model[1:3], "act")))
    with pytest.raises(TypeError):  # several leaves: no single array
        np.asarray(rb.get_column("obs"))
    for view, expected in ((rb.get_column("obs"), column(model, "obs")),
                           (rb.get_slice(slice(None, None, 2)), model[::2]),
                           (rb, model)):
        got = view.to_numpy()
        assert_same(got, stack(expected), "numpy")  # numpy whatever the backend
    assert_same(rb.get_slice(slice(3, 3)).to_numpy(), empty_batch(rb.single_space))


def test_views_flattened_and_iteration(setup):
    create, backend = setup
    rb = create()
    rows = random_rows(rb.single_space, 5, 9)
    rb.extend(stack(rows))
    view = rb.get_slice([4, 0, 2])
    want = np.stack([gymnasium.spaces.flatten(rb.single_space, rows[i]) for i in (4, 0, 2)])
    np.testing.assert_array_equal(as_numpy(view.get_flattened_at(slice(None))), want)
    np.testing.assert_array_equal(as_numpy(view.get_flattened_at(1)), want[1])
    col = rb.get_column("extra")
    want = np.stack([gymnasium.spaces.flatten(col.single_space, r["extra"]) for r in rows])
    np.testing.assert_array_equal(as_numpy(col.get_flattened_at(...)), want)
    got = list(rb.get_slice(slice(1, 4)))
    assert len(got) == 3
    for g, r in zip(got, rows[1:4]):
        assert_same(g, r, backend)


def test_views_of_a_read_only_buffer(buffers):
    rb = buffers.create(SPACES["nested"](), capacity=4)
    rows = random_rows(rb.single_space, 6, 10)
    rb.extend(stack(rows))
    rb.dumps()
    ro = buffers.load(rb.cache_path, read_only=True)
    view = ro.get_slice(slice(1, None))
    col = ro.get_column(["obs", "cam"])
    rb.extend(stack(rows[:2]))  # the writer goes on; the reader's views see committed rows at read time
    rb.flush()
    model = ring_model(rows, rows[:2], 4)
    assert_same(view[:], stack(model[1:]))
    assert_same(col[:], take(stack(model), slice(None))["obs"]["cam"])
    with pytest.raises(ReadOnlyError):
        view.set_at(0, rows[0])
    assert_same(rb[:], stack(model))


def test_get_column_unknown_key(buffers):
    rb = buffers.create(SPACES["nested"]())
    with pytest.raises(SpaceMismatchError):
        rb.get_column(["nope"])
    with pytest.raises(SpaceMismatchError):
        rb.get_column(["obs", "pos", "deeper"])
