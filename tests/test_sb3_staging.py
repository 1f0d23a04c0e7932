"""How ``ZarrReplayBuffer.add`` stages rows (trajstore/sb3/replay.py, trajstore/core/stager.py).

``add`` stages only the observations; action, reward, done, timeout and step are gathered from
the SB3 RAM arrays when a block is handed over (``RowStager.fill``), and a block ends where a
chunk ends.  These tests check what reaches the store: after reads that hand over part-filled
blocks, after SB3's ``_setup_learn`` edit, after a hand-over that failed (full disk), and after a
SIGKILL of the writer, every stored row equals what stable-baselines3's own buffer holds.
"""

from __future__ import annotations

import errno
import multiprocessing
import os
import shutil
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("stable_baselines3")

from gymnasium import spaces  # noqa: E402
from stable_baselines3.common.buffers import ReplayBuffer  # noqa: E402

import _workers as W  # noqa: E402
from trajstore import ReplayBuffer as StoreBuffer  # noqa: E402
from trajstore.errors import ClosedError, StoreFullError  # noqa: E402
from trajstore.sb3 import ZarrReplayBuffer  # noqa: E402

IMAGE = spaces.Box(0, 255, (84, 84, 4), np.uint8)
VECTOR = spaces.Box(-np.inf, np.inf, (5,), np.float32)


def _transition(space: spaces.Box, n_envs: int, t: int, rng: np.random.Generator) -> tuple[Any, ...]:
    """Transition ``t``: observations encode ``t`` (obs ``t``, next obs ``t + 1``), the rest is random."""
    shape = (n_envs, *space.shape)
    obs = np.full(shape, t % 251, space.dtype)
    nxt = np.full(shape, (t + 1) % 251, space.dtype)
    return (obs, nxt, rng.integers(0, 4, (n_envs, 1)), rng.standard_normal(n_envs).astype(np.float32),
            rng.random(n_envs) < 0.1, [{"TimeLimit.truncated": bool(rng.random() < 0.5)} for _ in range(n_envs)])


def _stored_equals_sb3(path: Path, ref: ReplayBuffer, n_envs: int, added: int, closed: bool = True) -> None:
    """Every stored row of the buffer at ``path`` holds what SB3's buffer holds at its position.

    ``closed``: the buffer was closed, so it holds exactly SB3's rows; else ``path`` is a folder
    as a SIGKILL left it, whose committed rows are checked (those SB3 still holds)."""
    with StoreBuffer.load_from(path / "transitions", read_only=True) as stored:
        n = len(stored)
        rows = stored[np.arange(n)]
        steps = rows["step"]
        assert (np.diff(steps) == 1).all()
        if closed:
            assert n == (ref.buffer_size if ref.full else ref.pos) and int(steps[-1]) == added - 1
        keep = steps >= added - ref.buffer_size  # (a folder left by a kill: rows SB3 has not overwritten since)
        assert keep.sum() >= n - ref.buffer_size // 4
        pos = steps[keep] % ref.buffer_size
        for e in range(n_envs):
            np.testing.assert_array_equal(rows[f"obs.{e}"][keep], ref.observations[pos, e])
            np.testing.assert_array_equal(rows[f"next_obs.{e}"][keep], ref.next_observations[pos, e])
        for name, arr in (("action", ref.actions), ("reward", ref.rewards), ("done", ref.dones),
                          ("timeout", ref.timeouts)):
            np.testing.assert_array_equal(rows[name][keep], arr[pos], err_msg=name)


@pytest.mark.parametrize("space, n_envs", [(IMAGE, 1), (VECTOR, 2)], ids=["image-1env", "vector-2envs"])
def test_rows_equal_sb3_across_partial_blocks_and_edits(tmp_path: Path, space: spaces.Box, n_envs: int) -> None:
    """Reads between adds hand over part-filled blocks; SB3's ``dones[pos - 1] = True`` edits a
    staged or an already stored row; the ring wraps: the store still equals SB3's buffer."""
    act = spaces.Discrete(4)
    size = 600
    ref = ReplayBuffer(size * n_envs, space, act, "cpu", n_envs=n_envs)
    ours = ZarrReplayBuffer(size * n_envs, space, act, "cpu", n_envs=n_envs, cache_path=tmp_path / "rb")
    rng, draws = np.random.default_rng(0), np.random.default_rng(1)
    for t in range(int(size * 2.3)):
        tr = _transition(space, n_envs, t, rng)
        ref.add(*tr)
        ours.add(*tr)
        if draws.random() < 0.02:
            ours.sample(4)  # hands the staged rows over, mid-block
        if draws.random() < 0.01:
            for buf in (ref, ours):
                buf.dones[(buf.pos - 1) % buf.buffer_size] = True  # what SB3's _setup_learn does
    ours.sample(4)  # hand over and commit what is staged, without the RAM edits' rewrite of close
    shutil.copytree(tmp_path / "rb", tmp_path / "killed")  # the folder as a SIGKILL now leaves it
    ours.close()
    _stored_equals_sb3(tmp_path / "killed", ref, n_envs, t + 1, closed=False)
    _stored_equals_sb3(tmp_path / "rb", ref, n_envs, t + 1)


