"""Prioritized replay (issue 15): the sum tree, the sampler's distribution and weights, priorities
that survive close/reopen and reach a read-only reader in another process, rings that evict,
bad input, and a writer SIGKILLed while it updates priorities.  Real stores on disk throughout."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import pytest
from gymnasium.spaces import Box

HERE = str(Path(__file__).resolve().parent)
if HERE not in sys.path:
    sys.path.insert(0, HERE)

import _prio_workers as PW  # noqa: E402
import _workers as W  # noqa: E402

from trajstore import PrioritizedSampler, ReplayBuffer, TrajectoryReplayBuffer, verify_store  # noqa: E402
from trajstore.errors import (  # noqa: E402
    BadArgumentError,
    BadIndexError,
    BadOptionError,
    BadValueError,
    DamagedStoreError,
    EmptyBufferError,
    IndexOutOfRangeError,
    LockedError,
)
from trajstore.sampling.prioritized import PRIORITIES_DIR  # noqa: E402
from trajstore.sampling.sumtree import SumTree  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SPACE = Box(-np.inf, np.inf, (1,), np.float64)  # row value = its absolute row number

#: chi-square critical value at p = 0.001 for 49 degrees of freedom (tables: 85.351)
CHI2_49_999 = 85.351


def _buffer(path: Path, n: int, capacity: int | None = None) -> ReplayBuffer:
    buf = ReplayBuffer.create(SPACE, cache_path=str(path), capacity=capacity)
    if n:
        buf.extend(np.arange(n, dtype=np.float64)[:, None])
    return buf


def _values(batch: np.ndarray) -> np.ndarray:
    return np.asarray(batch).reshape(len(batch), -1)[:, 0].astype(np.int64)


# ---------------------------------------------------------------------------------------------
# the sum tree
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("n", [1, 7, 1000, 40_000])
def test_sumtree_find_matches_cumsum(n: int) -> None:
    """find(mass) is searchsorted over the cumulative sums, after builds, updates (repeated slots:
    the last wins) and growth; slots of weight 0 are never returned."""
    rng = np.random.default_rng(n)
    w = rng.random(n) * (rng.random(n) > 0.3)
    w[-1] = 0.0
    if not w.any():
        w[0] = 1.0
    t = SumTree(n)
    t.build(w)
    for _ in range(3):
        mass = np.concatenate([rng.random(500) * w.sum(), [0.0, np.nextafter(w.sum(), 0)]])
        got = t.find(mass)
        want = np.minimum(np.searchsorted(np.cumsum(w), mass, side="right"), n - 1)
        assert np.isclose(t.total, w.sum())
        assert (w[got] > 0).all()
        agree = got == want
        # Rounding may move a mass that lies within 1e-9 of a boundary to the neighbouring slot.
        cs = np.cumsum(w)
        assert agree.mean() > 0.99 and np.all(np.min(np.abs(cs[:, None] - mass[~agree]), axis=0) < 1e-9)
        slots = rng.integers(0, n, 50)
        vals = rng.random(50)
        t.update(slots, vals)
        for s_, v in zip(slots.tolist(), vals.tolist()):
            w[s_] = v  # sequential assignment: the last value of a repeated slot wins
    t.grow(2 * n + 5)
    assert t.size >= 2 * n + 5 and np.allclose(t.leaves[:n], w) and np.isclose(t.total, w.sum())


def test_sumtree_builds_ten_million_leaves() -> None:
    t = SumTree(10_000_000)
    w = np.ones(10_000_000)
    t.build(w)
    assert t.total == 10_000_000.0
    assert (t.find(np.array([0.0, 5e6, 9_999_999.5])) == [0, 5_000_000, 9_999_999]).all()


# ---------------------------------------------------------------------------------------------
# distribution and weights
# ---------------------------------------------------------------------------------------------
def _chi2(counts: np.ndarray, p: np.ndarray) -> float:
    expected = counts.sum() * p
    return float(((counts - expected) ** 2 / expected).sum())


def test_sampled_frequencies_match_priorities(tmp_path: Path) -> None:
    """200,000 draws from 50 rows of priorities 0..49 (alpha 0.6): chi-square against P(i) below
    the 0.1% critical value; the same counts against uniform far above it (the test has power)."""
    with _buffer(tmp_path / "b", 50) as buf, PrioritizedSampler(buf, alpha=0.6) as s:
        s.sample(1, rng=0)
        pri = np.arange(50, dtype=np.float64)
        s.update_priorities(np.arange(50), pri)
        p = (pri + s.eps) ** 0.6
        p /= p.sum()
        assert np.allclose(s.probabilities(np.arange(50)), p)
        counts = np.zeros(50)
        rng = np.random.default_rng(12345)
        for _ in range(200):
            batch, idx, _w = s.sample(1000, rng=rng)
            assert (_values(batch) == idx).all()  # buffer[indices] is the batch
            counts += np.bincount(idx, minlength=50)
        assert _chi2(counts, p) < CHI2_49_999, _chi2(counts, p)
        assert _chi2(counts, np.full(50, 1 / 50)) > 10 * CHI2_49_999


def test_alpha_zero_is_uniform_and_weights_follow_the_formula(tmp_path: Path) -> None:
    with _buffer(tmp_path / "b", 20) as buf, PrioritizedSampler(buf, alpha=0.7, beta=0.5) as s:
        s.sample(1, rng=0)
        s.update_priorities(np.arange(20), np.linspace(0.0, 5.0, 20))
        _b, idx, w = s.sample(64, rng=1)
        prob = s.probabilities(idx)
        want = (20 * prob) ** -0.5
        want /= want.max()
        assert w.dtype == np.float32 and np.allclose(w, want, rtol=1e-6) and w.max() == 1.0
        s.beta = 1.0  # annealed by the caller
        _b, idx, w = s.sample(64, rng=1)
        want = 1.0 / (20 * s.probabilities(idx))
        assert np.allclose(w, want / want.max(), rtol=1e-6)
    with ReplayBuffer.load_from(str(tmp_path / "b")) as buf, PrioritizedSampler(buf, alpha=0.0) as s:
        assert np.allclose(s.probabilities(np.arange(20)), 1 / 20)


def test_new_rows_enter_with_the_largest_priority_seen(tmp_path: Path) -> None:
    with _buffer(tmp_path / "b", 10) as buf, PrioritizedSampler(buf) as s:
        assert s.max_priority == 1.0 and (s.priorities(np.arange(10)) == 1.0).all()
        s.sample(4, rng=0)
        s.update_priorities([0, 1, 2], [0.5, 7.0, 3.0])
        s.update_priorities([3], [2.0])
        assert s.max_priority == 7.0
        buf.extend(np.array([[10.0], [11.0]]))
        assert s.priorities(np.arange(12)).tolist() == [0.5, 7.0, 3.0, 2.0] + [1.0] * 6 + [7.0, 7.0]


def test_ring_eviction_and_updates_after_appends(tmp_path: Path) -> None:
    """Evicted rows leave the distribution; update_priorities after appends still reaches the rows
    that sample drew (indices are read as numbered at that sample); evicted ones are skipped."""
    with _buffer(tmp_path / "b", 10, capacity=10) as buf, PrioritizedSampler(buf, alpha=1.0) as s:
        batch, idx, _ = s.sample(200, rng=0)
        assert set(idx.tolist()) == set(range(10))
        s.update_priorities(np.arange(10), np.arange(10, dtype=np.float64) + 1)  # row r: r + 1
        buf.extend(np.array([[10.0], [11.0], [12.0]]))  # rows 0, 1, 2 evicted; logical numbering shifts by 3
        assert s.last_start == 0
        s.update_priorities([0, 5, 9], [100.0, 200.0, 300.0])  # rows 0 (gone), 5, 9 as numbered at the sample
        pri = s.priorities(np.arange(10))
        rows = _values(buf[np.arange(10)])
        assert rows.tolist() == list(range(3, 13))
        want = {r: r + 1.0 for r in range(3, 10)} | {10: 10.0, 11: 10.0, 12: 10.0, 5: 200.0, 9: 300.0}
        assert pri.tolist() == [want[r] for r in rows.tolist()]
        batch, idx, _ = s.sample(2000, rng=1)
        drawn = _values(batch)
        assert drawn.min() >= 3 and (drawn == _values(buf[idx])).all()
        # A large extend that replaces the whole ring: only the new rows remain, at max priority.
        buf.extend(np.arange(100, 125, dtype=np.float64)[:, None])
        assert (s.priorities(np.arange(10)) == 300.0).all()
        assert set(_values(s.sample(500, rng=2)[0]).tolist()) <= set(range(115, 125))


def test_priorities_survive_close_and_reopen(tmp_path: Path) -> None:
    path = tmp_path / "b"
    rng = np.random.default_rng(0)
    pri = rng.random(300) * 4
    with _buffer(path, 300, capacity=256) as buf, PrioritizedSampler(buf) as s:
        s.sample(1, rng=0)
        s.update_priorities(np.arange(256), pri[:256])
        want = s.priorities(np.arange(256))
        want_p = s.probabilities(np.arange(256))
        buf.extend(np.arange(300, 310, dtype=np.float64)[:, None])  # rows entering after the last update
        want_after = s.priorities(np.arange(256))
    assert (path / PRIORITIES_DIR / "trajstore.head.json").exists()
    with ReplayBuffer.load_from(str(path)) as buf, PrioritizedSampler(buf) as s:
        assert np.array_equal(s.priorities(np.arange(256)), want_after)
        assert s.max_priority == float(pri[:256].max())
        buf.extend(np.arange(310, 330, dtype=np.float64)[:, None])
        s.flush()
    with ReplayBuffer.load_from(str(path), read_only=True) as ro:
        s = PrioritizedSampler(ro)
        got = s.priorities(np.arange(256))
        assert np.array_equal(got[:-30], want[30:])  # rows 74..299 kept their priorities
        assert (got[-30:] == np.float32(pri[:256].max())).all()
        s.close()
    assert np.isclose(want_p.sum(), 1.0)
    for where in (path, path / PRIORITIES_DIR):
        rep = verify_store(str(where))
        assert rep.ok, rep.faults
    # A second writer's sampler on the same store is refused while the first holds the priorities.
    with ReplayBuffer.load_from(str(path)) as buf, PrioritizedSampler(buf) as s:
        with pytest.raises(LockedError):
            PrioritizedSampler(buf)


def test_stored_priorities_cover_every_row_of_a_wrapping_ring(tmp_path: Path) -> None:
    """Priorities written in steps of their own (every third batch of rows) cover every row the
    ring buffer holds, lap after lap.  (A sidecar ring only as large as the buffer's lost rows
    after a kill between its eviction record and its final commit: test_sigkill_... caught it.)"""
    path = tmp_path / "b"
    rng = np.random.default_rng(0)
    with _buffer(path, 0, capacity=1000) as buf, PrioritizedSampler(buf, flush_interval=None) as s:
        row = 0
        for k in range(80):
            n = int(rng.integers(1, 120))
            buf.extend(np.arange(row, row + n, dtype=np.float64)[:, None])  # the buffer evicts in its steps
            buf.flush()
            row += n
            if k % 3:
                continue
            s.sample(1, rng=k)
            s.update_priorities(np.arange(len(buf)), (np.arange(len(buf)) + buf.row_source().start) % 7 + 0.5)
            s.flush()  # the priorities follow in steps of their own
            ro = ReplayBuffer.load_from(str(path), read_only=True)
            r = PrioritizedSampler(ro)
            rows = _values(ro[np.arange(len(ro))])
            assert np.array_equal(r.priorities(np.arange(len(ro))), rows % 7 + 0.5), k
            r.close()
            ro.close()


def test_read_only_reader_in_another_process_sees_the_same_priorities(tmp_path: Path) -> None:
    path = tmp_path / "b"
    out = str(tmp_path / "seen.npz")
    with _buffer(path, 500, capacity=400) as buf, PrioritizedSampler(buf, flush_interval=None) as s:
        s.sample(1, rng=0)
        s.update_priorities(np.arange(400), np.random.default_rng(1).random(400) * 3)
        s.flush()
        want_p, want_pr = s.priorities(np.arange(400)), s.probabilities(np.arange(400))
        # The writer keeps its store open; the reader opens it read-only in a spawned process.
        p = W.start(PW.read_priorities, str(path), out, ctx=W.context("spawn"))
        p.join(120)
        assert p.exitcode == 0
    seen = np.load(out)
    assert np.array_equal(seen["priorities"], want_p)
    assert np.allclose(seen["probabilities"], want_pr, rtol=1e-12)
    assert seen["rows"].tolist() == list(range(100, 500))
    # A reader in this process follows the writer's later flushes.
    with ReplayBuffer.load_from(str(path)) as buf, PrioritizedSampler(buf, flush_interval=None) as s:
        ro = ReplayBuffer.load_from(str(path), read_only=True)
        r = PrioritizedSampler(ro)
        assert np.array_equal(r.priorities(np.arange(400)), want_p)
        s.sample(1, rng=0)
        s.update_priorities([0, 1], [9.0, 0.0])
        buf.extend(np.array([[500.0]]))
        s.flush()
        assert r.priorities([0, 1, 399]).tolist() == [0.0, want_p[2], 9.0]  # row 100 (at 9.0) evicted, 500 added
        assert r.max_priority == 9.0
        r.close()
        ro.close()


def test_trajectory_buffer_and_unbounded_growth(tmp_path: Path) -> None:
    path = tmp_path / "t"
    with TrajectoryReplayBuffer.create(Box(-1, 1, (2,), np.float32), cache_path=str(path)) as buf:
        with PrioritizedSampler(buf) as s:
            for ep in range(40):  # unbounded: the store and the tree grow as rows arrive
                buf.extend(np.full((100, 2), ep / 100, np.float32))
                buf.mark_episode_end()
                batch, idx, w = s.sample(16, rng=ep)
                assert batch["step_data"].shape == (16, 2) and idx.max() < len(buf)
                s.update_priorities(idx, np.full(16, 0.01))
            assert len(s) == 4000
    for where in (path, path / PRIORITIES_DIR):
        rep = verify_store(str(where))
        assert rep.ok, rep.faults
    with TrajectoryReplayBuffer.load_from(str(path), read_only=True) as ro:
        s = PrioritizedSampler(ro)
        assert len(s) == 4000 and (s.priorities(np.arange(4000)) > 0).all()
        s.close()


def test_prioritized_sequences(tmp_path: Path) -> None:
    """sample_sequences draws anchors by priority and reads their windows as get_sequences does;
    within_episode keeps only windows inside one episode (per-field offsets too); the weights and
    indices are the anchors'."""
    from gymnasium.spaces import Dict

    space = Dict({"obs": Box(-np.inf, np.inf, (1,), np.float64), "act": Box(-np.inf, np.inf, (1,), np.float64)})
    lengths = [5, 9, 3, 12, 7, 2, 10]
    with TrajectoryReplayBuffer.create(space, cache_path=str(tmp_path / "t")) as buf:
        row = 0
        for n in lengths:
            v = np.arange(row, row + n, dtype=np.float64)[:, None]
            buf.extend({"obs": v, "act": -v})
            buf.mark_episode_end()
            row += n
        ids = buf.get_at_with_metadata(slice(None))[1]["episode_ids"]
        with PrioritizedSampler(buf, alpha=1.0, beta=0.5, eps=0.0) as s:
            s.sample(1, rng=0)
            hot = np.array([3, 20, 40])  # anchors near episode ends, at the start of one, in the last episode
            p = np.full(len(buf), 0.01)
            p[hot] = 10.0
            s.update_priorities(np.arange(len(buf)), p)
            data, mask, idx, w = s.sample_sequences(4000, 3, rng=1)
            want, want_mask = buf.get_sequences(idx, np.arange(3))
            np.testing.assert_array_equal(data["step_data"]["obs"], want["step_data"]["obs"])
            np.testing.assert_array_equal(mask, want_mask)
            freq = np.isin(idx, hot).mean()
            assert 0.95 < freq < 0.99, f"{freq:.3f} of the anchors are the high-priority rows; P says 0.985"
            np.testing.assert_allclose(w, np.power(p[idx].min() / p[idx], 0.5), rtol=1e-6)
            # within_episode: every window lies in its anchor's episode; anchor 3 (episode 0 has rows
            # 0..4) cannot start a 3-row window, so the hot anchors drawn are 20 and 40 only
            data, mask, idx, w = s.sample_sequences(2000, 3, rng=2, within_episode=True)
            assert mask.all() and not np.isin(idx, [3]).any()
            win = idx[:, None] + np.arange(3)
            assert (ids[win] == ids[idx][:, None]).all()
            assert np.isin(idx, [20, 40]).mean() > 0.9
            # per-field offsets: one frame of history, three actions ahead
            offs = {"obs": [-1, 0], "act": [0, 1, 2]}
            data, masks, idx, w = s.sample_sequences(500, offsets=offs, rng=3, within_episode=True)
            assert set(masks) == {"obs", "act"} and all(m.all() for m in masks.values())
            np.testing.assert_array_equal(data["step_data"]["obs"][:, :, 0], idx[:, None] + np.array([-1, 0]))
            np.testing.assert_array_equal(data["step_data"]["act"][:, :, 0], -(idx[:, None] + np.arange(3)))
            assert (ids[idx - 1] == ids[idx]).all() and (ids[idx + 2] == ids[idx]).all()
            with pytest.raises(BadOptionError, match="inside one episode"):
                s.sample_sequences(8, 13, rng=4, within_episode=True)  # longer than every episode
            with pytest.raises(BadArgumentError, match="either seq_len"):
                s.sample_sequences(8, 3, offsets=offs)
    with _buffer(tmp_path / "r", 10) as rb, PrioritizedSampler(rb) as s:
        with pytest.raises(BadOptionError, match="needs a TrajectoryReplayBuffer"):
            s.sample_sequences(4, 2)


