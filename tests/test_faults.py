"""Faults of the filesystem and of the process around a store (docs/design.md 3, invariants 3, 5, 9).

- A real full disk: a 24 MiB tmpfs mounted here (root only; skipped otherwise).  The writer
  runs in a subprocess, so a ``SIGBUS`` (a store through a mapping into a hole the full
  filesystem cannot fill) shows as a signal exit and fails the test.
- Injected faults: ``ENOSPC`` and ``EIO`` raised by the Nth call to ``os.pwrite``, ``os.write``,
  ``os.posix_fallocate``, ``os.replace``, the commit record's move (``replace_file``), zarr's local
  chunk write or ``Location.put``, for every N
  an operation makes (extend, flush, set_at, remove_at, a ring's extend).  The call raises; the
  store on disk holds the rows of one commit, all intact; after the fault is gone the same
  writer keeps working and the store verifies.
- ``.zip`` stores are read-only: no writable entry point truncates or changes one.
- A child forked from a single writer does not keep the store locked after the parent closed.

Every row's content encodes its id (``x[0]``), so a row read back is checked whole.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pytest
import zarr.storage._local as zarr_local
from gymnasium.spaces import Box, Dict

import trajstore.storage.location
from trajstore import ReplayBuffer, TrajectoryReplayBuffer, verify_store
from trajstore.errors import ReadOnlyError, StoreExistsError, StoreFullError
from trajstore.storage.fields import _syscalls

IMG = (16, 16, 3)  # 768-byte rows: a 64-row chunk is 12 pages; 86+ rows go through pwrite


def _space() -> Dict:
    return Dict([("img", Box(0, 255, IMG, np.uint8)), ("x", Box(-np.inf, np.inf, (3,), np.float32))])


def _rows(ids: Any) -> dict[str, np.ndarray]:
    """Rows whose every byte depends on their id (``x[:, 0]`` is the id)."""
    ids = np.asarray(ids, dtype=np.int64)
    size = int(np.prod(IMG))
    img = ((np.arange(size)[None] * 7 + ids[:, None] * 131 + (ids[:, None] ** 2) % 97) % 256).astype(np.uint8)
    x = np.stack([ids, ids * 0.5 + 1, -ids], axis=1).astype(np.float32)
    return {"img": img.reshape(len(ids), *IMG), "x": x}


def _ids_of(values: dict[str, np.ndarray], where: str) -> list[int]:
    """The ids of rows read back, after checking that each row is exactly the row of its id."""
    ids = values["x"][:, 0].astype(np.int64)
    want = _rows(ids)
    for k in ("img", "x"):
        bad = np.flatnonzero((values[k] != want[k]).reshape(len(ids), -1).any(axis=1))
        assert bad.size == 0, f"{where}: rows {bad[:5].tolist()} of {k!r} are torn or foreign (ids {ids[bad[:5]].tolist()})"
    return ids.tolist()


def _read_ids(path: Path, where: str) -> list[int]:
    with ReplayBuffer.load_from(path, read_only=True) as ro:
        return _ids_of(ro[:], where) if len(ro) else []


# ---------------------------------------------------------------------------- injected faults

class _Faults:
    """Makes the ``fail_at``-th call (counted over every patched function together, only while
    armed) raise ``OSError(err)``; counts calls when ``fail_at`` is None."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.armed = False
        self.calls = 0
        self.fail_at: int | None = None
        self.err = errno.ENOSPC
        self.hit: str | None = None
        for mod, name in ((os, "pwrite"), (os, "write"), (os, "posix_fallocate"), (os, "replace"),
                          (trajstore.storage.location, "replace_file"),  # (the commit record's move)
                          (zarr_local, "_put"), (trajstore.storage.location.Location, "put")):
            monkeypatch.setattr(mod, name, self._wrap(getattr(mod, name), name))

    def _wrap(self, fn: Callable, name: str) -> Callable:
        def patched(*args: Any, **kwargs: Any) -> Any:
            if self.armed:
                self.calls += 1
                if self.calls == self.fail_at:
                    self.hit = name
                    raise OSError(self.err, f"injected {os.strerror(self.err)} in {name}")
            return fn(*args, **kwargs)
        return patched

    def arm(self, fail_at: int | None, err: int = errno.ENOSPC) -> None:
        self.armed, self.calls, self.fail_at, self.err, self.hit = True, 0, fail_at, err, None

    def disarm(self) -> None:
        self.armed = False


BASE = 100  # committed rows of every template store


def _template(root: Path, layout: str, capacity: int | None) -> Path:
    path = root / f"template-{layout}-{capacity}"
    if not path.exists():
        kw = {"compressor": "lz4"} if layout == "lz4" else {}
        with ReplayBuffer.create(_space(), cache_path=path, capacity=capacity, chunk_rows=64,
                                 commit_interval=3600, **kw) as rb:
            rb.extend(_rows(range(BASE)))
    return path


# Each operation: (run it on a writer whose next new id is 1000, ids before, ids after).
def _op_extend(rb: ReplayBuffer, before: list[int]) -> list[int]:
    rb.extend(_rows(range(1000, 1150)))  # new chunk files, written by pwrite (>= 64 KiB)
    rb.extend(_rows(range(1150, 1160)))  # and through the mapping
    rb.flush()
    return before + list(range(1000, 1160))


