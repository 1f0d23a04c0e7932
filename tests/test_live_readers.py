"""Every read path of a read-only reader of a LIVE ring store, while the writer reuses slots.

A writer and a read-only reader of the same store live in one process.  A monkeypatched
internal function of the reader's read path makes the writer append rows (the ring evicts its
oldest rows and reuses their slots) and commit exactly between the point where the reader
resolved its rows (drew anchors, resolved indices, made a view) and the point where it reads
them: deterministic, no timing, no second process.  Every value written encodes its absolute
row and its episode, so a row read from a reused slot, a wrong mask or another episode's
episode data shows.  A read must return rows of a record it checked (retrying or drawing again
as it needs), or raise a ``trajstore.errors`` type.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import pytest
from gymnasium.spaces import Box, Dict

from trajstore import ReplayBuffer, TrajectoryReplayBuffer
from trajstore.errors import ConcurrentWriteError, IndexOutOfRangeError, UnknownEpisodeError
from trajstore.sampling import field_windows, sequences

STEP = Dict({"obs": Box(-1e9, 1e9, (2,), np.float64), "act": Box(-1e9, 1e9, (), np.float32)})
EP = Box(-1e9, 1e9, (), np.float64)
ROWS = Dict({"x": Box(-1e9, 1e9, (2,), np.float64), "y": Box(-1e9, 1e9, (), np.float32)})
# Episodes of 8 steps, the first of 4: a turn of the ring evicts part of an episode, so frames
# before an anchor that survived were evicted (their slots then hold another episode's steps);
# "long": one open episode, whose evicted steps' slots receive steps of the same episode.
EPISODES = {"short": (8, 4), "long": (10**6, 0)}  # (steps per episode, steps missing from the first)
CAP = 64  # ring capacity (rows or steps); chunks of 16 rows
TURN = 16  # rows the writer adds (and the ring evicts) while a read is under way


class Live:
    """A writer filling a ring and a read-only reader of the same store.

    ``kind`` "trajectory": steps of episodes as :meth:`episode_of` says (``episodes``: a key of
    :data:`EPISODES`), obs = (row, episode id), act = row + 0.5; episode data = episode id, set
    at the episode's first step (with ``episode_capacity``, a ring of that many
    episode-data rows); "replay": rows x = (row, -row), y = row.
    """

    def __init__(self, path: Any, kind: str = "trajectory", episode_capacity: int | None = None,
                 with_episode_data: bool = True, episodes: str = "short", capacity: int = CAP,
                 sharded: bool = False) -> None:
        from trajstore.shards import create_shard, open_sharded

        self.kind, self.row = kind, 0
        self.length, self.shift = EPISODES[episodes]
        if kind == "replay":
            self.w: Any = ReplayBuffer.create(ROWS, cache_path=path, capacity=capacity, chunk_rows=16)
        else:
            ep = dict(episode_data_instance_space=EP, episode_data_capacity=episode_capacity) if with_episode_data else {}
            kwargs: dict[str, Any] = dict(step_data_capacity=CAP, chunk_rows=16, **ep)
            # sharded: the store is the one shard of a sharded dataset (its writer is the shard's)
            self.w = (create_shard(path, STEP, shard="a", **kwargs) if sharded
                      else TrajectoryReplayBuffer.create(STEP, cache_path=path, **kwargs))
        self.episode_capacity = episode_capacity
        self.add(capacity)
        self.w.flush()
        self.ends = [self.row]  # the end of every record committed since the reader opened
        self.ro: Any = open_sharded(path) if sharded else type(self.w).load_from(path, read_only=True)
        self.store_reader: Any = self.ro.shard("a") if sharded else self.ro  # the reader's buffer of the store
        self.fired: list[tuple[Any, ...]] = []

    def episode_of(self, rows: Any) -> Any:
        """Episode id of the steps at absolute ``rows``."""
        return (np.asarray(rows, np.int64) + self.shift) // self.length

    def add(self, n: int) -> None:
        """Append ``n`` rows; the ring evicts as many of its oldest."""
        rows = np.arange(self.row, self.row + n)
        if self.kind == "replay":
            self.w.extend({"x": np.stack([rows, -rows], 1).astype(np.float64), "y": rows.astype(np.float32)})
        else:
            ids = self.episode_of(rows)
            for e in np.unique(ids).tolist():
                if e != self.w.current_episode_id:
                    self.w.mark_episode_end()
                assert self.w.current_episode_id == e
                mine = rows[ids == e]
                self.w.extend({"obs": np.stack([mine, ids[ids == e]], 1).astype(np.float64),
                               "act": (mine + 0.5).astype(np.float32)})
                if self.w.episode_space is not None and self.episode_of(mine[0] - 1) != e:  # its first step
                    self.w.set_current_episode_data(np.float64(e))
        self.row += n

    def turn(self, n: int = TURN) -> None:
        """The writer adds ``n`` rows and commits: ``n`` old rows evicted, their slots reused."""
        self.add(n)
        self.w.flush()
        self.ends.append(self.row)

    def during(self, monkeypatch: Any, owner: Any, names: Sequence[str], n: int = TURN, after: bool = False,
               when: Callable[..., bool] | None = None) -> None:
        """Patch ``owner.<name>`` for each of ``names``: the first call (for which ``when(*args)``
        holds) first runs :meth:`turn` (``after``: runs it after the call returned); its
        arguments are kept in :attr:`fired`."""
        for name in names:
            real = getattr(owner, name)

            def wrapped(*args: Any, _real: Any = real, **kwargs: Any) -> Any:
                first = not self.fired and (when is None or when(*args))
                if first:
                    self.fired.append(tuple(np.copy(a) if isinstance(a, np.ndarray) else a for a in args))
                if first and not after:
                    self.turn(n)
                out = _real(*args, **kwargs)
                if first and after:
                    self.turn(n)
                return out

            monkeypatch.setattr(owner, name, wrapped)

    @property
    def start(self) -> int:
        """The first absolute step row of the latest record (the reader adopts it)."""
        self.store_reader._sync()
        return int(self.store_reader._store.committed.tables["step_data"].start)

    def with_data(self) -> np.ndarray:
        """Episode ids that have episode data under the writer's last commit."""
        last = int(self.episode_of(self.row - 1)) + 1
        first = 0 if self.episode_capacity is None else max(last - self.episode_capacity, 0)
        return np.arange(first, last)

    def close(self) -> None:
        self.ro.close()
        self.w.close()


