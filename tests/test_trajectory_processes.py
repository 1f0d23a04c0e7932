"""TrajectoryReplayBuffer with real processes (docs/design.md 1 "Writers, readers and processes", 3.3-3.4;
issue 3 items 2 and 9): a writer recording episodes SIGKILLed at random moments, writers
in several processes (fork and spawn), pickling as a handle, and the single-writer lock.

Child code lives in ``_traj_workers.py``; children start like those of ``test_crash.py``
(``_workers.start``: forkserver by default, ``TRAJSTORE_TEST_START=spawn`` to use spawn).
"""

from __future__ import annotations

import json
import multiprocessing
import os
import pickle
import re
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import zarr

HERE = str(Path(__file__).resolve().parent)
if HERE not in sys.path:
    sys.path.insert(0, HERE)

import _traj_workers as TW  # noqa: E402
import _workers as W  # noqa: E402

from trajstore import TrajectoryReplayBuffer  # noqa: E402
from trajstore.core import episodes  # noqa: E402
from trajstore.errors import EmptyBufferError, LockedError, UnknownEpisodeError  # noqa: E402


def _load(path) -> dict:
    with open(path) as f:
        return json.load(f)


def _all_rows(buf):
    """(step data, ids, episode data) of every row, as numpy."""
    n = len(buf)
    data, meta = buf.get_at_with_metadata(np.arange(n))
    return data["step_data"], np.asarray(meta["episode_ids"]), data["episode_data"]


def _episode_table_rows(store: str) -> np.ndarray:
    """Episode ids of the committed episode-data rows, read with plain zarr and the head record
    (documented format: unbounded tables keep absolute row = physical row; a recorded shape may lag
    the record after a kill, docs/format.md, so the array is read up to the record's end)."""
    from trajstore.storage.fields.spec import sized_array

    t = W.read_head(store)["tables"]["episode_data"]
    z = zarr.open_group(store, mode="r")["episode_data/_episode_id"]
    return np.asarray(sized_array(z, max(z.shape[0], t["end"]))[t["start"]:t["end"]])


