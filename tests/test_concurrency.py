"""One writer and many readers, the writer lock, and multiprocessing=True writers
(docs/design.md 1 "Writers, readers and processes", 3.4, 3.6), with real processes on real stores.

Child code lives in ``_workers.py`` (see its docstring for the start method).
"""

from __future__ import annotations

import json
import os
import pickle
import re
import signal
import sys
import time
from pathlib import Path

import numpy as np
import pytest

HERE = str(Path(__file__).resolve().parent)
if HERE not in sys.path:
    sys.path.insert(0, HERE)

import _workers as W  # noqa: E402

from trajstore import ReplayBuffer  # noqa: E402
from trajstore.errors import LockedError  # noqa: E402


def _join_ok(p, timeout: float = 120.0) -> None:
    p.join(timeout)
    if p.is_alive():
        os.kill(p.pid, signal.SIGKILL)
        p.join(5)
        raise AssertionError(f"child {p.pid} hung")
    assert p.exitcode == 0, f"child {p.pid} failed with exit code {p.exitcode}; see its stderr"


def _load(path) -> dict:
    with open(path) as f:
        return json.load(f)


# ----------------------------------------------------------------------------------------
# noticing a new commit record
# ----------------------------------------------------------------------------------------
def test_head_watch_sees_every_replacement(tmp_path):
    """A reader notices each new commit record even when it has the old one's size and
    modification time (commits within one clock tick): the watch holds the record it read
    open, so the next record cannot have its inode number."""
    from trajstore.storage.head import HeadWatch

    rb = ReplayBuffer.create(W.SPACE, cache_path=tmp_path / "s")
    ro = ReplayBuffer.load_from(tmp_path / "s", read_only=True)
    watch = HeadWatch(ro._store.loc)
    assert watch.changed()  # nothing read yet
    head = watch.read()
    assert not watch.changed() and head.generation == ro._store.committed.generation
    path = tmp_path / "s" / "trajstore.head.json"
    for i in range(50):
        before = os.stat(path)
        rb.extend(W.encode([i]))
        rb.flush()
        os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))  # same tick
        assert watch.changed(), f"commit {i} not noticed"
        assert watch.read().generation > head.generation
        head = watch.read()
        assert ro._store.refresh() and len(ro) == i + 1
    watch.close()
    ro.close()
    rb.close()


# ----------------------------------------------------------------------------------------
# readers next to an appending writer (docs/design.md 3.1, 3.2, 3.4)
# ----------------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("capacity", [None, 2000], ids=["unbounded", "ring2000"])
@pytest.mark.parametrize("compressor", [None, "lz4"], ids=["raw", "lz4"])
def test_reader_never_sees_uncommitted_rows(tmp_path, procs, compressor, capacity):
    store = str(tmp_path / "store")
    with ReplayBuffer.create(W.SPACE, cache_path=store, capacity=capacity, compressor=compressor,
                             chunk_rows=64) as rb:
        rb.extend(W.encode(np.arange(10)))
    bound, wready, stop = (str(tmp_path / n) for n in ("bound", "wready", "stop"))
    # A ring writer runs flat out and writes at least 3 laps; an unbounded one is paced so
    # the readers' rb[:] stays cheap.
    writer = W.start(W.committed_writer, store, bound, wready, 5, 2.5, 48, 300, 0.0 if capacity else 0.002,
                     3 * capacity if capacity else 0)
    procs.append(writer)
    W.wait_for_file(wready, writer)
    results = []
    for k in range(2):
        res, rready = str(tmp_path / f"result{k}"), str(tmp_path / f"rready{k}")
        reader = W.start(W.reader_loop, store, bound, res, rready, stop, k)
        procs.append(reader)
        results.append((reader, res))
    _join_ok(writer, 90)
    W.touch(stop)
    for reader, res in results:
        _join_ok(reader, 60)
    total = W.read_int(bound)
    for reader, res in results:
        out = _load(res)
        assert out["errors"] == [], "\n".join(out["errors"])
        assert out["loops"] >= 3 and out["sampled"] > 0, out
    if capacity:
        assert total >= 3 * capacity, f"the writer wrote only {total} rows: too few ring overwrites"
    # And what the writer left is whole.
    with ReplayBuffer.load_from(store, read_only=True) as ro:
        seq, ok = W.decode(ro[:])
        assert ok.all() and seq[-1] == total - 1 and (np.diff(seq) == 1).all()


