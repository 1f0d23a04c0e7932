"""Model-based tests (hypothesis stateful testing): ReplayBuffer and TrajectoryReplayBuffer
against plain-Python models of docs/design.md's semantics, on real local stores.

Machine A (:class:`ReplayMachine`) drives a ReplayBuffer (rings of 7 and 13 rows, so wraps
are frequent, and unbounded; numpy and torch backends; raw and lz4 layouts with chunk edges
inside the ring) with extend / append / set_at / remove_at / clear / flush / close-and-reopen
and compares every kind of read with a list of rows that applies docs/design.md's ring rules:
logical row i is physical (offset + i) % capacity; an extend of B rows with count + B >
capacity advances offset by the overflow; a batch of B >= capacity keeps only its last
capacity rows; remove_at deletes rows and later rows move up; clear empties.

Machine B (:class:`TrajectoryMachine`) drives a TrajectoryReplayBuffer with an episode-data
space and adds the episode semantics: ids, mark_episode_end, episode data (set, overwritten in
place, evicted when the last step of its episode leaves the ring, dropped when remove_at
deletes an episode's last step, emptied by clear), get_sequences (valid mask, "edge" and
"zero" padding), episodes() / get_episode and episode_id_to_episode_data_index.

Every row carries a unique counter value (obs = [v, v + 0.5, -v], d = v % 11), so a mismatch
names the rows involved.  Under the suite's default hypothesis profile (``ci``, tests/conftest.py)
runs are derandomized and use no example database, so CI is reproducible (hypothesis still caches
source constants in .hypothesis/, which it gitignores); ``--hypothesis-profile=long`` explores with
random seeds and larger budgets.
Bugs the machines found have minimal reproducers at the end of this file.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from typing import Any, ClassVar

import gymnasium
import numpy as np
import pytest
import torch
from gymnasium.spaces import Box, Dict, Discrete
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)
from test_trajectory_sequences import reference  # noqa: E402 (tests/ is on sys.path under pytest)

from trajstore import ReplayBuffer, TrajectoryReplayBuffer
from trajstore.errors import EmptyBufferError

N_D = 11  # small: a flattened row is 3 + 11 wide (the counter lives in obs)
SPACE = Dict({"obs": Box(-np.inf, np.inf, (3,), np.float32), "d": Discrete(N_D)})
EP_SPACE = Box(-np.inf, np.inf, (), np.float32)

#: Storage layouts: raw memory-mapped chunks, and lz4 chunks of 4 rows (chunk edges inside a ring).
LAYOUTS: dict[str, dict[str, Any]] = {"raw": {}, "lz4": {"compressor": "lz4", "chunk_rows": 4}}


def _settings(max_examples: int) -> settings:
    """The loaded profile (tests/conftest.py) with this variant's budget: ``ci`` (derandomized) runs
    ``max_examples`` programs of 30 steps; an exploring profile (``--hypothesis-profile=long``) runs
    at least its own ``max_examples`` and ``stateful_step_count``."""
    profile = settings.default
    if profile.derandomize:
        return settings(profile, max_examples=max_examples, stateful_step_count=30)
    return settings(profile, max_examples=max(max_examples, profile.max_examples),
                    stateful_step_count=max(30, profile.stateful_step_count))


# ----------------------------------------------------------------------------------------
# values
# ----------------------------------------------------------------------------------------
def encode(vals: Any) -> dict[str, np.ndarray]:
    """A batch of rows; row ``v`` has obs ``[v, v + 0.5, -v]`` and d ``v``."""
    v = np.asarray(vals, np.int64).reshape(-1)
    obs = np.stack([v, v + 0.5, -v], axis=1).astype(np.float32)
    return {"obs": obs, "d": (v % N_D).astype(np.int64)}


def encode_one(v: int) -> dict[str, Any]:
    b = encode([v])
    return {"obs": b["obs"][0], "d": b["d"][0]}


def flat(vals: Any) -> np.ndarray:
    """gymnasium's flattened layout of rows ``vals``, (B, 14)."""
    return np.stack([gymnasium.spaces.flatten(SPACE, encode_one(v)) for v in vals]) if len(vals) else np.zeros((0, 14))


def to_torch(x: Any) -> Any:
    if isinstance(x, dict):
        return {k: to_torch(v) for k, v in x.items()}
    return torch.from_numpy(np.array(x))


def npy(x: Any) -> Any:
    """Nested torch/numpy -> nested numpy."""
    if isinstance(x, dict):
        return {k: npy(v) for k, v in x.items()}
    if isinstance(x, tuple):
        return tuple(npy(v) for v in x)
    if isinstance(x, torch.Tensor):
        return x.detach().cpu().numpy()
    return np.asarray(x)


def check_kind(x: Any, backend: str, where: str) -> None:
    if isinstance(x, dict):
        for k, v in x.items():
            check_kind(v, backend, f"{where}[{k!r}]")
        return
    want = torch.Tensor if backend == "torch" else (np.ndarray, np.generic)
    assert isinstance(x, want), f"{where}: backend {backend!r} returned a {type(x).__name__}"


def decode_obs(obs: np.ndarray) -> list:
    """The counter values an obs batch claims (for messages)."""
    return np.asarray(obs)[..., 0].astype(np.int64).tolist()


def check_rows(got: Any, expected: list[int], backend: str, where: str, single: bool = False) -> None:
    """``got`` (a read of the ReplayBuffer space) holds exactly the rows ``expected``."""
    check_kind(got, backend, where)
    g = npy(got)
    assert isinstance(g, dict) and sorted(g) == ["d", "obs"], f"{where}: keys {list(g) if isinstance(g, dict) else g}"
    exp = encode(expected)
    if single:
        exp = {k: v[0] for k, v in exp.items()}
    for k in ("obs", "d"):
        a = np.asarray(g[k])
        assert a.dtype == exp[k].dtype, f"{where}: {k} dtype {a.dtype} != {exp[k].dtype}"
        assert a.shape == exp[k].shape, (f"{where}: {k} shape {a.shape} != {exp[k].shape}; rows "
                                         f"{decode_obs(g['obs'])} expected {expected}")
        if not np.array_equal(a, exp[k]):
            raise AssertionError(f"{where}: {k} differs: got rows {decode_obs(g['obs'])}, expected {expected}")