@pytest.fixture
def live(tmp_path):
    made: list[Live] = []

    def make(*args: Any, **kwargs: Any) -> Live:
        made.append(Live(tmp_path / f"s{len(made)}", *args, **kwargs))
        return made[-1]

    yield make
    for lv in made:
        lv.close()


def check_episode_data(lv: Live, eids: np.ndarray, data: Any) -> None:
    """Episode data is the episode's own (its id), or zeros where the last record gives it none."""
    ep = np.asarray(data)
    has = np.isin(eids, lv.with_data())
    np.testing.assert_array_equal(ep[has], eids[has])
    np.testing.assert_array_equal(ep[~has], 0)


# ---------------------------------------------------------------------------- 1. ReplayBuffer

TABLE_READS = ["read_row", "gather", "read_contiguous"]
INDICES: dict[str, tuple[Any, np.ndarray]] = {
    "int": (5, np.array(5)),
    "negative int": (-1, np.array(CAP - 1)),
    "slice": (slice(2, 10), np.arange(2, 10)),
    "strided slice": (slice(0, CAP, 7), np.arange(0, CAP, 7)),
    "array": (np.array([0, 15, 16, 63, 0]), np.array([0, 15, 16, 63, 0])),
    "mask": (np.arange(CAP) % 5 == 0, np.arange(0, CAP, 5)),
    "ellipsis": (..., np.arange(CAP)),
}


@pytest.mark.parametrize("how", list(INDICES))
def test_replay_indexing_while_the_ring_turns(live, monkeypatch, how):
    """``rb[idx]``: the rows the index names under the record it was resolved against, never the
    slots' new rows.  Safe: read_consistent re-reads when the ring's start moved (rows_intact)."""
    lv = live("replay")
    idx, logical = INDICES[how]
    lv.during(monkeypatch, lv.ro._table, TABLE_READS)
    x = np.asarray(lv.ro[idx]["x"])
    assert lv.fired and lv.start == TURN
    assert lv.ro.row_source().last_read.tables["step_data"].start == TURN  # the read that was returned
    np.testing.assert_array_equal(x[..., 0], TURN + logical)  # without the retry: rows 64.. for 0..
    np.testing.assert_array_equal(x[..., 1], -x[..., 0])
    flat = np.asarray(lv.ro.get_flattened_at(idx))
    np.testing.assert_array_equal(flat[..., 0], TURN + logical)


def test_replay_sample_while_the_ring_turns(live, monkeypatch):
    """``rb.sample``: anchors whose rows were evicted while read are drawn again; the others keep
    their rows.  Safe: sample_consistent follows each anchor's absolute row."""
    lv = live("replay")
    lv.during(monkeypatch, lv.ro._table, ["gather"])
    x = np.asarray(lv.ro.sample(512, rng=0)["x"])[:, 0].astype(np.int64)
    first = lv.fired[0][0]  # the logical rows (= absolute: the ring started at 0) of the first read
    kept = first >= TURN
    assert kept.any() and (~kept).any()
    np.testing.assert_array_equal(x[kept], first[kept])
    assert (x >= TURN).all() and (x < CAP + TURN).all()
    assert np.mean(x[~kept] == first[~kept] + CAP) < 0.2  # (each reused slot's new row: all of them, unchecked)


# ---------------------------------------------------------------------------- 2. TrajectoryReplayBuffer