def _op_flush(rb: ReplayBuffer, before: list[int]) -> list[int]:
    rb.disarmed_extend(_rows(range(1000, 1070)))  # written without faults; only the commit is faulted
    rb.flush()
    return before + list(range(1000, 1070))


def _op_set_at(rb: ReplayBuffer, before: list[int]) -> list[int]:
    rb.set_at([1, 70], _rows([1001, 1070]))
    after = list(before)
    after[1], after[70] = 1001, 1070
    return after


def _op_remove_at(rb: ReplayBuffer, before: list[int]) -> list[int]:
    rb.remove_at([2, 65])
    return [v for i, v in enumerate(before) if i not in (2, 65)]


OPS = {"extend": _op_extend, "flush": _op_flush, "set_at": _op_set_at, "remove_at": _op_remove_at}


def _run_case(tmp_path: Path, faults: _Faults, template: Path, op: str, fail_at: int | None, err: int,
              capacity: int | None, same_writer: bool = True) -> tuple[int, bool]:
    """One faulted operation on a fresh copy of ``template``; returns (calls counted, raised).

    Then, once the fault is gone, either the ``same_writer`` extends and commits, or it is
    dropped as if its process had died (nothing committed, lock released) and a new writer
    opens the store, extends and commits."""
    path = tmp_path / f"s-{op}-{fail_at}-{err}"
    shutil.copytree(template, path)
    before = list(range(BASE))
    rb = ReplayBuffer.load_from(path, commit_interval=3600)
    first_new = 2000

    def disarmed_extend(v: Any) -> None:
        armed, faults.armed = faults.armed, False
        try:
            rb.extend(v)
        finally:
            faults.armed = armed

    rb.disarmed_extend = disarmed_extend  # type: ignore[attr-defined]
    raised: BaseException | None = None
    faults.arm(fail_at, err)
    try:
        after = OPS[op](rb, before)
    except OSError as e:
        raised = e
        after = None
    finally:
        faults.disarm()
    calls = faults.calls
    where = f"{op} with {errno.errorcode[err]} at call {fail_at} ({faults.hit})"
    if raised is not None:
        if faults.hit is None:
            raise raised  # not ours
        assert raised.errno == err, f"{where}: raised {raised!r}"
        if err == errno.ENOSPC and not isinstance(raised, StoreFullError):
            NOT_WRAPPED.add(f"{op}: {faults.hit}")
    if after is None:
        after = OPS[op](_Dry(), before)
    # What may be on disk and in the writer: the rows from before or after the operation, or
    # after one of its steps (each extend and the flush of _op_extend stand alone).
    states = [before, after] + ([before + list(range(1000, 1150))] if op == "extend" else [])
    seq = after if op in ("set_at", "remove_at") else before + [i for i in after if i not in before]

    def allowed(ids: list[int], extra: list[int]) -> bool:
        if capacity is None:
            return any(ids == st + extra for st in states)
        # A ring: a run of consecutive rows of what was written (an extend may have evicted
        # some, and a ring's extend may commit part of its rows), then the rows written since.
        head = ids[: len(ids) - len(extra)]
        if ids[len(head):] != extra:
            return False
        return not head or (head[0] in seq and seq[seq.index(head[0]) : seq.index(head[0]) + len(head)] == head)

    # On disk: the rows of one commit record, every one intact.
    got = _read_ids(path, f"{where}, on disk after the fault")
    if capacity is None:
        assert got in states, f"{where}: the store on disk holds ids {_short(got)}; expected before or after"
        if raised is None and fail_at is not None:  # a fault that was absorbed must not have lost the operation
            assert got == after, f"{where}: no error, yet the store holds ids {_short(got)}"
    else:
        assert allowed(got, []), f"{where}: ring rows {_short(got)}"
    # The fault is gone: the same writer (or a new one, after this one died) keeps working.
    if not same_writer:
        rb._store.close()  # what a killed process leaves: no commit, the lock released by the kernel
        rb._closed = True
        rb = ReplayBuffer.load_from(path, commit_interval=3600)
    rb.extend(_rows(range(first_new, first_new + 10)))
    rb.flush()
    extra = list(range(first_new, first_new + 10))
    got = _read_ids(path, f"{where}, after writing on")
    assert allowed(got, extra), f"{where}: after writing on, ids {_short(got)}"
    rb.close()
    rep = verify_store(path)
    assert rep.ok, f"{where}: {[f.message for f in rep.faults]}"
    with ReplayBuffer.load_from(path) as again:  # a new writer opens it (rolls a pending rewrite forward)
        assert _ids_of(again[:], f"{where}, reopened") == got
    shutil.rmtree(path)
    return calls, raised is not None


class _Dry:
    """Stands in for a buffer to compute an operation's "after" ids without running it."""

    def __getattr__(self, name: str) -> Callable:
        return lambda *a, **k: None


def _short(ids: list[int]) -> str:
    return str(ids) if len(ids) <= 12 else f"[{ids[0]}..{ids[-1]}] ({len(ids)} rows; first {ids[:6]}, last {ids[-6:]})"