# ----------------------------------------------------------------------------------------
# index strategies (n: current length)
# ----------------------------------------------------------------------------------------
def int_index(n: int) -> st.SearchStrategy[int]:
    return st.integers(-n, n - 1)


def slice_index(n: int) -> st.SearchStrategy[slice]:
    bound = st.one_of(st.none(), st.integers(-n - 2, n + 2))
    return st.builds(slice, bound, bound, st.sampled_from([None, 1, 1, 2, 3, -1, -2]))


def array_index(n: int, unique: bool = False, min_size: int = 0, max_size: int = 10) -> st.SearchStrategy[np.ndarray]:
    """Int arrays of logical rows, some written as negative indices."""
    if n == 0:
        return st.just(np.zeros(0, np.int64))

    def build(rows: list[int], neg: list[bool]) -> np.ndarray:
        return np.array([r - n if m else r for r, m in zip(rows, neg)], np.int64)

    rows = st.lists(st.integers(0, n - 1), min_size=min(min_size, n), max_size=min(max_size, n) if unique else max_size,
                    unique=unique)
    return rows.flatmap(lambda r: st.lists(st.booleans(), min_size=len(r), max_size=len(r)).map(lambda m: build(r, m)))


def mask_index(n: int) -> st.SearchStrategy[np.ndarray]:
    return st.lists(st.booleans(), min_size=n, max_size=n).map(lambda m: np.array(m, bool))


def any_batch_index(n: int) -> st.SearchStrategy[Any]:
    return st.one_of(slice_index(n), array_index(n), mask_index(n), st.just(Ellipsis))


def resolve(idx: Any, n: int) -> list[int]:
    """Logical rows ``idx`` selects, by numpy's rules."""
    return np.atleast_1d(np.arange(n)[idx]).tolist()


# ----------------------------------------------------------------------------------------
# the ring model (docs/design.md 1 "Ring rules")
# ----------------------------------------------------------------------------------------
class RingModel:
    """Rows of a ring (capacity) or a growing list (None), with absolute row numbers: logical row
    ``i`` is absolute row ``start + i``, and ``offset == start % capacity``."""

    def __init__(self, capacity: int | None) -> None:
        self.capacity = capacity
        self.rows: list[Any] = []
        self.start = 0

    def extend(self, new: list[Any]) -> None:
        self.rows += list(new)
        if self.capacity is not None and len(self.rows) > self.capacity:
            drop = len(self.rows) - self.capacity
            self.rows = self.rows[drop:]
            self.start += drop  # the offset advances by the overflow

    def remove(self, logical: list[int]) -> None:
        gone = set(logical)
        self.rows = [r for i, r in enumerate(self.rows) if i not in gone]

    def clear(self) -> None:
        self.rows, self.start = [], 0

    @property
    def offset(self) -> int:
        return 0 if self.capacity is None else self.start % self.capacity

    @property
    def full(self) -> bool:
        return self.capacity is not None and len(self.rows) == self.capacity


def batch_size_strategy(capacity: int | None) -> st.SearchStrategy[int]:
    """1..20 rows, sometimes more than the capacity (a batch that alone wraps the ring)."""
    sizes = st.integers(1, 20)
    if capacity is not None:
        sizes = st.one_of(sizes, st.sampled_from([capacity - 1, capacity, capacity + 1, 2 * capacity + 3]))
    return sizes


class _StoreMachine(RuleBasedStateMachine):
    """What both machines share: a store in a fresh temp folder, its writer ``rb`` and an optional
    read-only ``reader`` (closed and removed at teardown), and fresh row values."""

    CAPACITY: int | None = None
    BACKEND = "numpy"
    LAYOUT = "raw"
    OPTIONS: ClassVar[dict[str, Any]] = {}
    BUFFER: ClassVar[Any]  # ReplayBuffer or TrajectoryReplayBuffer
    rb: Any
    reader: Any

    def __init__(self) -> None:
        super().__init__()
        self.tmp = tempfile.mkdtemp(prefix="trajstore-model-")
        self.path = os.path.join(self.tmp, "store")
        self.counter = 1

    def teardown(self) -> None:
        for buf in (self.reader, self.rb):
            if buf is not None:
                with contextlib.suppress(Exception):  # a failing example must still clean up
                    buf.close()
        shutil.rmtree(self.tmp, ignore_errors=True)

    def fresh(self, k: int) -> list[int]:
        vals = list(range(self.counter, self.counter + k))
        self.counter += k
        return vals

    def open_store(self, read_only: bool = False) -> Any:
        """The store at ``path`` opened again (``BUFFER.load_from``), as the writer or a reader."""
        options = {} if read_only else self.OPTIONS
        return self.BUFFER.load_from(self.path, read_only=read_only, backend=self.BACKEND, **options)

    @rule()
    def flush(self) -> None:
        self.rb.flush()


