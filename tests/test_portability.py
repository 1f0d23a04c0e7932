"""Portability (Linux, macOS, Windows), tested on Linux.

- The memory-mapped engine is optional: ``TRAJSTORE_NO_MMAP=1`` (what macOS, Windows, a libc that
  ctypes cannot load, or a filesystem refusing ``MAP_FIXED`` file mappings get) makes raw fields
  use the portable ``ChunkedField``.  The core suites run again with it set, the bytes on disk are
  the same, and stores written by one engine read the same through the other.
- ``import trajstore`` works without ``fcntl`` (Windows), and the writer lock's path there
  (:mod:`filelock`'s descriptor lock, :class:`trajstore.storage.locks.FilelockBackend`) keeps the
  lock's semantics: a single writer excludes writers, readers are never blocked, a SIGKILLed
  holder releases it, multiprocessing writers are refused with a reason.  The backend runs here
  as it is, on the real library (which takes ``flock`` on Linux and ``LockFileEx`` on Windows,
  tested there by filelock's own CI): the child processes hide ``fcntl`` from trajstore, so
  :func:`trajstore.storage.locks.lock_backend` picks it as it would on Windows.

What only a real macOS or Windows machine can show (rename onto open files, NTFS file ids,
mandatory locks) is not tested here.
"""

from __future__ import annotations

import ctypes
import errno
import hashlib
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
from gymnasium.spaces import Box, Dict, Discrete

import trajstore
from trajstore import ReplayBuffer, TrajectoryReplayBuffer
from trajstore.errors import LockedError
from trajstore.storage.fields import _syscalls
from trajstore.storage.fields import layout as fields
from trajstore.storage.fields.chunked import ChunkedField
from trajstore.storage.fields.mapped import MappedField
from trajstore.storage.locks import FilelockBackend, WriterLock

ROOT = Path(__file__).resolve().parent.parent
SPACE = Dict({"obs": Box(-np.inf, np.inf, (5,), np.float32), "img": Box(0, 255, (8, 8, 3), np.uint8),
              "a": Discrete(4)})


def _rows(lo: int, hi: int) -> dict[str, np.ndarray]:
    i = np.arange(lo, hi)
    return {"obs": np.repeat(i.astype(np.float32)[:, None], 5, 1),
            "img": ((i[:, None, None, None] + np.arange(192).reshape(8, 8, 3)) % 251).astype(np.uint8),
            "a": i % 4}


def _env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.pop("TRAJSTORE_NO_MMAP", None)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.update(extra)
    return env


def _run(code: str, *, env: dict[str, str] | None = None, timeout: float = 120) -> str:
    """Run ``code`` in a fresh interpreter; return its stdout (the test fails on a non-zero exit)."""
    p = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                       env=env or _env(), timeout=timeout, cwd=str(ROOT))
    assert p.returncode == 0, f"exit {p.returncode}\nstdout:\n{p.stdout}\nstderr:\n{p.stderr[-4000:]}"
    return p.stdout


def _engines(rb: ReplayBuffer | TrajectoryReplayBuffer) -> set[str]:
    return {type(f).__name__ for t in rb._store.tables.values() for f in t.fields}


def _chunk_digests(path: Path) -> dict[str, str]:
    """Every chunk file of a store, hashed (metadata and the commit records left out)."""
    out = {}
    for dirpath, _dirs, files in os.walk(path):
        for name in files:
            rel = os.path.relpath(os.path.join(dirpath, name), path)
            if "/c/" in rel.replace(os.sep, "/"):
                out[rel] = hashlib.sha256(Path(dirpath, name).read_bytes()).hexdigest()
    return out


