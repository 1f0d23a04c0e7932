"""A writer dropped without ``close()`` is committed when it is collected, also when the cyclic
collector frees it: its mappings outlive its own ``__del__`` (``_vmap._after_collection``), and
are unmapped once the collection is over.

Real stores on disk; the buffers sit in reference cycles (store listeners hold their methods), so
``gc.collect()`` finalizes them together with the arrays they write through.
"""

from __future__ import annotations

import gc
import os
from pathlib import Path

import numpy as np
import pytest
from gymnasium import spaces

from trajstore import ReplayBuffer, TrajectoryReplayBuffer

STEP = spaces.Box(-1, 1, (2,), np.float32)
EPISODE = spaces.Box(0, 1, (1,), np.float32)


def _mapped(path: Path) -> list[str]:
    """Lines of /proc/self/maps naming a file under ``path``."""
    with open("/proc/self/maps") as f:
        return [line for line in f if str(path) in line]


def _write_and_drop(kind: str, path: Path, n: int) -> None:
    """Create a writer, write ``n`` rows and one more, and drop it without closing it."""
    if kind == "replay":
        buf = ReplayBuffer.create(STEP, cache_path=path)
    elif kind == "ring":
        buf = ReplayBuffer.create(STEP, cache_path=path, capacity=64)
    else:
        buf = TrajectoryReplayBuffer.create(STEP, cache_path=path, episode_data_instance_space=EPISODE)
        buf.set_current_episode_data(np.array([0.75], np.float32))
    buf.extend(np.full((n, 2), 0.5, np.float32))
    buf.append(np.full(2, 0.25, np.float32))


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="reads /proc/self/maps")
@pytest.mark.parametrize("kind", ["replay", "ring", "trajectory"])
@pytest.mark.parametrize("n", [3, 5000])
def test_dropped_writer_is_committed_when_collected(tmp_path: Path, kind: str, n: int) -> None:
    path = tmp_path / "store"
    gc.collect()
    _write_and_drop(kind, path, n)
    gc.collect()
    assert _mapped(path) == []  # unmapped once the collection is over
    cls = TrajectoryReplayBuffer if kind == "trajectory" else ReplayBuffer
    with cls.load_from(path, read_only=True) as r:
        rows = min(n + 1, 64) if kind == "ring" else n + 1
        assert len(r) == rows
        got = r[:]["step_data"] if kind == "trajectory" else r[:]
        np.testing.assert_array_equal(got[-1], np.full(2, 0.25, np.float32))
        np.testing.assert_array_equal(got[:-1], np.full((rows - 1, 2), 0.5, np.float32))
        if kind == "trajectory":
            np.testing.assert_array_equal(r[-1]["episode_data"], np.array([0.75], np.float32))


def test_a_closed_mapping_maps_nothing(tmp_path: Path) -> None:
    """Once a VirtualArray is closed (its range unmapped, ``base`` 0) mapping or unmapping a
    chunk raises ClosedError: a ``MAP_FIXED`` call at ``0 + k * stride`` would map over whatever
    the process has at that low address."""
    from trajstore.errors import ClosedError
    from trajstore.storage.fields import _syscalls, _vmap

    if not _syscalls.AVAILABLE:
        pytest.skip("no memory-mapped engine on this system")
    va = _vmap.VirtualArray(4, _syscalls.PAGE, (1,), np.dtype(np.uint8), False)
    chunk = tmp_path / "chunk"
    chunk.write_bytes(bytes(_syscalls.PAGE))
    fd = os.open(chunk, os.O_RDONLY)
    try:
        va.map_chunk(1, fd, str(chunk))  # open: maps
        va.close()
        with pytest.raises(ClosedError):
            va.map_chunk(2, fd, str(chunk))
        with pytest.raises(ClosedError):
            va.unmap_chunk(1)
    finally:
        os.close(fd)


_GC_INSIDE_SYNC = r"""
import concurrent.futures._base as futures_base, gc, sys
import numpy as np, zarr
from gymnasium import spaces
from zarr.storage import MemoryStore
from trajstore import ReplayBuffer

armed = []
enter = futures_base._AcquireFutures.__enter__

def enter_then_collect(self):
    # The cyclic collector running inside zarr's sync(), while concurrent.futures.wait holds the
    # outer future's lock (what a collection triggered by an allocation there does).
    enter(self)
    if armed:
        armed.clear()
        gc.collect()

futures_base._AcquireFutures.__enter__ = enter_then_collect
gc.disable()
buf = ReplayBuffer.create(spaces.Box(-1, 1, (2,), np.float32), cache_path=sys.argv[1], compressor="lz4")
buf.extend(np.full((7, 2), 0.5, np.float32))  # not committed yet: the collector's close commits it
buf.cycle = buf
del buf
armed.append(1)
zarr.open_group(MemoryStore(), mode="w")  # a sync() call: the collection happens inside it
print("returned")
"""


def test_writer_collected_inside_a_zarr_sync_call_never_deadlocks(tmp_path: Path) -> None:
    """A collection inside zarr's ``sync`` wait defers the writer's commit (to the next open or
    exit) instead of committing there: the loop thread waits on the lock that wait holds, so a
    commit started there never returned (a hung tests/test_views.py under pytest-xdist)."""
    import subprocess
    import sys

    path = tmp_path / "store"
    p = subprocess.run([sys.executable, "-c", _GC_INSIDE_SYNC, str(path)], capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0 and "returned" in p.stdout, p.stderr[-3000:]
    with ReplayBuffer.load_from(path, read_only=True) as r:  # committed at exit
        np.testing.assert_array_equal(r[:], np.full((7, 2), 0.5, np.float32))


@pytest.mark.parametrize("compressor", [None, "lz4"])
def test_writer_left_open_at_exit_is_committed(tmp_path: Path, compressor: str | None) -> None:
    """A writer still open when the interpreter exits is committed, compressed fields included:
    their commit encodes on Python's default executor, which is shut down before atexit hooks run
    (the rows since the last commit were lost), so the commit runs from a threading exit hook."""
    import subprocess
    import sys

    path = tmp_path / "store"
    code = ("import sys, numpy as np\nfrom gymnasium import spaces\nfrom trajstore import ReplayBuffer\n"
            "buf = ReplayBuffer.create(spaces.Box(-1, 1, (2,), np.float32), cache_path=sys.argv[1], "
            f"compressor={compressor!r}, commit_interval=1000)\n"
            "buf.extend(np.full((7, 2), 0.5, np.float32))\n")
    p = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and "Traceback" not in p.stderr, p.stderr[-3000:]
    with ReplayBuffer.load_from(path, read_only=True) as r:
        np.testing.assert_array_equal(r[:], np.full((7, 2), 0.5, np.float32))
