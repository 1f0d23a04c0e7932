"""Raw chunk files grow with their rows, and committed rows whose bytes are missing are damage.

* Disk (issue 36.7): a raw chunk file has the full size of a chunk (what zarr's ``bytes`` codec
  reads) but disk blocks only under the rows written plus a bounded step; the writer allocates
  the blocks before it stores rows through its mapping, so a full disk while a file grows is a
  ``StoreFullError`` at a safe point.  Plain zarr-python reads every committed row.
* Damage (issue 37 section 6): a committed chunk file deleted or cut short, or a commit record
  naming rows past the written chunks, makes reads of those rows raise ``DamagedStoreError``
  naming the field and the rows (local mapped files, compressed chunks, a remote store), and the
  CLI commands that read rows exit non-zero with that message.

The kill loop of the growth step is ``test_kill_loops.py::test_kill_appends[replay-unbounded-growing]``.
"""

from __future__ import annotations

import errno
import subprocess
import sys
import uuid
from pathlib import Path

import numpy as np
import pytest
import zarr
from gymnasium.spaces import Box, Dict

from trajstore import ReplayBuffer, verify_store
from trajstore.demo import record_demo
from trajstore.errors import DamagedStoreError, StoreFullError
from trajstore.storage.fields import _syscalls
from trajstore.storage.fields.mapped import GROW_MAX_STEP_BYTES
from trajstore.storage.head import read_head, write_head
from trajstore.storage.location import resolve_location

ROW = 1024  # bytes of a row of SPACE: a 2 MiB chunk holds 2,048 rows
SPACE = Dict({"a": Box(0, 255, (ROW,), np.uint8), "x": Box(-np.inf, np.inf, (4,), np.float32)})


def _rows(lo: int, n: int) -> dict[str, np.ndarray]:
    ids = np.arange(lo, lo + n)
    return {"a": np.repeat((ids % 251 + 1).astype(np.uint8)[:, None], ROW, axis=1),
            "x": np.repeat((ids + 1).astype(np.float32)[:, None], 4, axis=1)}


def _disk(path: Path, chunks_only: bool = False) -> int:
    """Bytes of disk blocks the files under ``path`` take (what ``du`` counts)."""
    return sum(p.stat().st_blocks * 512 for p in path.rglob("*")
               if p.is_file() and (not chunks_only or "/c/" in p.as_posix()))


def _plain_zarr_equals(path: Path, table: str, want: dict[str, np.ndarray]) -> None:
    """zarr-python itself (no trajstore code) reads every committed row as trajstore wrote it."""
    g = zarr.open_group(str(path), mode="r")
    for name, values in want.items():
        got = g[f"{table}/{name}"][:]
        assert got.shape == values.shape and np.array_equal(got, values), f"plain zarr reads {name} differently"


def test_the_demo_store_takes_at_most_256_kib_and_plain_zarr_reads_it(tmp_path):
    path = tmp_path / "demo"
    record_demo(path)
    assert _disk(path) <= 256 << 10, f"the demo store takes {_disk(path)} bytes on disk"
    with ReplayBuffer.load_from(path, read_only=True) as ro:
        rows = ro[:]
    assert len(rows["obs"]) > 0
    _plain_zarr_equals(path, "step_data", {k: np.asarray(v) for k, v in rows.items()})
    assert verify_store(path, deep=True).ok


@pytest.mark.parametrize("n", [1, 300, 2047, 2048, 2049, 5000])
def test_a_store_takes_its_rows_plus_at_most_one_step_per_field(tmp_path, n):
    """Chunk files take at most the rows' bytes plus GROW_MAX_STEP_BYTES per field (the last,
    partly filled chunk), however the rows arrive; plain zarr reads them all."""
    path = tmp_path / "s"
    with ReplayBuffer.create(SPACE, cache_path=path) as rb:
        done = 0
        for b in [1] * 40 + [7] * 20 + [500] * 20:  # appends, then blocks (the larger ones by pwrite)
            m = min(b, n - done)
            if m <= 0:
                break
            if m == 1:
                rb.append({k: v[0] for k, v in _rows(done, 1).items()})
            else:
                rb.extend(_rows(done, m))
            done += m
    data = n * (ROW + 16)
    assert _disk(path, chunks_only=True) <= data + 2 * (GROW_MAX_STEP_BYTES + (64 << 10)), (
        f"{n} rows of {data} bytes take {_disk(path, chunks_only=True)} bytes of chunk files")
    _plain_zarr_equals(path, "step_data", _rows(0, n))


