"""Crash safety (docs/design.md 3.1-3.4): real writer processes on real stores, killed with
SIGKILL at random moments; the parent then reopens the store read-only and as the writer
and checks that nothing committed was lost and nothing half-written is visible.

Child code lives in ``_workers.py`` (see its docstring for the start method).
"""

from __future__ import annotations

import os
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
from trajstore.storage.fields import _syscalls  # noqa: E402

STAGING = ".trajstore-staging"


# ----------------------------------------------------------------------------------------
# append loops killed at random (docs/design.md 3.1-3.3)
# ----------------------------------------------------------------------------------------
def _check_append_rows(rb: ReplayBuffer, capacity: int | None, flushed: int, who: str) -> tuple[int, int]:
    """Rows of an append-only store: whole rows, consecutive numbers, nothing flushed lost."""
    n = len(rb)
    if n == 0:
        assert flushed == 0, f"{who}: the store is empty although {flushed} rows were flushed before the kill"
        return 0, -1
    x = rb[:]
    seq, ok = W.decode(x)
    if not ok.all():
        bad = int(np.flatnonzero(~ok)[0])
        raise AssertionError(f"{who}: row {bad} of {n} is damaged: obs[:3]={x['obs'][bad, :3]}, d={x['d'][bad]}, "
                             f"img[0,0]={x['img'][bad, 0, 0]} (claims seq {seq[bad]})")
    assert (np.diff(seq) == 1).all(), f"{who}: rows are not consecutive: {seq[np.flatnonzero(np.diff(seq) != 1)[:5]]}"
    first, last = int(seq[0]), int(seq[-1])
    assert last + 1 >= flushed, (f"{who}: committed rows lost: the last row is {last}, but rows 0..{flushed - 1} "
                                 "were flushed before the kill")
    if capacity is None:
        assert first == 0, f"{who}: an unbounded store starts at row {first}"
    else:
        assert n <= capacity
        assert rb.offset == first % capacity, f"{who}: offset {rb.offset} but the first row is number {first}"
        assert n >= min(last + 1, capacity // 2), f"{who}: ring holds only {n} rows after {last + 1} were written"
    for i in (0, n // 2, -1):
        s, ok1 = W.decode(W.batched(rb[i]))
        assert ok1[0] and s[0] == seq[i], f"{who}: rb[{i}] differs from rb[:][{i}]"
    s, ok = W.decode(rb.sample(128, rng=1))
    assert ok.all() and s.min() >= first and s.max() <= last, f"{who}: sample returned rows outside the store"
    return first, last


def _verify_append_store(store: str, capacity: int | None, flushed: int, writer_open: bool) -> tuple[int, int]:
    snap = W.tree_snapshot(store)
    with ReplayBuffer.load_from(store, read_only=True) as ro:
        got = _check_append_rows(ro, capacity, flushed, "read-only open after SIGKILL")
    assert W.tree_snapshot(store) == snap, "a read-only open of a crashed store changed its files"
    if writer_open:
        w = ReplayBuffer.load_from(store)  # must succeed
        try:
            assert W.orphans(store) == [], f"temp files left after a writer reopened: {W.orphans(store)}"
            assert _check_append_rows(w, capacity, flushed, "writer open after SIGKILL") == got
        finally:
            w.close()
    return got


def _append_kill_rounds(tmp_path: Path, procs: list, *, capacity: int | None, compressor: str | None,
                        chunk_rows: int, rounds: int, max_batch: int, max_unflushed: int, seed: int,
                        min_total: int = 0) -> int:
    """Create a store, then ``rounds`` times (more, up to 40, until ``min_total`` rows were
    written): start an appending child (it resumes from the store), SIGKILL it after
    0.05-0.4 s, verify.  Even rounds reopen as the writer in the parent; odd rounds leave
    the crash recovery to the next child's writer open."""
    store = str(tmp_path / "store")
    ReplayBuffer.create(W.SPACE, cache_path=store, capacity=capacity, compressor=compressor,
                        chunk_rows=chunk_rows).close()
    side = str(tmp_path / "flushed")
    rng = np.random.default_rng(seed)
    flushed, prev_last = 0, -1
    r = 0
    while r < rounds or (prev_last + 1 < min_total and r < 40):
        ready = str(tmp_path / f"ready{r}")
        p = W.start(W.append_loop, store, side, ready, seed * 1000 + r, max_batch, max_unflushed)
        procs.append(p)
        W.wait_for_file(ready, p)
        time.sleep(rng.uniform(0.05, 0.4))
        W.kill(p)
        flushed = max(flushed, W.read_int(side))
        _first, last = _verify_append_store(store, capacity, flushed, writer_open=r % 2 == 0)
        assert last >= prev_last, f"round {r}: the last committed row went back from {prev_last} to {last}"
        prev_last = last
        r += 1
    # The last child's recovery, once more through a writer open.
    _verify_append_store(store, capacity, flushed, writer_open=True)
    return prev_last + 1


@pytest.mark.slow
@pytest.mark.parametrize("capacity", [None, 5000], ids=["unbounded", "ring5000"])
def test_sigkill_append_loop(tmp_path, procs, capacity):
    total = _append_kill_rounds(tmp_path, procs, capacity=capacity, compressor=None, chunk_rows=256, rounds=20,
                                max_batch=96 if capacity is None else 256, max_unflushed=1000,
                                seed=11 if capacity is None else 12, min_total=3 * (capacity or 0))
    if capacity is not None:
        assert total >= 3 * capacity, f"only {total} rows were written: the ring did not wrap enough"


@pytest.mark.slow
@pytest.mark.parametrize("compressor", [None, "lz4"], ids=["raw", "lz4"])
def test_sigkill_during_ring_overwrite(tmp_path, procs, compressor):
    """A small ring (16 chunks of 64 rows for lz4) that the writer overwrites many times per round."""
    total = _append_kill_rounds(tmp_path, procs, capacity=1000, compressor=compressor, chunk_rows=64, rounds=15,
                                max_batch=64, max_unflushed=200, seed=21 if compressor is None else 22,
                                min_total=4000)
    assert total >= 4000, f"only {total} rows were written: too few ring overwrites"


# ----------------------------------------------------------------------------------------
# set_at / remove_at killed at random: before or after, never a mix (docs/design.md 1, 3.1)
# ----------------------------------------------------------------------------------------
def _parse_log(path: str) -> tuple[list[tuple], tuple | None]:
    """Completed operations and the one in flight (logged but not marked done)."""
    done, current = [], None
    with open(path) as f:
        for line in f:
            if not line.endswith("\n"):
                break
            parts = line.split()
            if parts[0] == "I":
                assert current is None, "log out of order"
                if parts[1] == "A":
                    current = ("A", int(parts[2]), int(parts[3]))
                elif parts[1] == "S":
                    current = ("S", int(parts[2]), np.array(parts[3:], dtype=np.int64))
                else:
                    current = ("R", np.array(parts[2:], dtype=np.int64))
            else:
                assert current is not None, "log out of order"
                done.append(current)
                current = None
    return done, current


def _apply(state: tuple[np.ndarray, np.ndarray], op: tuple) -> tuple[np.ndarray, np.ndarray]:
    key, ver = state[0].copy(), state[1].copy()
    if op[0] == "A":
        return np.concatenate([key, np.arange(op[1], op[1] + op[2])]), np.concatenate([ver, np.zeros(op[2], np.int64)])
    if op[0] == "S":
        ver[op[2]] = op[1]
        return key, ver
    return np.delete(key, op[1]), np.delete(ver, op[1])


def _same(a: tuple[np.ndarray, np.ndarray], b: tuple[np.ndarray, np.ndarray]) -> bool:
    return np.array_equal(a[0], b[0]) and np.array_equal(a[1], b[1])


def _read_kv(rb: ReplayBuffer, who: str) -> tuple[np.ndarray, np.ndarray]:
    x = rb[:]
    key, ver, ok = W.decode_kv(x)
    if not ok.all():
        bad = int(np.flatnonzero(~ok)[0])
        raise AssertionError(f"{who}: row {bad} of {len(ok)} is not a whole row: {W.describe_kv(x, bad)}")
    return key, ver


@pytest.mark.slow
@pytest.mark.parametrize("compressor", [None, "lz4"], ids=["raw", "lz4"])
def test_sigkill_during_set_at_and_remove_at(tmp_path, procs, compressor):
    store = str(tmp_path / "store")
    with ReplayBuffer.create(W.SPACE, cache_path=store, compressor=compressor, chunk_rows=64) as rb:
        rb.extend(W.encode_kv(np.arange(600), 0))
    state = (np.arange(600), np.zeros(600, np.int64))
    rng = np.random.default_rng(31 if compressor is None else 32)
    in_flight = {"before": 0, "after": 0, "pending_seen": 0}
    for r in range(20):
        log, ready = str(tmp_path / f"log{r}"), str(tmp_path / f"ready{r}")
        p = W.start(W.rewrite_loop, store, log, ready, 100 * r + (compressor is not None))
        procs.append(p)
        W.wait_for_file(ready, p)
        time.sleep(rng.uniform(0.05, 0.4))
        W.kill(p)
        done, current = _parse_log(log)
        for op in done:
            state = _apply(state, op)
        after = _apply(state, current) if current is not None else state
        pending = W.read_head(store).get("pending")
        snap = W.tree_snapshot(store)
        with ReplayBuffer.load_from(store, read_only=True) as ro:
            seen = _read_kv(ro, f"round {r}: read-only open (head pending: {bool(pending)}, "
                                f"op in flight: {current[0] if current else None})")
        assert W.tree_snapshot(store) == snap, "a read-only open changed files"
        if _same(seen, after):
            in_flight["after" if current is not None else "before"] += 1
        elif _same(seen, state):
            in_flight["before"] += 1
        else:
            raise AssertionError(f"round {r}: the store is neither before nor after the operation in flight "
                                 f"{current[0] if current else None}: {len(seen[0])} rows, expected {len(state[0])} "
                                 f"or {len(after[0])}")
        if pending:
            in_flight["pending_seen"] += 1
            assert _same(seen, after), "the commit record names staged chunks, but a reader does not see them"
        if r % 2 == 0:
            with ReplayBuffer.load_from(store) as w:
                assert _same(_read_kv(w, f"round {r}: writer open"), seen), "writer and reader opens disagree"
                assert W.orphans(store) == []
            assert not W.read_head(store).get("pending"), "a writer open did not finish the pending rewrite"
        state = seen
    print("kills that interrupted an operation:", in_flight)


@pytest.mark.parametrize("compressor,renames", [(None, 0), (None, 1), (None, 4), ("lz4", 0), ("lz4", 1), ("lz4", 7)],
                         ids=["raw-0", "raw-1", "raw-4", "lz4-0", "lz4-1", "lz4-7"])
def test_read_only_open_with_pending_rewrite(tmp_path, procs, compressor, renames):
    """A writer killed in the middle of moving staged chunks into place (the commit record
    still says ``pending``): a read-only open must read the new rows, consistently, without
    writing; a writer open finishes the move."""
    store = str(tmp_path / "store")
    with ReplayBuffer.create(W.SPACE, cache_path=store, compressor=compressor, chunk_rows=64) as rb:
        rb.extend(W.encode_kv(np.arange(300), 0))
    p = W.start(W.rewrite_and_die, store, 5, renames)
    procs.append(p)
    p.join(60)
    assert p.exitcode == -signal.SIGKILL, f"fault injection did not fire (exit code {p.exitcode})"
    head = W.read_head(store)
    assert head.get("pending"), "expected a commit record with pending staged chunks"
    snap = W.tree_snapshot(store)
    with ReplayBuffer.load_from(store, read_only=True) as ro:
        key, ver = _read_kv(ro, f"read-only open with {renames} of the staged chunks moved")
        assert np.array_equal(key, np.arange(300))
        assert (ver == 5).all(), f"read-only open sees versions {np.unique(ver)}; the committed state is all 5"
        s = ro.sample(256, rng=0)
        _k, v, ok = W.decode_kv(s)
        assert ok.all() and (v == 5).all()
    assert W.tree_snapshot(store) == snap, "a read-only open changed files"
    with ReplayBuffer.load_from(store) as w:
        key, ver = _read_kv(w, "writer open")
        assert np.array_equal(key, np.arange(300)) and (ver == 5).all()
    assert not W.read_head(store).get("pending")
    staging = os.path.join(store, STAGING)
    assert not os.path.exists(staging) or not any(os.scandir(staging)), os.listdir(staging)


def test_open_reader_adopts_pending_rewrite_past_its_reservation(tmp_path, procs):
    """A reader opened on a small store, then the writer grows the table and is killed while
    moving the staged chunks of a rewrite into place: the reader's next read maps staged chunks
    past the range it reserved at open (it grows first; CI once saw an IndexError here)."""
    store = str(tmp_path / "store")
    with ReplayBuffer.create(W.SPACE, cache_path=store, chunk_rows=64) as rb:
        rb.extend(W.encode_kv(np.arange(100), 0))
    with ReplayBuffer.load_from(store, read_only=True) as ro:
        assert len(ro) == 100
        with ReplayBuffer.load_from(store) as rb:
            rb.extend(W.encode_kv(np.arange(100, 5000), 0))
        p = W.start(W.rewrite_and_die, store, 5, 0)
        procs.append(p)
        p.join(60)
        assert p.exitcode == -signal.SIGKILL, f"fault injection did not fire (exit code {p.exitcode})"
        assert W.read_head(store).get("pending"), "expected a commit record with pending staged chunks"
        key, ver = _read_kv(ro, "reader opened before the table grew")
        assert np.array_equal(key, np.arange(5000)) and (ver == 5).all()


# ----------------------------------------------------------------------------------------
# orphans (docs/design.md 3.4, 3.6)
# ----------------------------------------------------------------------------------------
def test_orphans_removed_by_writer_open_not_by_reader(tmp_path, procs):
    store = str(tmp_path / "store")
    ReplayBuffer.create(W.SPACE, cache_path=store, chunk_rows=256).close()
    ready = str(tmp_path / "ready")
    p = W.start(W.hold_writer, store, ready, 1000)
    procs.append(p)
    W.wait_for_file(ready, p)
    W.kill(p)
    fakes = [
        os.path.join(store, ".trajstore-tmp", "somefile"),
        os.path.join(store, "step_data", "obs", "c", "0", "0.0123456789abcdef.partial"),
        os.path.join(store, STAGING, "123", "step_data", "obs", "c", "0", "0"),
    ]
    assert os.path.exists(os.path.join(store, "step_data", "obs", "c", "0", "0")), "chunk layout changed?"
    for f in fakes:
        os.makedirs(os.path.dirname(f), exist_ok=True)
        with open(f, "wb") as fh:
            fh.write(b"\x07" * 4096)
    snap = W.tree_snapshot(store)
    with ReplayBuffer.load_from(store, read_only=True) as ro:
        seq, ok = W.decode(ro[:])
        assert ok.all() and np.array_equal(seq, np.arange(1000))
    assert W.tree_snapshot(store) == snap, "a read-only open touched the store"
    assert all(os.path.exists(f) for f in fakes)
    with ReplayBuffer.load_from(store) as w:
        left = [os.path.relpath(f, store) for f in fakes if os.path.exists(f)]
        assert left == [], f"a writer open after a crash left orphans: {left}"
        assert not os.path.exists(os.path.join(store, STAGING, "123"))
        seq, ok = W.decode(w[:])
        assert ok.all() and np.array_equal(seq, np.arange(1000))


# ----------------------------------------------------------------------------------------
# flush(fsync=True) (docs/design.md 3.3): the call path runs, and it syncs data, folder, then head
# ----------------------------------------------------------------------------------------
class _SyncSpy:
    """Counting wrappers around ``os.fsync`` and the ``msync`` trajstore calls for memory-mapped
    chunks; both call the real function (a spy, not a mock).  ``events`` lists
    ``(kind, path-or-address, return code)`` in call order."""

    def __init__(self, monkeypatch):
        self.events: list[tuple[str, str, int]] = []
        real_fsync, real_msync = os.fsync, _syscalls.libc.msync

        def fsync_spy(fd):
            try:
                path = os.readlink(f"/proc/self/fd/{fd}")
            except OSError:
                path = "?"
            self.events.append(("fsync", path, 0))
            return real_fsync(fd)

        def msync_spy(addr, length, flags):
            rc = real_msync(addr, length, flags)
            self.events.append(("msync", str(addr), rc))
            return rc

        monkeypatch.setattr(os, "fsync", fsync_spy)
        monkeypatch.setattr(_syscalls.libc, "msync", msync_spy)

    def take(self) -> list[tuple[str, str, int]]:
        out, self.events[:] = list(self.events), []
        return out


def _head_fsync_index(events) -> int:
    heads = [i for i, e in enumerate(events) if e[0] == "fsync" and "/.trajstore-tmp/" in e[1]]
    assert heads, "the commit record was not fsynced"
    return heads[-1]


@pytest.mark.parametrize("compressor", [None, "lz4"], ids=["raw", "lz4"])
def test_flush_fsync(tmp_path, monkeypatch, compressor):
    """flush(fsync=True) syncs the chunks written, their folders, then the head and its folder."""
    spy = _SyncSpy(monkeypatch)
    store = str(tmp_path / "store")
    rb = ReplayBuffer.create(W.SPACE, cache_path=store, compressor=compressor, chunk_rows=64)
    rb.extend(W.encode(np.arange(500)))
    spy.take()
    rb.flush(fsync=True)
    synced = spy.take()
    head_i = _head_fsync_index(synced)
    assert any(e[0] == "fsync" and e[1] == store for e in synced[head_i + 1:]), \
        "the store folder was not fsynced after the commit record was replaced"
    data = [i for i, e in enumerate(synced)
            if e[0] == "msync" or (e[0] == "fsync" and "/step_data/" in e[1] and os.path.isfile(e[1]))]
    assert data, "no chunk data was synced"
    assert max(data) < head_i, "data must be synced before the commit record"
    assert all(e[2] == 0 for e in synced if e[0] == "msync"), "msync failed"
    assert any(e[0] == "fsync" and os.path.isdir(e[1]) and "/step_data/" in e[1] for e in synced[:head_i]), \
        "chunk folders were not fsynced before the commit record"
    if compressor == "lz4":
        files = {e[1] for e in synced if e[0] == "fsync" and "/step_data/img/c/" in e[1] and os.path.isfile(e[1])}
        assert len(files) == 500 // 64 + 1, f"{len(files)} img chunk files fsynced; 8 were written"
    rb.extend(W.encode(np.arange(500, 600)))
    spy.take()
    rb.flush()
    assert len(spy.take()) < len(synced), "flush() without fsync syncs as much as flush(fsync=True)"
    rb.close()
    with ReplayBuffer.load_from(store, read_only=True) as ro:
        seq, ok = W.decode(ro[:])
        assert ok.all() and np.array_equal(seq, np.arange(600))


@pytest.mark.parametrize("compressor", [None, "lz4"], ids=["raw", "lz4"])
def test_flush_fsync_covers_rows_of_earlier_plain_flush(tmp_path, monkeypatch, compressor):
    """After flush(fsync=True) the head on disk names every row written so far, so every one
    of them must be synced, including rows committed by an earlier flush() without fsync
    (those may still be dirty in the page cache)."""
    spy = _SyncSpy(monkeypatch)
    store = str(tmp_path / "store")
    rb = ReplayBuffer.create(W.SPACE, cache_path=store, compressor=compressor, chunk_rows=64)
    rb.extend(W.encode(np.arange(500)))  # img chunks 0..7
    rb.flush()
    rb.extend(W.encode(np.arange(500, 1000)))  # img chunks 7..15
    spy.take()
    rb.flush(fsync=True)
    synced = spy.take()
    need = set(range(1000 // 64 + 1))
    if compressor is None:
        img = next(f for f in rb._table.fields if f.spec.array_path.endswith("img"))  # white box: its mapping
        base, cb, nb = img._va.base, img._va.stride, img._va.nbytes
        got = {(int(e[1]) - base) // cb for e in synced if e[0] == "msync" and 0 <= int(e[1]) - base < nb}
    else:
        got = {int(e[1].split("/step_data/img/c/")[1].split("/")[0]) for e in synced
               if e[0] == "fsync" and "/step_data/img/c/" in e[1] and os.path.isfile(e[1])}
    assert need <= got, (f"flush(fsync=True) left img chunks {sorted(need - got)} unsynced; they hold rows committed "
                         "by the earlier flush() without fsync, which the durable head now names")
    rb.close()


@pytest.mark.parametrize("compressor", [None, "lz4"], ids=["raw", "lz4"])
def test_fsync_store_option(tmp_path, monkeypatch, compressor):
    """``fsync=True`` as a storage option makes every commit durable, flush() included."""
    spy = _SyncSpy(monkeypatch)
    store = str(tmp_path / "store")
    ReplayBuffer.create(W.SPACE, cache_path=store, compressor=compressor, chunk_rows=64).close()
    rb = ReplayBuffer.load_from(store, fsync=True)
    rb.extend(W.encode(np.arange(100)))
    spy.take()
    rb.flush()
    events = spy.take()
    assert any(e[0] == "fsync" and "/.trajstore-tmp/" in e[1] for e in events), \
        "load_from(..., fsync=True): flush() did not fsync the commit record"
    rb.extend(W.encode(np.arange(100, 200)))
    spy.take()
    rb.close()
    assert any(e[0] == "fsync" and "/.trajstore-tmp/" in e[1] for e in spy.take()), "close() did not fsync"
    with ReplayBuffer.load_from(store, read_only=True) as ro:
        seq, ok = W.decode(ro[:])
        assert ok.all() and np.array_equal(seq, np.arange(200))