@pytest.mark.parametrize("how", ["int", "slice", "array", "mask"])
def test_trajectory_get_at_with_metadata_while_both_rings_turn(live, monkeypatch, how):
    """``get_at_with_metadata`` / ``get_at`` with an episode-data ring of 4 episodes under a step
    ring of 8: steps, ids and episode data all from one record.  Safe: read_consistent, and
    rows_intact also follows the episode-data ring."""
    lv = live(episode_capacity=4)
    idx, logical = INDICES[how]
    lv.ro.get_at_with_metadata(0)  # the reader's episode index is built (as in any running reader)
    lv.during(monkeypatch, lv.ro.episode_index, ["lookup"])  # between the step read and the episode-data read
    data, meta = lv.ro.get_at_with_metadata(idx)
    assert lv.fired and lv.start == TURN
    obs, ids = np.asarray(data["step_data"]["obs"]), np.asarray(meta["episode_ids"])
    np.testing.assert_array_equal(obs[..., 0], TURN + logical)
    np.testing.assert_array_equal(obs[..., 1], ids)
    check_episode_data(lv, np.atleast_1d(ids), np.atleast_1d(np.asarray(data["episode_data"])))
    got = lv.ro.get_at(idx)  # and without the injection
    np.testing.assert_array_equal(np.asarray(got["step_data"]["obs"])[..., 0], TURN + logical)


def test_trajectory_sample_while_the_episode_data_ring_turns(live, monkeypatch):
    """``sample`` with episode data: the episode data of every step is its episode's, or zeros
    once the record gives the episode none (the eviction is injected right before the episode
    data is read).  Safe since ae8d2a9 (episode_data_stale); tests/test_live_episode_data.py has
    the sequence samplers."""
    lv = live(episode_capacity=4)
    lv.ro.sample(8, rng=1)
    lv.during(monkeypatch, lv.ro.layout.episode_table, ["gather"])
    data = lv.ro.sample(512, rng=0)
    assert lv.fired
    obs = np.asarray(data["step_data"]["obs"])
    assert (obs[:, 0] >= TURN).all()
    np.testing.assert_array_equal(obs[:, 1], lv.episode_of(obs[:, 0]))
    check_episode_data(lv, obs[:, 1].astype(np.int64), data["episode_data"])


# ---------------------------------------------------------------------------- 3. sequence windows


def check_frames(lv: Live, rows: np.ndarray, eids: np.ndarray, valid: np.ndarray, anchors: np.ndarray,
                 offsets: Sequence[int], pad: str) -> None:
    """Frames (B, T) of windows around ``anchors``: a frame is valid when its row is stored and in
    the anchor's episode; invalid frames hold the pad ("edge": a stored step of the anchor's
    episode; "zero": zeros).  Each window is checked against the record it may have been read
    under: the one before the writer's turn (its end) or the last (rows evicted meanwhile are
    stored in neither: no frame may come from them)."""
    start = lv.start
    want = anchors[:, None] + np.asarray(offsets)[None, :]
    mine = (want >= start) & (lv.episode_of(want) == lv.episode_of(anchors)[:, None])
    fits = np.zeros(len(anchors), bool)
    for end in lv.ends:
        fits |= (valid == (mine & (want < end))).all(axis=1)
    np.testing.assert_array_equal(fits, True)  # a frame from a reused slot would be marked valid
    np.testing.assert_array_equal(rows[valid], want[valid])
    if pad == "zero":
        np.testing.assert_array_equal(rows[~valid], 0)
        np.testing.assert_array_equal(eids[~valid], 0)
    else:
        pads = rows[~valid]
        assert (pads >= start).all() and (pads < lv.row).all()
        np.testing.assert_array_equal(lv.episode_of(pads), np.broadcast_to(lv.episode_of(anchors)[:, None], valid.shape)[~valid])
    filled = valid | (pad == "edge")
    np.testing.assert_array_equal(eids[filled], lv.episode_of(rows[filled]))


LIST_WINDOWS: dict[str, tuple[Callable[[Any, str, bool], Any], list[int], int]] = {
    # name: (read(reader, pad, within_episode) -> (data, mask), offsets, frame of the anchor)
    "sample_sequences(B, 4)": (lambda r, pad, within: r.sample_sequences(256, 4, rng=0, pad=pad, within_episode=within),
                               [0, 1, 2, 3], 0),
    "get_sequences([-3..0])": (lambda r, pad, within: r.get_sequences(np.arange(CAP), [-3, -2, -1, 0], pad=pad),
                               [-3, -2, -1, 0], 3),
}


@pytest.mark.parametrize("how, pad, within", [(how, pad, within) for how in LIST_WINDOWS for pad in ("edge", "zero")
                                              for within in (False, True) if not (within and how.startswith("get"))])
