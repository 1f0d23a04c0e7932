"""Episode-level editing (issue 16): select_episodes / filter_episodes views, remove_episodes
(crash-atomic, with a SIGKILL loop), trajstore.combine / split / filter_store and the --where
language.  Every store is real (on disk); expected values come from a plain-numpy model of the
rows written."""

from __future__ import annotations

import os
import shutil
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from gymnasium.spaces import Box, Dict

HERE = str(Path(__file__).resolve().parent)
if HERE not in sys.path:
    sys.path.insert(0, HERE)

import _episode_edit_workers as EW  # noqa: E402
import _traj_workers as TW  # noqa: E402
import _workers as W  # noqa: E402

import trajstore  # noqa: E402
from trajstore import TrajectoryReplayBuffer  # noqa: E402
from trajstore.errors import (  # noqa: E402
    BadArgumentError,
    BadOptionError,
    BadValueError,
    EmptyBufferError,
    ReadOnlyError,
    SpaceMismatchError,
    StoreExistsError,
    UnknownEpisodeError,
    UnknownFieldError,
)
from trajstore.maintenance.combine import filter_store, split_counts  # noqa: E402
from trajstore.maintenance.verify import verify_store  # noqa: E402
from trajstore.maintenance.where import compile_where, where_fields  # noqa: E402

STEP = Dict({"obs": Box(-1e6, 1e6, (3,), np.float32), "act": Box(-1e6, 1e6, (2,), np.float32)})
EPS = Dict({"return": Box(-1e9, 1e9, (), np.float64), "success": Box(0, 1, (), np.int64)})


def _steps(eid: int, n: int) -> dict[str, np.ndarray]:
    k = np.arange(n, dtype=np.float32)
    obs = np.stack([np.full(n, eid, np.float32), k, eid * 1000 + k], axis=1)
    act = np.stack([k, np.full(n, -eid, np.float32)], axis=1)
    return {"obs": obs, "act": act}


class Model:
    """What was written: per step row its episode id and step number; per episode its data."""

    def __init__(self) -> None:
        self.ids = np.zeros(0, np.int64)
        self.k = np.zeros(0, np.int64)
        self.ret: dict[int, float] = {}
        self.success: dict[int, int] = {}

    def obs(self, rows: np.ndarray) -> np.ndarray:
        ids, k = self.ids[rows], self.k[rows]
        return np.stack([ids, k, ids * 1000 + k], axis=-1).astype(np.float32)

    def remove(self, eids: list[int]) -> None:
        keep = ~np.isin(self.ids, eids)
        self.ids, self.k = self.ids[keep], self.k[keep]
        for e in eids:
            self.ret.pop(e, None)
            self.success.pop(e, None)


def _build(path: str | None, lengths: list[int], *, data: bool = True, seed: int = 0,
           **kw: object) -> tuple[TrajectoryReplayBuffer, Model]:
    rng = np.random.default_rng(seed)
    buf = TrajectoryReplayBuffer.create(STEP, episode_data_instance_space=EPS if data else None, cache_path=path,
                                        **kw)  # type: ignore[arg-type]
    m = Model()
    for n in lengths:
        eid = buf.current_episode_id
        buf.extend(_steps(eid, n))
        m.ids = np.concatenate([m.ids, np.full(n, eid)])
        m.k = np.concatenate([m.k, np.arange(n)])
        if data:
            r, s = float(rng.normal() * 100), int(rng.integers(0, 2))
            buf.set_current_episode_data({"return": np.float64(r), "success": np.int64(s)})
            m.ret[eid], m.success[eid] = r, s
        buf.mark_episode_end()
    return buf, m