# ----------------------------------------------------------------------------------------
# Machine A: ReplayBuffer
# ----------------------------------------------------------------------------------------
class ReplayMachine(_StoreMachine):
    BUFFER = ReplayBuffer

    def __init__(self) -> None:
        super().__init__()
        self.model = RingModel(self.CAPACITY)
        self.copies = 0
        self.reader: ReplayBuffer | None = None
        self.rb = ReplayBuffer.create(SPACE, cache_path=self.path, capacity=self.CAPACITY, backend=self.BACKEND,
                                      **LAYOUTS[self.LAYOUT], **self.OPTIONS)

    @property
    def n(self) -> int:
        return len(self.model.rows)

    def values(self, data: st.DataObject, vals: list[int]) -> Any:
        """A batch of rows ``vals``: numpy, or (torch backend, sometimes) torch tensors."""
        batch = encode(vals)
        return to_torch(batch) if self.BACKEND == "torch" and data.draw(st.booleans(), label="torch value") else batch

    def index(self, data: st.DataObject, idx: Any) -> Any:
        """An index array as given, or (torch backend, sometimes) as a torch tensor."""
        if self.BACKEND == "torch" and isinstance(idx, np.ndarray) and data.draw(st.booleans(), label="torch index"):
            return torch.from_numpy(idx)
        return idx

    # -- writes ----------------------------------------------------------------------------
    @rule(data=st.data())
    def extend(self, data: st.DataObject) -> None:
        vals = self.fresh(data.draw(batch_size_strategy(self.CAPACITY), label="B"))
        self.rb.extend(self.values(data, vals))
        self.model.extend(vals)

    @rule(k=st.integers(1, 5))
    def append(self, k: int) -> None:
        for v in self.fresh(k):
            self.rb.append(encode_one(v))
            self.model.extend([v])

    @rule(k=st.integers(1, 5), one_by_one=st.booleans())
    def append_flattened(self, k: int, one_by_one: bool) -> None:
        vals = self.fresh(k)
        if one_by_one:
            for v in vals:
                self.rb.append_flattened(flat([v])[0])
        else:
            self.rb.extend_flattened(flat(vals))
        self.model.extend(vals)

    @rule(data=st.data(), chunk_size=st.integers(1, 9))
    def extend_from(self, data: st.DataObject, chunk_size: int) -> None:
        """extend_from another (in-memory) buffer, or from a view of one."""
        vals = self.fresh(data.draw(batch_size_strategy(self.CAPACITY), label="B"))
        src = ReplayBuffer.create(SPACE)
        try:
            src.extend(encode([0, *vals, 0]))
            other = src.get_slice(slice(1, -1)) if data.draw(st.booleans(), label="view") else None
            if other is None:
                src.remove_at(np.array([0, len(vals) + 1]))
                other = src
            self.rb.extend_from(other, chunk_size=chunk_size)
        finally:
            src.close()
        self.model.extend(vals)

    @precondition(lambda self: self.n > 0)
    @rule(data=st.data())
    def set_at_int(self, data: st.DataObject) -> None:
        i = data.draw(int_index(self.n), label="i")
        (v,) = self.fresh(1)
        self.rb.set_at(i, encode_one(v))
        self.model.rows[i] = v

    @precondition(lambda self: self.n > 0)
    @rule(data=st.data())
    def set_at_many(self, data: st.DataObject) -> None:
        idx = data.draw(st.one_of(array_index(self.n, unique=True, min_size=1), slice_index(self.n),
                                  mask_index(self.n)), label="idx")
        rows = resolve(idx, self.n)
        vals = self.fresh(len(rows))
        self.rb.set_at(self.index(data, idx), self.values(data, vals))
        for r, v in zip(rows, vals):
            self.model.rows[r] = v

    @precondition(lambda self: self.n > 0)
    @rule(data=st.data())
    def set_flattened_at(self, data: st.DataObject) -> None:
        idx = data.draw(st.one_of(int_index(self.n), array_index(self.n, unique=True, min_size=1)), label="idx")
        rows = resolve(idx, self.n)
        vals = self.fresh(len(rows))
        self.rb.set_flattened_at(idx, flat(vals)[0] if isinstance(idx, int) else flat(vals))
        for r, v in zip(rows, vals):
            self.model.rows[r] = v

    @precondition(lambda self: self.n > 0)
    @rule(data=st.data())
    def set_through_view(self, data: st.DataObject) -> None:
        outer = data.draw(st.one_of(slice_index(self.n), array_index(self.n, unique=True)), label="outer")
        rows = resolve(outer, self.n)
        if not rows:
            return
        view = self.rb.get_slice(outer)
        j = data.draw(int_index(len(rows)), label="j")
        (v,) = self.fresh(1)
        view[j] = encode_one(v)
        self.model.rows[rows[j]] = v

    @precondition(lambda self: self.n > 0)
    @rule(data=st.data())
    def remove_at(self, data: st.DataObject) -> None:
        idx = data.draw(st.one_of(int_index(self.n), array_index(self.n, max_size=6), slice_index(self.n),
                                  mask_index(self.n), st.just(Ellipsis)), label="idx")
        rows = resolve(idx, self.n)
        self.rb.remove_at(self.index(data, idx))
        self.model.remove(rows)

    @precondition(lambda self: self.n > 0)  # (always enabled, it would empty the buffer too often)
    @rule()
    def clear(self) -> None:
        self.rb.clear()
        self.model.clear()

    @rule()
    def close_and_reopen(self) -> None:
        self.rb.close()
        self.rb = self.open_store()
        assert self.rb.capacity == self.CAPACITY

    @rule(keep=st.booleans())
    def read_only_handle_agrees(self, keep: bool) -> None:
        """After a flush a read-only handle (a fresh one, or one kept open across writes, which
        must adopt the new commit) sees exactly the writer's rows."""
        self.rb.flush()
        if self.reader is None:
            self.reader = self.open_store(read_only=True)
        r = self.reader
        assert r.read_only and r.capacity == self.CAPACITY
        assert len(r) == self.n, f"read-only handle: len {len(r)} != {self.n}"
        assert r.offset == self.model.offset, f"read-only handle: offset {r.offset} != {self.model.offset}"
        check_rows(r[:], self.model.rows, self.BACKEND, "read-only handle r[:]")
        if self.n:
            check_rows(r[-1], [self.model.rows[-1]], self.BACKEND, "read-only handle r[-1]", single=True)
            check_rows(r.get_slice(slice(0, 4))[:], self.model.rows[:4], self.BACKEND, "read-only handle view")
        if not keep:
            r.close()
            self.reader = None

    @rule()
    def dumps_copy(self) -> None:
        """dumps(other path) copies the store and leaves this one open; the copy holds the rows."""
        self.copies += 1
        dst = os.path.join(self.tmp, f"copy{self.copies}")
        self.rb.dumps(dst, progress=False)
        with ReplayBuffer.load_from(dst, read_only=True) as c:
            assert len(c) == self.n and c.capacity == self.CAPACITY
            check_rows(c[:], self.model.rows, "numpy", f"dumps({dst!r}) copy")
        shutil.rmtree(dst, ignore_errors=True)

    # -- reads -----------------------------------------------------------------------------
    @precondition(lambda self: self.n > 0)
    @rule(data=st.data())
    def get_int(self, data: st.DataObject) -> None:
        i = data.draw(int_index(self.n), label="i")
        check_rows(self.rb.get_at(i), [self.model.rows[i]], self.BACKEND, f"get_at({i})", single=True)
        check_rows(self.rb[np.int64(i)], [self.model.rows[i]], self.BACKEND, f"rb[np.int64({i})]", single=True)

    @rule(data=st.data())
    def get_batch(self, data: st.DataObject) -> None:
        idx = data.draw(any_batch_index(self.n), label="idx")
        want = [self.model.rows[r] for r in resolve(idx, self.n)]
        check_rows(self.rb[self.index(data, idx)], want, self.BACKEND, f"rb[{idx!r}]")

    @rule(data=st.data())
    def get_flattened(self, data: st.DataObject) -> None:
        if self.n and data.draw(st.booleans(), label="single"):
            i = data.draw(int_index(self.n), label="i")
            got, want = npy(self.rb.get_flattened_at(i)), flat([self.model.rows[i]])[0]
        else:
            idx = data.draw(any_batch_index(self.n), label="idx")
            got, want = npy(self.rb.get_flattened_at(idx)), flat([self.model.rows[r] for r in resolve(idx, self.n)])
        assert got.shape == want.shape, f"get_flattened_at: shape {got.shape} != {want.shape}"
        np.testing.assert_array_equal(got, want, err_msg="get_flattened_at differs from gymnasium.spaces.flatten")

    @rule()
    def out_of_range(self) -> None:
        for i in (self.n, -self.n - 1):
            with pytest.raises(IndexError):
                self.rb[i]
        if self.n:
            with pytest.raises(IndexError):
                self.rb[np.array([0, self.n])]

    @rule(data=st.data())
    def view_reads(self, data: st.DataObject) -> None:
        outer = data.draw(st.one_of(slice_index(self.n), array_index(self.n), mask_index(self.n)), label="outer")
        rows = [self.model.rows[r] for r in resolve(outer, self.n)]
        view = self.rb.get_slice(outer)
        assert len(view) == len(rows), f"len(get_slice({outer!r})) = {len(view)} != {len(rows)}"
        inner = data.draw(any_batch_index(len(rows)), label="inner")
        want = [rows[r] for r in resolve(inner, len(rows))]
        check_rows(view[inner], want, self.BACKEND, f"get_slice({outer!r})[{inner!r}]")
        check_rows(view[:], rows, self.BACKEND, f"get_slice({outer!r})[:]")
        if rows:
            j = data.draw(int_index(len(rows)), label="j")
            check_rows(view[j], [rows[j]], self.BACKEND, f"get_slice({outer!r})[{j}]", single=True)
            # A view of a view.
            inner2 = data.draw(slice_index(len(rows)), label="inner2")
            want2 = [rows[r] for r in resolve(inner2, len(rows))]
            check_rows(view.get_slice(inner2)[:], want2, self.BACKEND, f"get_slice({outer!r}).get_slice({inner2!r})[:]")
        col = npy(view.get_column("obs")[inner])
        np.testing.assert_array_equal(col, encode(want)["obs"], err_msg=f"get_slice({outer!r}).get_column('obs')[{inner!r}]")

    @rule(data=st.data(), key=st.sampled_from(["obs", "d"]), as_list=st.booleans())
    def column_reads(self, data: st.DataObject, key: str, as_list: bool) -> None:
        idx = data.draw(any_batch_index(self.n), label="idx")
        col = self.rb.get_column([key] if as_list else key)
        assert len(col) == self.n
        got = col[idx]
        check_kind(got, self.BACKEND, f"get_column({key!r})[{idx!r}]")
        want = encode([self.model.rows[r] for r in resolve(idx, self.n)])[key]
        g = npy(got)
        assert g.dtype == want.dtype and g.shape == want.shape, f"get_column({key!r}): {g.dtype}{g.shape} != {want.dtype}{want.shape}"
        np.testing.assert_array_equal(g, want, err_msg=f"get_column({key!r})[{idx!r}]")
        np.testing.assert_array_equal(np.asarray(col), encode(self.model.rows)[key], err_msg=f"np.asarray(get_column({key!r}))")

    @rule(k=st.integers(1, 40), seed=st.integers(0, 2**32 - 1))
    def sample(self, k: int, seed: int) -> None:
        if self.n == 0:
            with pytest.raises(EmptyBufferError):
                self.rb.sample(k, rng=seed)
            return
        got = npy(self.rb.sample(k, rng=np.random.default_rng(seed)))
        assert got["obs"].shape == (k, 3) and got["d"].shape == (k,)
        vals = got["obs"][:, 0].astype(np.int64)
        members = set(self.model.rows)
        stray = [v for v in vals.tolist() if v not in members]
        assert not stray, f"sample returned rows {stray} that are not in the buffer {self.model.rows}"
        check_rows(got, vals.tolist(), "numpy", "sample (rows whole)")

    # -- invariants ------------------------------------------------------------------------
    @invariant()
    def agrees_with_model(self) -> None:
        rb, m = self.rb, self.model
        assert len(rb) == len(m.rows), f"len {len(rb)} != model {len(m.rows)}"
        assert rb.count == len(m.rows)
        assert rb.offset == m.offset, f"offset {rb.offset} != model {m.offset} (model start {m.start})"
        assert rb.full == m.full, f"full {rb.full} != model {m.full}"
        check_rows(rb[:], m.rows, self.BACKEND, "rb[:]")
        if self.reader is not None and self.OPTIONS.get("commit_interval") == 0.0:
            # Every write commits at once: an open read-only handle sees it without a flush.
            r = self.reader
            assert len(r) == len(m.rows), f"read-only handle (commit_interval=0, no flush): len {len(r)} != {len(m.rows)}"
            assert r.offset == m.offset, f"read-only handle (commit_interval=0, no flush): offset {r.offset} != {m.offset}"
            check_rows(r[:], m.rows, self.BACKEND, "read-only handle (commit_interval=0, no flush) r[:]")


