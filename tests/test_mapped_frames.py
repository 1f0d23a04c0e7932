"""Encoded chunks of local compressed fields stay memory-mapped within one process-wide bound
(issue 35, point 4): ``trajstore.storage.fields._rowblocks.MAPS``, not the per-field bound of
frames held in RAM (``chunked.MAX_ENCODED``, 4,096), which made random batches of a field of more
chunks map and unmap frames on every call.  Checked against ``/proc/self/maps``: the mappings of a
store's chunk files stay within the budget, across fields, and the budget is given back on close
and when a store is dropped unclosed.
"""

from __future__ import annotations

import gc
import sys
from pathlib import Path

import numpy as np
import pytest
from gymnasium.spaces import Box, Dict

from trajstore import ReplayBuffer
from trajstore.storage.fields import _rowblocks, chunked

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="counts mappings in /proc/self/maps")

N, C = 640, 32  # 20 chunks per field
SPACE = Dict({"a": Box(-np.inf, np.inf, (17,), np.float32), "b": Box(-np.inf, np.inf, (17,), np.float32)})


@pytest.fixture
def row_reads(monkeypatch):
    """Rows decoded from mapped frames at every field size (the default keeps small fields on
    whole cached chunks)."""
    monkeypatch.setattr(chunked, "ROW_READS_ABOVE_BYTES", 0)
    monkeypatch.setattr(chunked, "SMALL_BLOCK_ROW_READS_ABOVE_BYTES", 0)


def _rows(n: int) -> np.ndarray:
    """Row ``i``: ``i`` then a little noise (compressible enough to be decoded, not stored)."""
    x = np.repeat(np.arange(n, dtype=np.float32)[:, None], 17, axis=1)
    x[:, 1:] += np.random.default_rng(0).integers(0, 4, (n, 16)).astype(np.float32)
    return x


def _build(path: Path) -> np.ndarray:
    x = _rows(N)
    with ReplayBuffer.create(SPACE, cache_path=str(path), compressor="lz4", chunk_rows=C) as rb:
        rb.extend({"a": x, "b": x + 0.5})
    return x


def _maps(path: Path) -> int:
    """This process's mappings of files under ``path``."""
    root = str(path.resolve())
    with open("/proc/self/maps") as f:
        return sum(1 for line in f if root in line)


def _check(batch: dict, x: np.ndarray) -> None:
    rows = batch["a"][:, 0].astype(np.int64)
    np.testing.assert_array_equal(batch["a"], x[rows])
    np.testing.assert_array_equal(batch["b"], x[rows] + 0.5)


def test_local_frames_are_not_bounded_by_max_encoded(tmp_path, row_reads, monkeypatch):
    """Frames held in RAM are bounded per field; a field's mapped frames only by the process-wide budget."""
    monkeypatch.setattr(chunked, "MAX_ENCODED", 2)
    x = _build(tmp_path / "s")
    with ReplayBuffer.load_from(str(tmp_path / "s"), read_only=True) as rb:
        g = np.random.default_rng(1)
        for _ in range(40):
            _check(rb.sample(64, rng=g), x)
        assert _maps(tmp_path / "s") == 2 * N // C  # every frame of both fields stays mapped
    assert _maps(tmp_path / "s") == 0


def test_mapped_frames_stay_within_the_budget(tmp_path, row_reads, monkeypatch):
    """Two fields of 20 chunks each share a budget of 5 frames: never more mapped after a read, the
    values right, the budget given back on close."""
    budget = _rowblocks.MapBudget(5, 1 << 40)
    monkeypatch.setattr(_rowblocks, "MAPS", budget)
    x = _build(tmp_path / "s")
    with ReplayBuffer.load_from(str(tmp_path / "s"), read_only=True) as rb:
        g = np.random.default_rng(2)
        for _ in range(30):
            _check(rb.sample(16, rng=g), x)
            assert budget.frames <= 5
            assert _maps(tmp_path / "s") == budget.frames  # (frames of the read itself are unmapped after it)
        assert budget.frames > 0
    assert (budget.frames, budget.nbytes) == (0, 0)
    assert _maps(tmp_path / "s") == 0


def test_budget_of_bytes_and_an_unclosed_store(tmp_path, row_reads, monkeypatch):
    """The address-space bound holds too, and a store dropped without close gives its frames back."""
    x = _build(tmp_path / "s")
    frame = max(p.stat().st_size for p in (tmp_path / "s").rglob("c/*/0"))
    budget = _rowblocks.MapBudget(1000, 3 * frame)
    monkeypatch.setattr(_rowblocks, "MAPS", budget)
    rb = ReplayBuffer.load_from(str(tmp_path / "s"), read_only=True)
    g = np.random.default_rng(3)
    for _ in range(20):
        _check(rb.sample(16, rng=g), x)
        assert budget.nbytes <= 3 * frame and _maps(tmp_path / "s") == budget.frames
    assert budget.frames > 0
    del rb
    gc.collect()
    assert (budget.frames, budget.nbytes) == (0, 0)