@pytest.mark.parametrize("episodes", list(EPISODES))
def test_list_windows_while_the_rings_turn(live, monkeypatch, how, pad, within, episodes):
    """``sample_sequences(B, T)`` and ``get_sequences(idx, [-3..0])``: every window from an intact
    record, its mask that record's, its episode data its anchor's.  Safe: sample_consistent
    (windows start at the anchor: its row is the earliest read) and read_consistent."""
    lv = live(episode_capacity=4, episodes=episodes)
    read, offsets, at = LIST_WINDOWS[how]
    read(lv.ro, pad, within)  # a running reader: its run and episode indexes are built
    lv.during(monkeypatch, sequences, ["_read_windows"])
    data, mask = read(lv.ro, pad, within)
    assert lv.fired and lv.start == TURN
    obs, valid = np.asarray(data["step_data"]["obs"]), np.asarray(mask)
    rows, eids = obs[..., 0].astype(np.int64), obs[..., 1].astype(np.int64)
    anchors = rows[:, at]
    if how.startswith("get"):
        np.testing.assert_array_equal(anchors, TURN + np.arange(CAP))  # the indices, under the record read
    if within:
        assert valid.all()
    check_frames(lv, rows, eids, valid, anchors, offsets, pad)
    check_episode_data(lv, lv.episode_of(anchors), data["episode_data"])


FIELD_OFFSETS = {"obs": [-2, -1, 0, 1], "act": [0, 1]}


@pytest.mark.parametrize("how", [dict(pad="edge"), dict(pad="zero"), dict(within_episode=True),
                                 dict(within_episode=True, allow_pad=True, pad="edge"),
                                 dict(within_episode=True, allow_pad=True, pad="zero"), "get_sequences"])
@pytest.mark.parametrize("episodes", list(EPISODES))
def test_field_windows_while_the_rings_turn(live, monkeypatch, how, episodes):
    """Per-field windows (``offsets`` a mapping), drawn or given: frames before the anchor were in
    the first rows evicted.  Safe: reach_back (1a716ed) and episode_data_stale (ae8d2a9)."""
    lv = live(episode_capacity=4, episodes=episodes)

    def read() -> Any:
        if how == "get_sequences":
            return lv.ro.get_sequences(np.arange(CAP), FIELD_OFFSETS, pad="edge")
        return lv.ro.sample_sequences(256, offsets=FIELD_OFFSETS, rng=0, **how)

    read()
    lv.during(monkeypatch, field_windows, ["_read"])
    data, mask = read()
    assert lv.fired and lv.start == TURN
    pad = "edge" if how == "get_sequences" else how.get("pad", "edge")
    obs = np.asarray(data["step_data"]["obs"])
    rows, eids = obs[..., 0].astype(np.int64), obs[..., 1].astype(np.int64)
    anchors = rows[:, 2]
    if how == "get_sequences":
        np.testing.assert_array_equal(anchors, TURN + np.arange(CAP))
    check_frames(lv, rows, eids, np.asarray(mask["obs"]), anchors, FIELD_OFFSETS["obs"], pad)
    act, act_ok = np.asarray(data["step_data"]["act"]), np.asarray(mask["act"])
    np.testing.assert_array_equal(act[act_ok], (anchors[:, None] + np.array([0.5, 1.5]))[act_ok])
    check_episode_data(lv, lv.episode_of(anchors), data["episode_data"])


def test_episode_columns_while_the_ring_turns(live, monkeypatch):
    """``filter_episodes`` sees the episodes as columns (``episode_columns``): the table (start,
    length) and the episode data come from one record.  The table was read before the data, so
    a turn in between gave starts and lengths of the old record (episode 2: start 12, length 8,
    where 4 of its steps were left at row 0) beside the data of the new one."""
    from trajstore.buffers.episode_edit import episode_columns

    lv = live(episode_capacity=4)
    lv.during(monkeypatch, sequences, ["episode_table"], after=True)
    cols = episode_columns(lv.ro)
    assert lv.fired and lv.start == TURN
    stored = np.arange(TURN, lv.row)
    ids, first = np.unique(lv.episode_of(stored), return_index=True)
    np.testing.assert_array_equal(cols["episode_id"], ids)
    np.testing.assert_array_equal(cols["start"], first)
    np.testing.assert_array_equal(cols["length"], np.diff(np.append(first, len(stored))))
    np.testing.assert_array_equal(cols["has_data"], np.isin(ids, lv.with_data()))
    check_episode_data(lv, ids, cols["value"])
    view = lv.ro.filter_episodes(lambda ep: ep["length"] == lv.length)  # whole episodes only
    np.testing.assert_array_equal(view.episode_ids, ids[1:-1])  # not 2 (half evicted), nor 10 (4 steps so far)


# ---------------------------------------------------------------------------- 5b. select_episodes views

SELECTED = [1, 2, 4, 6, 8]  # after a turn: 1 evicted, 2 half (16-19), 4 and 6 whole, 8 (open) grew by 4 steps
VIEW_READS: dict[str, Callable[[Any], Any]] = {
    "int": lambda v: v[0]["step_data"]["obs"][None],
    "negative int": lambda v: v[-1]["step_data"]["obs"][None],
    "slice": lambda v: v[2:6]["step_data"]["obs"],
    "array": lambda v: v[np.array([0, 5, 19])]["step_data"]["obs"],
    "get_at_with_metadata": lambda v: v.get_at_with_metadata(np.array([0, 5, 19]))[0]["step_data"]["obs"],
    "sample": lambda v: v.sample(256, rng=0)["step_data"]["obs"],
    "sample_sequences": lambda v: v.sample_sequences(256, 2, rng=0, within_episode=True)[0]["step_data"]["obs"],
    "get_sequences": lambda v: v.get_sequences(np.arange(8), [-1, 0], pad="edge")[0]["step_data"]["obs"],
    "per-field windows": lambda v: v.sample_sequences(256, offsets={"obs": [-1, 0]}, rng=0)[0]["step_data"]["obs"],
}