def test_rewrites_reset_priorities(tmp_path: Path) -> None:
    """remove_at renumbers rows: every priority returns to max_priority (and the sidecar with it)."""
    path = tmp_path / "b"
    with _buffer(path, 20) as buf, PrioritizedSampler(buf) as s:
        s.sample(1, rng=0)
        s.update_priorities(np.arange(20), np.arange(20, dtype=np.float64) / 4)
        s.flush()
        buf.remove_at([3])
        assert (s.priorities(np.arange(19)) == 19 / 4).all()
        s.update_priorities([0], [1.0])  # numbered before remove_at: ignored
        assert s.priorities([0]).tolist() == [19 / 4]
    with ReplayBuffer.load_from(str(path), read_only=True) as ro:
        s = PrioritizedSampler(ro)
        assert (s.priorities(np.arange(19)) == 19 / 4).all()
        s.close()


def test_in_memory_buffer(tmp_path: Path) -> None:
    buf = ReplayBuffer.create(SPACE, cache_path=None, capacity=5)
    buf.extend(np.arange(8, dtype=np.float64)[:, None])
    s = PrioritizedSampler(buf, alpha=1.0)
    s.sample(1, rng=0)
    s.update_priorities(np.arange(5), [0, 0, 0, 0, 1])
    assert set(_values(s.sample(50, rng=0)[0]).tolist()) == {7}
    s.close()
    buf.close()