# ----------------------------------------------------------------------------------------
# SIGKILL in the middle of episodes
# ----------------------------------------------------------------------------------------
def _check_episode_store(buf, store: str, side: dict, prev: tuple[np.ndarray, np.ndarray] | None,
                         who: str) -> tuple[np.ndarray, np.ndarray]:
    steps, ids, ep_data = _all_rows(buf)
    n = len(ids)
    eid, k, ok = TW.decode_steps(steps)
    # Every committed row is whole and carries the episode id its obs encodes.
    if not ok.all():
        bad = int(np.flatnonzero(~ok)[0])
        raise AssertionError(f"{who}: row {bad} of {n} is damaged (obs {steps['obs'][bad]}, tag {steps['tag'][bad]})")
    assert np.array_equal(eid, ids), (
        f"{who}: stored episode ids differ from the episodes the rows were written in, first at row "
        f"{int(np.flatnonzero(eid != ids)[0])}")
    # Nothing committed before was lost or changed.
    if prev is not None:
        m = len(prev[0])
        assert n >= m, f"{who}: the store shrank from {m} to {n} rows"
        assert np.array_equal(eid[:m], prev[0]) and np.array_equal(k[:m], prev[1]), (
            f"{who}: rows committed before this kill changed")
    # The rows the side file says were flushed are present.
    assert n >= side["rows"], f"{who}: {side['rows']} rows were flushed but only {n} are present"
    if side["rows"]:
        r = side["rows"] - 1
        assert [int(eid[r]), int(k[r])] == side["last"], (
            f"{who}: flushed row {r} is episode {eid[r]} step {k[r]}, expected {side['last']}")
    # Each episode: one run of rows, steps 0, 1, 2, ... (ids grow: never reused).
    if n:
        assert (np.diff(ids) >= 0).all(), f"{who}: episode ids go back: an id was reused"
        starts = np.flatnonzero(np.r_[True, ids[1:] != ids[:-1]])
        lengths = np.diff(np.r_[starts, n])
        run_ids = ids[starts]
        assert len(np.unique(run_ids)) == len(run_ids), f"{who}: an episode's steps are not contiguous"
        expect_k = np.arange(n) - np.repeat(starts, lengths)
        assert np.array_equal(k, expect_k), f"{who}: an episode's steps are not 0, 1, 2, ... in order"
        # episodes() agrees with the steps.
        ep = {key: np.asarray(v) for key, v in buf.episodes().items()}
        assert ep["episode_id"].tolist() == run_ids.tolist(), f"{who}: episodes() ids differ from the steps"
        assert ep["start"].tolist() == starts.tolist() and ep["length"].tolist() == lengths.tolist(), (
            f"{who}: episodes() start/length differ from the steps")
    else:
        run_ids = np.zeros(0, np.int64)
    # Episode data: only episodes with steps, and each step shows its own episode's data.
    table_ids = _episode_table_rows(store)
    assert len(np.unique(table_ids)) == len(table_ids), f"{who}: an episode has two episode-data rows"
    assert set(table_ids.tolist()) <= set(run_ids.tolist()), (
        f"{who}: episode data for episodes without steps: {sorted(set(table_ids.tolist()) - set(run_ids.tolist()))}")
    if len(table_ids):
        got = np.asarray(buf.episode_id_to_episode_data_index(table_ids))
        assert sorted(got.tolist()) == list(range(len(table_ids))), f"{who}: episode index is not a bijection"
    has = ep_data[:, 2] == 1.0
    assert (ep_data[has, 0] == ids[has]).all(), f"{who}: a step shows another episode's data"
    assert (ep_data[~has] == 0).all(), f"{who}: a step without episode data shows something"
    assert set(ids[has].tolist()) == set(table_ids.tolist())
    assert set(ep_data[has, 1].tolist()) <= {1.0, 2.0}
    for e in set(run_ids.tolist()) - set(table_ids.tolist()):
        with pytest.raises(KeyError):
            buf.episode_id_to_episode_data_index(e)
    d_eid, d_ver = side["data"]
    if d_eid >= 0 and side["rows"]:
        row = buf.episode_id_to_episode_data_index(d_eid)  # flushed data is present
        assert row >= 0 and (ep_data[ids == d_eid, 1] >= d_ver).all(), f"{who}: flushed episode data {side['data']} lost"
    # No id reuse: the writer's next episode is newer than every id in the store.
    if not buf.read_only:
        newest = max([int(ids.max()) if n else -1] + [int(table_ids.max()) if len(table_ids) else -1])
        assert buf.current_episode_id > newest, (
            f"{who}: current_episode_id {buf.current_episode_id} would reuse episode id {newest}")
    return eid, k


@pytest.mark.slow
def test_sigkill_while_recording_episodes(tmp_path, procs):
    store = str(tmp_path / "store")
    TrajectoryReplayBuffer.create(TW.STEP_SPACE, episode_data_instance_space=TW.EP_SPACE, cache_path=store,
                                  chunk_rows=64).close()
    side_path = str(tmp_path / "flushed")
    rng = np.random.default_rng(31)
    side = {"rows": 0, "last": [-1, -1], "data": [-1, -1]}
    prev = None
    rounds = 22
    for r in range(rounds):
        ready = str(tmp_path / f"ready{r}")
        p = W.start(TW.episode_loop, store, side_path, ready, 1000 + r)
        procs.append(p)
        W.wait_for_file(ready, p)
        time.sleep(rng.uniform(0.03, 0.35))
        W.kill(p)
        if os.path.exists(side_path):
            new = _load(side_path)
            if new["rows"] >= side["rows"]:
                side = new
        snap = W.tree_snapshot(store)
        with TrajectoryReplayBuffer.load_from(store, read_only=True) as ro:
            got = _check_episode_store(ro, store, side, prev, f"round {r}, read-only open")
        assert W.tree_snapshot(store) == snap, "a read-only open of a crashed store changed its files"
        w = TrajectoryReplayBuffer.load_from(store)
        try:
            assert W.orphans(store) == [], f"round {r}: temp files left after a writer reopened"
            got_w = _check_episode_store(w, store, side, prev, f"round {r}, writer open")
            assert all(np.array_equal(a, b) for a, b in zip(got, got_w))
        finally:
            w.close()
        prev = got
    n_rows = len(prev[0])
    n_eps = len(np.unique(prev[0]))
    assert n_rows > 200 and n_eps > 50, f"only {n_rows} steps in {n_eps} episodes were written in {rounds} rounds"