@pytest.mark.parametrize("how", list(VIEW_READS))
def test_episode_view_reads_while_the_ring_turns(live, monkeypatch, how):
    """A ``select_episodes`` view of a live ring, the ring turned while a read is under way: the
    rows returned are rows of the selection under the record read (indices resolved against it,
    samples drawn again where their steps were evicted, windows within the selection).  Safe:
    SelectionRows numbers the selected steps evicted since the view was made, so the retry loop
    follows each anchor; indexing retries through read_consistent."""
    lv = live()
    view = lv.ro.select_episodes(SELECTED)
    view.sample(8, rng=1)
    lv.during(monkeypatch, lv.ro._table, ["gather", "read_row", "read_contiguous", "gather_windows"])
    obs = np.asarray(VIEW_READS[how](view))
    assert lv.fired and lv.start == TURN
    selected = np.flatnonzero(np.isin(lv.episode_of(np.arange(lv.row)), SELECTED))
    now = selected[selected >= TURN]  # the view's rows under the last record
    rows, eids = obs[..., 0].astype(np.int64), obs[..., 1].astype(np.int64)
    np.testing.assert_array_equal(eids, lv.episode_of(rows))
    assert np.isin(rows, now).all()
    want = {"int": now[[0]], "negative int": now[[-1]], "slice": now[2:6], "array": now[[0, 5, 19]],
            "get_at_with_metadata": now[[0, 5, 19]]}
    if how in want:
        np.testing.assert_array_equal(rows, want[how])
    if how == "get_sequences":
        np.testing.assert_array_equal(rows[:, 1], now[:8])
    if rows.ndim == 2:  # windows: a frame's step is the anchor's or an earlier one of its episode
        assert (eids == eids[:, -1:]).all() and (rows[:, 0] <= rows[:, 1]).all()


# ---------------------------------------------------------------------------- 6. torch datasets


def test_torch_datasets_over_a_live_store(live, monkeypatch):
    """TransitionDataset / SequenceDataset opened on the path of a store a writer keeps filling
    (in-process, as with num_workers=0): item ``i`` is logical row (or anchor) ``i`` of the record
    it was read under, its mask and episode data that record's.  Safe: both read through
    read_consistent (datasets are meant for finished stores; on a live ring items shift as it turns)."""
    from trajstore.torch import SequenceDataset, TransitionDataset

    lv = live(episode_capacity=4)
    path = lv.ro.cache_path
    items = np.array([0, 1, 17, 40, 63])
    steps = TransitionDataset(path, ["obs", "episode_data"], output="numpy", episode_ids=True)
    lv.during(monkeypatch, steps.buffer.row_source(), ["read_rows", "read_episode_rows"])
    batch = steps.read_batch(items)
    assert lv.fired
    start = int(steps.buffer.row_source().last_read.tables["step_data"].start)
    assert start == TURN
    np.testing.assert_array_equal(batch["obs"][:, 0], start + items)
    np.testing.assert_array_equal(batch["episode_id"], lv.episode_of(start + items))
    check_episode_data(lv, batch["episode_id"], batch["episode_data"])
    steps.close()

    lv.fired.clear()
    windows = SequenceDataset(path, 4, ["obs", "episode_data"], output="numpy")
    lv.during(monkeypatch, windows.buffer.row_source(), ["read_rows", "read_episode_rows"])
    batch = windows.read_batch(items)
    assert lv.fired
    start = int(windows.buffer.row_source().last_read.tables["step_data"].start)
    anchors = start + windows.anchors[items]
    lv.ro._sync()
    rows, eids = batch["obs"][..., 0].astype(np.int64), batch["obs"][..., 1].astype(np.int64)
    check_frames(lv, rows, eids, batch["mask"], anchors, [0, 1, 2, 3], "edge")
    check_episode_data(lv, lv.episode_of(anchors), batch["episode_data"])
    windows.close()


# ---------------------------------------------------------------------------- 6b. dask arrays

DASK_CHANGES = {
    "turn while read": None,
    "clear": lambda lv: (lv.w.clear(), lv.add(1024)),
    "remove_at": lambda lv: lv.w.remove_at(np.arange(0, 1024, 2)),
    "set_at": lambda lv: lv.w.set_at(3, {"x": np.array([-7.0, 7.0]), "y": np.float32(-7)}),
}