# ---------------------------------------------------------------------------------------------
# bad input
# ---------------------------------------------------------------------------------------------
def test_bad_input_raises_specific_errors(tmp_path: Path) -> None:
    with _buffer(tmp_path / "e", 0) as empty, PrioritizedSampler(empty) as s:
        with pytest.raises(EmptyBufferError, match="empty buffer"):
            s.sample(4)
    with _buffer(tmp_path / "b", 10) as buf:
        for kw, what in ((dict(alpha=-1.0), "alpha"), (dict(beta=float("nan")), "beta"), (dict(eps="x"), "eps")):
            with pytest.raises(BadOptionError, match=f"{what} must be a .*got"):
                PrioritizedSampler(buf, **kw)
        with pytest.raises(BadOptionError, match="ReplayBuffer or TrajectoryReplayBuffer; got list"):
            PrioritizedSampler([1, 2])
        with PrioritizedSampler(buf) as s:
            for bad in (0, -3, 2.5, True):
                with pytest.raises(BadOptionError, match=rf"batch_size must be an int > 0; got {bad!r}"):
                    s.sample(bad)
            s.sample(4, rng=0)
            with pytest.raises(BadValueError, match=r"finite, >= 0 and at most .*; got -1\.0 at position 1"):
                s.update_priorities([0, 1], [2.0, -1.0])
            with pytest.raises(BadValueError, match=r"finite, >= 0 and .*; got nan at position 0"):
                s.update_priorities([0], [float("nan")])
            with pytest.raises(BadValueError, match=r"finite, >= 0 and .*; got inf"):
                s.update_priorities([0], [float("inf")])
            with pytest.raises(BadValueError, match=r"stored as float32\); got 1e\+300"):
                s.update_priorities([0], [1e300])  # would overflow the stored float32 to inf
            with pytest.raises(BadValueError, match=r"expected 2 priorities .* got shape \(3,\)"):
                s.update_priorities([0, 1], [1.0, 2.0, 3.0])
            with pytest.raises(IndexOutOfRangeError, match=r"index 10 \(position 1\) is out of range: expected "
                                                             r"logical rows 0\.\.9 \(10 rows\)"):
                s.update_priorities([0, 10], [1.0, 1.0])
            with pytest.raises(IndexOutOfRangeError, match="index -1"):
                s.update_priorities([-1], [1.0])
            with pytest.raises(BadIndexError, match="must be integers .* got dtype float64"):
                s.update_priorities([0.5], [1.0])
            with pytest.raises(BadIndexError, match="1-D array; got shape"):
                s.update_priorities(np.zeros((2, 2), np.int64), [1.0])
            # Nothing was changed by the refused calls.
            assert (s.priorities(np.arange(10)) == 1.0).all()
        with PrioritizedSampler(buf, eps=0.0) as s:
            s.sample(1, rng=0)
            s.update_priorities(np.arange(10), 0.0)
            with pytest.raises(BadValueError, match="every one of the 10 rows has priority 0 and eps is 0"):
                s.sample(4)


