"""How ``ZarrReplayBuffer.add`` stages rows (trajstore/sb3/replay.py, trajstore/sb3/_inplace.py,
trajstore/core/stager.py).

``add`` stages only the observations; action, reward, done, timeout and step are gathered from
the SB3 RAM arrays when a block is handed over (``RowStager.fill``), and a block ends where a
chunk ends.  On memory-mapped fields the observations are stored straight into their rows of the
chunk files ("in-place", ``InPlaceRows``) once the block's old rows are out of the commit record;
elsewhere ("staged": a kernel that refuses ``MADV_POPULATE_WRITE``, ``TRAJSTORE_NO_MMAP``) they
are staged in RAM and written at the hand-over.  These tests check what reaches the store on
every path: after reads that hand over part-filled blocks, after SB3's ``_setup_learn`` edit,
after a hand-over or a block start that failed (full disk), while a reader process samples,
after a fork of the writer and after a SIGKILL of the writer, every stored row equals what
stable-baselines3's own buffer holds.
"""

from __future__ import annotations

import errno
import itertools
import multiprocessing
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("stable_baselines3")

import _workers as W  # noqa: E402
from gymnasium import spaces  # noqa: E402
from stable_baselines3.common.buffers import ReplayBuffer  # noqa: E402

import trajstore.storage.location  # noqa: E402
from trajstore import ReplayBuffer as StoreBuffer  # noqa: E402
from trajstore.errors import ClosedError, ConcurrentWriteError, LockedError, StoreFullError  # noqa: E402
from trajstore.sb3 import ZarrReplayBuffer  # noqa: E402
from trajstore.storage.fields import _syscalls, _vmap  # noqa: E402

IMAGE = spaces.Box(0, 255, (84, 84, 4), np.uint8)
SMALL_IMAGE = spaces.Box(0, 255, (32, 32, 4), np.uint8)  # one page a row: in place (InPlaceRows.MIN_ROW_BYTES)
VECTOR = spaces.Box(-np.inf, np.inf, (5,), np.float32)  # staged on every path: rows too small to go in place
PATHS = ["in-place", "staged", "no-mmap"]


@pytest.fixture(params=PATHS)
def row_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """The path ``add``'s observations take: "in-place" (this kernel's), "staged" (a kernel that
    refuses ``MADV_POPULATE_WRITE``: the advice is replaced by one no kernel knows, so the real
    EINVAL fallback runs) or "no-mmap" (``TRAJSTORE_NO_MMAP``: no field is memory-mapped).
    Forked children inherit it."""
    if request.param == "in-place" and not _syscalls.populate_write_works():
        pytest.skip("this kernel refuses MADV_POPULATE_WRITE: rows are staged")
    monkeypatch.setattr(_syscalls, "POPULATE_WRITE", _syscalls.POPULATE_WRITE)  # restored after the test
    if request.param == "staged":
        monkeypatch.setattr(_syscalls, "MADV_POPULATE_WRITE", 0x7FFF)
        monkeypatch.setattr(_syscalls, "POPULATE_WRITE", None)  # tried again, with that advice
    elif request.param == "no-mmap":
        monkeypatch.setattr(_syscalls, "AVAILABLE", False)
    return str(request.param)


def _path_taken(buf: ZarrReplayBuffer) -> str:
    """The path ``buf.add`` took (after at least one add)."""
    if buf._in_place is not None and buf._in_place.active:
        return "in-place"
    return "staged" if type(buf._rb._table.fields[0]).__name__ == "MappedField" else "no-mmap"


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


@pytest.mark.parametrize("space, n_envs", [(IMAGE, 1), (SMALL_IMAGE, 2), (VECTOR, 2)],
                         ids=["image-1env", "image-2envs", "vector-2envs"])