# ----------------------------------------------------------------------------------------
# the mapped engine is optional
# ----------------------------------------------------------------------------------------
def test_the_capability_check_is_computed_at_import_and_never_raises():
    assert _syscalls.AVAILABLE is (sys.platform.startswith("linux") and not os.environ.get("TRAJSTORE_NO_MMAP"))
    out = _run("""
        import trajstore.storage.fields._syscalls as v
        print(v.AVAILABLE, v.UNAVAILABLE_REASON)
    """, env=_env(TRAJSTORE_NO_MMAP="1"))
    assert out.strip() == "False TRAJSTORE_NO_MMAP is set"
    # A libc that ctypes cannot load: import works, the engine is off, stores work.
    out = _run("""
        import ctypes
        real = ctypes.CDLL
        def cdll(name, *a, **k):
            if name is None:
                raise OSError("no libc here")
            return real(name, *a, **k)
        ctypes.CDLL = cdll
        import tempfile, numpy as np, gymnasium as gym
        import trajstore
        from trajstore.storage.fields import _syscalls
        print(_syscalls.AVAILABLE, _syscalls.UNAVAILABLE_REASON)
        d = tempfile.mkdtemp()
        with trajstore.ReplayBuffer.create(gym.spaces.Box(-1, 1, (1024,), np.float32), cache_path=d + "/s") as rb:
            rb.extend(np.ones((10, 1024), np.float32))
            print(sorted({type(f).__name__ for t in rb._store.tables.values() for f in t.fields}))
        with trajstore.ReplayBuffer.load_from(d + "/s", read_only=True) as ro:
            print(len(ro), float(ro[9].sum()))
    """)
    lines = out.splitlines()
    assert lines[0].startswith("False libc cannot be loaded (no libc here")
    assert lines[1:] == ["['ChunkedField']", "10 1024.0"]


def write_stores(path: str) -> None:
    """A ring (wrapped, appended row by row, set_at), an unbounded store (remove_at) and a
    trajectory ring with episode data (run in a child: one engine per process)."""
    with ReplayBuffer.create(SPACE, cache_path=f"{path}/ring", capacity=300, chunk_rows=64) as rb:
        rb.extend(_rows(0, 250))
        rb.flush()
        rb.extend(_rows(250, 420))
        for i in range(420, 450):
            rb.append({k: v[0] for k, v in _rows(i, i + 1).items()})
        rb.set_at([3, 7], _rows(1000, 1002))
        print(sorted(_engines(rb)))
    with ReplayBuffer.create(SPACE, cache_path=f"{path}/unbounded", chunk_rows=64) as rb:
        rb.extend(_rows(0, 200))
        rb.remove_at([5, 100])
    with TrajectoryReplayBuffer.create(SPACE, cache_path=f"{path}/traj", step_data_capacity=256, chunk_rows=64,
                                       episode_data_instance_space=Dict({"r": Box(-1e9, 1e9, (), np.float64)})) as tb:
        for e in range(5):
            tb.extend(_rows(e * 80, e * 80 + 80))
            tb.set_current_episode_data({"r": np.float64(e)})
            tb.mark_episode_end()


def read_stores(path: str) -> None:
    """Print what a reader of :func:`write_stores`' stores sees."""
    for name in ("ring", "unbounded"):
        with ReplayBuffer.load_from(f"{path}/{name}", read_only=True) as ro:
            x = ro[:]
            print(name, len(ro), ro.offset, x["obs"][:, 0].astype(int).tolist(), int(x["img"].sum()),
                  ro.sample(16, rng=3)["obs"][:, 0].astype(int).tolist())
    with TrajectoryReplayBuffer.load_from(f"{path}/traj", read_only=True) as tb:
        item, meta = tb.get_at_with_metadata(slice(None))
        print("traj", len(tb), np.asarray(meta["episode_ids"]).tolist(), np.asarray(item["episode_data"]["r"]).tolist(),
              int(item["step_data"]["img"].sum()))


def _call(fn: str, path: Path, no_mmap: bool) -> str:
    env = _env(PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "tests")]), **({"TRAJSTORE_NO_MMAP": "1"} if no_mmap else {}))
    return _run(f"import test_portability as T; T.{fn}({str(path)!r})", env=env)


@pytest.mark.skipif(not _syscalls.AVAILABLE, reason="the mapped engine is off in this process")
def test_no_mmap_gives_the_same_bytes_and_both_engines_read_each_others_stores(tmp_path):
    """The same writes through both engines leave byte-identical chunk files; each engine reads
    what the other wrote (ring, unbounded, trajectory), and sample gives the same rows."""
    assert _call("write_stores", tmp_path / "mapped", False).strip() == "['MappedField']"
    assert _call("write_stores", tmp_path / "chunked", True).strip() == "['ChunkedField']"
    for name in ("ring", "unbounded", "traj"):
        a, b = _chunk_digests(tmp_path / "mapped" / name), _chunk_digests(tmp_path / "chunked" / name)
        assert a and a == b, f"{name}: chunk files differ between the engines"
    outs = {(engine, written): _call("read_stores", tmp_path / written, engine == "chunked")
            for engine in ("mapped", "chunked") for written in ("mapped", "chunked")}
    assert len(set(outs.values())) == 1, outs
    assert outs["mapped", "mapped"].startswith("ring 300 150 [150, 151, 152, 1000, 154, 155, 156, 1001, 158")