def _ref_windows(ids: np.ndarray, obs: np.ndarray, anchors: np.ndarray, offsets: list[int],
                 pad: str) -> tuple[np.ndarray, np.ndarray]:
    """docs/design.md's sequence rule on plain arrays: frame valid when its row exists and has the
    anchor's id; "edge" repeats the earliest valid frame before the anchor, the latest after."""
    n, offs = len(ids), np.asarray(offsets)
    valid = np.zeros((len(anchors), len(offs)), bool)
    out = np.zeros((len(anchors), len(offs), *obs.shape[1:]), obs.dtype)
    for b, a in enumerate(anchors):
        for t, o in enumerate(offs):
            r = a + o
            valid[b, t] = 0 <= r < n and ids[r] == ids[a]
            if valid[b, t]:
                out[b, t] = obs[r]
        if pad == "edge":
            v = np.flatnonzero(valid[b])
            for t, o in enumerate(offs):
                if not valid[b, t]:
                    out[b, t] = out[b, v[0]] if o < 0 else out[b, v[-1]]
    return out, valid


LENGTHS = [5, 1, 7, 3, 9, 2, 6, 4]


# -- views -----------------------------------------------------------------------------------------
def test_select_episodes_view_reads_the_selected_rows(tmp_path):
    buf, m = _build(str(tmp_path / "s"), LENGTHS, chunk_rows=4)
    sel = [6, 1, 4, 2, 4]  # unordered, duplicated
    view = buf.select_episodes(np.array(sel))
    rows = np.flatnonzero(np.isin(m.ids, sel))  # the model's rows, in row order
    assert np.array_equal(view.episode_ids, [1, 2, 4, 6])
    assert len(view) == len(rows) == 1 + 7 + 9 + 6
    got = view[:]
    np.testing.assert_array_equal(got["step_data"]["obs"], m.obs(rows))
    np.testing.assert_array_equal(got["episode_data"]["return"], [m.ret[e] for e in m.ids[rows]])
    one = view[-1]
    np.testing.assert_array_equal(one["step_data"]["obs"], m.obs(rows[-1]))
    data, meta = view.get_at_with_metadata(np.array([0, 3, 10]))
    np.testing.assert_array_equal(meta["episode_ids"], m.ids[rows[[0, 3, 10]]])
    np.testing.assert_array_equal(data["step_data"]["obs"], m.obs(rows[[0, 3, 10]]))
    # sample draws view rows uniformly: the same generator gives the same rows.
    s = view.sample(64, rng=np.random.default_rng(7))
    expect = rows[np.random.default_rng(7).integers(0, len(rows), size=64)]
    np.testing.assert_array_equal(s["step_data"]["obs"], m.obs(expect))
    eps = view.episodes()
    assert eps["episode_id"].tolist() == [1, 2, 4, 6]
    assert eps["length"].tolist() == [1, 7, 9, 6] and eps["start"].tolist() == [0, 1, 8, 17]
    np.testing.assert_array_equal(view.get_episode(4)["step_data"]["obs"], m.obs(np.flatnonzero(m.ids == 4)))
    with pytest.raises(UnknownEpisodeError):
        view.get_episode(3)  # in the buffer, not in the selection
    # Views of the view read the same rows (get_column, get_slice, to_dask).
    np.testing.assert_array_equal(view.get_column(["step_data", "obs"])[2:5], m.obs(rows[2:5]))
    np.testing.assert_array_equal(view.get_slice(slice(-3, None))[:]["step_data"]["act"][:, 0], m.k[rows[-3:]])
    pytest.importorskip("dask")
    buf.flush()
    np.testing.assert_array_equal(view.get_column("step_data/obs").to_dask().compute(), m.obs(rows))
    buf.close()


