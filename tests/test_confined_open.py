"""Chunk files are opened through the store's confinement on both of its paths: ``openat2``
(RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS, one system call) and the portable per-folder checks used
where the kernel has no openat2.  Each tampering is refused with DamagedStoreError on both paths,
and nothing outside the store is read or written."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
from gymnasium.spaces import Box

from trajstore import ReplayBuffer
from trajstore.errors import DamagedStoreError
from trajstore.storage import confined

SPACE = Box(0, 255, (64, 64), np.uint8)  # 4 KiB rows: 512 rows per 2 MiB chunk
CHUNK = "step_data/c/0/0/0"


def _store(tmp: Path) -> Path:
    path = tmp / "s"
    rb = ReplayBuffer.create(SPACE, cache_path=path)
    rb.extend(np.arange(600 * 64 * 64, dtype=np.int64).reshape(600, 64, 64).astype(np.uint8))
    rb.close()
    return path


def _link_dir(store: Path, outside: Path) -> None:
    d = store / "step_data/c/1"
    os.rename(d, outside / "c1")
    os.symlink(outside / "c1", d)


def _link_file(store: Path, outside: Path) -> None:
    f = store / CHUNK
    os.rename(f, outside / "chunk")
    os.symlink(outside / "chunk", f)


def _fifo(store: Path, outside: Path) -> None:
    os.unlink(store / CHUNK)
    os.mkfifo(store / CHUNK)


def _folder(store: Path, outside: Path) -> None:
    os.unlink(store / CHUNK)
    os.mkdir(store / CHUNK)


@pytest.fixture(params=[True, False], ids=["openat2", "portable"])
def fast_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> bool:
    if request.param and not confined._openat2_ok:
        pytest.skip("this kernel has no openat2")
    monkeypatch.setattr(confined, "_openat2_ok", request.param)
    return bool(request.param)


def test_untampered_store_reads_the_same_on_both_paths(tmp_path: Path, fast_path: bool) -> None:
    path = _store(tmp_path)
    with ReplayBuffer.load_from(path, read_only=True) as rb:
        got = rb[np.arange(600)]
    assert np.array_equal(got, np.arange(600 * 64 * 64, dtype=np.int64).reshape(600, 64, 64).astype(np.uint8))
    assert confined._openat2_ok is fast_path  # the path under test was the one taken


@pytest.mark.parametrize("tamper", [_link_dir, _link_file, _fifo, _folder], ids=lambda f: f.__name__.strip("_"))
@pytest.mark.parametrize("read_only", [True, False], ids=["reader", "writer"])
def test_tampered_chunk_is_refused_on_both_paths(tmp_path: Path, fast_path: bool, tamper, read_only: bool) -> None:
    path = _store(tmp_path)
    outside = tmp_path / "outside"
    outside.mkdir()
    tamper(path, outside)
    before = {p.name: p.read_bytes() for p in outside.rglob("*") if p.is_file()}
    with pytest.raises(DamagedStoreError):
        rb = ReplayBuffer.load_from(path, read_only=read_only)
        try:
            rb[np.arange(600)]
            if not read_only:
                rb.extend(np.zeros((10, 64, 64), np.uint8))
                rb.flush()
        finally:
            rb.close()
    assert {p.name: p.read_bytes() for p in outside.rglob("*") if p.is_file()} == before


def test_mapping_a_store_leaves_no_descriptor_open(tmp_path: Path, fast_path: bool) -> None:
    """Chunk files are mapped with the root held open for the batch (openat2 path); the held
    descriptor and every chunk file's are closed again."""
    path = _store(tmp_path)
    before = set(os.listdir("/proc/self/fd"))
    with ReplayBuffer.load_from(path, read_only=True) as rb:
        rb[np.arange(600)]
        assert len(set(os.listdir("/proc/self/fd")) - before) <= 2  # the head / lock files at most
    assert set(os.listdir("/proc/self/fd")) - before == set()


def _short(store: Path, outside: Path) -> None:
    with open(store / CHUNK, "r+b") as f:
        f.truncate(100)


# What a reader's first read says of each tampered chunk file, on both open paths: the check that
# fires and its words stay the same whichever step (open or map) makes it.
FIRST_READ_ERRORS = [
    (_link_file, "is a symbolic link, not a regular file"),
    (_fifo, "is a FIFO, not a regular file"),
    (_folder, "is a folder, not a regular file; not mapped"),
    (_short, f"holds 100 bytes; expected {512 * 64 * 64}"),
]


@pytest.mark.parametrize("tamper,words", FIRST_READ_ERRORS, ids=lambda x: getattr(x, "__name__", "").strip("_"))
def test_first_read_of_a_reader_names_the_tampered_chunk(tmp_path: Path, fast_path: bool, tamper, words: str) -> None:
    path = _store(tmp_path)
    outside = tmp_path / "outside"
    outside.mkdir()
    tamper(path, outside)
    with ReplayBuffer.load_from(path, read_only=True) as rb:
        with pytest.raises(DamagedStoreError) as err:
            rb[np.arange(600)]
    assert words in str(err.value)
    assert CHUNK in str(err.value)


def test_mapping_asks_fstat_once_per_chunk_file(tmp_path: Path, fast_path: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """The open's fstat (which shows the file regular) also gives the map its size: mapping a
    large store's hundreds of chunk files on a first read pays one fstat each, not two."""
    path = _store(tmp_path)
    asked: list[str] = []
    real = os.fstat

    def counting(fd: int) -> os.stat_result:
        asked.append(os.readlink(f"/proc/self/fd/{fd}"))
        return real(fd)

    with ReplayBuffer.load_from(path, read_only=True) as rb:
        monkeypatch.setattr(os, "fstat", counting)
        rb[np.arange(600)]  # 600 rows: chunk files 0 and 1
        monkeypatch.setattr(os, "fstat", real)
    chunks = sorted(a[len(str(path)) + 1:] for a in asked if a.startswith(f"{path}/step_data/"))
    assert chunks == ["step_data/c/0/0/0", "step_data/c/1/0/0"]


@pytest.mark.parametrize("key", ["", "/a", "a/", "a//b", ".", "..", "./a", "a/.", "a/./b", "../a", "a/..", "a/../b",
                                 "a\x00b", "/", "//", "\x00", None, b"a"])
def test_check_key_refuses(key) -> None:
    with pytest.raises(DamagedStoreError):
        confined.check_key(key, "store")


@pytest.mark.parametrize("key", ["a", "a/b", "...", "a/.../b", ".a", "a.", "a/.b/c", "..a", "a..", "a\n", "\n",
                                 "a/\n", "a b/c", "é/ß"])
def test_check_key_takes(key) -> None:
    confined.check_key(key, "store")