# ----------------------------------------------------------------------------------------
# multiprocessing=True writers
# ----------------------------------------------------------------------------------------
N_WRITERS, N_STEPS = 4, 1000


@pytest.mark.slow
@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_multiprocessing_episode_writers(tmp_path, procs, method):
    """4 processes write 1,000 steps each, in episodes of random length, into one store.
    Every (writer, step) is present exactly once, whole; every writer episode's steps carry
    one id that no other episode (of any writer) used; episode data lands on its episode.
    ``spawn`` children get the buffer pickled (a handle), ``fork`` children inherit it."""
    store = str(tmp_path / "store")
    TrajectoryReplayBuffer.create(TW.STEP_SPACE, episode_data_instance_space=TW.EP_SPACE, cache_path=store).close()
    rb = TrajectoryReplayBuffer.load_from(store, multiprocessing=True)
    blob = pickle.dumps(rb)
    assert len(blob) < 2000, f"a multiprocessing buffer pickles to {len(blob)} bytes"
    ctx = multiprocessing.get_context(method)
    results = [str(tmp_path / f"result{w}") for w in range(N_WRITERS)]
    ps = [W.start(TW.mp_episode_writer, rb, w, N_STEPS, 100 + w, results[w], ctx=ctx) for w in range(N_WRITERS)]
    procs.extend(ps)
    with pytest.raises(LockedError, match=re.escape(store)):
        TrajectoryReplayBuffer.load_from(store)  # a plain writer is refused meanwhile
    errors, episodes = [], {}
    for w, p in enumerate(ps):
        out = W.join_result(p, results[w], 150)
        if not out["ok"]:
            errors.append(f"writer {w}: {out['error']}")
        else:
            episodes[w] = out["episodes"]
    assert not errors, "\n".join(errors)
    try:
        for who, buf in (("parent multiprocessing handle", rb), ("read-only open", None)):
            buf = buf or TrajectoryReplayBuffer.load_from(store, read_only=True)
            try:
                _check_mp_store(buf, episodes, who)
            finally:
                if buf is not rb:
                    buf.close()
    finally:
        rb.close()
    with TrajectoryReplayBuffer.load_from(store) as w:  # every multiprocessing writer is gone
        assert len(w) == N_WRITERS * N_STEPS
        ids = set(np.asarray(w.get_at_with_metadata(np.arange(len(w)))[1]["episode_ids"]).tolist())
        assert w.current_episode_id not in ids, (
            f"a new writer would append to episode {w.current_episode_id}, recorded by another process")
        w.mark_episode_end()
        assert w.current_episode_id > max(ids), "the next episode id reuses one of the writers' ids"


def test_multiprocessing_open_while_another_process_writes(tmp_path, procs):
    """Opening a multiprocessing handle (what every spawned worker does when it unpickles the
    buffer) must not disturb a writer in another process that is in the middle of a write."""
    store = str(tmp_path / "store")
    TrajectoryReplayBuffer.create(TW.STEP_SPACE, cache_path=store).close()
    ready, result = str(tmp_path / "ready"), str(tmp_path / "result")
    n = 1500
    p = W.start(TW.mp_steady_writer, store, n, ready, result)
    procs.append(p)
    W.wait_for_file(ready, p)
    opens = 0
    while p.is_alive() and opens < 400:
        TrajectoryReplayBuffer.load_from(store, multiprocessing=True).close()
        opens += 1
    p.join(120)
    out = _load(result) if os.path.exists(result) else {"ok": False, "error": f"exit code {p.exitcode}"}
    assert out["ok"], f"the writer failed while another process opened {opens} handles:\n{out['error']}"
    with TrajectoryReplayBuffer.load_from(store, read_only=True) as ro:
        wr, i, ok = TW.decode_steps(ro[:]["step_data"])
        assert ok.all() and i.tolist() == list(range(n))


