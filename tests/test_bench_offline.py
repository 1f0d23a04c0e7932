"""scripts/bench_offline.py's section runs at --quick sizes through scripts/bench_all.py (timings
are printed, never asserted)."""

from __future__ import annotations

from pathlib import Path

import pytest
from _bench import quick_section


@pytest.mark.slow
def test_bench_offline_quick(tmp_path: Path) -> None:
    text = quick_section("offline", tmp_path)
    assert "| sequences x32 | 4 |" in text and '| transitions, output="numpy" | 4 |' in text
    for rows, batch in (("raw (17,)+(6,)+() f32", 256), ("raw (84,84,4) u8", 64), ("lz4 (84,84,4) u8", 64),
                        ("zstd (84,84,4) u8", 64), ("jpeg:90 per frame (84,84,4) u8", 64)):  # workers vs no workers
        assert f"| {rows} | {batch} | `RandomBatchSampler` + `collate_batch` | 2 |" in text
    assert "| (84,84,4) u8 (7 MiB, shared memory) |" in text  # the cost of moving one batch
    if "S3 (moto) DataLoader" in text:  # with moto[server] and s3fs: uniform random against chunk-ordered epochs
        assert "| `ChunkShuffleSampler` (`pool_chunks=4`) | 2 |" in text
        assert "| `RandomBatchSampler` + local chunk cache, warm folder | 0 |" in text
