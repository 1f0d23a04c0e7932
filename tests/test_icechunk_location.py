"""Stores inside icechunk repositories (issue 33, part 1): one icechunk commit per trajstore commit,
readers on one snapshot, conflicting writers on moto S3 (a real SIGSTOP), SIGKILL at random
instants of a loop of icechunk commits, and the bad input of an icechunk location."""

from __future__ import annotations

import os
import random
import signal
import threading
import time
import uuid

import _icechunk_workers as IW
import _workers as W
import gymnasium as gym
import icechunk
import numpy as np
import pytest
import zarr
from _kill_workers import parse_log
from test_remote import s3_options  # noqa: F401  (the moto S3 server fixture)

from trajstore import ReplayBuffer, TrajectoryReplayBuffer, verify_store
from trajstore.errors import (
    BadOptionError,
    ConcurrentWriteError,
    DamagedStoreError,
    NotATrajstoreError,
    ReadOnlyError,
    StoreNotFoundError,
    VersionNotFoundError,
)
from trajstore.maintenance.versions import log as versions_log

rows = IW.rows


def _repo(path):
    return icechunk.Repository.open(icechunk.local_filesystem_storage(str(path)))


def _s3_url():
    return f"icechunk+s3://trajstore-test/ic-{uuid.uuid4().hex}"


def test_every_commit_is_one_icechunk_commit_and_readers_read_one_snapshot(tmp_path):
    url = f"icechunk://{tmp_path / 'repo'}"
    buf = TrajectoryReplayBuffer.create(IW.SPACE, cache_path=url, chunk_rows=16, commit_interval=3600)
    for e in range(3):
        buf.extend(rows(10 * e, 10 * e + 10))
        buf.mark_episode_end()
    buf.flush()
    reader = TrajectoryReplayBuffer.load_from(url, read_only=True)
    buf.extend(rows(30, 35))
    buf.remove_at(np.arange(2))  # an edit: staged chunks named by a record, then moved into place
    buf.close()
    messages = [s.message for s in _repo(tmp_path / "repo").ancestry(branch="main")]
    # create, the flush, the record remove_at commits first, its record naming the staged chunks,
    # the commit moving them into place, and close's: one snapshot each, newest first.
    assert messages[-1] == "Repository initialized" and messages[-2].startswith("create:")
    assert messages[-3] == "append: step_data 30 (+30)"
    assert any(m.startswith("edit:") for m in messages[:-3]), messages
    assert messages[0].startswith("append: step_data 33") and len(messages) == 7, messages
    # The reader opened before the later commits reads its snapshot, whole, for its whole life.
    assert len(reader) == 30 and reader.get_at(np.arange(30))["step_data"][:, 0].tolist() == list(range(30))
    with pytest.raises(ReadOnlyError):
        reader.extend(rows(0, 1))
    reader.close()
    now = TrajectoryReplayBuffer.load_from(url, read_only=True)
    assert now[:]["step_data"][:, 0].tolist() == list(range(2, 35))
    assert now.episodes() is not None
    now.close()
    # Plain zarr reads the repository's arrays through icechunk, trajstore's files included.
    group = zarr.open_group(_repo(tmp_path / "repo").readonly_session(branch="main").store, mode="r")
    assert "trajstore_files" in group
    # ... and each snapshot's arrays record exactly its committed rows (published with the record).
    assert group["step_data"].shape == (33, 4) and group["step_data"][:, 0].tolist() == list(range(2, 35))


def test_two_writers_on_s3_the_second_commit_raises_and_loses_nothing(s3_options):  # noqa: F811
    url = _s3_url()
    a = ReplayBuffer.create(IW.SPACE, cache_path=url, storage_options=s3_options, chunk_rows=16, commit_interval=3600)
    a.extend(rows(0, 20))
    a.flush()
    b = ReplayBuffer.load_from(url, storage_options=s3_options, commit_interval=3600)  # no lease: icechunk decides
    b.extend(rows(20, 50))
    b.flush()
    a.extend(rows(20, 30) + 1000)  # A's session began before B's commit: these rows would land on B's
    with pytest.raises(ConcurrentWriteError, match="another writer committed"):
        a.flush()
    with pytest.raises(ConcurrentWriteError):  # and A writes no more
        a.extend(rows(0, 1)) or a.flush()
    b.extend(rows(50, 60))
    b.close()
    got = ReplayBuffer.load_from(url, read_only=True, storage_options=s3_options)
    np.testing.assert_array_equal(got[:], rows(0, 60))
    got.close()