@pytest.mark.parametrize("what", ["link-to-a-folder-outside", "file"])
def test_a_tampered_sidecar_is_never_followed_or_erased(tmp_path: Path, what: str) -> None:
    """A store is input: its ``trajstore.priorities`` entry may be a link to a folder elsewhere
    (holding a damaged "store", which a writer would otherwise erase and recreate) or a file.  The
    writer's sampler refuses with DamagedStoreError, a reader samples without priorities (a
    warning), and nothing outside the buffer changes."""
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "precious.txt").write_text("keep me")
    (outside / "zarr.json").write_text("{not json")
    _buffer(tmp_path / "buf", 20).close()
    side = tmp_path / "buf" / PRIORITIES_DIR
    if what == "file":
        side.write_text("not a folder")
    else:
        side.symlink_to(outside, target_is_directory=True)
    buf = ReplayBuffer.load_from(str(tmp_path / "buf"))
    with pytest.raises(DamagedStoreError, match="is a link|is not a folder"):
        PrioritizedSampler(buf).update_priorities(np.arange(4), np.ones(4))
    buf.close()
    with ReplayBuffer.load_from(str(tmp_path / "buf"), read_only=True) as ro:
        with pytest.warns(UserWarning, match="max_priority"):
            s = PrioritizedSampler(ro)
            _batch, idx, w = s.sample(8, rng=0)
        assert len(idx) == 8 and np.allclose(w, 1.0)
    assert sorted(p.name for p in outside.iterdir()) == ["precious.txt", "zarr.json"]
    assert (outside / "precious.txt").read_text() == "keep me"