def _variant(machine: type[_StoreMachine], capacity: int | None, backend: str, layout: str,
             options: dict[str, Any]) -> type[_StoreMachine]:
    """``machine`` for one store configuration (a subclass, so hypothesis reports its name)."""
    return type(f"{machine.__name__}_{capacity}_{backend}_{layout}", (machine,),
                {"CAPACITY": capacity, "BACKEND": backend, "LAYOUT": layout, "OPTIONS": options})


#: (capacity, backend, layout, storage options, examples).  Rings of 7 and 13 wrap often (guard
#: 1 row); a ring of 70 commits evictions in blocks of guard = 2 rows.  commit_interval=0 commits
#: on every write (eviction records and interval commits interleave with rewrites).
REPLAY_VARIANTS = [
    pytest.param(7, "numpy", "raw", {}, 25, id="ring7-numpy-raw"),
    pytest.param(13, "torch", "lz4", {"commit_interval": 0.0}, 20, id="ring13-torch-lz4-commit0"),
    pytest.param(None, "numpy", "lz4", {}, 15, id="unbounded-numpy-lz4"),
    pytest.param(None, "torch", "raw", {"commit_interval": 0.0}, 15, id="unbounded-torch-raw-commit0"),
    pytest.param(70, "numpy", "lz4", {}, 10, id="ring70-numpy-lz4", marks=pytest.mark.slow),
    pytest.param(7, "torch", "raw", {"commit_interval": 0.0}, 25, id="ring7-torch-raw-commit0", marks=pytest.mark.slow),
]


