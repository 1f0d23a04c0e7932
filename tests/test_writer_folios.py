"""The sole writer of a raw field writes zeros with its blocks out to the edges of the 2 MiB pieces
of a new chunk file, so that the page cache holds each piece as one folio, which readers map with
one fault and one TLB entry (trajstore/storage/fields/folios.py; docs/performance-notes.md, "Vector
reads at 1e7 rows").  What must hold: no row is ever overwritten by those zeros, whatever the
order of blocks (rings that wrap, an extend that skips rows, small appends before large ones, a
reopened writer, several writer processes), and readers see exactly the rows written.

The SIGKILL loops of the same write path: ``test_kill_loops.py::test_kill_appends``.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np
import pytest
import zarr
from gymnasium.spaces import Box, Dict

from trajstore import ReplayBuffer, verify_store
from trajstore.storage.fields import _syscalls

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
from probe_read_faults import folios  # noqa: E402  (scripts/ is not a package)

# Rows of 68 and 24 bytes: chunk files of 2,158,592 and 2,101,248 bytes, each with one whole 2 MiB
# piece and a tail that is not one.
SPACE = Dict({"obs": Box(-np.inf, np.inf, (17,), np.float32), "act": Box(-np.inf, np.inf, (6,), np.float32)})


def _rows(lo: int, n: int) -> dict[str, np.ndarray]:
    """Rows numbered ``lo .. lo + n - 1``: every value non-zero and tied to its row."""
    ids = np.arange(lo, lo + n, dtype=np.float32) + 1
    return {"obs": np.repeat(ids[:, None], 17, axis=1), "act": -np.repeat(ids[:, None], 6, axis=1)}


def _check(path: Path, first: int, end: int) -> None:
    """The store holds exactly rows ``first .. end - 1`` (ours and plain zarr), and verifies."""
    with ReplayBuffer.load_from(path, read_only=True) as rb:
        assert len(rb) == end - first
        got = rb[np.arange(len(rb))]
        want = _rows(first, end - first)
        for k in want:
            assert np.array_equal(got[k], want[k]), f"{k}: rows differ"
    rep = verify_store(path, deep=True)
    assert rep.ok, rep


@pytest.mark.parametrize("capacity", [None, 70_000, 150_000])
def test_blocks_of_every_size_keep_every_row(tmp_path: Path, capacity: int | None) -> None:
    """Small appends (stored through the mapping), blocks of 1-200 KiB and blocks over a chunk,
    in a random order, into an unbounded table and into rings that wrap several times."""
    path = tmp_path / "rb"
    rng = np.random.default_rng(0)
    sizes = [1, 3, 800, 1200, 3000, 40, 20_000, 7, 4096, 2500, 33_000, 1, 900, 61_000, 5000, 1700]
    end = 0
    with ReplayBuffer.create(SPACE, cache_path=path, capacity=capacity) as rb:
        for n in sizes + rng.permutation(sizes).tolist():
            rb.extend(_rows(end, n))
            end += n
    first = 0 if capacity is None else max(0, end - capacity)
    _check(path, first, end)


def test_an_extend_that_skips_rows_then_small_appends(tmp_path: Path) -> None:
    """An extend of more than twice the capacity writes only the last ``capacity`` rows, starting
    in the middle of a chunk file this process has not written before (zeros lead the block)."""
    path, cap = tmp_path / "rb", 100_000
    with ReplayBuffer.create(SPACE, cache_path=path, capacity=cap) as rb:
        rb.extend(_rows(0, 250_000 + 12_345))
        end = 262_345
        for n in (5, 70_000, 3, 9000):
            rb.extend(_rows(end, n))
            end += n
    _check(path, end - cap, end)


def test_a_reopened_writer_never_writes_zeros_into_chunk_files_it_did_not_make(tmp_path: Path) -> None:
    """Chunk files of an earlier writer are written as they are: rows continue where they stopped."""
    path = tmp_path / "rb"
    end = 0
    for n_blocks in (3, 4, 2):
        opened = ReplayBuffer.load_from(path) if end else ReplayBuffer.create(SPACE, cache_path=path, capacity=200_000)
        with opened as rb:
            for _ in range(n_blocks):
                rb.extend(_rows(end, 7777))
                end += 7777
        _check(path, max(0, end - 200_000), end)


def test_plain_zarr_reads_zeros_past_the_rows(tmp_path: Path) -> None:
    """Zeros written past the rows read as the fill value a plain zarr reader expects there."""
    path = tmp_path / "rb"
    with ReplayBuffer.create(SPACE, cache_path=path) as rb:
        rb.extend(_rows(0, 5000))
    g = zarr.open_group(str(path), mode="r")
    arrays = [g[f"step_data/{name}"] for name in ("obs", "act")]
    for a in arrays:
        whole = a[:]
        assert np.array_equal(whole[:5000], _rows(0, 5000)["obs" if a.shape[1] == 17 else "act"])
        assert not whole[5000:].any()


@pytest.mark.skipif(not os.access("/proc/kpageflags", os.R_OK), reason="folio sizes need /proc/kpageflags (root)")
def test_a_ring_written_in_small_blocks_leaves_2_mib_folios(tmp_path: Path) -> None:
    """A ring's blocks (here 4,096 rows: 278 KiB) leave the first 2 MiB of each chunk file as one
    page-cache folio, as one 2 MiB write does (the kernel's own answer, checked first: a kernel or
    filesystem without large folios skips the test), once the field's rows reach 2 MiB (the first
    chunk file of ``obs`` is written before that, so it is left as the blocks made it)."""
    control = tmp_path / "control"
    control.write_bytes(np.random.default_rng(0).bytes(_syscalls.HUGE))
    if max(folios(control)) * _syscalls.PAGE < _syscalls.HUGE:
        pytest.skip("this kernel or filesystem keeps no 2 MiB page-cache folios")
    path = tmp_path / "rb"
    with ReplayBuffer.create(SPACE, cache_path=path, capacity=400_000) as rb:
        for lo in range(0, 200_000, 4096):
            rb.extend(_rows(lo, 4096))
    files = sorted((p for p in (path / "step_data" / "obs" / "c").rglob("*") if p.is_file()),
                   key=lambda p: int(p.parent.name))
    assert len(files) == 7  # 31,744 rows a chunk file
    whole = [int(p.parent.name) for p in files if max(folios(p)) * _syscalls.PAGE >= _syscalls.HUGE]
    # The kernel may fall back to smaller folios when memory is short: one miss is allowed.
    assert len(set(whole) & set(range(1, 7))) >= 5, f"chunk files holding a 2 MiB folio: {whole}"


@pytest.mark.skipif(not os.access("/proc/kpageflags", os.R_OK), reason="folio sizes need /proc/kpageflags (root)")
def test_small_appends_land_in_2_mib_folios(tmp_path: Path) -> None:
    """Rows stored a few at a time through the writer's mapping (8-row extends: 544 bytes) land in
    pieces filled whole beforehand, once the field's rows reach 2 MiB."""
    control = tmp_path / "control"
    control.write_bytes(np.random.default_rng(0).bytes(_syscalls.HUGE))
    if max(folios(control)) * _syscalls.PAGE < _syscalls.HUGE:
        pytest.skip("this kernel or filesystem keeps no 2 MiB page-cache folios")
    path = tmp_path / "rb"
    with ReplayBuffer.create(SPACE, cache_path=path, capacity=100_000) as rb:
        for lo in range(0, 96_000, 8):
            rb.extend(_rows(lo, 8))
    _check(path, 0, 96_000)
    files = sorted((p for p in (path / "step_data" / "obs" / "c").rglob("*") if p.is_file()),
                   key=lambda p: int(p.parent.name))
    whole = [int(p.parent.name) for p in files if max(folios(p)) * _syscalls.PAGE >= _syscalls.HUGE]
    assert {1, 2} <= set(whole), f"chunk files holding a 2 MiB folio: {whole}"