@pytest.mark.parametrize("pad", ["edge", "zero"])
def test_view_windows_never_reach_steps_outside_the_selection(tmp_path, pad):
    buf, m = _build(str(tmp_path / "w"), LENGTHS, chunk_rows=4)
    sel = [0, 2, 3, 5]  # neighbours 2 and 3 stay apart; 0 and 2 are separated by episode 1
    view = buf.select_episodes(sel)
    rows = np.flatnonzero(np.isin(m.ids, sel))
    vids, vobs = m.ids[rows], m.obs(rows)
    anchors = np.arange(len(rows))
    for offsets in ([-2, -1, 0, 1, 2], [0, 1, 2, 3], [-3, 0, 4]):
        data, mask = view.get_sequences(anchors, offsets, pad=pad)
        ref, valid = _ref_windows(vids, vobs, anchors, offsets, pad)
        np.testing.assert_array_equal(mask, valid)
        np.testing.assert_array_equal(data["step_data"]["obs"][valid], ref[valid])
        if pad == "edge":
            np.testing.assert_array_equal(data["step_data"]["obs"], ref)
        else:
            assert not data["step_data"]["obs"][~valid].any()
        # Every frame read is a step of a selected episode.
        assert set(np.unique(data["step_data"]["obs"][..., 0][valid]).tolist()) <= set(sel)
    # Per-field windows over the same selection.
    fdata, fmask = view.get_sequences(anchors, {"obs": [-1, 0], "act": [0, 1, 2]}, pad=pad)
    np.testing.assert_array_equal(fmask["obs"], _ref_windows(vids, vobs, anchors, [-1, 0], pad)[1])
    np.testing.assert_array_equal(fmask["act"], _ref_windows(vids, vobs, anchors, [0, 1, 2], pad)[1])
    assert set(fdata["step_data"]) == {"obs", "act"} and fdata["step_data"]["act"].shape == (len(rows), 3, 2)
    # Sampled windows inside one episode come from selected episodes only, with their own rows.
    d, mk = view.sample_sequences(200, 3, rng=1, pad=pad, within_episode=True)
    assert mk.all()
    o = d["step_data"]["obs"]
    assert set(np.unique(o[..., 0]).tolist()) <= set(sel) - {5}  # episode 5 has 2 steps: no 3-step window
    assert (o[:, :, 0] == o[:, :1, 0]).all() and (np.diff(o[:, :, 1], axis=1) == 1).all()
    np.testing.assert_array_equal(d["episode_data"]["return"], [m.ret[int(e)] for e in o[:, 0, 0]])
    buf.close()


def test_view_follows_the_parent_store_without_copying(tmp_path):
    buf, m = _build(str(tmp_path / "f"), LENGTHS)
    view = buf.select_episodes([3, buf.current_episode_id - 1])  # 3 and the last finished one (7)
    assert len(view) == 3 + 4
    # Nothing is copied: a write to the parent shows through the view, and the view refuses writes.
    row = int(np.flatnonzero(m.ids == 3)[1])
    new = {"obs": np.array([3, 99, 99], np.float32), "act": np.zeros(2, np.float32)}
    buf.set_at(row, new)
    np.testing.assert_array_equal(view[1]["step_data"]["obs"], [3, 99, 99])
    with pytest.raises(ReadOnlyError):
        view.set_at(0, new)
    with pytest.raises(ReadOnlyError):
        view.extend({"obs": np.zeros((1, 3), np.float32), "act": np.zeros((1, 2), np.float32)})
    # Removing a selected episode from the parent shrinks the view.
    buf.remove_episodes([3])
    assert len(view) == 4 and view.episodes()["episode_id"].tolist() == [7]
    buf.remove_episodes([7])
    assert len(view) == 0
    with pytest.raises(EmptyBufferError):
        view.sample(1)
    buf.close()
    # A read-only reader's view reads the committed store.
    with TrajectoryReplayBuffer.load_from(str(tmp_path / "f"), read_only=True) as ro:
        v = ro.select_episodes([0, 6])
        rows = np.flatnonzero(np.isin(m.ids, [0, 6]))
        np.testing.assert_array_equal(v[:]["step_data"]["obs"], m.obs(rows))


def test_view_of_a_ring_drops_evicted_steps(tmp_path):
    buf, m = _build(str(tmp_path / "r"), [10, 10, 10], step_data_capacity=25)
    view = buf.select_episodes([0, 2])
    assert len(view) == 5 + 10  # episode 0 lost its first 5 steps to the ring
    np.testing.assert_array_equal(view[:]["step_data"]["obs"][:, 1], list(range(5, 10)) + list(range(10)))
    buf.extend(_steps(buf.current_episode_id, 3))  # evicts 3 more steps of episode 0
    assert len(view) == 2 + 10
    np.testing.assert_array_equal(view[0]["step_data"]["obs"], [0, 8, 8])
    # Removing an episode from a ring (its first rows evicted, the ring wrapped) keeps the others whole.
    buf.remove_episodes([0])
    ids = buf.get_at_with_metadata(slice(None))[1]["episode_ids"]
    assert ids.tolist() == [1] * 10 + [2] * 10 + [3] * 3
    np.testing.assert_array_equal(buf[:]["step_data"]["obs"][:, 1], list(range(10)) * 2 + list(range(3)))
    assert len(view) == 10 and verify_store(str(tmp_path / "r")).ok
    buf.close()


