"""The commit record's atomic replacement (``trajstore.storage._replace.replace_file``): the
exchange-then-unlink path, its portable fallback, links and folders at the key, and a writer
SIGKILLed between the exchange and the unlink."""

from __future__ import annotations

import ctypes
import errno
import json
import os
import signal
import sys
from pathlib import Path

import numpy as np
import pytest

HERE = str(Path(__file__).resolve().parent)
if HERE not in sys.path:
    sys.path.insert(0, HERE)

import _workers as W  # noqa: E402

from trajstore import ReplayBuffer, verify_store  # noqa: E402
from trajstore.storage import _replace  # noqa: E402
from trajstore.storage.keys import HEAD_KEY  # noqa: E402
from trajstore.storage.location import TMP_DIR  # noqa: E402

needs_exchange = pytest.mark.skipif(_replace._renameat2 is None, reason="no renameat2 in this libc")


def _temp_files(store: str | Path) -> list[str]:
    """The files in a store's temp folder (which a writer's open removes)."""
    folder = Path(store, TMP_DIR)
    return os.listdir(folder) if folder.exists() else []


def _store_and_outside(tmp_path: Path) -> tuple[Path, Path]:
    """A closed ring store, and a folder outside it holding one precious file (``keep``)."""
    store = tmp_path / "store"
    ReplayBuffer.create(W.SPACE, cache_path=str(store), capacity=64, chunk_rows=16).close()
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep").write_bytes(b"precious")
    return store, outside