FRAME = Box(0, 255, (84, 84, 4), np.uint8)  # 28,224-byte rows: 256-row chunk files of 7.2 MB, 3 whole 2 MiB pieces

_CHILD = """
import sys, numpy as np
from trajstore import ReplayBuffer
rb = ReplayBuffer.load_from(sys.argv[1], multiprocessing=True)
lo, n = int(sys.argv[2]), int(sys.argv[3])
rb.extend((np.arange(lo, lo + n) % 251 + 1).astype(np.uint8)[:, None, None, None] * np.ones((1, 84, 84, 4), np.uint8))
rb.close()
"""


def _frames(lo: int, n: int) -> np.ndarray:
    return (np.arange(lo, lo + n) % 251 + 1).astype(np.uint8)[:, None, None, None] * np.ones((1, 84, 84, 4), np.uint8)


def test_multiprocessing_writers_never_write_zeros(tmp_path: Path) -> None:
    """With several writer processes (``multiprocessing=True``) no writer knows what the others
    wrote into a chunk file it made, so none writes zeros: rows of another process in the 2 MiB
    piece a block starts in stay (here rows 40-99 of the child, in the piece where the parent's
    next block starts)."""
    import subprocess

    path = tmp_path / "rb"
    with ReplayBuffer.create(FRAME, cache_path=path, multiprocessing=True) as rb:
        rb.extend(_frames(0, 40))
        subprocess.run([sys.executable, "-c", _CHILD, str(path), "40", "60"], check=True, timeout=120)
        rb.extend(_frames(100, 100))
    with ReplayBuffer.load_from(path, read_only=True) as rb:
        assert np.array_equal(rb[np.arange(200)], _frames(0, 200))


ROOT = Path(__file__).resolve().parents[1]


def test_the_probes_run_both_ways(tmp_path: Path) -> None:
    """scripts/probe_writer_folios.py and probe_read_faults.py (its ``raw-nofill`` store) run; their
    numbers are printed for docs/performance-notes.md, never asserted."""
    import subprocess

    run = subprocess.run([sys.executable, str(ROOT / "scripts" / "probe_writer_folios.py"), "--rows", "40000",
                          "--block", "4096", "--rounds", "2", "--dir", str(tmp_path)],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert "40,000 rows of (17,) in extends of 4,096: fill" in run.stdout
    assert not list(tmp_path.iterdir()), "the stores are removed"
    run = subprocess.run([sys.executable, str(ROOT / "scripts" / "probe_read_faults.py"), "--rows", "40000",
                          "--systems", "raw,raw-nofill,mm", "--rounds", "1", "--calls", "50", "--dir", str(tmp_path)],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    for name in ("raw ", "raw-nofill ", "mm "):
        assert f"  {name}" in run.stdout, run.stdout