@pytest.mark.parametrize("capacity,backend,layout,options,examples", REPLAY_VARIANTS)
def test_replay_buffer_model(capacity, backend, layout, options, examples):
    run_state_machine_as_test(_variant(ReplayMachine, capacity, backend, layout, options), settings=_settings(examples))


# ----------------------------------------------------------------------------------------
# Machine B: TrajectoryReplayBuffer
# ----------------------------------------------------------------------------------------
def model_sequences(ids: list[int], vals: list[int], anchors: list[int], offsets: list[int], pad: str
                    ) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """docs/design.md's get_sequences over the model's rows, leaf by leaf (the frame-by-frame reference
    of test_trajectory_sequences: valid when the row exists and has the anchor's episode id;
    "edge" fills with the earliest / latest valid frame, "zero" with zeros)."""
    rows, out, mask = encode(vals), {}, np.zeros((len(anchors), len(offsets)), bool)
    for key in ("obs", "d"):
        mask, out[key] = reference(np.asarray(ids), rows[key], np.asarray(anchors, np.int64), offsets, pad)
    return mask, out


def offsets_strategy() -> st.SearchStrategy[list[int]]:
    """[-1, 0, 1] mostly; otherwise sorted distinct offsets in [-4, 4] that contain 0."""
    other = st.lists(st.integers(-4, 4), max_size=4, unique=True).map(lambda o: sorted(set(o) | {0}))
    return st.one_of(st.just([-1, 0, 1]), other)