#: ENOSPC faults that surfaced as a plain OSError rather than StoreFullError (for the record;
#: those come from writes outside fields.py: Location.put of the commit record, zarr metadata).
NOT_WRAPPED: set[str] = set()


_REWRITE_SLOW = [pytest.mark.slow]


@pytest.mark.parametrize("layout", ["raw", "lz4"])
@pytest.mark.parametrize("op,same_writer", [
    ("extend", True), ("flush", True), ("set_at", False), ("remove_at", False),
    pytest.param("set_at", True, marks=_REWRITE_SLOW), pytest.param("remove_at", True, marks=_REWRITE_SLOW)])
def test_injected_faults_leave_one_intact_commit_and_a_working_writer(tmp_path, monkeypatch, layout, op, same_writer):
    """Every call an operation makes to the file-writing functions fails in turn (ENOSPC, then EIO
    for a sample): the operation raises that error; the store on disk holds the rows from before
    or from after it, all intact; the writer (or, for rewrites, a new writer after this one died)
    then extends, commits and closes, and the store verifies and reopens."""
    template = _template(tmp_path, layout, None)
    faults = _Faults(monkeypatch)
    total, _ = _run_case(tmp_path, faults, template, op, None, errno.ENOSPC, None)
    assert total > 0, f"{op} made no file write that could fail"
    cases = [(n, errno.ENOSPC) for n in _picks(total, 12)] + [(n, errno.EIO) for n in sorted({1, (total + 1) // 2, total})]
    _run_cases(tmp_path, faults, template, op, cases, None, same_writer)


def _picks(total: int, most: int) -> list[int]:
    """Call numbers 1..total, or ``most`` of them spread evenly (first and last included), so the
    file stays within its time budget on a busy 2-core machine."""
    return sorted(set(np.linspace(1, total, min(total, most)).round().astype(int).tolist()))


def _run_cases(tmp_path: Path, faults: _Faults, template: Path, op: str, cases: list[tuple[int, int]],
               capacity: int | None, same_writer: bool = True) -> None:
    """Every case, then one assertion listing every case that failed (not just the first)."""
    failed, raised = [], 0
    for n, err in cases:
        try:
            raised += _run_case(tmp_path, faults, template, op, n, err, capacity, same_writer)[1]
        except AssertionError as e:
            failed.append(str(e).split("\n")[0])
            shutil.rmtree(tmp_path / f"s-{op}-{n}-{err}", ignore_errors=True)
    assert not failed, f"{len(failed)} of {len(cases)} faults broke the store or the writer:\n" + "\n".join(failed)
    assert raised > 0, f"no injected fault of {op} surfaced as an error"


def test_injected_faults_in_a_full_ring(tmp_path, monkeypatch):
    """A ring's extend commits eviction records between its writes: a fault anywhere leaves
    consecutive intact rows on disk, and the writer goes on."""
    template = _template(tmp_path, "raw", 128)
    faults = _Faults(monkeypatch)
    total, _ = _run_case(tmp_path, faults, template, "extend", None, errno.ENOSPC, 128)
    _run_cases(tmp_path, faults, template, "extend", [(n, errno.ENOSPC if n % 3 else errno.EIO) for n in _picks(total, 20)], 128)


def test_full_disk_on_a_new_chunk_file_is_store_full_error_and_changes_nothing(tmp_path, monkeypatch):
    """ENOSPC while reserving a new raw chunk file: StoreFullError (an OSError, errno ENOSPC) that
    names the chunk file; no chunk or temp file is left; len and contents unchanged; writing
    works again once space returns."""
    path = tmp_path / "s"
    rb = ReplayBuffer.create(_space(), cache_path=path, chunk_rows=64, commit_interval=3600)
    rb.extend(_rows(range(60)))
    rb.flush()
    files = sorted(p.relative_to(path) for p in path.rglob("*") if p.is_file())
    real = os.posix_fallocate

    def full(fd: int, off: int, n: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", full)
    with pytest.raises(StoreFullError) as info:
        rb.extend(_rows(range(60, 70)))  # crosses into chunk 1 of img
    assert info.value.errno == errno.ENOSPC and isinstance(info.value, OSError)
    assert "step_data/img/c/1/0/0/0" in str(info.value) and "No space left" in str(info.value)
    assert len(rb) == 60 and _ids_of(rb[:], "after the failed extend") == list(range(60))
    assert sorted(p.relative_to(path) for p in path.rglob("*") if p.is_file()) == files
    monkeypatch.setattr(os, "posix_fallocate", real)
    rb.extend(_rows(range(60, 70)))
    rb.close()
    assert _read_ids(path, "after space returned") == list(range(70))


def test_rows_appended_before_a_full_disk_are_kept(tmp_path, monkeypatch):
    """append stages rows and writes them a block at a time: when the block write meets a full
    disk, the rows of earlier append calls (which returned normally) must not be lost; only the
    failing call's row is in doubt.  Once space returns, a flush commits them."""
    path = tmp_path / "s"
    rb = ReplayBuffer.create(_space(), cache_path=path, chunk_rows=64, commit_interval=3600)
    real = os.posix_fallocate

    def full(fd: int, off: int, n: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", full)
    accepted = 0
    rows = _rows(range(1000))
    with pytest.raises(StoreFullError):
        for i in range(1000):
            rb.append({k: v[i] for k, v in rows.items()})
            accepted += 1
    monkeypatch.setattr(os, "posix_fallocate", real)
    rb.flush()
    assert len(rb) >= accepted, f"{accepted} appends returned normally, but only {len(rb)} rows are kept"
    assert _ids_of(rb[:], "appended rows") == list(range(len(rb)))
    rb.close()


def test_a_failed_ring_write_never_commits_torn_rows(tmp_path, monkeypatch):
    """A full ring's block write fails after its first field was written (EIO from the second
    field's pwrite): the rows whose slots were overwritten are gone, never committed torn."""
    space = Dict([("a", Box(0, 255, (768,), np.uint8)), ("b", Box(0, 255, (768,), np.uint8))])
    cap = 4096  # blocks of capacity/32 = 128 rows: 96 KiB per field, written with pwrite

    def rows(lo: int, n: int) -> dict[str, np.ndarray]:
        v = np.repeat((np.arange(lo, lo + n) % 251).astype(np.uint8)[:, None], 768, axis=1)
        return {"a": v, "b": v.copy()}

    path = tmp_path / "s"
    rb = ReplayBuffer.create(space, cache_path=path, capacity=cap, commit_interval=3600)
    for lo in range(0, cap + 256, 128):
        rb.extend(rows(lo, 128))
    rb.flush()
    real, calls = os.pwrite, [0]

    def pwrite(*args: Any) -> int:
        calls[0] += 1
        if calls[0] == 2:
            raise OSError(errno.EIO, "injected EIO")
        return real(*args)

    monkeypatch.setattr(os, "pwrite", pwrite)
    with pytest.raises(OSError) as info:
        rb.extend(rows(cap + 256, 128))
    assert info.value.errno == errno.EIO
    monkeypatch.setattr(os, "pwrite", real)
    rb.flush()
    with ReplayBuffer.load_from(path, read_only=True) as ro:
        v = ro[:]
        torn = np.flatnonzero(v["a"][:, 0] != v["b"][:, 0])
        assert torn.size == 0, f"{torn.size} torn rows committed (logical rows {torn[:5].tolist()}...)"
    rb.extend(rows(cap + 256, 10))
    rb.close()
    assert verify_store(path).ok


def test_chunk_files_have_blocks_under_their_rows_and_the_fallback_writes_zeros(tmp_path, monkeypatch):
    """A new raw chunk file has the full size of a chunk (what zarr reads) but disk blocks only
    under the rows written and a bounded step beyond (no hole a mapped store could fault on, no
    2 MiB per field for a small store); where posix_fallocate is unsupported (EOPNOTSUPP) zeros
    are written whole instead."""
    row = 84 * 84 * 4
    for unsupported in (False, True):
        if unsupported:
            def nope(fd: int, *args: int) -> None:
                raise OSError(errno.EOPNOTSUPP, "Operation not supported")
            monkeypatch.setattr(os, "posix_fallocate", nope)
            monkeypatch.setattr(_syscalls, "_fallocate_in_place", nope)  # (what growing a file calls)
        path = tmp_path / f"s{unsupported}"
        with ReplayBuffer.create(Box(0, 255, (84, 84, 4), np.uint8), cache_path=path) as rb:
            rb.append(np.full((84, 84, 4), 9, np.uint8))
            rb.flush()
            chunk = path / "step_data" / "c" / "0" / "0" / "0" / "0"
            st = chunk.stat()
            assert st.st_size == rb._store.tables["step_data"].fields[0].C * row  # a whole chunk for zarr
            if unsupported:
                assert st.st_blocks * 512 >= st.st_size, f"chunk file has holes ({st.st_blocks * 512} of {st.st_size})"
            else:
                assert row <= st.st_blocks * 512 <= row + (1 << 20), f"{st.st_blocks * 512} bytes allocated for one row"
            data = chunk.read_bytes()
            assert data[:row] == b"\x09" * row and data.count(0) == len(data) - row


def test_a_writer_allocates_the_blocks_under_its_rows_a_reader_changes_nothing(tmp_path):
    """A chunk file with holes (every new one past its rows; older trajstore versions made whole
    ones sparse) gets its blocks allocated by the writer up to the rows it stores, before it
    stores them, with its content unchanged; a reader never changes a byte."""
    path = tmp_path / "s"
    space = Box(0, 255, (64, 64), np.uint8)  # 4 KiB rows: the chunk is 512 pages
    with ReplayBuffer.create(space, cache_path=path) as rb:
        rb.extend(np.arange(3 * 64 * 64).reshape(3, 64, 64).astype(np.uint8))
    chunk = path / "step_data" / "c" / "0" / "0" / "0"
    data = chunk.read_bytes()
    tmp = chunk.with_name("sparse")
    with open(tmp, "wb") as f:  # the same bytes, holes where they are zero
        f.write(data[: 3 * 4096])
        f.truncate(len(data))
    os.replace(tmp, chunk)
    assert chunk.stat().st_blocks * 512 < 4 * 4096
    with ReplayBuffer.load_from(path, read_only=True) as ro:
        assert ro[:].shape == (3, 64, 64)
    assert chunk.stat().st_blocks * 512 < 4 * 4096  # the reader wrote nothing
    with ReplayBuffer.load_from(path) as rb:
        rb.extend(np.ones((20, 64, 64), np.uint8))
        rb.flush()
        assert 23 * 4096 <= chunk.stat().st_blocks * 512 < len(data)  # rows allocated, the rest a hole
    assert chunk.read_bytes()[: 3 * 4096] == data[: 3 * 4096]
    with ReplayBuffer.load_from(path, read_only=True) as ro:
        assert len(ro) == 23 and (ro[3:] == 1).all()


# ---------------------------------------------------------------------------- a real full disk

_CHILD = textwrap.dedent('''
    import errno, json, os, sys
    import numpy as np
    from gymnasium.spaces import Box
    from trajstore import ReplayBuffer, verify_store
    from trajstore.errors import TrajstoreError

    fs, layout, capacity = sys.argv[1], sys.argv[2], (None if sys.argv[3] == "none" else int(sys.argv[3]))
    SHAPE = (84, 84, 4)
    NOISE = np.random.default_rng(0).integers(0, 256, int(np.prod(SHAPE)), dtype=np.uint8)
    def rows(lo, n):
        """Incompressible rows (lz4 must fill the disk too), each one unique to its number."""
        return np.stack([np.roll(NOISE, 37 * i) ^ np.uint8(i % 251) for i in range(lo, lo + n)]).reshape(n, *SHAPE)
    def check(path, what):
        """Every committed row is the row of its absolute number; returns (start, end)."""
        head = json.load(open(os.path.join(path, "trajstore.head.json")))["tables"]["step_data"]
        with ReplayBuffer.load_from(path, read_only=True) as ro:
            got = ro[:]
        start, end = head["start"], head["end"]
        assert len(got) >= 0
        want = rows(end - len(got), len(got))
        assert (got == want).all(), f"{what}: committed rows differ from what was written"
        rep = verify_store(path)
        assert rep.ok, f"{what}: verify: {[f.message for f in rep.faults]}"
        return end - len(got), end
    out = {}
    filler = os.path.join(fs, "filler")
    with open(filler, "wb") as f:
        # Deleted later, it leaves room for one more raw chunk of 256 frames; a ring (two chunks of
        # 64 frames, 3.4 MiB) meets a full disk only with less than that free.
        f.write(os.urandom((8 if capacity is None else 21) << 20))
    path = os.path.join(fs, "store")
    kw = {"compressor": "lz4"} if layout == "lz4" else {}
    if capacity is not None:
        kw["chunk_rows"] = 64  # a ring of two chunks that wraps within the disk, and fills it
    rb = ReplayBuffer.create(Box(0, 255, SHAPE, np.uint8), cache_path=path, capacity=capacity,
                             commit_interval=3600, **kw)
    added = committed = 0
    sizes = [1, 3, 1, 2, 1, 5]  # 1-2 rows go through the mapping, 3+ through pwrite
    err = None
    for step in range(100000):
        n = sizes[step % len(sizes)]
        try:
            rb.extend(rows(added, n))
            added += n
            if step % 4 == 3:
                rb.flush()
                committed = added
        except OSError as e:
            err = e
            break
    assert err is not None, "the disk never filled up"
    out["error"] = [type(err).__name__, err.errno, str(err)]
    assert err.errno == errno.ENOSPC, repr(err)
    # The buffer survived: what it holds is what it had before the failed call (a ring writes
    # an extend in blocks of its eviction step: the blocks before the failed one stay written).
    if capacity is None:
        assert len(rb) == added, (len(rb), added)
    else:
        assert min(added, capacity) <= len(rb) < min(added + n, capacity + 1), (len(rb), added, n)
        out["ring_rows_of_the_failed_extend_kept"] = len(rb) - min(added, capacity)
        added += len(rb) - min(added, capacity)
    start, end = check(path, "after the error")
    assert end >= committed, (end, committed)
    # Now fill the last free pages too: the commit record, the lock file and the temp files
    # of a reopening writer meet a filesystem with no byte left.
    fd = os.open(os.path.join(fs, "filler2"), os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        while True:
            os.write(fd, b"x" * 4096)
    except OSError as e:
        assert e.errno == errno.ENOSPC
    finally:
        os.close(fd)
    try:
        rb.extend(rows(added, 1))
        added += 1
    except OSError as e:
        assert e.errno == errno.ENOSPC, repr(e)
    try:
        rb.flush()
        out["flush_on_full_disk"] = "ok"
        committed = added
    except OSError as e:
        out["flush_on_full_disk"] = [type(e).__name__, e.errno]
    try:
        rb.close()
        out["close_on_full_disk"] = "ok"
    except OSError as e:
        out["close_on_full_disk"] = [type(e).__name__, e.errno]
    start, end = check(path, "after close on a full disk")
    assert end >= committed
    try:  # a writer reopens on the full disk, or says why in a trajstore error
        rb = ReplayBuffer.load_from(path, commit_interval=3600)
        out["reopen_on_full_disk"] = "ok"
    except TrajstoreError as e:
        out["reopen_on_full_disk"] = [type(e).__name__, str(e)]
        rb = None
    os.unlink(filler)  # space returns
    os.unlink(os.path.join(fs, "filler2"))
    if rb is None:
        rb = ReplayBuffer.load_from(path, commit_interval=3600)
    assert len(rb) == end - start
    more = 20 if capacity is None else capacity + 20  # a ring wraps around
    for lo in range(end, end + more, 7):
        rb.extend(rows(lo, min(7, end + more - lo)))
    rb.flush()
    rb.close()
    start2, end2 = check(path, "after writing on")
    assert end2 == end + more, (end2, end)
    out["rows"] = [committed, end, end2]
    print("RESULT " + json.dumps(out))
''')


@pytest.fixture
def tiny_fs(small_tmpfs):
    """A 24 MiB tmpfs (root only), unmounted at teardown."""
    return small_tmpfs(24)


@pytest.mark.parametrize("layout,capacity", [("raw", None), ("raw", 128), ("lz4", None)])
def test_a_full_disk_is_an_error_not_sigbus(tiny_fs, layout, capacity):
    """(84, 84, 4) uint8 rows until a 24 MiB filesystem is full, in a subprocess: the write raises
    OSError ENOSPC, the process lives on, every committed row is intact and the store verifies;
    close and reopen work or raise trajstore errors; once a filler file is deleted, writing
    resumes and commits."""
    res = subprocess.run([sys.executable, "-c", _CHILD, str(tiny_fs), layout, str(capacity).lower()],
                         capture_output=True, text=True, timeout=120)
    if res.returncode < 0:
        pytest.fail(f"the writer was killed by {signal.Signals(-res.returncode).name} on a full disk:\n{res.stderr[-3000:]}")
    assert res.returncode == 0, res.stderr[-3000:]
    out = json.loads(res.stdout.split("RESULT ", 1)[1])
    assert out["error"][1] == errno.ENOSPC
    if layout == "raw":
        assert out["error"][0] == "StoreFullError", out["error"]


# ---------------------------------------------------------------------------- zip stores

def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_no_writable_entry_point_changes_a_zip(tmp_path, capsys):
    """A zip written by dumps is read-only: writable opens raise ReadOnlyError before touching it,
    create without overwrite raises StoreExistsError, and even create with overwrite (a buffer
    cannot be built inside a zip) and the CLI's writable commands leave its bytes as they were."""
    from trajstore.cli import main

    src = tmp_path / "src"
    with ReplayBuffer.create(Box(0, 255, (84, 84, 4), np.uint8), cache_path=src) as rb:
        rb.extend(np.random.default_rng(0).integers(0, 255, (60, 84, 84, 4), dtype=np.uint8))
        rb.dumps(tmp_path / "r.zip")
        rb.dumps(tmp_path / "r.zip")  # dumps replaces a zip it wrote before
    with TrajectoryReplayBuffer.create(Box(-1, 1, (3,), np.float32), cache_path=tmp_path / "t") as tb:
        tb.extend(np.zeros((5, 3), np.float32))
        tb.dumps(tmp_path / "t.zip")
    for name, kind in (("r.zip", ReplayBuffer), ("t.zip", TrajectoryReplayBuffer)):
        z = tmp_path / name
        digest, listing = _sha(z), sorted(os.listdir(tmp_path))
        for cls in (ReplayBuffer, TrajectoryReplayBuffer):
            with pytest.raises(ReadOnlyError, match="read_only=True"):
                cls.load_from(z)
            with pytest.raises(ReadOnlyError):
                cls.load_from(str(z), multiprocessing=True)
        with pytest.raises(StoreExistsError):
            ReplayBuffer.create(Box(0, 1, (2,)), cache_path=z)
        with pytest.raises(StoreExistsError):
            TrajectoryReplayBuffer.create(Box(0, 1, (2,)), cache_path=z)
        with pytest.raises(ReadOnlyError, match="written once"):
            ReplayBuffer.create(Box(0, 1, (2,)), cache_path=z, overwrite=True)
        for argv in (["repair", str(z)], ["demo", str(z)]):
            assert main(argv) != 0
        assert _sha(z) == digest and sorted(os.listdir(tmp_path)) == listing, name
        with kind.load_from(z, read_only=True) as ro:
            assert len(ro) == (60 if kind is ReplayBuffer else 5)
    capsys.readouterr()


def test_a_failed_dumps_leaves_the_previous_zip(tmp_path, monkeypatch):
    """dumps to a zip writes beside it and renames at the end: a copy that fails half way (a full
    disk) leaves the zip that was there, and no temp file."""
    with ReplayBuffer.create(Box(0, 255, (16,), np.uint8), cache_path=tmp_path / "s", chunk_rows=4096) as rb:
        rb.extend(np.ones((9000, 16), np.uint8))
        z = tmp_path / "s.zip"
        rb.dumps(z)
        digest = _sha(z)
        rb.extend(np.ones((10, 16), np.uint8))
        calls = {"n": 0}
        real = trajstore.storage.location.Location.put

        def put(self: Any, key: str, data: bytes, **kw: Any) -> None:
            from trajstore.storage.zipstore import ZipWriter

            if isinstance(self.zstore, ZipWriter):  # the zip's keys (not the commit's published metadata)
                calls["n"] += 1
                if calls["n"] == 3:
                    raise OSError(errno.ENOSPC, "No space left on device")
            return real(self, key, data, **kw)

        monkeypatch.setattr(trajstore.storage.location.Location, "put", put)
        with pytest.raises(OSError):
            rb.dumps(z)
        monkeypatch.setattr(trajstore.storage.location.Location, "put", real)
        import gc

        gc.collect()
    assert _sha(z) == digest and sorted(p.name for p in tmp_path.iterdir()) == ["s", "s.zip"]
    with ReplayBuffer.load_from(z, read_only=True) as ro:
        assert len(ro) == 9000


# ---------------------------------------------------------------------------- fork

def test_a_forked_child_does_not_keep_the_writer_lock(tmp_path):
    """A child forked from a single writer (it sleeps on) does not hold the store: once the parent
    closed, a new writer opens at once; the child is no writer (it cannot commit)."""
    path = tmp_path / "s"
    rb = ReplayBuffer.create(Box(-1, 1, (3,), np.float32), cache_path=path)
    rb.extend(np.zeros((4, 3), np.float32))
    rb.flush()
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report whether it still holds a lock descriptor, then sleep
        try:
            lock = rb._store.lock
            os.write(w, b"1" if lock._fd is None and lock.forked_child else b"0")
            time.sleep(30)
        finally:
            os._exit(0)
    try:
        os.close(w)
        assert os.read(r, 1) == b"1", "the child kept the writer lock descriptor"
        rb.close()
        with ReplayBuffer.load_from(path) as again:  # the child still lives
            assert os.waitpid(pid, os.WNOHANG) == (0, 0)
            again.append(np.ones(3, np.float32))
            assert len(again) == 5
    finally:
        os.close(r)
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)


def test_a_forked_child_cannot_write_or_commit(tmp_path):
    """The child of a single writer gets LockedError from extend/append/flush (nothing reaches the
    files, whose mapped chunks it shares with its parent), and its close commits nothing."""
    from trajstore.errors import LockedError

    path = tmp_path / "s"
    rb = ReplayBuffer.create(Box(-1, 1, (3,), np.float32), cache_path=path, capacity=8)
    rb.extend(np.zeros((8, 3), np.float32))
    rb.flush()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            refused = 0
            for call in (lambda: rb.extend(np.ones((3, 3), np.float32)), lambda: rb.flush(),
                         lambda: rb.set_at(0, np.ones(3, np.float32)),
                         lambda: rb.append(np.ones(3, np.float32))):  # (a ring of 8 stages 1 row)
                try:
                    call()
                except LockedError:
                    refused += 1
            rb.close()  # commits nothing, releases only this process's maps
            code = 0 if refused == 4 else 2
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, "the child could write through its parent's buffer"
    assert len(rb) == 8 and (rb[:] == 0).all()
    rb.close()
    with ReplayBuffer.load_from(path, read_only=True) as ro:
        assert len(ro) == 8 and (ro[:] == 0).all()


def _in_forked_child(fn: Callable[[], int], deadline: int = 20) -> int:
    """Run ``fn`` in a forked child under an alarm; its exit code (-1: it hung)."""
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            signal.signal(signal.SIGALRM, signal.SIG_DFL)
            signal.alarm(deadline)
            code = fn()
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    if os.WIFSIGNALED(status):
        return -1
    return os.waitstatus_to_exitcode(status)


@pytest.mark.parametrize("multiprocessing", [False, True])
def test_a_forked_childs_garbage_collection_never_commits(tmp_path, multiprocessing):
    """A writer inherited through fork and collected in the child commits nothing, even when the
    collection runs inside zarr's event-loop setup (a commit there took zarr's loop lock again and
    hung the child: the full suite's hostile-store children hung this way on buffers that earlier
    tests left open)."""
    import gc

    import zarr.core.sync as zsync

    path = tmp_path / "s"
    held = [ReplayBuffer.create(Box(-1, 1, (3,), np.float32), cache_path=path, multiprocessing=multiprocessing)]
    held[0].extend(np.zeros((2, 3), np.float32))
    held[0].flush()
    held[0].extend(np.ones((3, 3), np.float32))  # a single writer has not committed these yet
    with ReplayBuffer.load_from(path, read_only=True) as ro:
        before = len(ro)
        generation = ro._store.committed.generation

    def child() -> int:
        get_lock = getattr(zsync, "_get_lock", None)
        with (get_lock() if get_lock is not None else contextlib.nullcontext()):
            held.clear()
            gc.collect()
        return 0

    assert _in_forked_child(child) == 0, "the child hung or failed collecting its inherited writer"
    with ReplayBuffer.load_from(path, read_only=True) as ro:
        assert (len(ro), ro._store.committed.generation) == (before, generation), "the child committed"
    held[0].close()
    with ReplayBuffer.load_from(path, read_only=True) as ro:
        assert len(ro) == 5 and (ro[2:] == 1).all()


def test_a_writer_collected_in_zarrs_event_loop_still_commits(tmp_path):
    """Buffers sit in reference cycles, so the cyclic collector frees a dropped writer in
    whichever thread it runs, zarr's IO thread included, where a commit would wait on that very
    loop (it failed: "coroutine was never awaited", rows lost).  Such a writer is kept and
    commits before the next store opens (or at exit), so the next writer of its path opens."""
    import gc

    from zarr.core.sync import sync

    path = tmp_path / "s"
    held = [ReplayBuffer.create(Box(-1, 1, (3,), np.float32), cache_path=path)]
    held[0].extend(np.ones((5, 3), np.float32))  # not committed

    async def collect_in_loop() -> None:
        held.clear()
        gc.collect()

    sync(collect_in_loop())
    # Opening a store first commits the deferred writer and releases its lock: a new writer opens.
    with ReplayBuffer.load_from(path) as again:
        assert len(again) == 5 and (again[:] == 1).all()


def test_a_writer_collected_in_another_event_loop_commits_at_once(tmp_path):
    """Only zarr's own loop defers the commit: a writer collected while another loop runs in this
    thread (Jupyter's, a user's asyncio.run) commits and releases its lock right there."""
    import asyncio
    import gc

    from trajstore.buffers import base

    path = tmp_path / "s"
    held = [ReplayBuffer.create(Box(-1, 1, (3,), np.float32), cache_path=path)]
    held[0].extend(np.ones((4, 3), np.float32))  # not committed

    async def collect() -> None:
        held.clear()
        gc.collect()

    asyncio.run(collect())
    assert not base._DEFERRED
    assert (path / "trajstore.lock").read_text().strip() == "closed"  # released by the commit-and-close


def test_a_forked_child_of_a_lockless_writer_is_no_writer():
    """Stores without a lock file (in memory, remote URLs) have one writer too: the process that
    opened them.  Its forked child gets LockedError, as the child of a local writer does."""
    from trajstore.errors import LockedError

    rb = ReplayBuffer.create(Box(-1, 1, (3,), np.float32), cache_path=None, capacity=8)
    rb.extend(np.zeros((2, 3), np.float32))

    def child() -> int:
        try:
            rb.append(np.ones(3, np.float32))
            rb.flush()
        except LockedError:
            return 0
        return 2

    assert _in_forked_child(child) == 0
    rb.append(np.ones(3, np.float32))  # the parent still writes
    assert len(rb) == 3
    rb.close()


def test_multiprocessing_writers_keep_their_shared_lock_across_fork(tmp_path):
    """multiprocessing=True: a forked child keeps the shared lock (it may write through the buffer
    it inherited), so a single writer stays refused while it lives; it writes with its own op lock."""
    from trajstore.errors import LockedError

    path = tmp_path / "s"
    rb = ReplayBuffer.create(Box(-1, 1, (3,), np.float32), cache_path=path, multiprocessing=True)
    rb.extend(np.zeros((2, 3), np.float32))
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            rb.extend(np.ones((3, 3), np.float32))
            os.write(w, b"w")
            time.sleep(30)
            code = 0
        finally:
            os._exit(code)
    try:
        os.close(w)
        assert os.read(r, 1) == b"w"
        rb.close()
        with pytest.raises(LockedError):
            ReplayBuffer.load_from(path)
        with ReplayBuffer.load_from(path, read_only=True) as ro:
            assert len(ro) == 5
    finally:
        os.close(r)
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    with ReplayBuffer.load_from(path) as again:  # the child is gone: free
        assert len(again) == 5


def test_appends_after_a_failed_block_retry_it_and_drop_nothing(tmp_path, monkeypatch):
    """A full disk while a block of staged single-row appends is handed to the table: the append that
    filled the block raises, the next one tries the block again (the same error while the disk stays
    full, never an IndexError), and once space returns every appended row is stored, in order."""
    import trajstore.core.table as table_mod

    space = Box(0, 255, (84, 84, 4), np.uint8)
    rb = ReplayBuffer.create(space, cache_path=tmp_path / "s", commit_interval=3600)
    rows = rb._stager.rows
    real = table_mod.Table.extend
    full = {"on": True}

    def extend(self, arrays, n):
        if full["on"]:
            raise StoreFullError(errno.ENOSPC, "injected: no space left", None)
        return real(self, arrays, n)

    monkeypatch.setattr(table_mod.Table, "extend", extend)
    frame = lambda i: np.full((84, 84, 4), i % 251, np.uint8)  # noqa: E731
    for i in range(rows - 1):
        rb.append(frame(i))
    with pytest.raises(StoreFullError):
        rb.append(frame(rows - 1))  # fills the block: its hand-over fails
    with pytest.raises(StoreFullError):
        rb.append(frame(rows))  # tries the block again first: still full, this row not taken
    full["on"] = False
    rb.append(frame(rows))
    for i in range(rows + 1, rows + 5):
        rb.append(frame(i))
    assert len(rb) == rows + 5
    got = rb[:]
    assert [int(x[0, 0, 0]) for x in got] == [i % 251 for i in range(rows + 5)]
    rb.close()