def _stopped(pid):
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] == "T"


def test_sigstopped_s3_writer_never_overwrites_its_successor(s3_options, tmp_path, procs):  # noqa: F811
    """Writer A (a child) appends and commits in a loop on moto S3 and gets a real SIGSTOP at
    whatever instant it is in; writer B opens the store, appends 100 rows and commits; A gets
    SIGCONT.  A's next commit raises ConcurrentWriteError (its session began before B's commit),
    so every row B acknowledged reads back as written, and so does every row A acknowledged."""
    url = _s3_url()
    log, ready = str(tmp_path / "log"), str(tmp_path / "ready")
    p = W.start(IW.append_loop, url, s3_options, log, ready, 10)
    procs.append(p)
    W.wait_for_file(ready, p)
    deadline = time.monotonic() + 60
    while max(v for _, v in parse_log(log)) < 30:
        assert p.is_alive() and time.monotonic() < deadline, parse_log(log)
        time.sleep(0.01)
    os.kill(p.pid, signal.SIGSTOP)
    while not _stopped(p.pid):
        time.sleep(0.005)
    b = ReplayBuffer.load_from(url, storage_options=s3_options, commit_interval=3600)
    lo = len(b)
    b.extend(rows(lo, lo + 100) + 1000)
    b.flush()
    b.close()
    os.kill(p.pid, signal.SIGCONT)
    p.join(60)
    assert p.exitcode == 0
    log_lines = parse_log(log)
    assert log_lines[-1][0] == "X", log_lines  # A lost the conflict: told, nothing published
    a_acked = max(v for tag, v in log_lines if tag == "F")
    assert a_acked <= lo  # A acknowledged nothing after B's commit
    got = ReplayBuffer.load_from(url, read_only=True, storage_options=s3_options)[:]
    assert len(got) == lo + 100
    np.testing.assert_array_equal(got[:lo], rows(0, lo))
    np.testing.assert_array_equal(got[lo:], rows(lo, lo + 100) + 1000)


def test_two_writer_processes_retry_a_lost_append_on_the_new_head(s3_options, tmp_path, procs):  # noqa: F811
    """Two writer processes append tagged blocks to one store on moto S3, each retrying a flush that
    lost a conflict by reopening the store and appending the block again (docs/versions.md).  The
    first conflict is forced: A's session begins before B's first commit.  At the end every block
    of both is in the store exactly once, whole, each writer's in order, after the rows before."""
    url = _s3_url()
    first = ReplayBuffer.create(IW.SPACE, cache_path=url, storage_options=s3_options, chunk_rows=16,
                                commit_interval=3600)
    first.extend(rows(0, 7))
    first.close()
    blocks, size = 8, 5
    children = {}
    for w in (1, 2):
        log, ready, go = (str(tmp_path / f"{name}{w}") for name in ("log", "ready", "go"))
        children[w] = (W.start(IW.retry_appender, url, s3_options, log, ready, go, w, blocks, size), log, go)
        procs.append(children[w][0])
        W.wait_for_file(ready, children[w][0])
    open(children[2][2], "w").close()  # B commits its block 0 first ...
    deadline = time.monotonic() + 60
    while ("F", 0) not in parse_log(children[2][1]):
        assert children[2][0].is_alive() and time.monotonic() < deadline
        time.sleep(0.005)
    open(children[1][2], "w").close()  # ... then A, whose session began before it, flushes and loses
    for p, _, _ in children.values():
        p.join(60)
        assert p.exitcode == 0
    logs = {w: parse_log(log) for w, (_, log, _) in children.items()}
    assert ("R", 0) in logs[1], logs[1]  # the forced conflict was lost, and retried
    for w in (1, 2):
        assert [v for tag, v in logs[w] if tag == "F"] == list(range(blocks)), logs[w]
    got = ReplayBuffer.load_from(url, read_only=True, storage_options=s3_options)
    data = got[:]
    got.close()
    np.testing.assert_array_equal(data[:7], rows(0, 7))
    assert (data == data[:, :1]).all()
    values = data[7:, 0].astype(np.int64)
    assert len(values) == 2 * blocks * size, len(values)
    seen = {1: [], 2: []}
    for lo in range(0, len(values), size):
        w, j = values[lo] // 100_000, (values[lo] % 100_000) // size
        np.testing.assert_array_equal(data[7 + lo : 7 + lo + size], IW.tagged(int(w), int(j), size))
        seen[int(w)].append(int(j))
    assert seen == {1: list(range(blocks)), 2: list(range(blocks))}, seen


