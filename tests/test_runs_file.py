"""The saved run index (``trajstore.runs``, :mod:`trajstore.storage.runs_file`): a writer saves the
runs of equal step ids at close, a fresh reader starts from them instead of scanning every id,
and nothing about the file (absent, stale, damaged, lying, a link, killed mid-write) can make a
reader answer differently from a scan or raise."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
import zarr
from gymnasium.spaces import Box

from trajstore import TrajectoryReplayBuffer, repair_store, verify_store
from trajstore.storage.keys import RUNS_KEY
from trajstore.storage.runs_file import SavedRuns, decode_runs, disagreement, encode_runs

SPACE = Box(-np.inf, np.inf, (3,), np.float32)


def _record(path: Path, lengths: list[int], *, capacity: int | None = None, first_id: int = 0, create: bool = True,
            seed: int = 0) -> None:
    """Episodes of the given lengths, step values encoding (episode id, step)."""
    rng = np.random.default_rng(seed)
    if create:
        tb = TrajectoryReplayBuffer.create(SPACE, cache_path=path, step_data_capacity=capacity, overwrite=True)
    else:
        tb = TrajectoryReplayBuffer.load_from(path)
    eid = first_id
    for n in lengths:
        steps = np.stack([np.full(n, eid), np.arange(n), rng.standard_normal(n)], 1).astype(np.float32)
        tb.extend({"step_data": steps, "episode_ids": np.full(n, eid, np.int64)})
        eid += 1
    tb.close()


def _scan_runs(path: Path) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The runs of the committed ids, straight from zarr's reader (absolute row numbers aside)."""
    tb = TrajectoryReplayBuffer.load_from(path, read_only=True)
    try:
        ids = np.asarray(tb.get_at_with_metadata(np.arange(len(tb)))[1]["episode_ids"]) if len(tb) else np.zeros(0)
    finally:
        tb.close()
    first = np.flatnonzero(np.concatenate([[True], ids[1:] != ids[:-1]])) if len(ids) else np.zeros(0, np.int64)
    return first, np.diff(np.append(first, len(ids))), ids[first]


def _reader_runs(path: Path) -> tuple[tuple[np.ndarray, ...], int, np.ndarray]:
    """A fresh reader's runs, how many ids it scanned, and its one_run answer for every window
    of 8 rows."""
    tb = TrajectoryReplayBuffer.load_from(path, read_only=True)
    try:
        src = tb.row_source()
        runs = src.runs()
        lo = np.arange(max(len(tb) - 8, 0))
        one = src.one_run(lo, 7) if len(lo) else np.zeros(0, bool)
        return runs, tb.run_index.scanned, one
    finally:
        tb.close()


def _expected_one_run(path: Path) -> np.ndarray:
    first, lengths, _ids = _scan_runs(path)
    n = int(lengths.sum())
    run_of = np.repeat(np.arange(len(first)), lengths)
    lo = np.arange(max(n - 8, 0))
    return run_of[lo] == run_of[lo + 7]


def _assert_like_a_scan(path: Path, *, scanned: int | None = None) -> None:
    runs, n_scanned, one = _reader_runs(path)
    exp = _scan_runs(path)
    for got, want in zip(runs, exp):
        np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(one, _expected_one_run(path))
    if scanned is not None:
        assert n_scanned == scanned


LENGTHS = [37, 120, 9, 64, 200, 15, 88] * 6


def test_a_fresh_reader_starts_from_the_saved_runs(tmp_path):
    p = tmp_path / "s"
    _record(p, LENGTHS)
    assert (p / RUNS_KEY).is_file()
    _assert_like_a_scan(p, scanned=0)  # not one id read
    # Sampling within episodes gives what a scan gives.
    got = []
    for keep in (True, False):
        if not keep:
            os.unlink(p / RUNS_KEY)
        tb = TrajectoryReplayBuffer.load_from(p, read_only=True)
        data, mask = tb.sample_sequences(64, 16, within_episode=True, rng=np.random.default_rng(3))
        assert tb.run_index.scanned == (0 if keep else len(tb))
        got.append(np.asarray(data["step_data"]))
        tb.close()
    np.testing.assert_array_equal(got[0], got[1])
    steps = got[0]
    assert (steps[:, :, 0] == steps[:, :1, 0]).all() and (np.diff(steps[:, :, 1], axis=1) == 1).all()