def test_view_of_a_reader_follows_the_writers_commits(tmp_path):
    path = str(tmp_path / "live")
    buf, m = _build(path, [4, 6])
    buf.flush()
    live = buf.current_episode_id
    buf.extend(_steps(live, 2))
    buf.flush()
    with TrajectoryReplayBuffer.load_from(path, read_only=True) as ro:
        view = ro.select_episodes([0, live])
        assert len(view) == 4 + 2 and view.episodes()["live"].tolist() == [False, True]
        buf.extend(_steps(live, 3))  # the live episode grows; the reader sees it after the commit
        buf.flush()
        assert len(view) == 4 + 5
        np.testing.assert_array_equal(view[4:]["step_data"]["obs"][:, 1], [0, 1, 0, 1, 2])
        d, mk = view.get_sequences([3, 4], [0, 1])
        assert mk.tolist() == [[True, False], [True, True]]
    buf.close()


def test_filter_episodes_over_episode_data(tmp_path):
    buf, m = _build(str(tmp_path / "e"), LENGTHS, seed=3)
    view = buf.filter_episodes(lambda ep: (ep["return"] > 0) & (ep["length"] >= 3))
    expect = [e for e in range(len(LENGTHS)) if m.ret[e] > 0 and LENGTHS[e] >= 3]
    assert view.episode_ids.tolist() == expect and expect  # the seed gives a non-empty selection
    np.testing.assert_array_equal(view[:]["step_data"]["obs"], m.obs(np.flatnonzero(np.isin(m.ids, expect))))
    seen: dict[str, np.ndarray] = {}
    buf.filter_episodes(lambda ep: seen.update(ep) or np.ones(len(ep["episode_id"]), bool))
    assert set(seen) == {"episode_id", "start", "length", "live", "has_data", "return", "success"}
    np.testing.assert_array_equal(seen["success"], [m.success[e] for e in range(len(LENGTHS))])
    assert len(buf.filter_episodes(lambda ep: ep["return"] > 1e12)) == 0
    with pytest.raises(BadValueError, match=r"\(8,\) bool mask"):
        buf.filter_episodes(lambda ep: ep["return"])
    with pytest.raises(UnknownEpisodeError, match="99"):
        buf.select_episodes([1, 99])
    with pytest.raises(BadArgumentError):
        buf.select_episodes([1.5])
    buf.close()


# -- remove_episodes -----------------------------------------------------------------------------------
def test_remove_episodes_matches_the_model_and_survives_reopen(tmp_path):
    path = str(tmp_path / "rm")
    buf, m = _build(path, LENGTHS, chunk_rows=4)
    buf.remove_episodes([1, 4, 6])
    m.remove([1, 4, 6])
    buf.close()
    with TrajectoryReplayBuffer.load_from(path) as buf:
        data, meta = buf.get_at_with_metadata(slice(None))
        np.testing.assert_array_equal(meta["episode_ids"], m.ids)
        np.testing.assert_array_equal(data["step_data"]["obs"], m.obs(np.arange(len(m.ids))))
        np.testing.assert_array_equal(data["episode_data"]["return"], [m.ret[e] for e in m.ids])
        assert buf.episodes()["episode_id"].tolist() == [0, 2, 3, 5, 7]
        assert sorted(buf.episode_index.column().tolist()) == [0, 2, 3, 5, 7]  # their episode-data rows are gone
        before = buf[:]
        with pytest.raises(UnknownEpisodeError, match="4"):
            buf.remove_episodes([0, 4])  # 4 is gone: nothing is removed
        np.testing.assert_array_equal(buf[:]["step_data"]["obs"], before["step_data"]["obs"])
        # The episode being recorded can be removed: later steps start a fresh episode.
        live = buf.current_episode_id
        buf.extend(_steps(live, 3))
        buf.remove_episodes([live])
        assert buf.current_episode_id > live and len(buf) == len(m.ids)
    assert verify_store(path).ok
    with TrajectoryReplayBuffer.load_from(path, read_only=True) as ro:
        with pytest.raises(ReadOnlyError):
            ro.remove_episodes([0])