@pytest.mark.slow
@pytest.mark.parametrize("compressor", [None, "lz4"], ids=["raw", "lz4"])
def test_reader_during_set_at_and_remove_at(tmp_path, procs, compressor):
    """A read-only reader next to a writer that rewrites committed rows (set_at, remove_at):
    every read shows whole rows (all leaves of one row at one version), never zeros, and
    the reader never fails."""
    store = str(tmp_path / "store")
    with ReplayBuffer.create(W.SPACE, cache_path=store, compressor=compressor, chunk_rows=64) as rb:
        rb.extend(W.encode_kv(np.arange(1000), 0))
    wready, rready, stop, res = (str(tmp_path / n) for n in ("wready", "rready", "stop", "result"))
    writer = W.start(W.rewrite_writer, store, wready, stop, 7, 4.0)
    procs.append(writer)
    W.wait_for_file(wready, writer)
    reader = W.start(W.rewrite_reader, store, res, rready, 2.5)
    procs.append(reader)
    _join_ok(reader, 60)
    W.touch(stop)
    _join_ok(writer, 60)
    out = _load(res)
    assert out["errors"] == [], "\n".join(out["errors"])
    assert out["loops"] > 10


# ----------------------------------------------------------------------------------------
# writer lock (docs/design.md 1 "Writers, readers and processes", 3.4)
# ----------------------------------------------------------------------------------------
def test_writer_lock(tmp_path, procs):
    store = str(tmp_path / "store")
    rb = ReplayBuffer.create(W.SPACE, cache_path=store)
    rb.extend(W.encode(np.arange(100)))
    rb.flush()

    # Another process: a second writer is refused (load_from and create(overwrite=True)),
    # a reader is allowed and sees the committed rows.
    res = str(tmp_path / "other")
    p = W.start(W.try_open, store, res)
    procs.append(p)
    _join_ok(p)
    out = _load(res)
    for what in ("load_from", "create_overwrite"):
        assert out[what].startswith("trajstore.errors.LockedError"), f"second writer ({what}) from another process: {out[what]}"
        assert store in out[what], f"the LockedError message does not name the store: {out[what]}"
    assert out["read_only"] == "ok" and out["reader_rows"] == 100 and out["reader_ok"], out

    # The same process.
    with pytest.raises(LockedError, match=re.escape(store)):
        ReplayBuffer.load_from(store)
    with pytest.raises(LockedError, match=re.escape(store)):
        ReplayBuffer.create(W.SPACE, cache_path=store, overwrite=True)
    with pytest.raises(LockedError):
        ReplayBuffer.load_from(store, multiprocessing=True)
    with ReplayBuffer.load_from(store, read_only=True) as ro:
        assert len(ro) == 100
    assert len(rb) == 100, "a refused writer must not disturb the open one"
    rb.extend(W.encode(np.arange(100, 150)))
    rb.close()

    # After close, a writer from another process can open.
    p = W.start(W.hold_writer, store, str(tmp_path / "ready1"), 50)
    procs.append(p)
    W.wait_for_file(str(tmp_path / "ready1"), p)
    with pytest.raises(LockedError, match=re.escape(store)):
        ReplayBuffer.load_from(store)
    with ReplayBuffer.load_from(store, read_only=True) as ro:
        seq, ok = W.decode(ro[:])
        assert ok.all() and np.array_equal(seq, np.arange(200))
    # ... and after that writer is SIGKILLed, a new writer can open.
    W.kill(p)
    with ReplayBuffer.load_from(store) as w:
        seq, ok = W.decode(w[:])
        assert ok.all() and np.array_equal(seq, np.arange(200))


# ----------------------------------------------------------------------------------------
# multiprocessing=True (docs/design.md 1)
# ----------------------------------------------------------------------------------------
def test_create_multiprocessing_store_on_fresh_path(tmp_path):
    store = str(tmp_path / "store")
    rb = ReplayBuffer.create(W.SPACE, cache_path=store, multiprocessing=True)
    try:
        rb.append(W.one(W.encode([0])))
        assert len(rb) == 1 and len(pickle.dumps(rb)) < 2000
    finally:
        rb.close()


def _held_inodes(prefix: str) -> set[int]:
    out = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{fd}").startswith(prefix):
                out.add(os.stat(f"/proc/self/fd/{fd}").st_ino)
        except OSError:
            pass
    return out