def test_a_zip_of_the_buffer_leaves_the_priorities_out(tmp_path: Path) -> None:
    """``dumps`` to a ``.zip`` writes the buffer's rows; the sidecar (a store of its own, which
    readers of a zip never look for) is not copied in part."""
    import zipfile

    buf = _buffer(tmp_path / "buf", 50)
    s = PrioritizedSampler(buf)
    s.update_priorities(np.arange(10), np.arange(1, 11, dtype=np.float64))
    s.flush()
    assert (tmp_path / "buf" / PRIORITIES_DIR).is_dir()
    buf.dumps(str(tmp_path / "b.zip"))
    s.close()
    buf.close()
    names = zipfile.ZipFile(tmp_path / "b.zip").namelist()
    assert names and not [n for n in names if n.startswith(PRIORITIES_DIR)]
    with ReplayBuffer.load_from(str(tmp_path / "b.zip"), read_only=True) as z:
        assert _values(z[:]).tolist() == list(range(50))


# ---------------------------------------------------------------------------------------------
# priorities committed with the buffer: its close, its flush, the process's exit
# ---------------------------------------------------------------------------------------------
def test_closing_the_buffer_alone_keeps_the_priorities(tmp_path: Path) -> None:
    """``buf.close()`` without ``sampler.close()``, inside the flush interval: the priorities are
    written and the sidecar released, so the same process reopens both at once."""
    path = tmp_path / "b"
    pri = np.linspace(0.5, 8.0, 40)
    buf = _buffer(path, 40)
    s = PrioritizedSampler(buf, alpha=1.0, flush_interval=3600)
    s.sample(4, rng=0)
    s.update_priorities(np.arange(40), pri)
    buf.close()
    with ReplayBuffer.load_from(str(path)) as again, PrioritizedSampler(again, alpha=1.0) as s2:
        assert np.allclose(s2.priorities(np.arange(40)), pri)
        s2.update_priorities(np.arange(40), pri[::-1])  # last sample: none, so all rows
        again.flush()  # a flush of the buffer writes them too, sampler left open
        with ReplayBuffer.load_from(str(path), read_only=True) as ro:
            reader = PrioritizedSampler(ro, alpha=1.0)
            assert np.allclose(reader.priorities(np.arange(40)), pri[::-1])
            reader.close()