class TrajectoryMachine(_StoreMachine):
    BUFFER = TrajectoryReplayBuffer

    def __init__(self) -> None:
        super().__init__()
        self.steps = RingModel(self.CAPACITY)  # rows are (value, episode id)
        self.current = 0
        self.next_id = 1
        self.ep: dict[int, float] = {}  # episode id -> data, in insertion order (one row per episode with data)
        self.reader: TrajectoryReplayBuffer | None = None
        self.rb = TrajectoryReplayBuffer.create(SPACE, step_data_capacity=self.CAPACITY,
                                                episode_data_instance_space=EP_SPACE, cache_path=self.path,
                                                backend=self.BACKEND, **LAYOUTS[self.LAYOUT], **self.OPTIONS)

    # -- model helpers ---------------------------------------------------------------------

    @property
    def n(self) -> int:
        return len(self.steps.rows)

    @property
    def ids(self) -> list[int]:
        return [e for _v, e in self.steps.rows]

    @property
    def vals(self) -> list[int]:
        return [v for v, _e in self.steps.rows]

    def ep_value(self, eid: int) -> float:
        return self.ep.get(eid, 0.0)

    def model_extend(self, vals: list[int], ids: list[int] | None = None) -> None:
        ids = [self.current] * len(vals) if ids is None else ids
        self.steps.extend(list(zip(vals, ids)))
        if self.CAPACITY is not None:
            # Episode data is evicted when the last step of its episode leaves the step ring
            # (the episode being recorded keeps its data).
            present = set(self.ids)
            for eid in list(self.ep):
                if eid != self.current and eid not in present:
                    del self.ep[eid]

    def set_ep(self, eid: int, value: float) -> None:
        self.ep[eid] = value  # a known id keeps its row (dicts keep insertion order on overwrite)

    def new_episode(self) -> None:
        self.current = self.next_id
        self.next_id += 1

    def ids_strategy(self, k: int) -> st.SearchStrategy[list[int]]:
        """k explicit episode ids among those already used (any order, so episodes interleave)."""
        return st.lists(st.sampled_from(list(range(self.next_id))), min_size=k, max_size=k)

    # -- writes ----------------------------------------------------------------------------
    @rule(data=st.data(), with_ep=st.booleans())
    def extend(self, data: st.DataObject, with_ep: bool) -> None:
        vals = self.fresh(data.draw(batch_size_strategy(self.CAPACITY), label="B"))
        if with_ep:
            # {"step_data", "episode_data"}: B rows of episode data, the last row of each episode wins.
            epv = np.array([v + 0.25 for v in vals], np.float32)
            self.rb.extend({"step_data": encode(vals), "episode_data": epv})
            self.model_extend(vals)
            self.set_ep(self.current, float(epv[-1]))
        else:
            self.rb.extend(encode(vals))
            self.model_extend(vals)

    @rule(data=st.data(), with_ep=st.booleans())
    def extend_explicit_ids(self, data: st.DataObject, with_ep: bool) -> None:
        """{"step_data", "episode_ids"(, "episode_data")}: steps join the episodes named (old ones
        too, so episodes interleave); explicit ids never advance current_episode_id, but later
        fresh ids never collide with them."""
        k = data.draw(st.integers(1, 8), label="B")
        vals = self.fresh(k)
        pool = list(range(self.next_id))
        ids = data.draw(st.lists(st.sampled_from(pool + [self.next_id, self.next_id + 2]), min_size=k, max_size=k),
                        label="episode_ids")
        value: dict[str, Any] = {"step_data": encode(vals), "episode_ids": np.array(ids, np.int64)}
        if with_ep:
            value["episode_data"] = np.array([v + 0.25 for v in vals], np.float32)
        self.rb.extend(value)
        self.model_extend(vals, ids)
        self.next_id = max(self.next_id, max(ids) + 1)
        if with_ep:
            last = {e: v + 0.25 for v, e in zip(vals, ids)}  # the last row of each episode wins
            for e in sorted(last):  # new episode rows are added in id order
                self.set_ep(e, float(np.float32(last[e])))

    @rule(k=st.integers(1, 5))
    def append(self, k: int) -> None:
        for v in self.fresh(k):
            self.rb.append(encode_one(v))
            self.model_extend([v])

    @rule()
    def mark_episode_end(self) -> None:
        self.rb.mark_episode_end()
        self.new_episode()
        assert self.rb.current_episode_id == self.current

    @rule()
    def set_current_episode_data(self) -> None:
        (v,) = self.fresh(1)
        self.rb.set_current_episode_data(np.float32(v + 0.5))
        self.set_ep(self.current, float(np.float32(v + 0.5)))

    @rule(data=st.data())
    def set_episode_data_at(self, data: st.DataObject) -> None:
        known = sorted(set(self.ids) | set(self.ep) | {self.current})
        eid = data.draw(st.sampled_from(known), label="episode_id")
        (v,) = self.fresh(1)
        self.rb.set_episode_data_at(eid, np.float32(v + 0.75))
        self.set_ep(eid, float(np.float32(v + 0.75)))

    @precondition(lambda self: self.n > 0)
    @rule(data=st.data(), how=st.sampled_from(["bare", "wrapped", "ids", "episode_data"]))
    def set_at(self, data: st.DataObject, how: str) -> None:
        """set_at with bare step data or {"step_data"} (ids stay), with "episode_ids" (ids already
        used: see test_set_at_with_fresh_episode_ids_advances_next_id for fresh ones), or with
        "episode_data" (one value per episode in the call, so first-or-last-row-wins cannot matter)."""
        idx = data.draw(st.one_of(int_index(self.n), array_index(self.n, unique=True, min_size=1),
                                  slice_index(self.n), mask_index(self.n)), label="idx")
        rows = resolve(idx, self.n)
        single = isinstance(idx, int)
        vals = self.fresh(len(rows))
        step = encode_one(vals[0]) if single else encode(vals)
        ids = [self.steps.rows[r][1] for r in rows]
        value: Any = step
        if how == "wrapped":
            value = {"step_data": step}
        elif how == "ids":
            ids = data.draw(self.ids_strategy(len(rows)), label="episode_ids")
            value = {"step_data": step, "episode_ids": np.int64(ids[0]) if single else np.array(ids, np.int64)}
        elif how == "episode_data":
            epv = {e: float(np.float32(self.fresh(1)[0] + 0.125)) for e in ids}
            col = np.array([epv[e] for e in ids], np.float32)
            value = {"step_data": step, "episode_data": col[0] if single else col}
        self.rb.set_at(idx, value)
        for r, v, e in zip(rows, vals, ids):
            self.steps.rows[r] = (v, e)
        if how == "episode_data":
            for e in sorted(epv):
                self.set_ep(e, epv[e])

    @precondition(lambda self: self.n > 0)
    @rule(data=st.data())
    def remove_at(self, data: st.DataObject) -> None:
        idx = data.draw(st.one_of(int_index(self.n), array_index(self.n, max_size=6), slice_index(self.n),
                                  mask_index(self.n)), label="idx")
        rows = resolve(idx, self.n)
        removed = {self.ids[r] for r in rows}
        self.rb.remove_at(idx)
        self.steps.remove(rows)
        # Episodes left without steps lose their episode data.
        for eid in removed - set(self.ids):
            self.ep.pop(eid, None)

    @precondition(lambda self: self.n > 0)
    @rule()
    def clear(self) -> None:
        self.rb.clear()
        self.steps.clear()
        self.ep.clear()
        self.new_episode()  # ids are never reused: a fresh episode starts

    @rule()
    def close_and_reopen(self) -> None:
        self.rb.close()
        self.rb = self.open_store()
        assert self.rb.current_episode_id == self.current, "a cleanly closed writer's episode continues"

    @rule(keep=st.booleans())
    def read_only_handle_agrees(self, keep: bool) -> None:
        self.rb.flush()
        if self.reader is None:
            self.reader = self.open_store(read_only=True)
        r = self.reader
        assert len(r) == self.n, f"read-only handle: len {len(r)} != {self.n}"
        assert r.offset == self.steps.offset, f"read-only handle: offset {r.offset} != {self.steps.offset}"
        assert r.current_episode_id == self.current
        self.check_all(r, "read-only handle")
        if not keep:
            r.close()
            self.reader = None

    # -- reads -----------------------------------------------------------------------------
    def check_traj(self, got: Any, rows: list[int], where: str, single: bool = False) -> None:
        assert set(got) == {"step_data", "episode_data"}, f"{where}: keys {list(got)}"
        check_rows(got["step_data"], [self.vals[r] for r in rows], self.BACKEND, f"{where}['step_data']", single)
        check_kind(got["episode_data"], self.BACKEND, f"{where}['episode_data']")
        ep = npy(got["episode_data"])
        want = np.array([self.ep_value(self.ids[r]) for r in rows], np.float32)
        if single:
            want = want[0]
        assert ep.dtype == np.float32 and ep.shape == want.shape, f"{where}: episode_data {ep.dtype}{ep.shape}"
        if not np.array_equal(ep, want):
            raise AssertionError(f"{where}: episode_data {ep.tolist()} != model {want.tolist()} "
                                 f"(episode ids {[self.ids[r] for r in rows]}, model data {self.ep})")

    def check_all(self, buf: TrajectoryReplayBuffer, who: str) -> None:
        if self.n:
            data, meta = buf.get_at_with_metadata(slice(None))
            self.check_traj(data, list(range(self.n)), f"{who} get_at_with_metadata(:)")
            ids = npy(meta["episode_ids"])
            assert ids.dtype == np.int64 and ids.tolist() == self.ids, f"{who}: episode ids {ids.tolist()} != {self.ids}"
        else:
            assert len(npy(buf[:]["step_data"]["obs"])) == 0
        # Episode-data rows: one per episode with data, in insertion order; KeyError for the rest.
        for eid in range(self.next_id + 1):
            if eid in self.ep:
                got = buf.episode_id_to_episode_data_index(eid)
                want = list(self.ep).index(eid)
                assert got == want, (f"{who}: episode_id_to_episode_data_index({eid}) = {got}, model row {want} "
                                     f"(model episodes with data, in order: {list(self.ep)})")
            else:
                with pytest.raises(KeyError):
                    buf.episode_id_to_episode_data_index(eid)
                    raise AssertionError(f"{who}: episode {eid} still has episode data; the model has "
                                         f"data for {list(self.ep)} and steps of {sorted(set(self.ids))}")

    @precondition(lambda self: self.n > 0)
    @rule(data=st.data())
    def get_at(self, data: st.DataObject) -> None:
        i = data.draw(int_index(self.n), label="i")
        self.check_traj(self.rb.get_at(i), [i % self.n], f"get_at({i})", single=True)
        idx = data.draw(any_batch_index(self.n), label="idx")
        self.check_traj(self.rb[idx], resolve(idx, self.n), f"rb[{idx!r}]")
        _got, meta = self.rb.get_at_with_metadata(i)
        assert int(npy(meta["episode_ids"])) == self.ids[i]

    @rule(data=st.data(), pad=st.sampled_from(["edge", "zero"]), offsets=offsets_strategy())
    def get_sequences(self, data: st.DataObject, pad: str, offsets: list[int]) -> None:
        if self.n == 0:
            return
        idx = data.draw(st.one_of(array_index(self.n, min_size=1, max_size=12), slice_index(self.n)), label="anchors")
        anchors = resolve(idx, self.n)
        if not anchors:
            return
        if self.BACKEND == "torch" and isinstance(idx, np.ndarray) and data.draw(st.booleans(), label="torch idx"):
            idx = torch.from_numpy(idx)
        got, mask = self.rb.get_sequences(idx, offsets, pad=pad)
        check_kind(mask, self.BACKEND, "valid_mask")
        want_mask, want = model_sequences(self.ids, self.vals, anchors, offsets, pad)
        where = f"get_sequences({idx!r}, {offsets}, pad={pad!r}) with episode ids {self.ids}"
        m = npy(mask)
        assert m.dtype == bool and m.shape == want_mask.shape, f"{where}: mask {m.dtype}{m.shape}"
        assert np.array_equal(m, want_mask), f"{where}: mask {m.astype(int).tolist()} != {want_mask.astype(int).tolist()}"
        sd = npy(got["step_data"])
        for k in ("obs", "d"):
            assert sd[k].shape == want[k].shape and sd[k].dtype == want[k].dtype, f"{where}: {k} {sd[k].dtype}{sd[k].shape}"
            assert np.array_equal(sd[k], want[k]), (f"{where}: {k} rows {sd['obs'][..., 0].astype(int).tolist()} != "
                                                    f"model {want['obs'][..., 0].astype(int).tolist()} (values {self.vals})")
        ep = npy(got["episode_data"])
        want_ep = np.array([self.ep_value(self.ids[a]) for a in anchors], np.float32)
        assert ep.shape == want_ep.shape and np.array_equal(ep, want_ep), f"{where}: episode_data {ep.tolist()} != {want_ep.tolist()}"

    @rule(k=st.integers(1, 10), seq_len=st.integers(1, 5), pad=st.sampled_from(["edge", "zero"]),
          within=st.booleans(), seed=st.integers(0, 2**32 - 1))
    def sample_sequences(self, k: int, seq_len: int, pad: str, within: bool, seed: int) -> None:
        """Windows of seq_len rows from drawn first rows: each equals get_sequences' definition for
        offsets 0..seq_len-1 at its first row (identified by its value: frame 0 is always valid);
        within_episode=True gives only windows wholly inside one episode (ValueError if none is)."""
        if self.n == 0:
            with pytest.raises(EmptyBufferError):
                self.rb.sample_sequences(k, seq_len, rng=seed, pad=pad, within_episode=within)
            return
        ids = self.ids
        possible = any(len(set(ids[i:i + seq_len])) == 1 for i in range(self.n - seq_len + 1))
        if within and not possible:
            with pytest.raises(ValueError):
                self.rb.sample_sequences(k, seq_len, rng=seed, pad=pad, within_episode=True)
            return
        got, mask = self.rb.sample_sequences(k, seq_len, rng=np.random.default_rng(seed), pad=pad, within_episode=within)
        sd, m = npy(got["step_data"]), npy(mask)
        assert sd["obs"].shape == (k, seq_len, 3) and m.shape == (k, seq_len), f"sample_sequences shapes {sd['obs'].shape} {m.shape}"
        where_of = {v: i for i, v in enumerate(self.vals)}
        firsts = sd["obs"][:, 0, 0].astype(np.int64).tolist()
        stray = [v for v in firsts if v not in where_of]
        assert not stray, f"sample_sequences: first frames {stray} are not rows of the buffer {self.vals}"
        anchors = [where_of[v] for v in firsts]
        want_mask, want = model_sequences(ids, self.vals, anchors, list(range(seq_len)), pad)
        where = f"sample_sequences({k}, {seq_len}, pad={pad!r}, within_episode={within}) anchors {anchors} ids {ids}"
        assert np.array_equal(m, want_mask), f"{where}: mask {m.astype(int).tolist()} != {want_mask.astype(int).tolist()}"
        for key in ("obs", "d"):
            assert np.array_equal(sd[key], want[key]), f"{where}: {key} differs"
        if within:
            assert m.all(), f"{where}: within_episode=True returned windows that leave their episode"
        want_ep = np.array([self.ep_value(ids[a]) for a in anchors], np.float32)
        assert np.array_equal(npy(got["episode_data"]), want_ep), f"{where}: episode_data differs"

    @rule(data=st.data())
    def episodes_and_get_episode(self, data: st.DataObject) -> None:
        table = {k: npy(v) for k, v in self.rb.episodes().items()}
        # Model: one entry per episode with steps, ordered by its first step; length counts all
        # its steps (explicit ids can interleave episodes).
        first: dict[int, int] = {}
        count: dict[int, int] = {}
        for i, e in enumerate(self.ids):
            first.setdefault(e, i)
            count[e] = count.get(e, 0) + 1
        eids = sorted(first, key=first.get)
        assert table["episode_id"].tolist() == eids, f"episodes() ids {table['episode_id'].tolist()} != {eids} (ids {self.ids})"
        assert table["start"].tolist() == [first[e] for e in eids], f"episodes() starts {table['start'].tolist()} (ids {self.ids})"
        assert table["length"].tolist() == [count[e] for e in eids], f"episodes() lengths {table['length'].tolist()} (ids {self.ids})"
        assert table["live"].tolist() == [e == self.current for e in eids]
        if eids:
            eid = data.draw(st.sampled_from(eids), label="episode")
            rows = [i for i, e in enumerate(self.ids) if e == eid]
            self.check_traj(self.rb.get_episode(eid), rows, f"get_episode({eid})")
        missing = next(e for e in range(self.next_id + 2) if e not in first)
        with pytest.raises(KeyError):
            self.rb.get_episode(missing)

    @rule(k=st.integers(1, 30), seed=st.integers(0, 2**32 - 1))
    def sample(self, k: int, seed: int) -> None:
        if self.n == 0:
            with pytest.raises(EmptyBufferError):
                self.rb.sample(k, rng=seed)
            return
        got = npy(self.rb.sample(k, rng=np.random.default_rng(seed)))
        vals = got["step_data"]["obs"][:, 0].astype(np.int64).tolist()
        by_val = {v: e for v, e in self.steps.rows}
        stray = [v for v in vals if v not in by_val]
        assert not stray, f"sample returned steps {stray} that are not in the buffer {self.vals}"
        check_rows(got["step_data"], vals, "numpy", "sample (rows whole)")
        want_ep = np.array([self.ep_value(by_val[v]) for v in vals], np.float32)
        assert np.array_equal(got["episode_data"], want_ep), f"sample episode_data {got['episode_data'].tolist()} != {want_ep.tolist()}"

    # -- invariants ------------------------------------------------------------------------
    @invariant()
    def agrees_with_model(self) -> None:
        rb = self.rb
        assert len(rb) == self.n, f"len {len(rb)} != model {self.n}"
        assert rb.offset == self.steps.offset, f"offset {rb.offset} != model {self.steps.offset}"
        assert rb.full == self.steps.full
        assert rb.current_episode_id == self.current
        self.check_all(rb, "writer")
        if self.reader is not None and self.OPTIONS.get("commit_interval") == 0.0:
            # Every write commits at once: an open read-only handle sees it without a flush
            # (mark_episode_end writes nothing, so the handle's current_episode_id may lag).
            r = self.reader
            assert len(r) == self.n, f"read-only handle (commit_interval=0, no flush): len {len(r)} != {self.n}"
            assert r.offset == self.steps.offset
            self.check_all(r, "read-only handle (commit_interval=0, no flush)")