def test_create_multiprocessing_overwrite_keeps_lock_files(tmp_path, procs):
    """create(..., multiprocessing=True, overwrite=True) over an existing store: the lock
    files on disk must be the ones this writer holds, or other processes lock different
    files and their writes are not serialized with this one's."""
    store = str(tmp_path / "store")
    ReplayBuffer.create(W.SPACE, cache_path=store).close()
    rb = ReplayBuffer.create(W.SPACE, cache_path=store, multiprocessing=True, overwrite=True)
    try:
        held = _held_inodes(store)
        assert held, "the writer holds no lock file"
        on_disk = {n: os.stat(os.path.join(store, n)).st_ino for n in os.listdir(store)
                   if n.startswith("trajstore.") and n.endswith("lock")}
        assert on_disk, "no lock file left on disk"
        assert set(on_disk.values()) >= held, (
            f"this writer locks {len(held)} file(s) but only {sorted(on_disk)} on disk match: "
            "overwrite=True erased a lock file it holds")
    finally:
        rb.close()


def test_multiprocessing_handle_pickles_small(tmp_path):
    store = str(tmp_path / "store")
    with ReplayBuffer.create(W.SPACE, cache_path=store) as rb:
        rb.extend(W.encode(np.arange(50_000)))
    rb = ReplayBuffer.load_from(store, multiprocessing=True)
    try:
        blob = pickle.dumps(rb)
        assert len(blob) < 2000, f"a multiprocessing buffer pickles to {len(blob)} bytes"
        rb2 = pickle.loads(blob)  # a second handle in the same process (shared lock)
        try:
            assert rb2.multiprocessing and len(rb2) == 50_000
            seq, ok = W.decode(rb2[-3:])
            assert ok.all() and list(seq) == [49_997, 49_998, 49_999]
        finally:
            rb2.close()
    finally:
        rb.close()
    ro = ReplayBuffer.load_from(store, read_only=True)
    try:
        assert len(pickle.dumps(ro)) < 2000
    finally:
        ro.close()


@pytest.mark.slow
@pytest.mark.parametrize("method,chunk_rows", [("spawn", None), ("fork", None), ("spawn", 256)],
                         ids=["spawn", "fork", "spawn-growing"])
def test_multiprocessing_writers(tmp_path, procs, method, chunk_rows):
    """4 processes append 1,000 tagged rows each into one unbounded store; every (writer, i)
    row must be there exactly once, whole.  ``spawn`` gets the buffer pickled (a handle),
    ``fork`` inherits the parent's open buffer.  ``spawn-growing`` uses small chunks so the
    arrays grow while several processes write."""
    import multiprocessing

    store = str(tmp_path / "store")
    ReplayBuffer.create(W.SPACE, cache_path=store, chunk_rows=chunk_rows).close()
    rb = ReplayBuffer.load_from(store, multiprocessing=True)
    assert len(pickle.dumps(rb)) < 2000
    ctx = multiprocessing.get_context(method)
    n_per = 1000
    results = [str(tmp_path / f"result{w}") for w in range(4)]
    ps = [W.start(W.mp_append, rb, w, n_per, results[w], ctx=ctx) for w in range(4)]
    procs.extend(ps)
    errors = []
    # While multiprocessing writers are open, a plain writer is refused (readers are not).
    with pytest.raises(LockedError, match=re.escape(store)):
        ReplayBuffer.load_from(store)
    with ReplayBuffer.load_from(store, read_only=True) as ro:
        for _ in range(20):
            w_, i_, ok = W.decode_tag(ro[:])
            if not ok.all():
                errors.append(f"a reader saw {int((~ok).sum())} torn rows of {len(ok)} while the writers append")
                break
            time.sleep(0.05)
    for w, p in enumerate(ps):
        out = W.join_result(p, results[w], 180)
        if not out["ok"]:
            errors.append(f"writer {w} failed: {out['error']}")
    try:
        for who, buf in (("parent multiprocessing handle", rb), ("read-only open", None)):
            buf = buf or ReplayBuffer.load_from(store, read_only=True)
            x = buf[:]
            w_, i_, ok = W.decode_tag(x)
            if not ok.all():
                errors.append(f"{who}: {int((~ok).sum())} torn rows")
            pairs = w_ * n_per + i_
            uniq, counts = np.unique(pairs, return_counts=True)
            missing = 4 * n_per - len(uniq)
            if not ((counts == 1).all() and missing == 0 and len(pairs) == 4 * n_per):
                errors.append(f"{who}: {len(pairs)} rows; {missing} of the {4 * n_per} (writer, i) rows missing, "
                              f"{int((counts > 1).sum())} duplicated")
            for w in range(4):  # each writer's rows keep their order
                if not (np.diff(i_[w_ == w]) > 0).all():
                    errors.append(f"{who}: writer {w}'s rows out of order")
            if buf is not rb:
                buf.close()
    finally:
        rb.close()
    assert not errors, "\n".join(errors)
    with ReplayBuffer.load_from(store) as w:  # all multiprocessing writers gone: a plain writer opens
        assert len(w) == 4 * n_per