def test_sigkill_during_remove_episodes_leaves_whole_pairs(tmp_path):
    store = str(tmp_path / "store")
    rng = np.random.default_rng(11)
    with TrajectoryReplayBuffer.create(EW.STEP_SPACE, episode_data_instance_space=EW.EP_SPACE, cache_path=store,
                                       chunk_rows=64) as tb:
        for _ in range(12):
            EW.record_pair(tb, rng)
    kills_mid_write = 0
    for r in range(8):
        ready = str(tmp_path / f"ready{r}")
        p = W.start(EW.remove_pairs_loop, store, ready, 200 + r)
        try:
            W.wait_for_file(ready, p)
            time.sleep(rng.uniform(0.05, 0.3))
        finally:
            W.kill(p)
        staging = os.path.join(store, ".trajstore-staging")
        kills_mid_write += bool(W.read_head(store).get("pending")) or any(
            files for _d, _s, files in os.walk(staging))
        for read_only in (True, False):
            with TrajectoryReplayBuffer.load_from(store, read_only=read_only) as tb:
                data, meta = tb.get_at_with_metadata(slice(None))
                ids = np.asarray(meta["episode_ids"])
                a, b, ok = TW.decode_steps(data["step_data"])
                assert ok.all() and np.array_equal(a, ids), f"round {r}: torn steps"
                ep = np.asarray(data["episode_data"])
                assert (ep[:, 3] == 1.0).all() and np.array_equal(ep[:, 0], ids), f"round {r}: episode data lost"
                eps = tb.episodes()
                for eid, start, length in zip(eps["episode_id"], eps["start"], eps["length"]):
                    rows = slice(start, start + length)
                    assert length == ep[start, 2] and np.array_equal(b[rows], np.arange(length)), (
                        f"round {r}: episode {eid} is not whole")
                pairs, count = np.unique(ep[eps["start"], 1], return_counts=True)
                # Every pair is whole, except the one being recorded when the writer was killed.
                assert (count == 2).sum() >= len(pairs) - 1, f"round {r}: a pair lost one episode only"
                half = pairs[count == 1]
                if len(half):  # a half-recorded pair is the newest one, never a half-removed one
                    assert half[0] == pairs.max(), f"round {r}: pair {half[0]} lost one of its episodes"
                if not read_only:
                    assert W.orphans(store) == []
        assert verify_store(store).ok
    print(f"kills inside a rewrite: {kills_mid_write} of 8")


# -- combine / split / filter ----------------------------------------------------------------------------
def test_combine_keeps_episodes_with_fresh_ids_and_source(tmp_path):
    a, ma = _build(str(tmp_path / "a"), [3, 4, 2], seed=1)
    b, mb = _build(str(tmp_path / "b"), [5, 1], seed=2)
    a.close()
    out = trajstore.combine([str(tmp_path / "a"), b], str(tmp_path / "c"))  # a path and an open buffer
    assert out["episodes"] == [3, 2] and out["steps"] == [9, 6] and out["verified"]
    b.close()
    with TrajectoryReplayBuffer.load_from(str(tmp_path / "c"), read_only=True) as c:
        assert c.episode_space == Dict({**EPS.spaces, "source": Box(0, 1, (), np.int64)})
        data, meta = c.get_at_with_metadata(slice(None))
        ids = np.asarray(meta["episode_ids"])
        src_ids = np.concatenate([ma.ids, mb.ids])
        src_of = np.concatenate([np.zeros(len(ma.ids), np.int64), np.ones(len(mb.ids), np.int64)])
        np.testing.assert_array_equal(ids, src_ids + np.where(src_of == 1, 3, 0))  # fresh: 0..4 in order
        obs = np.concatenate([ma.obs(np.arange(len(ma.ids))), mb.obs(np.arange(len(mb.ids)))])
        np.testing.assert_array_equal(data["step_data"]["obs"], obs)
        np.testing.assert_array_equal(data["episode_data"]["source"], src_of)
        rets = [ma.ret[e] if s == 0 else mb.ret[e] for e, s in zip(src_ids, src_of)]
        np.testing.assert_array_equal(data["episode_data"]["return"], rets)
        assert c.current_episode_id == 5
    assert [n for n in os.listdir(tmp_path) if "partial" in n] == []