def test_a_copy_to_another_folder_copies_only_what_is_there(tmp_path):
    path, copy = tmp_path / "s", tmp_path / "copy"
    with ReplayBuffer.create(SPACE, cache_path=path) as rb:
        rb.extend(_rows(0, 40))
        rb.dumps(copy)
    assert _disk(copy, chunks_only=True) <= 40 * (ROW + 16) + 2 * (64 << 10)
    _plain_zarr_equals(copy, "step_data", _rows(0, 40))
    with ReplayBuffer.load_from(copy) as rb:  # and the copy grows as its source did
        rb.extend(_rows(40, 100))
    _plain_zarr_equals(copy, "step_data", _rows(0, 140))
    assert verify_store(copy, deep=True).ok


def test_a_rewrite_keeps_a_partly_filled_chunk_file_small(tmp_path):
    """set_at and remove_at replace whole chunk files (staged, then renamed in): the zero pages
    past the rows are holes again, and appends after the rewrite allocate before they store."""
    path = tmp_path / "s"
    with ReplayBuffer.create(SPACE, cache_path=path) as rb:
        rb.extend(_rows(0, 40))
        rb.set_at(5, {k: v[0] for k, v in _rows(1000, 1).items()})
        rb.remove_at([0])
        want = {k: np.concatenate([v[1:5], _rows(1000, 1)[k], v[6:]]) for k, v in _rows(0, 40).items()}
        assert _disk(path, chunks_only=True) <= 39 * (ROW + 16) + 2 * (64 << 10)
        rb.extend(_rows(40, 300))
        want = {k: np.concatenate([want[k], _rows(40, 300)[k]]) for k in want}
    assert _disk(path, chunks_only=True) <= 339 * (ROW + 16) + 2 * (GROW_MAX_STEP_BYTES + (64 << 10))
    _plain_zarr_equals(path, "step_data", want)
    assert verify_store(path, deep=True).ok


def _enospc(fd: int, nbytes: int, offset: int = 0) -> None:
    raise OSError(errno.ENOSPC, "No space left on device")


@pytest.mark.parametrize("how", ["append", "extend"])
def test_a_full_disk_while_a_chunk_file_grows_is_store_full_error_at_a_safe_point(tmp_path, monkeypatch, how):
    """The disk fills when a chunk file needs more blocks (not when it is created): the write raises
    StoreFullError naming the chunk file before any of its rows is stored (no SIGBUS), committed
    rows stay, and the same write succeeds once space returns."""
    path = tmp_path / "s"
    rb = ReplayBuffer.create(SPACE, cache_path=path, commit_interval=3600)
    rb.extend(_rows(0, 10))  # within the chunk file's first 16 KiB
    rb.flush()
    # The allocation of more blocks (the fallocate system call), not a new file's posix_fallocate.
    monkeypatch.setattr(_syscalls, "_fallocate_in_place", _enospc)
    with pytest.raises(StoreFullError) as info:
        if how == "append":
            for i in range(10, 40):
                rb.append({k: v[0] for k, v in _rows(i, 1).items()})
            rb.flush()  # appends are staged in blocks: the block reaches the chunk file here at the latest
        else:
            rb.extend(_rows(10, 30))
    assert info.value.errno == errno.ENOSPC and "step_data/a/c/0/0" in str(info.value)
    monkeypatch.undo()
    rb.flush()  # (staged appends that returned normally are written now)
    kept = len(rb)
    assert 10 <= kept <= 40 and np.array_equal(rb[:]["a"], _rows(0, kept)["a"])
    rb.extend(_rows(kept, 100 - kept))
    rb.close()
    with ReplayBuffer.load_from(path, read_only=True) as ro:
        assert len(ro) == 100 and np.array_equal(ro[:]["a"], _rows(0, 100)["a"])
    assert verify_store(path, deep=True).ok


