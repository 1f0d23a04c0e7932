"""TrajectoryReplayBuffer with real processes (DESIGN.md 1 "multiprocessing=True", 3.3-3.4;
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
from trajstore.errors import LockedError  # noqa: E402


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


def _check_windows(data, mask, offsets, within: bool) -> None:
    """Every frame is an intact row; valid frames are the anchor episode's steps at the right
    offsets; a within_episode batch is wholly valid; episode data is the anchor's episode's."""
    mask = np.asarray(mask)
    B, T = mask.shape
    flat = {key: np.asarray(v).reshape(B * T, *np.asarray(v).shape[2:]) for key, v in data["step_data"].items()}
    eid, k, ok = (x.reshape(B, T) for x in TW.decode_steps(flat))
    assert ok.all(), "a frame is a torn row (read while the writer overwrote it)"
    t0 = list(offsets).index(0)
    same = (eid == eid[:, t0 : t0 + 1]) & (k == k[:, t0 : t0 + 1] + np.asarray(offsets))
    assert same[mask].all(), "a valid frame is not the anchor episode's step at its offset"
    assert mask[:, t0].all() and (mask.all() if within else True)
    ep = np.asarray(data["episode_data"])
    have = ep[:, 2] == 1.0
    assert (ep[have, 0] == eid[have, t0]).all(), "episode data of another episode"


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