def test_combine_without_episode_space_and_refusals(tmp_path):
    for name in ("p", "q"):
        _build(str(tmp_path / name), [2, 3], data=False)[0].close()
    trajstore.combine([str(tmp_path / "p"), str(tmp_path / "q"), str(tmp_path / "p")], str(tmp_path / "pq"))
    with TrajectoryReplayBuffer.load_from(str(tmp_path / "pq"), read_only=True) as pq:
        assert pq.episode_space == Dict({"source": Box(0, 2, (), np.int64)})
        assert pq[:]["episode_data"]["source"].tolist() == [0] * 5 + [1] * 5 + [2] * 5
        assert pq.episodes()["episode_id"].tolist() == [0, 1, 2, 3, 4, 5]
    _build(str(tmp_path / "d"), [2], data=True)[0].close()
    with pytest.raises(SpaceMismatchError, match="episode space"):
        trajstore.combine([str(tmp_path / "p"), str(tmp_path / "d")], str(tmp_path / "x"))
    other = TrajectoryReplayBuffer.create(Box(-1, 1, (3,), np.float32), cache_path=str(tmp_path / "o"))
    other.close()
    with pytest.raises(SpaceMismatchError, match="step space"):
        trajstore.combine([str(tmp_path / "p"), str(tmp_path / "o")], str(tmp_path / "x"))
    with pytest.raises(StoreExistsError):
        trajstore.combine([str(tmp_path / "p")], str(tmp_path / "q"))
    with pytest.raises(BadArgumentError):
        trajstore.combine([], str(tmp_path / "x"))
    with pytest.raises(BadOptionError, match="both a source and a destination"):
        trajstore.combine([str(tmp_path / "p"), str(tmp_path / "q")], str(tmp_path / "q"), overwrite=True)
    with TrajectoryReplayBuffer.load_from(str(tmp_path / "q"), read_only=True) as q:
        assert len(q) == 5
    trajstore.combine([str(tmp_path / "p")], str(tmp_path / "pq"), overwrite=True)  # replaced once verified
    with TrajectoryReplayBuffer.load_from(str(tmp_path / "pq"), read_only=True) as pq:
        assert len(pq) == 5 and pq.episode_space == Dict({"source": Box(0, 0, (), np.int64)})
    assert not os.path.exists(tmp_path / "x") and [n for n in os.listdir(tmp_path) if "partial" in n] == []


def test_combine_failing_mid_copy_leaves_nothing_behind(tmp_path):
    _build(str(tmp_path / "good"), [4, 4])[0].close()
    _build(str(tmp_path / "bad"), [300, 300], chunk_rows=64)[0].close()
    chunks = tmp_path / "bad" / "step_data" / "obs" / "c"
    victim = sorted(p for p in chunks.rglob("*") if p.is_file())[-1]
    victim.write_bytes(b"torn")  # a damaged chunk: reading it fails after the first source was copied
    with pytest.raises(Exception) as info:
        trajstore.combine([str(tmp_path / "good"), str(tmp_path / "bad")], str(tmp_path / "out"))
    assert not isinstance(info.value, AssertionError)
    assert not os.path.exists(tmp_path / "out")
    assert [n for n in os.listdir(tmp_path) if "partial" in n] == []