def _write(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


@pytest.fixture(params=["exchange", "portable"])
def mode(request, monkeypatch):
    if request.param == "exchange" and _replace._renameat2 is None:
        pytest.skip("no renameat2 in this libc")
    if request.param == "portable":
        monkeypatch.setattr(_replace, "_renameat2", None)
    return request.param


def test_replaces_and_removes_the_temp_name(tmp_path, mode):
    dest = _write(tmp_path / "head", b"old")
    tmp = _write(tmp_path / "t1", b"new")
    ino = os.stat(tmp).st_ino
    _replace.replace_file(tmp, dest)
    assert dest.read_bytes() == b"new" and os.stat(dest).st_ino == ino
    assert not tmp.exists(), "the temp name (holding the old file after an exchange) was left"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["head"]


def test_missing_key_is_created(tmp_path, mode):
    tmp = _write(tmp_path / "t1", b"new")
    _replace.replace_file(tmp, tmp_path / "head")
    assert (tmp_path / "head").read_bytes() == b"new" and not tmp.exists()


def test_link_at_the_key_is_replaced_not_written_through(tmp_path, mode):
    outside = _write(tmp_path / "outside", b"precious")
    (tmp_path / "store").mkdir()
    dest = tmp_path / "store" / "head"
    dest.symlink_to(outside)
    _replace.replace_file(_write(tmp_path / "store" / "t1", b"new"), dest)
    assert not dest.is_symlink() and dest.read_bytes() == b"new"
    assert outside.read_bytes() == b"precious"
    assert sorted(p.name for p in (tmp_path / "store").iterdir()) == ["head"], "the link was left under the temp name"


def test_folder_at_the_key_raises_and_stays(tmp_path, mode):
    dest = tmp_path / "head"
    dest.mkdir()
    (dest / "inner").write_bytes(b"x")
    tmp = _write(tmp_path / "t1", b"new")
    with pytest.raises(OSError):
        _replace.replace_file(tmp, dest)
    assert (dest / "inner").read_bytes() == b"x", "a folder at the key was moved or changed"


@needs_exchange
@pytest.mark.parametrize("err", [errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP])
def test_filesystem_without_exchange_falls_back(tmp_path, monkeypatch, err):
    """A filesystem that refuses RENAME_EXCHANGE (EINVAL) gets os.replace, with the same result."""
    calls = []

    def refuse(*args):
        calls.append(args)
        ctypes.set_errno(err)
        return -1

    monkeypatch.setattr(_replace, "_renameat2", refuse)
    dest = _write(tmp_path / "head", b"old")
    _replace.replace_file(_write(tmp_path / "t1", b"new"), dest)
    assert calls and dest.read_bytes() == b"new" and sorted(p.name for p in tmp_path.iterdir()) == ["head"]


@needs_exchange
def test_other_errors_raise_and_keep_the_old_file(tmp_path, monkeypatch):
    def fail(*args):
        ctypes.set_errno(errno.EIO)
        return -1

    monkeypatch.setattr(_replace, "_renameat2", fail)
    dest = _write(tmp_path / "head", b"old")
    with pytest.raises(OSError) as e:
        _replace.replace_file(_write(tmp_path / "t1", b"new"), dest)
    assert e.value.errno == errno.EIO and dest.read_bytes() == b"old"


def test_commits_of_a_store_go_through_it(tmp_path, monkeypatch):
    """Every local commit record is moved into place by replace_file (the one place that knows how)."""
    seen = []
    real = _replace.replace_file

    def spy(tmp, dest, **dir_fds):
        seen.append(os.path.basename(dest))
        return real(tmp, dest, **dir_fds)

    monkeypatch.setattr("trajstore.storage.location.replace_file", spy)
    with ReplayBuffer.create(W.SPACE, cache_path=str(tmp_path / "s"), capacity=64, chunk_rows=16) as rb:
        seen.clear()
        for k in range(5):
            rb.extend(W.encode(np.arange(k * 20, k * 20 + 20)))
            rb.flush()
        seq, ok = W.decode(rb[:])
        assert ok.all() and np.array_equal(seq, np.arange(36, 100))
    assert seen.count(HEAD_KEY) >= 5
    assert not _temp_files(tmp_path / "s"), "a commit left a file in the temp folder"


@needs_exchange
@pytest.mark.parametrize("commits", [1, 3])
def test_sigkill_between_exchange_and_unlink(tmp_path, procs, commits):
    """Killed right after the record's exchange: the commit is in place (its rows are there for
    every reader), the old record waits in the temp folder, which readers ignore, verify accepts,
    repair does not prefer over the record, and the next writer's open clears."""
    store = str(tmp_path / "store")
    ReplayBuffer.create(W.SPACE, cache_path=store, capacity=100, chunk_rows=16).close()
    with ReplayBuffer.load_from(store) as rb:
        rb.extend(W.encode(np.arange(90)))
    before = json.loads(Path(store, HEAD_KEY).read_bytes())
    p = W.start(W.die_after_head_exchange, store, 30, commits)
    procs.append(p)
    p.join(60)
    assert p.exitcode == -signal.SIGKILL, f"the writer ended with {p.exitcode}, not at the exchange"
    left = _temp_files(store)
    assert len(left) == 1, f"expected the old record in the temp folder, found {left}"
    old = json.loads(Path(store, TMP_DIR, left[0]).read_bytes())
    head = json.loads(Path(store, HEAD_KEY).read_bytes())
    assert old["generation"] < head["generation"] and head["generation"] > before["generation"]
    last = 90 + 30 * commits
    with ReplayBuffer.load_from(store, read_only=True) as ro:
        seq, ok = W.decode(ro[:])
        assert ok.all() and np.array_equal(seq, np.arange(last - 100, last)), "the last commit's rows are not all there"
    assert verify_store(store).ok
    with ReplayBuffer.load_from(store) as w:
        assert not _temp_files(store), "the writer's open left the old record"
        seq, ok = W.decode(w[:])
        assert ok.all() and np.array_equal(seq, np.arange(last - 100, last))


def test_writer_open_empties_the_temp_folder_and_keeps_it(tmp_path):
    """A writer's open removes everything in the temp folder (files, folders, links, any name:
    never following a link) but keeps the folder, so its first commit makes no folder."""
    store, outside = _store_and_outside(tmp_path)
    tmp_dir = store / TMP_DIR
    tmp_dir.mkdir(exist_ok=True)
    (tmp_dir / "old-record").write_bytes(b'{"generation": 1}')
    (tmp_dir / "we ird\nname").write_bytes(b"x")
    (tmp_dir / "sub" / "deeper").mkdir(parents=True)
    (tmp_dir / "sub" / "deeper" / "f").write_bytes(b"x")
    (tmp_dir / "link-to-outside").symlink_to(outside)
    ino = os.stat(tmp_dir).st_ino
    with ReplayBuffer.load_from(str(store)) as rb:
        assert tmp_dir.is_dir() and os.stat(tmp_dir).st_ino == ino and _temp_files(store) == []
        rb.extend(W.encode(np.arange(10)))
        rb.flush()
        assert _temp_files(store) == []
    assert (outside / "keep").read_bytes() == b"precious", "a link in the temp folder was followed"


def test_writer_open_removes_a_link_where_the_temp_folder_belongs(tmp_path):
    store, outside = _store_and_outside(tmp_path)
    tmp_dir = store / TMP_DIR
    if tmp_dir.exists():
        os.rmdir(tmp_dir)
    tmp_dir.symlink_to(outside, target_is_directory=True)
    with ReplayBuffer.load_from(str(store)) as rb:
        rb.extend(W.encode(np.arange(10)))
        rb.flush()
        assert not tmp_dir.is_symlink()
    assert sorted(os.listdir(outside)) == ["keep"] and (outside / "keep").read_bytes() == b"precious"


@pytest.mark.parametrize("what", ["link", "file"])
def test_commit_refuses_a_temp_folder_swapped_for_a_link_or_file(tmp_path, what):
    """A link (or a file) put where the temp folder belongs while a writer runs: the commit
    raises DamagedStoreError and writes nothing outside the store."""
    from trajstore.errors import DamagedStoreError

    store = tmp_path / "store"
    outside = tmp_path / "outside"
    outside.mkdir()
    with ReplayBuffer.create(W.SPACE, cache_path=str(store), capacity=64, chunk_rows=16) as rb:
        rb.extend(W.encode(np.arange(10)))
        rb.flush()
        tmp_dir = store / TMP_DIR
        os.rmdir(tmp_dir)
        if what == "link":
            tmp_dir.symlink_to(outside, target_is_directory=True)
        else:
            tmp_dir.write_bytes(b"x")
        rb.extend(W.encode(np.arange(10, 20)))
        with pytest.raises(DamagedStoreError, match=TMP_DIR):
            rb.flush()
        assert os.listdir(outside) == []
        os.unlink(tmp_dir)
        rb.flush()  # the folder is made again
        seq, ok = W.decode(rb[:])
        assert ok.all() and np.array_equal(seq, np.arange(20))


def test_writer_open_survives_a_temp_entry_it_cannot_remove(tmp_path, monkeypatch):
    """An entry of the temp folder that cannot be removed (EPERM) stays; the open does not fail
    over it (as when the folder was removed with rmtree's errors ignored)."""
    store, _outside = _store_and_outside(tmp_path)
    (store / TMP_DIR).mkdir(exist_ok=True)
    stuck = store / TMP_DIR / "stuck"
    stuck.write_bytes(b"x")
    real_unlink = os.unlink

    def refuse(path, *args, **kwargs):
        if os.fspath(path) == str(stuck):
            raise PermissionError(errno.EPERM, "Operation not permitted", str(path))
        return real_unlink(path, *args, **kwargs)

    monkeypatch.setattr(os, "unlink", refuse)
    with ReplayBuffer.load_from(str(store)) as rb:
        rb.extend(W.encode(np.arange(5)))
        rb.flush()
        assert stuck.exists()
        seq, ok = W.decode(rb[:])
        assert ok.all() and np.array_equal(seq, np.arange(5))


def test_names_relative_to_open_folders(tmp_path, mode):
    """With ``src_dir_fd`` / ``dst_dir_fd`` (Location.put's folder fds) the names are resolved from
    those folders, as ``os.replace`` resolves them."""
    (tmp_path / "tmp").mkdir()
    (tmp_path / "dest").mkdir()
    _write(tmp_path / "dest" / "head", b"old")
    _write(tmp_path / "tmp" / "t1", b"new")
    src, dst = (os.open(tmp_path / d, os.O_RDONLY | os.O_DIRECTORY) for d in ("tmp", "dest"))
    try:
        _replace.replace_file("t1", "head", src_dir_fd=src, dst_dir_fd=dst)
    finally:
        os.close(src)
        os.close(dst)
    assert (tmp_path / "dest" / "head").read_bytes() == b"new"
    assert os.listdir(tmp_path / "tmp") == [] and os.listdir(tmp_path / "dest") == ["head"]


# -------------------------------------------------- Location.put through open folder fds

def _location(root: Path):
    from trajstore.storage.location import resolve_location

    root.mkdir(exist_ok=True)
    return resolve_location(str(root), read_only=False, must_exist=True)


def _count_calls(monkeypatch, obj, name: str) -> list[int]:
    calls: list[int] = []
    real = getattr(obj, name)

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(obj, name, counted)
    return calls


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="openat2 is Linux's")
def test_put_goes_through_folder_fds_where_both_folders_stand(tmp_path, monkeypatch):
    """The temp folder and the key's folder stand (a writer's open keeps the temp folder): put
    walks no path (no makedirs, no temp path), and leaves no temp file.  Without the temp folder
    it takes the path-based way once, which makes the folder."""
    from trajstore.storage.confined import Confinement
    from trajstore.storage.location import Location

    loc = _location(tmp_path / "s")
    walks = _count_calls(monkeypatch, Confinement, "makedirs")
    temps = _count_calls(monkeypatch, Location, "new_tmp_path")
    loc.put("a.json", b"first")  # no temp folder yet: the path-based put makes it
    assert walks and len(temps) == 1 and (tmp_path / "s" / TMP_DIR).is_dir()
    before = len(walks)
    (tmp_path / "s" / "sub").mkdir()
    for k in range(3):
        loc.put("a.json", b"again %d" % k)
        loc.put("sub/b.json", b"nested %d" % k)
    assert (len(walks), len(temps)) == (before, 1), "a put walked the path although both folders stood"
    assert (tmp_path / "s" / "a.json").read_bytes() == b"again 2"
    assert (tmp_path / "s" / "sub" / "b.json").read_bytes() == b"nested 2"
    assert _temp_files(tmp_path / "s") == []