EXIT_WITHOUT_CLOSING = """
import sys, numpy as np
from gymnasium.spaces import Box
from trajstore import PrioritizedSampler, ReplayBuffer
buf = ReplayBuffer.create(Box(-np.inf, np.inf, (1,), np.float64), cache_path=sys.argv[1])
buf.extend(np.arange(30, dtype=np.float64)[:, None])
s = PrioritizedSampler(buf, alpha=1.0, flush_interval=3600)
s.sample(4, rng=0)
s.update_priorities(np.arange(30), np.arange(30) + 0.5)
"""


def test_a_process_exiting_without_closing_keeps_its_priorities(tmp_path: Path) -> None:
    """Exit hooks: the sampler writes its priorities before Python's thread pools stop, so the
    write neither fails ("cannot schedule new futures after shutdown") nor leaves a sidecar that
    the next open must write anew."""
    path = tmp_path / "b"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-W", "always", "-c", EXIT_WITHOUT_CLOSING, str(path)], capture_output=True,
                         text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr
    assert "cannot schedule" not in out.stderr and "Warning" not in out.stderr, out.stderr
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # "the stored priorities cannot be read ... written anew" would fail here
        with ReplayBuffer.load_from(str(path)) as buf, PrioritizedSampler(buf, alpha=1.0) as s:
            assert np.allclose(s.priorities(np.arange(30)), np.arange(30) + 0.5)