def test_rows_equal_sb3_across_partial_blocks_and_edits(tmp_path: Path, space: spaces.Box, n_envs: int,
                                                        row_path: str) -> None:
    """Reads between adds hand over part-filled blocks; SB3's ``dones[pos - 1] = True`` edits a
    staged or an already stored row; the ring wraps; the buffer is reopened and sampled (which
    maps its rows read-only in the new process) before it adds again: the store still equals
    SB3's buffer."""
    act = spaces.Discrete(4)
    size = 600
    ref = ReplayBuffer(size * n_envs, space, act, "cpu", n_envs=n_envs)
    ours = ZarrReplayBuffer(size * n_envs, space, act, "cpu", n_envs=n_envs, cache_path=tmp_path / "rb")
    rng, draws = np.random.default_rng(0), np.random.default_rng(1)
    for t in range(int(size * 2.3)):
        tr = _transition(space, n_envs, t, rng)
        ref.add(*tr)
        ours.add(*tr)
        if t == size + 150:
            ours.close()
            ours = ZarrReplayBuffer(size * n_envs, space, act, "cpu", n_envs=n_envs, cache_path=tmp_path / "rb",
                                    resume=True)
            for _ in range(40):
                ours.sample(64)
        if draws.random() < 0.02:
            ours.sample(4)  # hands the staged rows over, mid-block
        if draws.random() < 0.01:
            for buf in (ref, ours):
                buf.dones[(buf.pos - 1) % buf.buffer_size] = True  # what SB3's _setup_learn does
    ours.sample(4)  # hand over and commit what is staged, without the RAM edits' rewrite of close
    assert _path_taken(ours) == ("staged" if row_path == "in-place" and space is VECTOR else row_path)
    if _path_taken(ours) == "in-place":  # every obs and next obs leaf (one per env)
        assert ours._in_place is not None and len(ours._in_place._leaves) == 2 * n_envs
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
    """A full disk while a staged block is handed over raises StoreFullError from ``add``; the
    transition stays added (SB3's position moved on) and staged, and is written once the disk has
    room."""
    monkeypatch.setattr(_syscalls, "POPULATE_WRITE", False)  # staged: the frames' pwrite meets the full disk
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


def _fail_once(monkeypatch: pytest.MonkeyPatch, module: Any, name: str,
               when: Callable[..., bool] = lambda *args: True) -> list[int]:
    """Make ``module.name`` raise ENOSPC once, at its first call from now whose arguments ``when``
    accepts; the returned list gets an entry when it did."""
    real, failed = getattr(module, name), []

    def full_once(*args: Any, **kwargs: Any) -> Any:
        if not failed and when(*args):
            failed.append(1)
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, full_once)
    return failed


@pytest.mark.parametrize("fails", ["chunk file", "eviction record"])
def test_failed_block_start_adds_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fails: str) -> None:
    """In place, a block's rows are prepared before its first row is stored: a new chunk file
    (created on a fresh ring's first lap) or the record evicting the rows of a full ring's next
    block.  A full disk there raises StoreFullError from ``add`` before anything of the transition
    was added (SB3's position stays); the same add succeeds once the disk has room, and the store
    equals SB3's buffer."""
    if not _syscalls.populate_write_works():
        pytest.skip("this kernel refuses MADV_POPULATE_WRITE: rows are staged")
    act = spaces.Discrete(4)
    ref = ReplayBuffer(400, IMAGE, act, "cpu")
    ours = ZarrReplayBuffer(400, IMAGE, act, "cpu", cache_path=tmp_path / "rb", commit_interval=3600)
    rng = np.random.default_rng(6)
    failed: list[int] = []
    refused = 0
    for t in range(700):
        tr = _transition(IMAGE, 1, t, rng)
        if t == 100 and fails == "chunk file":  # the ring's second chunk file is created at row 256
            failed = _fail_once(monkeypatch, os, "posix_fallocate")
        if t == 450:
            ours.flush()  # a record that counts rows (none yet: commit_interval is an hour)
        if t == 500 and fails == "eviction record":  # the ring is full: the next block evicts first
            failed = _fail_once(monkeypatch, trajstore.storage.location, "replace_file",
                                lambda src, dest: str(dest).endswith(W.HEAD))
        before = (ours.pos, ours.size())
        try:
            ours.add(*tr)
        except StoreFullError:
            assert (ours.pos, ours.size()) == before, "a refused block start added the transition"
            refused += 1
            monkeypatch.undo()
            ours.add(*tr)
        ref.add(*tr)
        assert ours.pos == ref.pos and ours.size() == ref.size()
    assert failed and refused == 1 and _path_taken(ours) == "in-place"
    ours.sample(4)
    shutil.copytree(tmp_path / "rb", tmp_path / "killed")  # the folder as a SIGKILL now leaves it
    ours.close()
    _stored_equals_sb3(tmp_path / "killed", ref, 1, 700, closed=False)
    _stored_equals_sb3(tmp_path / "rb", ref, 1, 700)