def test_closing_a_stale_multiprocessing_handle_keeps_other_writers_rows(tmp_path):
    """Two multiprocessing handles (as a parent and a worker hold them): the one that did not
    write last closes (close = flush) after the other committed rows; those rows must stay."""
    store = str(tmp_path / "store")
    TrajectoryReplayBuffer.create(TW.STEP_SPACE, episode_data_instance_space=TW.EP_SPACE, cache_path=store).close()
    a = TrajectoryReplayBuffer.load_from(store, multiprocessing=True)
    b = TrajectoryReplayBuffer.load_from(store, multiprocessing=True)
    b.extend(TW.encode_steps(np.full(5, 1), np.arange(5)))
    b.set_current_episode_data(TW.encode_episode(1, 1))
    b.mark_episode_end()
    b.close()
    a.flush()
    a.close()
    with TrajectoryReplayBuffer.load_from(store, read_only=True) as ro:
        assert len(ro) == 5, f"closing a stale handle dropped committed rows: {len(ro)} of 5 left"
        assert ro[0]["episode_data"].tolist() == [1, 1, 1]


def _check_mp_store(buf, episodes: dict, who: str) -> None:
    steps, ids, ep_data = _all_rows(buf)
    wr, i, ok = TW.decode_steps(steps)
    assert ok.all(), f"{who}: {int((~ok).sum())} damaged rows"
    pairs = wr * N_STEPS + i
    uniq, counts = np.unique(pairs, return_counts=True)
    assert len(pairs) == N_WRITERS * N_STEPS and len(uniq) == len(pairs), (
        f"{who}: {len(pairs)} rows, {N_WRITERS * N_STEPS - len(uniq)} (writer, step) pairs missing, "
        f"{int((counts > 1).sum())} duplicated")
    owner: dict[int, tuple[int, int]] = {}  # episode id -> (writer, episode number)
    for w in range(N_WRITERS):
        sel = wr == w
        order = np.argsort(i[sel])
        w_ids, w_ed = ids[sel][order], ep_data[sel][order]
        assert (np.diff(i[sel]) > 0).all(), (
            f"{who}: writer {w}'s steps are out of order")
        for j, (first, length, has_data) in enumerate(episodes[w]):
            e_ids = np.unique(w_ids[first:first + length])
            assert len(e_ids) == 1, f"{who}: writer {w} episode {j} (steps {first}..) has ids {e_ids.tolist()}"
            e = int(e_ids[0])
            assert e not in owner, (f"{who}: episode id {e} is used by writer {w} episode {j} and by writer "
                                    f"{owner[e][0]} episode {owner[e][1]}")
            owner[e] = (w, j)
            if has_data:
                assert (w_ed[first:first + length] == [w * 1000 + j, 0, 1]).all(), (
                    f"{who}: writer {w} episode {j} (id {e}) shows episode data {w_ed[first].tolist()}")
            else:
                assert (w_ed[first:first + length] == 0).all(), (
                    f"{who}: writer {w} episode {j} (id {e}) has data it never set: {w_ed[first].tolist()}")
    assert sorted(owner) == sorted(set(ids.tolist()))
    ep = {key: np.asarray(v) for key, v in buf.episodes().items()}
    assert sorted(ep["episode_id"].tolist()) == sorted(owner), f"{who}: episodes() differs from the steps"