def test_plain_zarr_and_verify_accept_the_file(tmp_path):
    p = tmp_path / "s"
    _record(p, LENGTHS)
    g = zarr.open_group(str(p), mode="r")
    assert g["step_episode_ids"].shape == (sum(LENGTHS),)
    rep = verify_store(p)
    assert rep.ok, rep.faults


@pytest.mark.parametrize("dest", ["copy", "copy.zip"])
def test_copies_carry_the_file(tmp_path, dest):
    p = tmp_path / "s"
    _record(p, LENGTHS, capacity=700)
    tb = TrajectoryReplayBuffer.load_from(p, read_only=True)
    tb.dumps(tmp_path / dest)
    tb.close()
    _assert_like_a_scan(tmp_path / dest, scanned=0)


def test_a_writer_takes_the_file_and_saves_only_what_it_appended(tmp_path):
    p = tmp_path / "s"
    _record(p, LENGTHS)
    tb = TrajectoryReplayBuffer.load_from(p)
    assert not (p / RUNS_KEY).exists()  # removed at open: rows it writes must never be described by it
    # A reader of the live store has no file: it scans, and is right.
    _assert_like_a_scan(p, scanned=sum(LENGTHS))
    tb.extend({"step_data": np.zeros((50, 3), np.float32), "episode_ids": np.full(50, 10_000, np.int64)})
    tb.close()
    assert tb.run_index.scanned == 50  # the saved runs were handed over; only the new rows were read
    _assert_like_a_scan(p, scanned=0)


def test_appends_after_the_file_are_scanned(tmp_path):
    """A multiprocessing writer does not save: a file from before its appends stays usable."""
    p = tmp_path / "s"
    _record(p, LENGTHS)
    saved = (p / RUNS_KEY).read_bytes()
    _record(p, [30, 40], first_id=500, create=False)
    (p / RUNS_KEY).write_bytes(saved)  # as the file of an earlier close
    _assert_like_a_scan(p, scanned=70)