def test_in_place_rows_are_evicted_first_and_stored_once(tmp_path: Path) -> None:
    """In place, a frame is in its chunk file as soon as ``add`` returns (before its block is
    handed over: no second copy at the hand-over), and every slot stored into holds a row that the
    last commit record no longer counts, also when a plain commit between two blocks counted every
    row again.  A block after one that a read handed over part-filled is staged (the file holds
    its frames only after the hand-over); the block after that is in place again."""
    if not _syscalls.populate_write_works():
        pytest.skip("this kernel refuses MADV_POPULATE_WRITE: rows are staged")
    cap = 600
    ours = ZarrReplayBuffer(cap, IMAGE, spaces.Discrete(4), "cpu", cache_path=tmp_path / "rb", commit_interval=3600)
    rng = np.random.default_rng(7)
    row = int(np.prod(IMAGE.shape))
    placed = staged = 0
    for t in range(int(cap * 2.5)):
        if t % 97 == 96:
            ours.sample(4)  # a read hands the block over part-filled: the next one is staged
        ours.add(*_transition(IMAGE, 1, t, rng))
        st, ip = ours._stage, ours._in_place
        assert st is not None and ip is not None and ip.active
        table = st.table
        if not st.n:  # a block was handed over: a plain record (as the store's commit timer writes at a
            table.store.commit()  # hand-over) counts every row again, up to the next block's slots
            continue
        field = table.fields[0]
        p = (table.state.end + st.n - 1) % cap
        k, r = divmod(p, field.C)
        fd = os.open(field._path(k), os.O_RDONLY)  # a plain read of the file, not through the buffer
        try:
            got = os.pread(fd, row, r * row)
        finally:
            os.close(fd)
        if np.shares_memory(st.bufs[0], ip._own[0]):  # staged: the file has it after the hand-over
            staged += 1
            continue
        placed += 1
        assert got == bytes([t % 251]) * row, f"add {t}: the frame is not in its chunk file"
        committed = table.store.committed.tables[table.name]
        # the slot just stored into held absolute row end + n - 1 - cap: out of the record
        assert committed.start > table.state.end + st.n - 1 - cap or committed.end <= committed.start, f"add {t}"
    assert placed > 2 * staged > 0
    ours.close()


def _read_bytes() -> int:
    """Bytes this process has read from disk (``/proc/self/io``)."""
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("read_bytes"))


def test_rows_out_of_the_page_cache_are_staged(tmp_path: Path) -> None:
    """A block whose pages are not in the page cache (a ring larger than RAM) is staged: stored in
    place, every page would first be read from disk only to be overwritten, where ``pwrite`` of
    whole pages reads nothing.  The rows still equal SB3's."""
    if not _syscalls.populate_write_works() or not os.path.exists("/proc/self/io"):
        pytest.skip("needs MADV_POPULATE_WRITE and /proc/self/io")
    act, cap = spaces.Discrete(4), 1024
    ref = ReplayBuffer(cap, IMAGE, act, "cpu")
    ours = ZarrReplayBuffer(cap, IMAGE, act, "cpu", cache_path=tmp_path / "rb")
    rng = np.random.default_rng(9)
    t = 0
    for t in range(cap + 100):
        tr = _transition(IMAGE, 1, t, rng)
        ref.add(*tr)
        ours.add(*tr)
    ours.close()
    os.sync()
    chunks = [p for p in (tmp_path / "rb" / "transitions").rglob("*") if p.is_file() and "/c/" in str(p)]
    assert len(chunks) >= 8
    for p in chunks:  # out of the page cache: clean and mapped by no one
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    ours = ZarrReplayBuffer(cap, IMAGE, act, "cpu", cache_path=tmp_path / "rb", resume=True)
    before = _read_bytes()
    for t in range(t + 1, t + 1 + 2 * 256):  # two chunks' worth of rows
        tr = _transition(IMAGE, 1, t, rng)
        ref.add(*tr)
        ours.add(*tr)
    read = _read_bytes() - before
    assert _path_taken(ours) == "in-place"  # (on: its blocks were staged because of the page cache)
    assert read < 2 * 256 * IMAGE.shape[0] * IMAGE.shape[1] * IMAGE.shape[2] // 4, f"{read} bytes read"
    ours.close()
    _stored_equals_sb3(tmp_path / "rb", ref, 1, t + 1)