@pytest.mark.parametrize("change", list(DASK_CHANGES))
def test_dask_blocks_of_rows_that_changed(live, monkeypatch, change):
    """A dask array holds the rows committed when it was made: a block whose rows were evicted
    while it read them, or rewritten since (clear, remove_at, set_at: a new epoch), raises
    ConcurrentWriteError; blocks whose rows stayed return them.  Before, a block read its rows
    without checking the record afterwards (rows 64-71 returned as rows 0-7) and never looked
    at the epoch (clear: the new rows; remove_at: every other row)."""
    pytest.importorskip("dask.array")
    from trajstore.buffers.rows import BufferRows
    from trajstore.dask import to_dask

    lv = live("replay", capacity=1024)  # column x: blocks of 256 rows (a raw field's chunk)
    arr = to_dask(lv.ro.get_column("x"))[:, 0]
    assert arr.chunks[0] == (256,) * 4
    if DASK_CHANGES[change] is None:
        lv.during(monkeypatch, BufferRows, ["read_rows"], when=lambda src, *_: src.buffer is not lv.w)
        with pytest.raises(ConcurrentWriteError, match="evicted"):
            arr[:8].compute(scheduler="sync")  # rows 0-15 were evicted while the block read them
        assert lv.fired and lv.start == TURN
        np.testing.assert_array_equal(arr[256:].compute(scheduler="sync"), np.arange(256, 1024))
        return
    DASK_CHANGES[change](lv)
    lv.w.flush()
    with pytest.raises(ConcurrentWriteError, match="rewritten"):
        arr.compute(scheduler="sync")


def test_dask_array_of_an_episode_view_that_saw_evictions(live):
    """``to_dask`` of a ``select_episodes`` view whose steps a ring evicted since it was made: the
    array's rows are the view's rows.  A view numbers its rows in its own process (counting the
    selected steps evicted since it was made) while the tasks reopen the store and number them
    afresh: the blocks read rows 8 further on, and the last block raised a raw IndexError."""
    pytest.importorskip("dask.array")
    lv = live()
    view = lv.ro.select_episodes([1, 2, 4, 6])
    want = np.flatnonzero(np.isin(lv.episode_of(np.arange(CAP + TURN)), [1, 2, 4, 6]))
    assert len(view) == len(want[want < CAP])
    lv.turn()
    column = view.get_column(["step_data", "obs"])
    np.testing.assert_array_equal(np.asarray(column[:])[:, 0], want[want >= TURN])  # the view moved on
    got = column.to_dask().compute(scheduler="sync")
    np.testing.assert_array_equal(got[:, 0], want[want >= TURN])
    np.testing.assert_array_equal(got[:, 1], lv.episode_of(want[want >= TURN]))


def test_dask_column_method_of_a_sharded_dataset(tmp_path):
    """``ds.get_column(...).to_dask()`` (the method) builds each shard's arrays as
    ``trajstore.dask.to_dask`` does; it read the dataset's global rows instead, whose numbers are
    its process's only, and raised a BadArgumentError about episode data."""
    pytest.importorskip("dask.array")
    from trajstore.dask import to_dask
    from trajstore.shards import create_shard, open_sharded

    root = tmp_path / "root"
    for k, name in enumerate(["a", "b"]):
        w = create_shard(root, ROWS if k == 0 else None, shard=name, kind="replay", capacity=64, chunk_rows=16)
        rows = np.arange(100 * k, 100 * k + 80)  # a ring of 64: rows 16.. of each shard stay
        w.extend({"x": np.stack([rows, -rows], 1).astype(np.float64), "y": rows.astype(np.float32)})
        w.close()
    ds = open_sharded(root)
    want = np.concatenate([np.arange(16, 80), np.arange(116, 180)])
    for arr in (ds.get_column("x").to_dask(), to_dask(ds.get_column("x")), ds.to_dask()["x"]):
        np.testing.assert_array_equal(arr.compute(scheduler="sync")[:, 0], want)
    ds.close()


# ---------------------------------------------------------------------------- 7. prioritized sampling

PRIORITIZED = {
    "sample": lambda s: (lambda b, i, w: (b, None, i))(*s.sample(256, rng=0)),
    "sample_sequences(B, 3)": lambda s: (lambda d, m, i, w: (d, m, i))(*s.sample_sequences(256, 3, rng=0)),
    "per-field offsets": lambda s: (lambda d, m, i, w: (d, m, i))(
        *s.sample_sequences(256, offsets={"obs": [-2, -1, 0], "act": [0, 1]}, rng=0)),
}


@pytest.mark.parametrize("how", list(PRIORITIZED))
def test_prioritized_reader_of_a_live_ring(live, monkeypatch, how):
    """A read-only reader's PrioritizedSampler (priorities from the writer's sidecar): the rows
    returned are the rows its indices name under ``last_start``, with their own episode data.
    Safe: it reads through get_at / get_sequences (read_consistent) pinned to the record it drew
    from, and draws again when the ring's start moved meanwhile."""
    from trajstore import PrioritizedSampler

    lv = live(episode_capacity=4)
    writer_side = PrioritizedSampler(lv.w)
    writer_side.update_priorities(np.arange(CAP), np.arange(CAP) + 1.0)
    writer_side.flush()
    sampler = PrioritizedSampler(lv.ro)
    lv.during(monkeypatch, lv.ro._table, ["gather", "gather_windows"])
    data, mask, idx = PRIORITIZED[how](sampler)
    assert lv.fired and sampler.last_start == TURN
    obs = np.asarray(data["step_data"]["obs"])
    anchors = sampler.last_start + idx
    frame0 = {"sample": None, "sample_sequences(B, 3)": 0, "per-field offsets": 2}[how]
    np.testing.assert_array_equal(obs[:, 0] if frame0 is None else obs[:, frame0, 0], anchors)
    if how == "per-field offsets":
        m = np.asarray(mask["obs"])
        check_frames(lv, obs[..., 0].astype(np.int64), obs[..., 1].astype(np.int64), m, anchors, [-2, -1, 0], "edge")
    check_episode_data(lv, lv.episode_of(anchors), data["episode_data"])
    sampler.close()
    writer_side.close()