def test_multiprocessing_handle_pickles_small(tmp_path):
    store = str(tmp_path / "store")
    with TrajectoryReplayBuffer.create(TW.STEP_SPACE, episode_data_instance_space=TW.EP_SPACE, cache_path=store) as rb:
        for e in range(200):
            rb.extend(TW.encode_steps(np.full(100, e), np.arange(100)))
            rb.set_current_episode_data(TW.encode_episode(e, 1))
            rb.mark_episode_end()
    rb = TrajectoryReplayBuffer.load_from(store, multiprocessing=True)
    try:
        blob = pickle.dumps(rb)
        assert len(blob) < 2000, f"a multiprocessing buffer pickles to {len(blob)} bytes"
        rb2 = pickle.loads(blob)
        try:
            assert rb2.multiprocessing and len(rb2) == 20_000
            eid, k, ok = TW.decode_steps(rb2[-3:]["step_data"])
            assert ok.all() and eid.tolist() == [199] * 3 and k.tolist() == [97, 98, 99]
            assert rb2[-1]["episode_data"].tolist() == [199, 1, 1]
            # Two handles in one process take distinct fresh episode ids.
            assert rb2.current_episode_id != rb.current_episode_id
            assert min(rb.current_episode_id, rb2.current_episode_id) > 199
        finally:
            rb2.close()
    finally:
        rb.close()
    with TrajectoryReplayBuffer.load_from(store, read_only=True) as ro:
        assert len(pickle.dumps(ro)) < 2000
    with TrajectoryReplayBuffer.create(TW.STEP_SPACE, cache_path=tmp_path / "single") as single:
        with pytest.raises(TypeError):
            pickle.dumps(single)  # a single writer cannot be duplicated


def test_single_writer_lock(tmp_path, procs):
    store = str(tmp_path / "store")
    rb = TrajectoryReplayBuffer.create(TW.STEP_SPACE, episode_data_instance_space=TW.EP_SPACE, cache_path=store)
    rb.extend(TW.encode_steps(np.zeros(10), np.arange(10)))
    rb.flush()
    res = str(tmp_path / "other")
    p = W.start(TW.try_second_writer, store, res)
    procs.append(p)
    p.join(60)
    assert p.exitcode == 0
    out = _load(res)
    for what in ("load_from", "load_from_mp"):
        assert out[what].startswith("trajstore.errors.LockedError"), f"second writer ({what}): {out[what]}"
    assert out["read_only"] == "ok" and out["reader_rows"] == 10, out
    with pytest.raises(LockedError, match=re.escape(store)):
        TrajectoryReplayBuffer.load_from(store)
    with pytest.raises(LockedError):
        TrajectoryReplayBuffer.load_from(store, multiprocessing=True)
    with pytest.raises(LockedError):
        TrajectoryReplayBuffer.create(TW.STEP_SPACE, cache_path=store, overwrite=True)
    with TrajectoryReplayBuffer.load_from(store, read_only=True) as ro:
        assert len(ro) == 10
    rb.extend(TW.encode_steps(np.zeros(5), np.arange(10, 15)))  # the refused opens did not disturb it
    rb.close()
    with TrajectoryReplayBuffer.load_from(store) as w:
        eid, k, ok = TW.decode_steps(w[:]["step_data"])
        assert ok.all() and k.tolist() == list(range(15))


def _check_episode_data(ep, eid: np.ndarray) -> int:
    """Row ``b`` of episode data ``ep`` is episode ``eid[b]``'s (version 1 or 2, flag on) or all
    zeros (flag off: the episode has no data row in the record read).  Returns how many are zeros."""
    ep = np.asarray(ep)
    have = ep[:, 2] == 1.0
    bad = np.flatnonzero(have & (ep[:, 0] != eid))
    assert not bad.size, (f"episode data of another episode: row {bad[0]} of episode {eid[bad[0]]} shows "
                          f"{ep[bad[0]].tolist()} ({bad.size} of {len(eid)} rows)")
    assert np.isin(ep[have, 1], [1.0, 2.0]).all(), "episode data of a version never written"
    assert (ep[~have] == 0).all(), "episode data without its present flag is not all zeros"
    return int((~have).sum())