def test_blocks_end_at_chunk_ends(tmp_path: Path) -> None:
    """Rows appended one at a time reach the table in blocks that never straddle a chunk (or the
    ring's end) of the widest field, also after a read handed over a part-filled block."""
    space = spaces.Dict({"frame": IMAGE, "x": spaces.Box(-1, 1, (2,), np.float32)})
    rb = StoreBuffer.create(space, cache_path=tmp_path / "rb", capacity=1000)
    table = rb._table
    chunk = max(f.C for f in table.fields if f.spec.row_shape == IMAGE.shape)
    blocks: list[tuple[int, int]] = []
    table.listeners.append(lambda lo, arrays: blocks.append((lo, len(arrays[0]))))
    for i in range(2500):
        rb.append({"frame": np.full(IMAGE.shape, i % 256, np.uint8), "x": np.full(2, i, np.float32)})
        if i in (100, 1203):
            len(rb)  # a read: the staged rows are handed over
    rb.flush()
    assert sum(n for _lo, n in blocks) == 2500 and len(blocks) > 2500 // chunk
    for lo, n in blocks:
        p = lo % 1000
        assert p // chunk == (p + n - 1) // chunk and p + n <= 1000, f"block [{lo}, {lo + n}) straddles a chunk"
    got = rb[np.arange(len(rb))]
    ids = np.arange(2500 - len(rb), 2500)
    np.testing.assert_array_equal(got["x"][:, 0], ids.astype(np.float32))
    np.testing.assert_array_equal(got["frame"][:, 0, 0, 0], (ids % 256).astype(np.uint8))
    rb.close()