# ---------------------------------------------------------------------------------------------
# SIGKILL while priorities are written
# ---------------------------------------------------------------------------------------------
def test_sigkill_during_update_priorities(tmp_path: Path, procs: list) -> None:
    """A writer that updates (and flushes) priorities in a loop is killed at random moments; each
    time the buffer and its priorities reopen (writer and reader), verify clean, and every row
    whose priority a finished flush committed still has it."""
    path = tmp_path / "b"
    _buffer(path, 0, capacity=3000).close()
    progress = str(tmp_path / "progress.npz")
    rng = np.random.default_rng(7)
    for round_ in range(12):
        if os.path.exists(progress):
            os.unlink(progress)
        p = W.start(PW.update_loop, str(path), progress)
        procs.append(p)
        W.wait_for_file(progress, p)
        time.sleep(float(rng.uniform(0.0, 0.25)))
        W.kill(p)
        done = np.load(progress)
        lo, hi = int(done["lo"]), int(done["hi"])
        for where in (path, path / PRIORITIES_DIR):
            rep = verify_store(str(where))
            assert rep.ok, (round_, where, rep.faults)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # a kill while the sidecar was first created: it is written anew
            for read_only in (True, False):
                with ReplayBuffer.load_from(str(path), read_only=read_only) as buf:
                    s = PrioritizedSampler(buf)
                    start = buf.row_source().start
                    rows = np.arange(len(buf)) + start
                    assert (_values(buf[np.arange(len(buf))]) == rows).all()
                    pri = s.priorities(np.arange(len(buf)))
                    want = PW.row_priority(rows)
                    flushed = (rows >= lo) & (rows < hi)
                    assert (pri[flushed] == want[flushed]).all(), (round_, read_only)
                    # Rows no finished flush covered: their own priority, or the max at their entry.
                    other = pri[~flushed][pri[~flushed] != want[~flushed]]
                    assert set(other.tolist()) <= {1.0, 12.25}, (round_, read_only, set(other.tolist()))
                    s.close()


# ---------------------------------------------------------------------------------------------
# the benchmark script
# ---------------------------------------------------------------------------------------------
def test_bench_prioritized_quick(tmp_path: Path) -> None:
    from _bench import quick_section

    text = quick_section("prioritized", tmp_path)
    assert text.startswith("## Prioritized replay (scripts/bench_prioritized.py)")
    for what in ("sample(256), cold", "sample(256), steady", "sample(256) + update_priorities(256)",
                 "tree build"):
        assert what in text, what