def _check_frames(eid: np.ndarray, k: np.ndarray, ok: np.ndarray, mask, offsets, anchor: tuple[np.ndarray, np.ndarray],
                  within: bool, what: str = "a frame") -> None:
    """Frames (B, T) decoded from one window (or one field's window) with pad "edge": every frame
    is an intact row of the anchor's episode; a valid frame is its step at the frame's offset, and
    an invalid one repeats the nearest row of the episode towards the anchor (a step strictly
    between the offset's and the anchor's); the anchor's frame is valid, and every frame of a
    within_episode window."""
    mask, offsets = np.asarray(mask), np.asarray(offsets, np.int64)
    e0, k0 = anchor[0][:, None], anchor[1][:, None]

    def first(bad: np.ndarray, why: str) -> str:
        b, t = (int(x[0]) for x in np.nonzero(bad))
        return (f"{what} {why}: anchor {b} is episode {int(e0[b, 0])} step {int(k0[b, 0])}, its frame at offset "
                f"{int(offsets[t])} (valid={bool(mask[b, t])}) is episode {int(eid[b, t])} step {int(k[b, t])} "
                f"({int(bad.sum())} such frames of {bad.size})")

    assert ok.all(), first(~ok, "is a torn row (read while the writer overwrote it)")
    assert (eid == e0).all(), first(eid != e0, "is not a row of the anchor's episode")
    at = k == k0 + offsets
    assert at[mask].all(), first(mask & ~at, "marked valid is not the anchor episode's step at its offset")
    near = np.where(offsets < 0, (k0 + offsets < k) & (k <= k0), (k0 <= k) & (k < k0 + offsets))
    assert near[~mask].all(), first(~mask & ~near, "padded with a row that is not the episode's nearest towards the anchor")
    if 0 in offsets.tolist():
        assert mask[:, offsets.tolist().index(0)].all(), f"{what}: the anchor's frame is marked invalid"
    assert mask.all() or not within, first(~mask, "is invalid in a within_episode window")


def _check_windows(data, mask, offsets, within: bool) -> int:
    """Every frame is an intact row; valid frames are the anchor episode's steps at the right
    offsets; a within_episode batch is wholly valid; episode data is the anchor's episode's.
    Returns how many anchors came without episode data."""
    mask = np.asarray(mask)
    B, T = mask.shape
    flat = {key: np.asarray(v).reshape(B * T, *np.asarray(v).shape[2:]) for key, v in data["step_data"].items()}
    eid, k, ok = (x.reshape(B, T) for x in TW.decode_steps(flat))
    t0 = list(offsets).index(0)
    _check_frames(eid, k, ok, mask, offsets, (eid[:, t0], k[:, t0]), within)
    return _check_episode_data(data["episode_data"], eid[:, t0])


def _check_field_windows(data, masks, offsets: dict, within: bool) -> int:
    """Per-field windows (``offsets``: "obs" and/or "tag", each naming offset 0) checked as
    :func:`_check_windows` checks whole windows, field by field: each field's anchor frame is
    the same step, every frame is that episode's (valid: at its offset; padded: nearest towards
    the anchor), and the episode data is the anchor's episode's.  Returns how many anchors
    came without episode data."""
    assert set(data["step_data"]) == set(offsets) == set(masks)
    anchor = None
    for key, offs in offsets.items():
        offs = list(offs)
        eid, k, ok = TW.decode_field(key, data["step_data"][key])
        here = eid[:, offs.index(0)], k[:, offs.index(0)]
        if anchor is None:
            anchor = here
        assert all(np.array_equal(a, h) for a, h in zip(anchor, here)), f"fields {list(offsets)} read other anchors"
        _check_frames(eid, k, ok, masks[key], offs, anchor, within, what=f"a frame of {key!r}")
    return _check_episode_data(data["episode_data"], anchor[0])