def test_sigkill_at_random_instants_of_icechunk_commits(tmp_path, procs):
    """A child appends 3 rows and commits (one icechunk commit each) in a loop on a local
    repository and is SIGKILLed a random delay after its first commit, 100 times; after each kill
    the branch opens at a committed snapshot holding every acknowledged row (a sample of them
    verified deep), and the next child writes on."""
    url = f"icechunk://{tmp_path / 'repo'}"
    log = str(tmp_path / "log")
    rng = random.Random(33)
    acked = kills = 0
    for i in range(100):
        ready = str(tmp_path / f"ready{i}")
        flushes = sum(tag == "F" for tag, _ in parse_log(log))
        p = W.start(IW.append_loop, url, None, log, ready, 3)
        procs.append(p)
        W.wait_for_file(ready, p)
        # Once the child has committed (its open logs one F, each commit one more), the kill lands
        # inside its loop of commits however loaded the machine is.
        deadline = time.monotonic() + 60
        while sum(tag == "F" for tag, _ in parse_log(log)) < flushes + 2:
            assert p.is_alive() and time.monotonic() < deadline, (i, parse_log(log)[-3:])
            time.sleep(0.002)
        time.sleep(rng.uniform(0.0, 0.06))
        W.kill(p)
        kills += 1
        acked = max([acked, *(v for tag, v in parse_log(log) if tag == "F")])
        reader = ReplayBuffer.load_from(url, read_only=True)
        n = len(reader)
        assert n >= acked and n % 3 == 0, (i, n, acked)
        if i % 10 == 0 or i == 99:
            np.testing.assert_array_equal(reader[:], rows(0, n))
        reader.close()
        if i % 20 == 0 or i == 99:  # a sample of deep verifies: every chunk, record and file checked
            report = verify_store(url, deep=True)
            assert report.ok, (i, report.faults)
    assert kills >= 100 and acked > 0
    snapshots = list(_repo(tmp_path / "repo").ancestry(branch="main"))
    assert len(snapshots) >= 100


def test_bad_icechunk_locations(tmp_path):
    missing = f"icechunk://{tmp_path / 'none'}"
    with pytest.raises(StoreNotFoundError, match="no icechunk repository"):
        ReplayBuffer.load_from(missing, read_only=True)
    assert not os.path.exists(tmp_path / "none")
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("not a repository")
    with pytest.raises(NotATrajstoreError, match="no icechunk repository"):
        ReplayBuffer.create(IW.SPACE, cache_path=f"icechunk://{other}")
    assert os.listdir(other) == ["notes.txt"]
    # A repository of another program's layout: a zarr group without trajstore's schema.
    foreign = icechunk.Repository.create(icechunk.local_filesystem_storage(str(tmp_path / "foreign")))
    session = foreign.writable_session("main")
    zarr.create_group(session.store, attributes={"made_by": "another program"}).create_array(
        "x", shape=(4,), dtype="i4")
    session.commit("another program's data")
    with pytest.raises(NotATrajstoreError, match="not a trajstore store"):
        ReplayBuffer.load_from(f"icechunk://{tmp_path / 'foreign'}", read_only=True)
    url = f"icechunk://{tmp_path / 'repo'}"
    ReplayBuffer.create(IW.SPACE, cache_path=url).close()
    with pytest.raises(VersionNotFoundError, match="no version named 'v9'"):
        ReplayBuffer.load_from(url, read_only=True, storage_options={"trajstore_version": "v9"})
    with pytest.raises(VersionNotFoundError, match="not a version of this dataset"):
        ReplayBuffer.load_from(url, read_only=True, storage_options={"trajstore_version": "0" * 20})
    with pytest.raises(BadOptionError, match="read-only"):
        ReplayBuffer.load_from(url, storage_options={"trajstore_version": "v9"})


def _opened_within(fn, limit_s: float = 60.0):
    """``fn()``'s exception (None when it returned), failing the test if it is still blocked after
    ``limit_s`` (icechunk's own open of a FIFO waits for a writer)."""
    got: list = []

    def run():
        try:
            fn().close()
            got.append(None)
        except BaseException as e:  # noqa: BLE001  # handed to the test thread
            got.append(e)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(limit_s)
    assert not t.is_alive(), "blocked opening a repository that holds a FIFO"
    return got[0]