@pytest.mark.parametrize("dropped", ["none", "middle", "end"])
def test_residency_probe_sees_a_range_out_of_the_page_cache(tmp_path: Path, dropped: str) -> None:
    """``VirtualArray.resident`` probes one page per PROBE_BYTES of a block (and its last page),
    not every page: a block with 1 MiB of its middle or of its end out of the page cache is still
    seen as not resident (staged), a block wholly in it as resident.  (Pages leave the page cache
    in whole folios: a single page of a large folio cannot be dropped alone, so the middle's whole
    2 MiB piece is dropped: the writer fills such pieces as one folio.)"""
    with StoreBuffer.create(IMAGE, cache_path=tmp_path / "rb", capacity=512) as rb:
        rb.extend(np.zeros((512, *IMAGE.shape), np.uint8))
    os.sync()
    rb = StoreBuffer.load_from(tmp_path / "rb")
    try:
        field = rb._table.fields[0]
        va, C = field._va, field.C
        field.ensure_mapped(0, C, create=False)
        lo, hi = 0, min(C, 256)
        path = field._path(0)
        row = int(np.prod(IMAGE.shape))
        assert (hi - lo) * row > 4 * _vmap.PROBE_BYTES
        fd = os.open(path, os.O_RDONLY)
        try:
            os.pread(fd, (hi - lo) * row, 0)  # all in the page cache
            assert va.resident(lo, hi)
            start, end = va._page_range(lo, hi)
            if dropped == "middle":
                at = ((start + end) // 2 - va.base) & ~(_syscalls.HUGE - 1)
                os.posix_fadvise(fd, at, _syscalls.HUGE, os.POSIX_FADV_DONTNEED)
            elif dropped == "end":
                os.posix_fadvise(fd, end - va.base - _vmap.PROBE_BYTES, _vmap.PROBE_BYTES, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
        assert va.resident(lo, hi) == (dropped == "none")
    finally:
        rb.close()


def test_a_forked_child_never_stores_into_the_parents_files(tmp_path: Path, procs: list) -> None:
    """A child forked while a block is open (its rows viewed in the mapping it shares with the
    parent) adds hundreds of transitions after the parent stored, handed over and committed that
    block: the child's are staged in its own memory and its hand-over is refused (LockedError), so
    none lands in the parent's chunk files; the parent's rows equal SB3's."""
    act = spaces.Discrete(4)
    ref = ReplayBuffer(500, IMAGE, act, "cpu")
    ours = ZarrReplayBuffer(500, IMAGE, act, "cpu", cache_path=tmp_path / "rb", commit_interval=3600)
    rng = np.random.default_rng(8)
    t = -1

    def add() -> None:
        nonlocal t
        t += 1
        tr = _transition(IMAGE, 1, t, rng)
        ref.add(*tr)
        ours.add(*tr)

    while t < 700 or ours._stage is None or ours._stage.n == 0:  # a full ring, a block part-filled
        add()
    assert _path_taken(ours) == "in-place" or not _syscalls.populate_write_works()
    go, done = str(tmp_path / "go"), str(tmp_path / "child_done")
    p = W.start(_child_adds, ours, go, done, ctx=multiprocessing.get_context("fork"))
    procs.append(p)
    while ours._stage.n:  # the parent fills the block the child saw open, hands it over ...
        add()
    ours.flush()  # ... and commits it; then the child adds
    W.touch(go)
    p.join(60)
    assert p.exitcode == 0 and os.path.exists(done)
    ours.close()
    _stored_equals_sb3(tmp_path / "rb", ref, 1, t + 1)


def _child_adds(buf: ZarrReplayBuffer, go: str, done: str) -> None:
    """In a forked child of the writer, once ``go`` exists: add frames of 250 (not what the
    parent stores at those positions)."""
    W.wait_for_file(go, None)
    frame = np.full((1, *IMAGE.shape), 250, np.uint8)
    refused = 0
    for _ in range(300):
        try:
            buf.add(frame, frame, np.zeros((1, 1)), np.zeros(1, np.float32), np.zeros(1), [{}])
        except LockedError:
            refused += 1
    assert refused
    W.touch(done)


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
        rb.append_leaves([np.zeros(3, np.float32)])
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
    for i in itertools.count():
        obs, nxt, action, _reward, done, infos = _transition(IMAGE, 1, t, rng)
        rb.add(obs, nxt, action, np.array([t], np.float32), done, infos)
        t += 1
        if rng.random() < 0.01:
            rb.sample(8)  # a part-filled block handed over
        if i == 100:  # the path its adds take, for the test to check
            Path(ready + ".tmp").write_text(_path_taken(rb))
            os.replace(ready + ".tmp", ready + ".path")


@pytest.mark.parametrize("row_path", ["in-place", "staged"], indirect=True)
def test_a_reader_samples_right_rows_while_the_writer_adds(tmp_path: Path, procs: list, row_path: str) -> None:
    """A reader process samples the transitions store while a writer adds image rows, ring lap
    after ring lap: every row it gets is whole (its observations, next observations, reward and
    step belong to one transition), although the writer stores rows into the slots of rows it
    evicted (in place: before the block is handed over)."""
    store = str(tmp_path / "rb")
    ZarrReplayBuffer(CAPACITY, IMAGE, spaces.Discrete(4), "cpu", cache_path=store).close()
    ready = str(tmp_path / "ready")
    p = W.start(_writer, store, ready, 11, ctx=multiprocessing.get_context("fork"))
    procs.append(p)
    W.wait_for_file(ready, p)
    checked = gave_up = newest = 0
    deadline = time.monotonic() + 120  # (a guard against a writer that stopped, not a timing)
    with StoreBuffer.load_from(tmp_path / "rb" / "transitions", read_only=True) as reader:
        while (checked < 500 or newest < 4 * CAPACITY) and time.monotonic() < deadline:
            if not len(reader):
                continue
            try:
                rows = reader.sample(32)
            except ConcurrentWriteError:  # evicted faster than 100 consistent attempts: allowed, counted
                gave_up += 1
                continue
            t = rows["step"]
            np.testing.assert_array_equal(rows["reward"][:, 0], t.astype(np.float32))
            assert (rows["obs.0"] == (t % 251).astype(np.uint8)[:, None, None, None]).all(), "a damaged obs"
            assert (rows["next_obs.0"] == ((t + 1) % 251).astype(np.uint8)[:, None, None, None]).all(), \
                "a damaged next obs"
            checked += 1
            newest = max(newest, int(t.max()))
    assert p.is_alive(), "the writer died"
    W.kill(p)
    procs.remove(p)
    assert checked >= 500 and newest >= 4 * CAPACITY and checked > gave_up
    assert Path(ready + ".path").read_text() == row_path


@pytest.mark.parametrize("row_path", ["in-place", "staged"], indirect=True)
def test_sigkill_while_adding_images(tmp_path: Path, procs: list, row_path: str) -> None:
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
    taken = {Path(f).read_text() for f in map(str, tmp_path.glob("ready*.path"))}
    assert taken == {row_path}