def test_reader_sequences_while_a_writer_fills_a_ring(tmp_path, procs, monkeypatch):
    """A reader samples sequences and frame stacks from a ring that a writer process keeps
    filling (episodes of 1..12 steps, commits every 50 ms, episode data rewritten in place, rows
    evicted all the time): every window it returns is one commit's rows.  The reader's bitmap of
    run starts keeps little slack below the ring, so it is trimmed and rebuilt all along."""
    monkeypatch.setattr(episodes._Boundaries, "_SLACK", 64)
    store = str(tmp_path / "store")
    TrajectoryReplayBuffer.create(TW.STEP_SPACE, episode_data_instance_space=TW.EP_SPACE, step_data_capacity=256,
                                  episode_data_capacity=64, cache_path=store, chunk_rows=16).close()
    ready = str(tmp_path / "ready")
    p = W.start(TW.episode_loop, store, str(tmp_path / "flushed"), ready, 5, 60.0)
    procs.append(p)
    W.wait_for_file(ready, p)
    rng = np.random.default_rng(0)
    checked, rounds = 0, 0
    with TrajectoryReplayBuffer.load_from(store, read_only=True) as ro:
        t_end = time.monotonic() + 5
        while time.monotonic() < t_end:
            n = len(ro)
            if n < 64:
                time.sleep(0.01)
                continue
            data, mask = ro.sample_sequences(64, 8, rng=rng, within_episode=rounds % 2 == 1)
            _check_windows(data, mask, np.arange(8), within=rounds % 2 == 1)
            offsets = [-3, -2, -1, 0]
            data, mask = ro.get_sequences(rng.integers(0, n // 2, size=32), offsets)
            _check_windows(data, mask, offsets, within=False)
            rounds += 1
            checked += 96
        gen_seen = ro._store.committed.generation
    os.kill(p.pid, 9)
    p.join(10)
    assert rounds >= 20 and gen_seen > 20, f"only {rounds} rounds over {gen_seen} commits"


#: Per-field offsets of the live-ring reader: frames before the anchor (a ring evicts those rows
#: first) in one field, after it in another.
FIELD_OFFSETS = {"obs": [-3, -1, 0], "tag": range(0, 4)}
READS = ("sample", "fields", "fields padded", "sequences", "selection")


def _read_and_check(ro, how: str, rng: np.random.Generator, held: list) -> tuple[int, int]:
    """One read of kind ``how`` from reader ``ro``, checked; returns how many windows (or steps)
    were checked (0: the selected episodes were all evicted meanwhile) and how many of them came
    without episode data.  ``held`` keeps the last episode view, sampled again at the next
    "selection" read, after the writer moved on."""
    if how == "sample":
        got = ro.sample(64, rng=rng)
        eid, k, ok = TW.decode_steps(got["step_data"])
        assert ok.all(), "a sampled step is a torn row"
        return 64, _check_episode_data(got["episode_data"], eid)
    if how in ("fields", "fields padded"):
        pad = how == "fields padded"
        data, masks = ro.sample_sequences(64, offsets=FIELD_OFFSETS, rng=rng, within_episode=True, allow_pad=pad)
        return 64, _check_field_windows(data, masks, FIELD_OFFSETS, within=not pad)
    if how == "sequences":
        data, mask = ro.sample_sequences(64, 8, rng=rng, within_episode=True)
        zeros = _check_windows(data, mask, np.arange(8), within=True)
        offsets = [-3, -2, -1, 0]
        data, mask = ro.get_sequences(rng.integers(0, len(ro) // 2, size=32), offsets)
        return 96, zeros + _check_windows(data, mask, offsets, within=False)
    checked = zeros = 0
    eps = np.asarray(ro.episodes()["episode_id"])
    try:  # the oldest episodes (their rows and data go first) and two others
        held.append(ro.select_episodes(np.unique(np.concatenate([eps[:2], rng.choice(eps, 2)]))))
    except UnknownEpisodeError:  # one was evicted between episodes() and select_episodes
        pass
    for view in held[-2:]:  # the view made last round, then this round's
        try:
            got = view.sample(32, rng=rng)
        except EmptyBufferError:  # every selected step was evicted meanwhile
            continue
        eid, k, ok = TW.decode_steps(got["step_data"])
        assert ok.all(), "a step sampled from a view is a torn row"
        assert np.isin(eid, view.episode_ids).all(), "a view sampled a step of an episode it does not select"
        zeros += _check_episode_data(got["episode_data"], eid)
        checked += 32
    del held[:-1]
    return checked, zeros


@pytest.mark.parametrize("episode_capacity", [64, 12])
def test_reader_of_a_live_ring_with_episode_data(tmp_path, procs, monkeypatch, episode_capacity):
    """A reader in this process samples a ring that a writer process keeps filling (as
    test_reader_sequences_while_a_writer_fills_a_ring), rotating between every sampler: rows with
    their episode data, per-field windows (frames before the anchor in one field, after it in
    another; within_episode with and without padding), sequences, frame stacks, and samples of
    episode views.  Nothing is injected: evictions land wherever the writer's timing puts them.
    With an episode-data ring of 12 rows (the step ring holds about 40 episodes) the data rows of
    sampled episodes are evicted and their slots reused all along: a step must show its own
    episode's data or zeros, never the slot's next occupant's."""
    monkeypatch.setattr(episodes._Boundaries, "_SLACK", 64)
    store = str(tmp_path / "store")
    TrajectoryReplayBuffer.create(TW.STEP_SPACE, episode_data_instance_space=TW.EP_SPACE, step_data_capacity=256,
                                  episode_data_capacity=episode_capacity, cache_path=store, chunk_rows=16).close()
    ready = str(tmp_path / "ready")
    p = W.start(TW.episode_loop, store, str(tmp_path / "flushed"), ready, 7, 60.0)
    procs.append(p)
    W.wait_for_file(ready, p)
    rng = np.random.default_rng(1)
    checked, no_data = dict.fromkeys(READS, 0), 0
    rounds, held = 0, []
    with TrajectoryReplayBuffer.load_from(store, read_only=True) as ro:
        # At least 4 s and 21 commits seen (a writer on loaded cores commits slower) and, with the
        # small episode-data ring, more than twice its rows evicted; at most 30 s.
        t0 = time.monotonic()

        def more() -> bool:
            head = ro._store.committed
            return head.generation <= 20 or head.tables["episode_data"].start <= 2 * episode_capacity < 64

        while (elapsed := time.monotonic() - t0) < 4 or (more() and elapsed < 30):
            if len(ro) < 64:
                time.sleep(0.01)
                continue
            how = READS[rounds % len(READS)]
            n, zeros = _read_and_check(ro, how, rng, held)
            checked[how] += n
            no_data += zeros
            rounds += 1
        head = ro._store.committed
        gen_seen, ep_evicted = head.generation, head.tables["episode_data"].start
    os.kill(p.pid, 9)
    p.join(10)
    assert rounds >= 25 and gen_seen > 20, f"only {rounds} rounds over {gen_seen} commits"
    assert all(checked.values()), f"a kind of read never ran: {checked}"
    # 64 rows outlast the step ring: an episode keeps its data while it has steps (a fifth of the
    # episodes never set any).  12 rows turn over many times while their episodes' steps are
    # sampled: most sampled steps' episodes lost their data.
    share = no_data / sum(checked.values())
    assert (share < 0.4) if episode_capacity == 64 else (share > 0.5 and ep_evicted > 2 * episode_capacity), (
        f"{share:.0%} of the windows and steps came without episode data; {ep_evicted} episode-data rows evicted")
    print(f"episode_capacity={episode_capacity}: {rounds} rounds, {gen_seen} commits, "
          f"{ep_evicted} episode-data rows evicted, checked {checked}, {no_data} without episode data")