def test_split_by_episodes_is_complete_and_seeded(tmp_path):
    lengths = [int(x) for x in np.random.default_rng(4).integers(1, 9, size=23)]
    src, m = _build(str(tmp_path / "src"), lengths)
    src.close()
    rep = trajstore.split(str(tmp_path / "src"), {"train": 0.7, "val": 0.2, "test": 0.1}, str(tmp_path / "out" / "s_"),
                          seed=5)
    assert split_counts(23, {"train": 0.7, "val": 0.2, "test": 0.1}) == {"train": 16, "val": 5, "test": 2}
    got: list[int] = []
    for name, n in (("train", 16), ("val", 5), ("test", 2)):
        info = rep["splits"][name]
        assert info["episodes"] == n
        with TrajectoryReplayBuffer.load_from(info["destination"], read_only=True) as s:
            ids = s.episodes()["episode_id"].tolist()
            assert ids == info["episode_ids"] == sorted(ids)
            rows = np.flatnonzero(np.isin(m.ids, ids))
            data, meta = s.get_at_with_metadata(slice(None))
            np.testing.assert_array_equal(meta["episode_ids"], m.ids[rows])  # ids kept
            np.testing.assert_array_equal(data["step_data"]["obs"], m.obs(rows))
            np.testing.assert_array_equal(data["episode_data"]["return"], [m.ret[e] for e in m.ids[rows]])
            got += ids
    assert sorted(got) == list(range(23))  # every episode in exactly one split
    again = trajstore.split(str(tmp_path / "src"), {"train": 0.7, "val": 0.2, "test": 0.1},
                            str(tmp_path / "again" / "s_"), seed=5)
    other = trajstore.split(str(tmp_path / "src"), {"train": 0.7, "val": 0.2, "test": 0.1},
                            str(tmp_path / "other" / "s_"), seed=6)
    assert all(again["splits"][k]["episode_ids"] == rep["splits"][k]["episode_ids"] for k in rep["splits"])
    assert any(other["splits"][k]["episode_ids"] != rep["splits"][k]["episode_ids"] for k in rep["splits"])
    for bad in ({"train": 0.9, "val": 0.2}, {"train": 1.1, "val": -0.1}, {"a/b": 1.0}):
        with pytest.raises(BadOptionError):
            trajstore.split(str(tmp_path / "src"), bad, str(tmp_path / "never" / "s_"))
    with pytest.raises(BadOptionError, match="sum to 1; got 1.1"):
        trajstore.split(str(tmp_path / "src"), {"train": 0.9, "val": 0.2}, str(tmp_path / "never" / "s_"))
    with pytest.raises(StoreExistsError):
        trajstore.split(str(tmp_path / "src"), {"train": 0.5, "val": 0.5}, str(tmp_path / "out" / "s_"))
    assert not os.path.exists(tmp_path / "never")
    assert [n for n in os.listdir(tmp_path / "out") if "partial" in n] == []
    # Without dst_prefix the splits go next to the source (as the split(src, ratios, seed=) call)
    beside = trajstore.split(str(tmp_path / "src"), {"train": 0.7, "val": 0.2, "test": 0.1}, seed=5)
    assert {k: v["destination"] for k, v in beside["splits"].items()} == {
        k: str(tmp_path / f"src_{k}") for k in ("train", "val", "test")}
    assert all(beside["splits"][k]["episode_ids"] == rep["splits"][k]["episode_ids"] for k in rep["splits"])
    with pytest.raises(BadArgumentError, match="pass dst_prefix"):
        trajstore.split(TrajectoryReplayBuffer.create(src.step_space, cache_path=None), {"all": 1.0})


def test_filter_store_with_where_expression(tmp_path):
    src, m = _build(str(tmp_path / "src"), LENGTHS, seed=3)
    src.close()
    rep = filter_store(str(tmp_path / "src"), str(tmp_path / "f"), "return > 0 and not (length < 3)")
    expect = [e for e in range(len(LENGTHS)) if m.ret[e] > 0 and LENGTHS[e] >= 3]
    assert rep["episodes"] == len(expect) and rep["of"] == len(LENGTHS)
    with TrajectoryReplayBuffer.load_from(str(tmp_path / "f"), read_only=True) as f:
        assert f.episodes()["episode_id"].tolist() == expect
        np.testing.assert_array_equal(f[:]["step_data"]["obs"], m.obs(np.flatnonzero(np.isin(m.ids, expect))))
    with pytest.raises(UnknownFieldError, match="'retrun'.*'return'"):
        filter_store(str(tmp_path / "src"), str(tmp_path / "g"), "retrun > 0")
    with pytest.raises(BadOptionError, match="Call"):
        filter_store(str(tmp_path / "src"), str(tmp_path / "g"), "__import__('os').getcwd() == 0")
    assert not os.path.exists(tmp_path / "g")