# ---------------------------------------------------------------------------- 4. lazy views

def fixed(*rows: int) -> Callable[[int], np.ndarray]:
    """The logical rows of a view whose rows were fixed when it was made, whatever the length."""
    return lambda count: np.array(rows)


VIEWS: dict[str, tuple[Callable[[Any], Any], Callable[[int], np.ndarray], bool]] = {
    # name: (make(reader) -> view, the logical rows it reads at a length, fixed at creation)
    "slice": (lambda r: r.get_slice(slice(56, None)), lambda count: np.arange(56, count), False),
    "column": (lambda r: r.get_column("x"), lambda count: np.arange(count), False),
    "array": (lambda r: r.get_slice(np.array([0, 40, 63])), fixed(0, 40, 63), True),
    "negative list": (lambda r: r.get_slice([-1, -64]), fixed(63, 0), True),
    "mask": (lambda r: r.get_slice(np.arange(CAP) >= 62), fixed(62, 63), True),
    "int": (lambda r: r.get_slice(50), fixed(50), True),
    "column of an array view": (lambda r: r.get_slice(np.array([0, 40, 63])).get_column("x"), fixed(0, 40, 63), True),
}


def view_rows(view: Any) -> np.ndarray:
    got = view[:]
    return np.asarray(got["x"] if isinstance(got, dict) else got)[:, 0].astype(np.int64)


@pytest.mark.parametrize("how", list(VIEWS))
def test_views_made_before_the_ring_turned(live, monkeypatch, how):
    """A view made before the ring turned, read after it (and while it turns again): its logical
    rows are resolved against the record it is read under (as the views' docstring says), so it
    returns that record's rows there, never the slots' new rows under the old numbers.  Safe: a
    view's read is its buffer's consistent read."""
    lv = live("replay")
    make, logical, _ = VIEWS[how]
    view = make(lv.ro)
    lv.turn()
    np.testing.assert_array_equal(view_rows(view), TURN + logical(CAP))
    lv.during(monkeypatch, lv.ro._table, TABLE_READS)
    got = view_rows(view)
    assert lv.fired and lv.start == 2 * TURN
    np.testing.assert_array_equal(got, 2 * TURN + logical(CAP))


@pytest.mark.parametrize("shrink", ["remove_at", "clear"])
@pytest.mark.parametrize("how", list(VIEWS))
def test_views_of_rows_the_buffer_no_longer_has(live, how, shrink):
    """Rows fixed when a view was made (an index array, a mask, an int) that the buffer no longer
    has (the writer removed rows or cleared it) raise IndexOutOfRangeError when read.  Before, a
    view read those slots anyway: rows removed or cleared (60, 63 after a clear), or slots past
    the last row that a writer may be filling.  Slices and columns read what is left."""
    lv = live("replay")
    make, logical, is_fixed = VIEWS[how]
    view = make(lv.ro)
    if shrink == "remove_at":
        lv.w.remove_at(np.arange(0, CAP, 2))  # 32 rows left: the odd ones
        left = np.arange(1, CAP, 2)
    else:
        lv.w.clear()
        lv.w.extend({"x": np.tile([[1000.0, -1000.0]], (5, 1)), "y": np.full(5, 1000, np.float32)})
        left = np.full(5, 1000)
    lv.w.flush()
    rows = logical(len(left))
    if is_fixed and rows.max() >= len(left):
        with pytest.raises(IndexOutOfRangeError, match="no longer"):
            view[:]
        assert len(view) == len(rows)  # the view still names them
    elif len(rows):
        np.testing.assert_array_equal(view_rows(view), left[rows])
    else:
        assert len(view) == 0


# ---------------------------------------------------------------------------- 5. episodes by id