def test_a_filesystem_that_refuses_shared_mappings_falls_back_per_store(tmp_path, monkeypatch):
    """The first mapping of a store's file failing with EINVAL (what a filesystem without shared
    mmap answers) makes that store's raw fields use ChunkedField; nothing raises."""
    if not _syscalls.AVAILABLE:
        pytest.skip("the mapped engine is off in this process")
    real = _syscalls.libc

    class NoSharedMaps:
        def __getattr__(self, name):
            return getattr(real, name)

        def mmap(self, addr, n, prot, flags, fd, off):
            if flags & _syscalls.MAP_SHARED:
                ctypes.set_errno(errno.EINVAL)
                return _syscalls.MAP_FAILED
            return real.mmap(addr, n, prot, flags, fd, off)

    path = tmp_path / "s"
    ReplayBuffer.create(SPACE, cache_path=path, chunk_rows=64).close()
    monkeypatch.setattr(_syscalls, "libc", NoSharedMaps())
    monkeypatch.setattr(fields, "_MAPS", {})
    with ReplayBuffer.load_from(path) as rb:
        assert _engines(rb) == {"ChunkedField"}
        rb.extend(_rows(0, 100))
        assert rb[99]["a"] == 3
    assert _syscalls.AVAILABLE  # other stores (other filesystems) still map
    monkeypatch.setattr(_syscalls, "libc", real)
    monkeypatch.setattr(fields, "_MAPS", {})
    with ReplayBuffer.load_from(path, read_only=True) as ro:
        assert _engines(ro) == {"MappedField"}
        assert np.array_equal(ro[:]["img"], _rows(0, 100)["img"])