def test_failed_hand_over_keeps_the_row(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A full disk while a block is handed over raises StoreFullError from ``add``; the transition
    stays added (SB3's position moved on) and staged, and is written once the disk has room."""
    act = spaces.Discrete(4)
    ref = ReplayBuffer(400, IMAGE, act, "cpu")
    ours = ZarrReplayBuffer(400, IMAGE, act, "cpu", cache_path=tmp_path / "rb")
    rng = np.random.default_rng(3)
    real_pwrite = os.pwrite
    failed = []

    def full_once(fd: int, data: Any, offset: int) -> int:
        if not failed:
            failed.append(offset)
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_pwrite(fd, data, offset)

    for t in range(300):
        tr = _transition(IMAGE, 1, t, rng)
        ref.add(*tr)
        if t == 150:
            monkeypatch.setattr(os, "pwrite", full_once)  # the next block's hand-over meets a full disk
        try:
            ours.add(*tr)
        except StoreFullError:
            assert failed and t >= 150
            monkeypatch.setattr(os, "pwrite", real_pwrite)  # room again: the next add writes the block first
        assert ours.pos == ref.pos and ours.size() == ref.size()
    ours.sample(4)
    shutil.copytree(tmp_path / "rb", tmp_path / "killed")  # the folder as a SIGKILL now leaves it
    ours.close()
    assert failed
    _stored_equals_sb3(tmp_path / "killed", ref, 1, 300, closed=False)
    _stored_equals_sb3(tmp_path / "rb", ref, 1, 300)


def test_row_stager_is_handed_out_to_single_writers_only(tmp_path: Path) -> None:
    """``ReplayBuffer.row_stager`` gives a writer the stager it stages appends in; rows written
    through it with ``added(commit_timer=False)`` are handed over only when the block is full
    (the store's timer, due at every row with ``commit_interval=0``, is the owner's to apply),
    with ``added()`` at the next row.  Read-only, multiprocessing and closed handles get None."""
    space = spaces.Box(-1, 1, (3,), np.float32)
    rb = StoreBuffer.create(space, cache_path=tmp_path / "rb", capacity=1000, commit_interval=0)
    st = rb.row_stager()
    assert st is not None and len(st.bufs) == 1
    with StoreBuffer.load_from(tmp_path / "rb", read_only=True) as reader:
        assert reader.row_stager() is None
        for i in range(3):
            st.room()
            st.bufs[0][st.n] = i
            st.added(commit_timer=False)
        assert st.n == 3 and len(reader) == 0  # staged, not handed over
        st.room()
        st.bufs[0][st.n] = 3
        st.added()  # the store's timer is due: the block is handed over and committed
        assert st.n == 0 and len(reader) == 4
    np.testing.assert_array_equal(rb[np.arange(4)][:, 0], np.arange(4, dtype=np.float32))
    rb.close()
    assert rb.row_stager() is None
    with pytest.raises(ClosedError):  # (it staged the row, never to be written, before row_stager)
        rb._append_leaves([np.zeros(3, np.float32)])
    with StoreBuffer.load_from(tmp_path / "rb", multiprocessing=True) as shared:
        assert shared.row_stager() is None


def test_add_after_a_pause_is_not_committed_alone(tmp_path: Path) -> None:
    """``ZarrReplayBuffer.add`` commits once ``commit_interval`` has passed since its oldest
    uncommitted add: the first add after a pause starts that interval and is not handed over
    and committed by itself (the store's own timer, from the last commit, would do that)."""
    ours = ZarrReplayBuffer(400, IMAGE, spaces.Discrete(4), "cpu", cache_path=tmp_path / "rb", commit_interval=0.05)
    rng = np.random.default_rng(4)
    with StoreBuffer.load_from(tmp_path / "rb" / "transitions", read_only=True) as reader:
        for t in range(3):
            ours.add(*_transition(IMAGE, 1, t, rng))
        time.sleep(0.1)
        ours.add(*_transition(IMAGE, 1, 3, rng))  # the oldest add is older than commit_interval: commit
        assert len(reader) == 4
        time.sleep(0.1)
        ours.add(*_transition(IMAGE, 1, 4, rng))  # the first add after a pause: staged, not committed
        assert len(reader) == 4
    ours.close()


# ------------------------------------------------------------------------------------------ SIGKILL
CAPACITY = 700  # about three 256-row chunks: the ring wraps within a round


def _writer(store: str, ready: str, seed: int) -> None:
    """Adds image transitions to the buffer at ``store`` (reopened) until killed; transition ``t``
    has obs ``t % 251``, next obs ``(t + 1) % 251`` and reward ``t``."""
    rng = np.random.default_rng(seed)
    rb = ZarrReplayBuffer(CAPACITY, IMAGE, spaces.Discrete(4), "cpu", cache_path=store, resume=True,
                          commit_interval=0.02)
    t = int(rb.rewards[(rb.pos - 1) % rb.buffer_size, 0]) + 1 if rb.size() else 0
    W.touch(ready)
    while True:
        obs, nxt, action, _reward, done, infos = _transition(IMAGE, 1, t, rng)
        rb.add(obs, nxt, action, np.array([t], np.float32), done, infos)
        t += 1
        if rng.random() < 0.01:
            rb.sample(8)  # a part-filled block handed over


def test_sigkill_while_adding_images(tmp_path: Path, procs: list) -> None:
    """SIGKILL at random instants while ``add`` stages image rows: the reopened buffer holds
    consecutive transitions whose observations, next observations and rewards agree."""
    store = str(tmp_path / "rb")
    ZarrReplayBuffer(CAPACITY, IMAGE, spaces.Discrete(4), "cpu", cache_path=store).close()
    ctx = multiprocessing.get_context("fork")  # this process has imported torch and SB3 already
    rng = np.random.default_rng(5)
    end = 0
    for r in range(8):
        ready = str(tmp_path / f"ready{r}")
        p = W.start(_writer, store, ready, r, ctx=ctx)
        procs.append(p)
        W.wait_for_file(ready, p)
        time.sleep(rng.uniform(0.05, 0.4))
        W.kill(p)
        procs.remove(p)
        rb = ZarrReplayBuffer(CAPACITY, IMAGE, spaces.Discrete(4), "cpu", cache_path=store, resume=True)
        try:
            n = rb.size()
            pos = (rb.pos - n + np.arange(n)) % rb.buffer_size  # oldest first
            t = rb.rewards[pos, 0].astype(np.int64)
            assert n == 0 or (np.diff(t) == 1).all(), f"round {r}: transitions are not consecutive"
            obs, nxt = np.asarray(rb.observations)[pos, 0], np.asarray(rb.next_observations)[pos, 0]
            assert (obs == (t % 251).astype(np.uint8)[:, None, None, None]).all(), f"round {r}: damaged obs"
            assert (nxt == ((t + 1) % 251).astype(np.uint8)[:, None, None, None]).all(), f"round {r}: damaged next obs"
            new_end = int(t[-1]) + 1 if n else 0
            assert new_end >= end, f"round {r}: committed transitions lost ({new_end} < {end})"
            end = new_end
        finally:
            rb.close()
    assert end > CAPACITY, f"only {end} transitions were added: the ring did not wrap"