# ------------------------------------------------------------------------------------ damage
def _damaged_store(tmp_path: Path, how: str, compressor: str | None = None) -> Path:
    """A store of 200 committed rows in chunks of 64, damaged ``how``."""
    path = tmp_path / "s"
    with ReplayBuffer.create(SPACE, cache_path=path, chunk_rows=64, compressor=compressor) as rb:
        rb.extend(_rows(0, 200))
    chunk = path / "step_data" / "a" / "c" / "1" / "0"
    if how == "deleted":
        chunk.unlink()
    elif how == "truncated":
        with open(chunk, "r+b") as f:
            f.truncate(chunk.stat().st_size // 2)
    else:  # a commit record naming rows past the written chunks
        loc = resolve_location(str(path), read_only=False, must_exist=True)
        head = read_head(loc)
        head.tables["step_data"].end = head.tables["step_data"].allocated = 320
        write_head(loc, head)
        loc.close()
    return path


HOWS = ["deleted", "truncated", "record-past-chunks"]


def _check_refused(path: Path, how: str, read_only: bool) -> None:
    rows = "256..319" if how == "record-past-chunks" else "64..127"
    with ReplayBuffer.load_from(path, read_only=read_only) as rb:
        for read in (lambda: rb[:], lambda: rb[100 if how != "record-past-chunks" else 300],
                     lambda: rb.sample(256, rng=0)):
            with pytest.raises(DamagedStoreError) as info:
                read()
            msg = str(info.value)
            assert "step_data/a" in msg, msg
            if how != "truncated":  # (a short file is named with its size: it is refused whole)
                assert f"rows {rows}" in msg, msg


@pytest.mark.parametrize("how", HOWS)
def test_committed_rows_whose_chunk_file_is_missing_or_short_raise_damaged_store_error(tmp_path, how):
    path = _damaged_store(tmp_path, how)
    _check_refused(path, how, read_only=True)
    _check_refused(path, how, read_only=False)
    assert not verify_store(path).ok


@pytest.mark.parametrize("how", ["deleted", "record-past-chunks"])
def test_a_missing_compressed_chunk_of_committed_rows_raises_damaged_store_error(tmp_path, how):
    """The zarr-read path (compressed chunks, read whole through zarr): a missing chunk key would
    read as fill values; it is detected where the chunk is fetched."""
    path = _damaged_store(tmp_path, how, compressor="lz4")
    _check_refused(path, how, read_only=True)


def test_a_missing_chunk_on_a_remote_store_raises_damaged_store_error(tmp_path):
    """A remote store (memory://, read through zarr): the chunk key of committed rows is deleted."""
    url = f"memory://trajstore-{uuid.uuid4().hex}"
    with ReplayBuffer.create(SPACE, cache_path=url, chunk_rows=64) as rb:
        rb.extend(_rows(0, 200))
    loc = resolve_location(url, read_only=False, must_exist=True)
    loc.delete("step_data/a/c/1/0")
    loc.close()
    with ReplayBuffer.load_from(url, read_only=True) as ro:
        assert np.array_equal(ro[:64]["a"], _rows(0, 64)["a"])  # the chunks that are there read
        with pytest.raises(DamagedStoreError, match=r"step_data/a: rows 64\.\.127 .*missing"):
            ro.sample(256, rng=0)


@pytest.mark.parametrize("command", ["info", "head", "stats"])
@pytest.mark.parametrize("how", ["deleted", "record-past-chunks"])
def test_cli_commands_that_read_rows_exit_non_zero_on_missing_chunks(tmp_path, command, how):
    path = _damaged_store(tmp_path, how)
    args = [command, str(path)] + (["-n", "400"] if command == "head" else [])
    r = subprocess.run([sys.executable, "-m", "trajstore", *args], capture_output=True, text=True, timeout=120)
    assert r.returncode != 0, f"`trajstore {command}` exited 0 on a damaged store:\n{r.stdout}"
    assert "step_data/a" in r.stderr and "missing" in r.stderr, r.stderr