@pytest.mark.slow
def test_core_suites_pass_without_memory_mappings():
    """test_replay_buffer, test_trajectory and test_views (reads, writes, rings, views, sample,
    sequences, rewrites) in subprocesses with TRAJSTORE_NO_MMAP=1.

    Left out: their lz4 and zstd parametrizations, whose fields are ChunkedField with or without
    memory mappings (the very code this suite already ran).  The two suites run side by side, one
    per core (about halves this test's time on 2 cores)."""
    if os.environ.get("TRAJSTORE_NO_MMAP"):
        pytest.skip("this whole run is already without memory mappings")
    shards = [["tests/test_replay_buffer.py"], ["tests/test_trajectory.py", "tests/test_views.py"]]
    procs = [subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k",
                               "not lz4 and not zstd", *files], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, env=_env(TRAJSTORE_NO_MMAP="1"), cwd=str(ROOT)) for files in shards]
    try:
        outs = [p.communicate(timeout=900)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for files, p, out in zip(shards, procs, outs):
        assert p.returncode == 0, f"{files}:\n{out[-6000:]}"
        assert " passed" in out and "failed" not in out, f"{files}:\n{out[-6000:]}"


def test_the_fallback_is_the_engine_of_raw_fields(tmp_path, monkeypatch):
    monkeypatch.setattr(_syscalls, "AVAILABLE", False)
    with ReplayBuffer.create(SPACE, cache_path=tmp_path / "s", capacity=100, chunk_rows=64) as rb:
        assert _engines(rb) == {"ChunkedField"}
        rb.extend(_rows(0, 150))
        assert rb.offset == 50 and int(rb[0]["obs"][0]) == 50
        assert len(rb.sample(32, rng=0)["a"]) == 32
    assert isinstance(ChunkedField, type) and isinstance(MappedField, type)


# ----------------------------------------------------------------------------------------
# the writer lock without fcntl
# ----------------------------------------------------------------------------------------
def test_filelock_backend_keeps_the_lock_semantics(tmp_path):
    """In one process: an exclusive lock excludes every other descriptor of the file and goes with
    its descriptor; shared locks are refused with the reason (no multiprocessing writers)."""
    import filelock

    b = FilelockBackend(filelock)
    fds = [os.open(tmp_path / "lock", os.O_RDWR | os.O_CREAT) for _ in range(3)]
    single, other, op = fds
    try:
        assert b.try_exclusive(single)
        assert not b.try_exclusive(other)
        with pytest.raises(LockedError, match="shared file locks"):
            b.try_shared(other)
        b.forget(single)
        os.close(single)  # closing drops the lock (as a process's death does)
        assert b.try_exclusive(other)
        b.release(other)
        b.acquire(op)  # the waiting form (the publish journal's lock) takes a free lock
        assert not b.try_exclusive(other)
        b.release(op)
        assert b.try_exclusive(other)
    finally:
        for fd in fds[1:]:
            os.close(fd)
    assert b.shares is False


def test_multiprocessing_writers_are_refused_without_shared_locks(tmp_path, monkeypatch):
    """Where the system's lock cannot share, a multiprocessing writer is refused before it opens
    anything (the lock file is not even created), naming why; a single writer opens."""
    import filelock

    from trajstore.storage import locks
    from trajstore.storage.location import resolve_location

    monkeypatch.setattr(locks, "_BACKEND", FilelockBackend(filelock))
    ReplayBuffer.create(SPACE, cache_path=tmp_path / "s", chunk_rows=64).close()
    (tmp_path / "s" / "trajstore.lock").unlink()
    loc = resolve_location(tmp_path / "s", read_only=False, storage_options=None, must_exist=True)
    with pytest.raises(LockedError, match="one writer per store, or shards"):
        WriterLock(loc, shared=True)
    assert not (tmp_path / "s" / "trajstore.lock").exists()
    with ReplayBuffer.load_from(tmp_path / "s") as rb:
        rb.extend(_rows(0, 3))
    with ReplayBuffer.load_from(tmp_path / "s", read_only=True) as ro:
        assert len(ro) == 3


_NO_FCNTL = """
    import sys
    # Third-party and standard modules first: on Linux they use fcntl themselves (subprocess,
    # multiprocessing, filelock's flock), on Windows they do not; what is tested is trajstore's
    # own choice of lock.
    import numpy, zarr, gymnasium, fsspec, numcodecs, multiprocessing.sharedctypes, subprocess
    if {with_filelock}:
        import filelock
        assert filelock.lock_descriptor  # (its flock stands in for Windows' LockFileEx here)
    else:
        sys.modules["filelock"] = None
    sys.modules["fcntl"] = None  # as on Windows: `import fcntl` raises ImportError
"""


def _child(code: str, with_filelock: bool = True) -> str:
    return textwrap.dedent(_NO_FCNTL.format(with_filelock=with_filelock)) + textwrap.dedent(code)


def test_import_without_fcntl_and_the_windows_lock_across_processes(tmp_path):
    """``import trajstore`` with ``fcntl`` unavailable picks filelock's lock; across processes a
    single writer excludes writers (not readers), multiprocessing writers are refused, and a
    SIGKILLed holder releases the lock."""
    store = tmp_path / "s"
    hold = tmp_path / "hold.py"
    hold.write_text(_child(f"""
        import sys, time, numpy as np
        import trajstore
        from trajstore import ReplayBuffer
        from trajstore.storage import locks
        assert type(locks.lock_backend()).__name__ == "FilelockBackend"
        assert "fcntl" not in {{m for m in sys.modules if sys.modules[m] is not None}}
        from test_portability import SPACE, _rows
        mp = sys.argv[1] == "mp"
        if sys.argv[2] == "create":
            rb = ReplayBuffer.create(SPACE, cache_path={str(store)!r}, chunk_rows=64, multiprocessing=mp)
        else:
            rb = ReplayBuffer.load_from({str(store)!r}, multiprocessing=mp)
        rb.extend(_rows(0, 10)); rb.flush()
        open(sys.argv[3], "w").close()
        time.sleep(60)
    """))
    probe = tmp_path / "probe.py"
    probe.write_text(_child(f"""
        import sys
        from trajstore import ReplayBuffer
        from trajstore.errors import LockedError
        out = []
        for mode in ("single", "mp", "read"):
            try:
                rb = ReplayBuffer.load_from({str(store)!r}, read_only=mode == "read", multiprocessing=mode == "mp")
            except LockedError as e:
                out.append(mode + ":locked")
            else:
                out.append(mode + ":" + str(len(rb)))
                rb.close()
        print(" ".join(out))
    """))
    env = _env(PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "tests")]))

    def start(mode: str, how: str, ready: Path) -> subprocess.Popen:
        p = subprocess.Popen([sys.executable, str(hold), mode, how, str(ready)], env=env, cwd=str(ROOT),
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        t_end = time.monotonic() + 60
        while not ready.exists():
            assert p.poll() is None, p.communicate()[1][-3000:]
            assert time.monotonic() < t_end
            time.sleep(0.05)
        return p

    def probe_run() -> str:
        r = subprocess.run([sys.executable, str(probe)], env=env, cwd=str(ROOT), capture_output=True, text=True,
                           timeout=120)
        assert r.returncode == 0, r.stderr[-3000:]
        return r.stdout.strip()

    a = start("single", "create", tmp_path / "r1")
    try:
        assert probe_run() == "single:locked mp:locked read:10"
        assert a.poll() is None  # still holding when the probe was refused
    finally:
        a.kill()
        a.wait()
    # The SIGKILLed holder's lock is gone; multiprocessing writers are refused (no shared locks).
    assert probe_run() == "single:10 mp:locked read:10"
    b = start("single", "open", tmp_path / "r2")  # the next single writer, also SIGKILLed
    try:
        assert probe_run() == "single:locked mp:locked read:20"
    finally:
        b.kill()
        b.wait()
    assert probe_run() == "single:20 mp:locked read:20"


def test_without_any_lock_reading_works_and_writing_is_refused(tmp_path):
    ReplayBuffer.create(SPACE, cache_path=tmp_path / "s", chunk_rows=64).close()
    out = _run(_child(f"""
        from trajstore import ReplayBuffer
        from trajstore.errors import LockedError
        with ReplayBuffer.load_from({str(tmp_path / "s")!r}, read_only=True) as ro:
            print(len(ro))
        try:
            ReplayBuffer.load_from({str(tmp_path / "s")!r})
        except LockedError as e:
            print("refused:", "read_only=True" in str(e))
    """, with_filelock=False))
    assert out.split() == ["0", "refused:", "True"]


def test_trajstore_imports_no_posix_only_module_at_the_top():
    """The modules a Windows import would load use no POSIX-only name at import time: run the
    import with fcntl, resource and termios made unimportable and os's POSIX-only functions
    removed."""
    out = _run("""
        import os, sys
        # Third-party and standard modules first (they are not what this test is about).
        import numpy, zarr, gymnasium, fsspec, numcodecs, random, multiprocessing, asyncio, tempfile, shutil
        import concurrent.futures, uuid, zipfile, json, argparse
        for m in ("fcntl", "resource", "termios", "msvcrt"):
            sys.modules[m] = None
        for name in ("pread", "pwrite", "posix_fallocate", "register_at_fork", "O_NOFOLLOW", "O_CLOEXEC",
                     "O_NONBLOCK", "O_DIRECTORY", "O_PATH", "memfd_create", "MFD_CLOEXEC", "sync"):
            if hasattr(os, name):
                delattr(os, name)
        import trajstore, trajstore.storage.fields.layout, trajstore.maintenance.verify, trajstore.maintenance.repair, trajstore.cli
        print("ok")
    """)
    assert out.strip() == "ok"


def test_portable_pread_pwrite(tmp_path, monkeypatch):
    from trajstore.storage import confined

    fd = os.open(tmp_path / "f", os.O_RDWR | os.O_CREAT)
    try:
        monkeypatch.delattr(os, "pread")
        monkeypatch.delattr(os, "pwrite")
        assert confined.pwrite(fd, b"hello world", 3) == 11
        assert confined.pread(fd, 5, 9) == b"world"
        assert confined.pread(fd, 100, 0) == b"\0\0\0hello world"
    finally:
        os.close(fd)


def test_lock_errors_are_trajstore_errors():
    assert issubclass(LockedError, trajstore.errors.TrajstoreError)