@pytest.mark.parametrize("eid, stored", [(4, np.arange(28, 36)), (2, np.arange(TURN, 20)), (1, None)])
@pytest.mark.parametrize("reader", ["buffer", "view", "sharded"])
def test_get_episode_while_the_ring_turns(live, monkeypatch, reader, eid, stored):
    """``get_episode(id)`` (buffer, ``select_episodes`` view, sharded dataset of one shard): the
    rows of the episode are found and read under one record, so a turn of the ring in between
    cannot hand back another episode's steps (it did: rows found under the old record were read
    under the new one, 16 rows further on), and an episode evicted meanwhile (1) raises
    UnknownEpisodeError."""
    lv = live(sharded=reader == "sharded")
    reader = lv.ro.select_episodes([1, 2, 4, 6]) if reader == "view" else lv.ro
    lv.during(monkeypatch, sequences, ["episode_rows"], after=True)  # rows found, then the ring turns
    if stored is None:
        with pytest.raises(UnknownEpisodeError):
            reader.get_episode(eid)
    else:
        obs = np.asarray(reader.get_episode(eid)["step_data"]["obs"])
        np.testing.assert_array_equal(obs[:, 0], stored)
        np.testing.assert_array_equal(obs[:, 1], eid)
    assert lv.fired and lv.start == TURN


# ---------------------------------------------------------------------------- sharded datasets

SHARDED_SAMPLERS = {
    "sample": lambda r: (r.sample(512, rng=0), None),
    "sample_sequences(B, 2)": lambda r: r.sample_sequences(512, 2, rng=0, within_episode=True),
    "per-field windows": lambda r: r.sample_sequences(512, offsets={"obs": [-1, 0]}, rng=0, within_episode=True),
}


@pytest.mark.parametrize("how", list(SHARDED_SAMPLERS))
def test_sharded_samples_while_the_episode_data_ring_turns(live, monkeypatch, how):
    """A sharded dataset of trajectory shards whose episode-data ring (4) is smaller than the
    episodes in the step ring: a sample that overlaps an eviction returns each step's own
    episode data, or zeros once the record gives its episode none.  ShardedRows had no
    ``episode_data_stale``, so the retry loop kept episode data read from reused slots (episode
    10's for episode 6's steps)."""
    lv = live(episode_capacity=4, sharded=True)
    sample = SHARDED_SAMPLERS[how]
    sample(lv.ro)  # the shard reader's episode index is built
    lv.during(monkeypatch, lv.store_reader.episode_index, ["lookup"])
    data, mask = sample(lv.ro)
    assert lv.fired and lv.start == TURN
    obs = np.asarray(data["step_data"]["obs"])
    anchors = obs[:, 0] if obs.ndim == 2 else obs[:, -1, 0]
    ids = obs[:, 1] if obs.ndim == 2 else obs[:, -1, 1]
    assert (anchors >= TURN).all()
    np.testing.assert_array_equal(ids, lv.episode_of(anchors))
    check_episode_data(lv, lv.episode_of(anchors), data["episode_data"])


def test_episode_data_set_again_while_a_sample_reads_it(live, monkeypatch):
    """An episode whose data row is evicted and then set again (a new row) while a sample reads it:
    the row read was the evicted slot's new occupant, and the episode has data again, so "no data
    row now" alone missed it (episode 9's data returned for episode 5)."""
    lv = live(episode_capacity=4)  # episodes 0-8 (8 open), data of 5-8 in the ring
    lv.ro.sample(8, rng=1)
    real, fired = lv.ro.episode_index.lookup, []

    def lookup(ids):
        rows = real(ids)  # episode 5's data row under the old record: its slot ...
        if not fired:
            fired.append(True)
            lv.add(16)  # ... is reused: episodes 9 and 10 get data (5's and 6's rows evicted)
            lv.w.set_episode_data_at(5, np.float64(500))  # 5's data set again: a new row
            lv.w.flush()
        return rows

    monkeypatch.setattr(lv.ro.episode_index, "lookup", lookup)
    data = lv.ro.sample(512, rng=0)
    obs, ep = np.asarray(data["step_data"]["obs"]), np.asarray(data["episode_data"])
    five = obs[:, 1] == 5
    assert fired and five.any()
    assert np.isin(ep[five], [5, 500]).all()


def test_selection_follows_rows_when_the_ring_start_moves_back(tmp_path):
    """A reader's ring start moves back when the commit after an eviction record names the rows of
    the guard band again; a select_episodes view must follow its rows across that (row 14 was
    followed to row 12)."""
    path = tmp_path / "s"
    w = TrajectoryReplayBuffer.create(STEP, step_data_capacity=64, cache_path=path, chunk_rows=16, commit_interval=1e9)
    rows = np.arange(64)
    w.extend({"obs": np.stack([rows, np.zeros(64)], 1), "act": rows.astype(np.float32)})
    w.flush()
    ro = TrajectoryReplayBuffer.load_from(path, read_only=True)
    sel = ro.select_episodes([0]).row_source()
    w.extend({"obs": np.array([[64.0, 0], [65.0, 0]]), "act": np.array([64, 65], np.float32)})  # eviction record
    sel.sync()  # start 4 (2 evicted + guard band)
    before, start_then = sel.record, ro._table.state.start
    step_then = sel.to_parent(np.array([10])) + start_then
    x = sel.absolute_rows(np.array([10]))
    w.flush()  # the next commit names the actual start, 2
    sel.sync()
    assert ro._table.state.start < start_then
    step_now = sel.to_parent(sel.logical_rows(x, before)) + ro._table.state.start
    assert step_now.tolist() == step_then.tolist()
    ro.close()
    w.close()