TRAJ_VARIANTS = [
    pytest.param(7, "numpy", "raw", {}, 25, id="ring7-numpy-raw"),
    pytest.param(13, "torch", "lz4", {"commit_interval": 0.0}, 20, id="ring13-torch-lz4-commit0"),
    pytest.param(None, "numpy", "raw", {}, 15, id="unbounded-numpy-raw"),
    pytest.param(70, "numpy", "lz4", {}, 15, id="ring70-numpy-lz4", marks=pytest.mark.slow),
    pytest.param(13, "numpy", "raw", {}, 20, id="ring13-numpy-raw", marks=pytest.mark.slow),
    pytest.param(None, "torch", "lz4", {"commit_interval": 0.0}, 12, id="unbounded-torch-lz4-commit0", marks=pytest.mark.slow),
]


@pytest.mark.parametrize("capacity,backend,layout,options,examples", TRAJ_VARIANTS)
def test_trajectory_buffer_model(capacity, backend, layout, options, examples):
    run_state_machine_as_test(_variant(TrajectoryMachine, capacity, backend, layout, options), settings=_settings(examples))


# ----------------------------------------------------------------------------------------
# minimal reproducers of what the machines found
# ----------------------------------------------------------------------------------------
SCALAR_STEP = Dict({"obs": Box(-np.inf, np.inf, (), np.float32)})


