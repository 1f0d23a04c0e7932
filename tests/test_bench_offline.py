"""scripts/bench_offline.py keeps working (run small; timings are printed, never asserted)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_bench_offline_quick(tmp_path: Path) -> None:
    md = tmp_path / "bench.md"
    md.write_text("# Benchmarks\n\n## Other\n\nkept\n\n## Offline datasets (old)\n\nold\n")
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_offline.py"), "--quick", "--markdown", str(md),
                          "--dir", str(tmp_path)], capture_output=True, text=True, timeout=600, check=False)
    assert out.returncode == 0, out.stderr
    assert "| sequences x32 | 4 |" in out.stdout
    for rows in ("raw (17,)+(6,)+() f32", "raw (84,84,4) u8", "lz4 (84,84,4) u8"):  # workers vs no workers
        assert f"| {rows} | `RandomBatchSampler` + `collate_batch` | 2 |" in out.stdout
    assert "| (84,84,4) u8 (7 MiB, shared memory) |" in out.stdout  # the cost of moving one batch
    text = md.read_text()
    assert "## Offline datasets (scripts/bench_offline.py)" in text and "old\n" not in text and "kept" in text