def test_where_language_is_a_whitelist():
    cols = {"episode_id": np.arange(4), "return": np.array([-5.0, 50, 150, 500]), "length": np.array([1, 5, 9, 2]),
            "live": np.array([False, False, False, True]), "info/success": np.array([0, 1, 1, 0])}
    cases = {"return > 100": [0, 0, 1, 1], "0 <= return < 200": [0, 1, 1, 0], "not live and length >= 5": [0, 1, 1, 0],
             "info.success == 1 or return < -1": [1, 1, 1, 0], "(return > 100) == (length > 3)": [1, 0, 1, 0],
             "return > -1e1": [1, 1, 1, 1], "True": [1, 1, 1, 1]}
    for expr, want in cases.items():
        np.testing.assert_array_equal(compile_where(expr, cols)(cols), np.array(want, bool), err_msg=expr)
    assert where_fields("return > 1 and info.success != 0") == ["return", "info/success"]
    for expr in ("open('x') == 1", "return.__class__ == 1", "return[0] > 1", "return + 1 > 2", "'a' == return",
                 "[1] == return", "lambda: 1", "x if 1 else 2", "return > 1; 2", "", "-return > 1", "(" * 3000):
        with pytest.raises(BadOptionError):
            compile_where(expr, cols)
    with pytest.raises(UnknownFieldError, match="'nope'"):
        compile_where("nope > 1", cols)
    with pytest.raises(BadOptionError, match="true/false"):
        compile_where("return", cols)(cols)
    with pytest.raises(BadOptionError, match="shape"):
        compile_where("v > 1", {"episode_id": np.arange(2), "v": np.zeros((2, 3))})


# -- CLI ---------------------------------------------------------------------------------------------------
def test_cli_combine_split_filter(tmp_path, capsys):
    import json

    from trajstore.cli import main

    _build(str(tmp_path / "a"), [3, 4], seed=1)[0].close()
    _build(str(tmp_path / "b"), [2, 2, 5], seed=2)[0].close()
    assert main(["combine", str(tmp_path / "a"), str(tmp_path / "b"), str(tmp_path / "c"), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["episodes"] == [2, 3] and out["verified"] is True
    assert main(["split", str(tmp_path / "c"), "--ratios", "train=0.6,val=0.4", str(tmp_path / "s_"), "--seed", "2",
                 "--json"]) == 0
    sp = json.loads(capsys.readouterr().out)["splits"]
    assert sp["train"]["episodes"] == 3 and sp["val"]["episodes"] == 2
    assert sorted(sp["train"]["episode_ids"] + sp["val"]["episode_ids"]) == [0, 1, 2, 3, 4]
    assert main(["filter", str(tmp_path / "c"), str(tmp_path / "f"), "--where", "source == 1 and length > 2"]) == 0
    assert "kept 1 of 5 episodes" in capsys.readouterr().out
    with TrajectoryReplayBuffer.load_from(str(tmp_path / "f"), read_only=True) as f:
        assert f.episodes()["episode_id"].tolist() == [4] and f.episodes()["length"].tolist() == [5]
    assert main(["filter", str(tmp_path / "c"), str(tmp_path / "g"), "--where", "sauce == 1"]) == 1
    assert "no episode field 'sauce'" in capsys.readouterr().err
    assert main(["split", str(tmp_path / "c"), "--ratios", "train=0.6,val=0.6", str(tmp_path / "t_")]) == 1
    assert "sum to 1" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main(["split", str(tmp_path / "c"), "--ratios", "train:0.6", str(tmp_path / "t_")])
    assert e.value.code == 2
    assert not os.path.exists(tmp_path / "g") and not os.path.exists(tmp_path / "t_train")
    shutil.rmtree(tmp_path / "f")