@pytest.mark.parametrize("edit", ["remove_episodes", "set_at", "clear"])
def test_a_stale_file_is_ignored(tmp_path, edit):
    p = tmp_path / "s"
    _record(p, LENGTHS)
    saved = (p / RUNS_KEY).read_bytes()
    tb = TrajectoryReplayBuffer.load_from(p)
    if edit == "remove_episodes":
        tb.remove_episodes([1, 3])
    elif edit == "set_at":
        row = tb.get_at_with_metadata(np.array([10]))
        tb.set_at(np.array([10]), {"step_data": np.asarray(row[0]["step_data"]), "episode_ids": np.array([99_999])})
    else:  # as many rows again, in other episodes
        tb.clear()
        n = sum(LENGTHS)
        tb.extend({"step_data": np.zeros((n, 3), np.float32), "episode_ids": 700 + np.arange(n, dtype=np.int64) // 49})
    rows = len(tb)
    tb.close()
    (p / RUNS_KEY).write_bytes(saved)  # the runs of the rows before the edit (an older writer left it)
    _assert_like_a_scan(p, scanned=rows)
    rep = verify_store(p)
    assert rep.ok and RUNS_KEY in dict(rep.removable)


def test_rings_save_the_rows_present(tmp_path):
    p = tmp_path / "s"
    _record(p, LENGTHS, capacity=500)
    saved = decode_runs((p / RUNS_KEY).read_bytes(), "t")
    tb = TrajectoryReplayBuffer.load_from(p, read_only=True)
    assert len(tb) == 500 and saved.end - saved.begin == 500
    tb.close()
    _assert_like_a_scan(p, scanned=0)
    # The ring moves on (a writer that does not save: multiprocessing): rows evicted since the
    # file are dropped from it, rows appended since are scanned.
    old = (p / RUNS_KEY).read_bytes()
    tb = TrajectoryReplayBuffer.load_from(p, multiprocessing=True)
    tb.extend({"step_data": np.zeros((120, 3), np.float32), "episode_ids": np.full(120, 9_000, np.int64)})
    tb.close()
    assert not (p / RUNS_KEY).exists()
    (p / RUNS_KEY).write_bytes(old)
    _assert_like_a_scan(p, scanned=120)


def test_a_file_from_before_the_rings_start_keeps_only_the_rows_present(tmp_path):
    """A file whose rows begin far before the ring's start (a ring's absolute rows grow without
    bound; a hostile file may name row 0) is cut to the rows present: what the reader keeps, its
    bitmap of run starts included, is sized by the rows present, and its answers are a scan's."""
    p = tmp_path / "s"
    _record(p, LENGTHS * 3, capacity=500)
    s = decode_runs((p / RUNS_KEY).read_bytes(), "t")
    assert s.begin > 1000
    early = SavedRuns(s.epoch, 0, s.end, np.concatenate([[0], s.starts]), np.concatenate([[-7], s.ids]))
    (p / RUNS_KEY).write_bytes(encode_runs(early))
    tb = TrajectoryReplayBuffer.load_from(p, read_only=True)
    tb.row_source().runs()
    assert tb.run_index._begin == s.begin and tb.run_index.scanned == 0
    tb.close()
    _assert_like_a_scan(p, scanned=0)


def test_short_runs_are_not_saved(tmp_path):
    p = tmp_path / "s"
    _record(p, [3, 2, 4] * 40)
    assert not (p / RUNS_KEY).exists()
    _assert_like_a_scan(p)


def _tamper(p: Path, how: str, outside: Path) -> None:
    f = p / RUNS_KEY
    good = f.read_bytes()
    s = decode_runs(good, "t")
    if how == "garbage":
        f.write_bytes(os.urandom(200))
    elif how == "truncated":
        f.write_bytes(good[:-5])
    elif how == "huge-count":
        b = bytearray(good)
        b[8 + 24 : 8 + 32] = (1 << 60).to_bytes(8, "little")
        f.write_bytes(bytes(b))
    elif how == "unsorted":
        st = s.starts.copy()
        st[[2, 3]] = st[[3, 2]]
        f.write_bytes(encode_runs(SavedRuns(s.epoch, s.begin, s.end, st, s.ids)))
    elif how == "past-the-rows":
        f.write_bytes(encode_runs(SavedRuns(s.epoch, s.begin, s.end + 1000, s.starts, s.ids)))
    elif how == "empty":
        f.write_bytes(b"")
    elif how == "big-file":
        f.write_bytes(good + bytes(64 << 20))
    elif how == "link-outside":
        outside.write_bytes(good)
        f.unlink()
        f.symlink_to(outside)
    elif how == "folder":
        f.unlink()
        f.mkdir()
    elif how == "fifo":
        f.unlink()
        os.mkfifo(f)


@pytest.mark.parametrize("how", ["garbage", "truncated", "huge-count", "unsorted", "past-the-rows", "empty",
                                 "big-file", "link-outside", "folder", "fifo"])
def test_a_damaged_file_is_ignored_and_reported(tmp_path, how):
    p = tmp_path / "s"
    _record(p, LENGTHS)
    outside = tmp_path / "outside"
    _tamper(p, how, outside)
    _assert_like_a_scan(p, scanned=sum(LENGTHS))
    rep = verify_store(p)
    assert rep.ok, rep.faults  # readers ignore it: not damage to the data
    if how not in ("folder",):
        assert any(RUNS_KEY in n for n in rep.notes), rep.notes
    if how == "link-outside":
        assert outside.read_bytes()  # never followed, never removed through the link
    if how in ("garbage", "truncated", "unsorted", "past-the-rows", "link-outside"):
        rr = repair_store(p)
        assert rr.recovered and not os.path.lexists(p / RUNS_KEY)
        assert outside.exists() or how != "link-outside"


def test_a_lying_file_is_a_fault_that_repair_removes(tmp_path):
    """Well formed and keyed to the record, but not the ids' runs: only verify can tell."""
    p = tmp_path / "s"
    _record(p, LENGTHS)
    s = decode_runs((p / RUNS_KEY).read_bytes(), "t")
    keep = np.ones(len(s.starts), bool)
    keep[4] = False  # two episodes shown as one: windows across them would be accepted
    (p / RUNS_KEY).write_bytes(encode_runs(SavedRuns(s.epoch, s.begin, s.end, s.starts[keep], s.ids[keep])))
    rep = verify_store(p)
    assert not rep.ok and [f.kind for f in rep.faults] == ["runs"]
    assert f"row {int(s.starts[4])}" in rep.faults[0].message
    rr = repair_store(p)
    assert rr.recovered and not (p / RUNS_KEY).exists()
    _assert_like_a_scan(p, scanned=sum(LENGTHS))


def test_disagreement_finds_the_first_wrong_row():
    ids = np.repeat([5, 6, 7, 8], [10, 20, 5, 15])
    starts = np.array([0, 10, 30, 35])
    s = SavedRuns(0, 0, 50, starts, np.array([5, 6, 7, 8]))
    assert disagreement(s, ids, 0) is None
    assert disagreement(SavedRuns(0, 0, 50, np.array([0, 10, 31, 35]), s.ids), ids, 0) == 30
    assert disagreement(SavedRuns(0, 0, 50, np.array([0, 10, 30]), np.array([5, 6, 7])), ids, 0) == 35
    assert disagreement(SavedRuns(0, 0, 50, starts, np.array([5, 6, 9, 8])), ids, 0) == 30
    # A ring: the ids present start at absolute row 12 (inside the second run).
    assert disagreement(s, ids[12:], 12) is None


_WRITER = textwrap.dedent("""
    import sys, numpy as np
    from gymnasium.spaces import Box
    from trajstore import TrajectoryReplayBuffer
    path, seed = sys.argv[1], int(sys.argv[2])
    rng = np.random.default_rng(seed)
    eid = 1_000 * (seed + 1)
    print("ready", flush=True)
    while True:
        tb = TrajectoryReplayBuffer.load_from(path)
        for _ in range(int(rng.integers(1, 6))):
            n = int(rng.integers(10, 90))
            tb.extend({"step_data": np.zeros((n, 3), np.float32), "episode_ids": np.full(n, eid, np.int64)})
            eid += 1
            if rng.random() < 0.3:
                tb.remove_episodes([eid - 1])
        tb.close()
""")


def test_sigkill_at_any_point_leaves_a_reader_right(tmp_path):
    """Writers that reopen, append, remove and close in a loop, killed at random instants (in an
    append, a removal, the save at close): after each kill a fresh reader answers as a scan does,
    and a file that is there is exactly the ids' runs."""
    p = tmp_path / "s"
    _record(p, LENGTHS)
    rng = np.random.default_rng(0)
    for k in range(12):
        proc = subprocess.Popen([sys.executable, "-c", _WRITER, str(p), str(k)], stdout=subprocess.PIPE)
        assert proc.stdout is not None and proc.stdout.readline().strip() == b"ready"
        time.sleep(float(rng.uniform(0.05, 0.6)))
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        proc.stdout.close()
        if (p / RUNS_KEY).exists():
            tb = TrajectoryReplayBuffer.load_from(p, read_only=True)
            ids = np.asarray(tb.get_at_with_metadata(np.arange(len(tb)))[1]["episode_ids"])
            st = tb._store.committed.tables["step_data"]
            s = decode_runs((p / RUNS_KEY).read_bytes(), "t")
            if s.usable(tb._store.committed.epoch, st):
                assert disagreement(s, ids, st.start) is None
            tb.close()
        _assert_like_a_scan(p)
        assert verify_store(p).ok
    # A writer that is killed has taken the file at open, so it is there only after a kill that
    # landed between a close and the next open; the next clean close saves it again.
    _record(p, [40], first_id=10**6, create=False)
    _assert_like_a_scan(p, scanned=0)