@pytest.mark.parametrize("where", ["key's folder", "temp folder"])
def test_put_refuses_a_link_where_a_folder_belongs(tmp_path, where):
    """A link where the key's folder (or the temp folder) belongs: put raises DamagedStoreError
    and nothing outside the store is created, changed or removed."""
    from trajstore.errors import DamagedStoreError

    loc = _location(tmp_path / "s")
    outside = tmp_path / "outside"
    outside.mkdir()
    _write(outside / "b.json", b"precious")
    if where == "temp folder":
        (tmp_path / "s" / TMP_DIR).symlink_to(outside, target_is_directory=True)
        key = "b.json"
    else:
        (tmp_path / "s" / TMP_DIR).mkdir()
        (tmp_path / "s" / "sub").symlink_to(outside, target_is_directory=True)
        key = "sub/b.json"
    with pytest.raises(DamagedStoreError):
        loc.put(key, b"new")
    assert os.listdir(outside) == ["b.json"] and (outside / "b.json").read_bytes() == b"precious"


def test_put_fsyncs_the_file_and_its_folder(tmp_path, monkeypatch):
    """``fsync=True``: the temp file before its move and the key's folder after (docs/design.md 3.3)."""
    import stat as st

    loc = _location(tmp_path / "s")
    loc.put("a.json", b"first")
    synced: list[str] = []
    real = os.fsync

    def spy(fd):
        synced.append("folder" if st.S_ISDIR(os.fstat(fd).st_mode) else "file")
        return real(fd)

    monkeypatch.setattr(os, "fsync", spy)
    loc.put("a.json", b"durable", fsync=True)
    assert synced == ["file", "folder"] and (tmp_path / "s" / "a.json").read_bytes() == b"durable"


def test_put_that_fails_keeps_the_old_bytes(tmp_path, monkeypatch):
    """A full disk while the temp file is written: StoreFullError, the key keeps its old bytes,
    and the temp file is gone."""
    from trajstore.errors import StoreFullError

    loc = _location(tmp_path / "s")
    loc.put("a.json", b"old")
    real = os.write

    def full(fd, data):
        if os.path.dirname(os.readlink(f"/proc/self/fd/{fd}")).endswith(TMP_DIR):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(fd, data)

    monkeypatch.setattr(os, "write", full)
    with pytest.raises(StoreFullError):
        loc.put("a.json", b"new")
    assert (tmp_path / "s" / "a.json").read_bytes() == b"old" and _temp_files(tmp_path / "s") == []