@pytest.mark.parametrize("capacity", [2, 64], ids=["guard1", "guard2"])
def test_ring_keeps_episode_data_of_an_episode_that_gets_steps_in_the_same_extend(tmp_path, capacity):
    """docs/design.md: episode data is evicted when the last step of its episode leaves the step ring.
    Here episode 5's only old step leaves the ring during an extend whose last row is a new step
    of episode 5, so after the call episode 5 has a step and must still have its data, whatever
    the ring's block size (Table.guard rows: 1 and 2 here)."""
    buf = TrajectoryReplayBuffer.create(SCALAR_STEP, step_data_capacity=capacity, episode_data_instance_space=EP_SPACE,
                                        cache_path=tmp_path / "s")
    try:
        buf.extend({"step_data": {"obs": np.arange(capacity, dtype=np.float32)},
                    "episode_ids": np.array([5] + [0] * (capacity - 1))})  # a full ring, episode 5 first
        buf.set_episode_data_at(5, np.float32(1.25))
        buf.extend({"step_data": {"obs": np.array([100.0, 101.0], np.float32)}, "episode_ids": np.array([0, 5])})
        data, meta = buf.get_at_with_metadata(-1)
        assert int(meta["episode_ids"]) == 5
        assert float(data["episode_data"]) == 1.25, "episode 5 has a step in the ring but lost its episode data"
        assert buf.episode_id_to_episode_data_index(5) == 0
    finally:
        buf.close()


def test_set_at_with_fresh_episode_ids_advances_next_id(tmp_path):
    """set_at(idx, {"step_data", "episode_ids"}) may name an id beyond next_episode_id.  extend
    and set_episode_data_at then make later fresh ids skip it ("fresh ids must never collide");
    set_at must too, or mark_episode_end would start a 'new' episode whose id is already in the
    store, and the new steps would join the old rows' episode."""
    buf = TrajectoryReplayBuffer.create(SCALAR_STEP, episode_data_instance_space=EP_SPACE, cache_path=tmp_path / "s")
    try:
        buf.extend({"obs": np.zeros(3, np.float32)})  # episode 0
        buf.set_at(0, {"step_data": {"obs": np.float32(1)}, "episode_ids": np.int64(2)})
        buf.mark_episode_end()
        buf.mark_episode_end()
        assert buf.current_episode_id not in (0, 2), (
            f"mark_episode_end started episode {buf.current_episode_id}, an id rows already carry")
    finally:
        buf.close()


def test_set_at_episode_data_last_row_of_each_episode_wins_as_in_extend(tmp_path):
    """extend(...{"episode_data"}) documents "the last row of each episode wins"; set_at with
    "episode_data" does the same."""
    buf = TrajectoryReplayBuffer.create(SCALAR_STEP, episode_data_instance_space=EP_SPACE, cache_path=tmp_path / "s")
    try:
        buf.extend({"step_data": {"obs": np.array([1.0, 2.0], np.float32)}, "episode_data": np.array([5.0, 6.0], np.float32)})
        assert float(buf[0]["episode_data"]) == 6.0  # extend: the last row wins
        buf.set_at(np.array([0, 1]), {"step_data": {"obs": np.array([3.0, 4.0], np.float32)},
                                       "episode_data": np.array([7.0, 8.0], np.float32)})
        assert float(buf[0]["episode_data"]) == 8.0, "set_at: the first row of the episode won; extend lets the last win"
    finally:
        buf.close()