def test_links_and_special_files_in_a_local_repository_are_refused(tmp_path):
    """A local repository's files are opened by icechunk, which follows links and blocks on a FIFO:
    a link or a FIFO anywhere below the folder is refused (DamagedStoreError naming it) when the
    store is opened, for readers, writers and the version listing, before icechunk reads it."""
    space = gym.spaces.Box(0, 255, (64,), np.uint8)
    data = (np.arange(4000 * 64) % 251).astype(np.uint8).reshape(4000, 64)
    url = f"icechunk://{tmp_path / 'repo'}"
    with ReplayBuffer.create(space, cache_path=url, capacity=4000, chunk_rows=1000) as rb:
        rb.extend(data)  # chunks of 8 KiB and more: files under chunks/ (small ones are inlined)
    chunks = sorted((tmp_path / "repo" / "chunks").iterdir())
    assert chunks
    outside = tmp_path / "outside"
    outside.write_bytes(chunks[0].read_bytes())
    for plant in ("fifo", "link"):
        chunks[0].unlink(missing_ok=True)
        if plant == "fifo":
            os.mkfifo(chunks[0])
        else:
            chunks[0].symlink_to(outside)
        for fn in (lambda: ReplayBuffer.load_from(url, read_only=True), lambda: ReplayBuffer.load_from(url)):
            err = _opened_within(fn)
            assert isinstance(err, DamagedStoreError), err
            assert f"chunks/{chunks[0].name} is a {'FIFO' if plant == 'fifo' else 'symbolic link'}" in str(err)
        with pytest.raises(DamagedStoreError, match="not a regular file"):
            versions_log(url)
        chunks[0].unlink()
    chunks[0].write_bytes(outside.read_bytes())  # as it was: the store opens and reads again
    with ReplayBuffer.load_from(url, read_only=True) as ro:
        np.testing.assert_array_equal(ro[:], data)


def test_one_writer_at_a_time_on_a_local_repository(tmp_path):
    """icechunk's local storage does not refuse the second of two concurrent commits (object stores
    do): a second writer of a local repository is refused; readers are not."""
    from trajstore.errors import LockedError

    url = f"icechunk://{tmp_path / 'repo'}"
    a = ReplayBuffer.create(IW.SPACE, cache_path=url)
    a.extend(rows(0, 3))
    with pytest.raises(LockedError, match="another writer"):
        ReplayBuffer.load_from(url)
    reader = ReplayBuffer.load_from(url, read_only=True)
    a.close()
    assert len(reader) == 0  # its snapshot: the one before a's close
    reader.close()
    b = ReplayBuffer.load_from(url)
    assert len(b) == 3
    b.close()


def test_a_commit_that_touches_no_key_of_another_is_rebased(tmp_path):
    """Another program commits an array of its own to the repository while a writer appends: the
    writer's commit is rebased onto it (ConflictDetector: no key changed by both) and both stay."""
    url = f"icechunk://{tmp_path / 'repo'}"
    buf = ReplayBuffer.create(IW.SPACE, cache_path=url, commit_interval=3600)
    buf.extend(rows(0, 10))
    other = _repo(tmp_path / "repo").writable_session("main")
    zarr.create_array(other.store, name="notes", shape=(3,), dtype="i4")[:] = [1, 2, 3]
    other.commit("another program's notes")
    buf.flush()  # rebased, not refused
    buf.close()
    snap = _repo(tmp_path / "repo").readonly_session(branch="main").store
    assert zarr.open_array(snap, path="notes", mode="r")[:].tolist() == [1, 2, 3]
    got = ReplayBuffer.load_from(url, read_only=True)
    np.testing.assert_array_equal(got[:], rows(0, 10))
    got.close()
    report = verify_store(url, deep=True)
    assert report.ok, report.faults


def test_multiprocessing_writers_refused(tmp_path):
    url = f"icechunk://{tmp_path / 'repo'}"
    with pytest.raises(BadOptionError, match="multiprocessing=True"):
        ReplayBuffer.create(IW.SPACE, cache_path=url, multiprocessing=True)
    ReplayBuffer.create(IW.SPACE, cache_path=url).close()  # (the refused open held no lock)
    with pytest.raises(BadOptionError, match="multiprocessing=True"):
        ReplayBuffer.load_from(url, multiprocessing=True)
    ReplayBuffer.load_from(url, read_only=True, multiprocessing=True).close()
