"""The benchmark scripts keep working (run small; timings are printed, never asserted)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_bench_core_quick(tmp_path: Path) -> None:
    md = tmp_path / "bench.md"
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_core.py"), "--quick", "--markdown", str(md),
                          "--dir", str(tmp_path)], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    assert "| sample(256) transitions (17,) f32 |" in out.stdout
    assert "## Core store" in md.read_text()


def test_bench_trajectory_quick(tmp_path: Path) -> None:
    md = tmp_path / "bench.md"
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_trajectory.py"), "--quick", "--markdown",
                          str(md), "--dir", str(tmp_path)], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    assert "Ratio 100,000 rows / 10,000 rows" in out.stdout
    assert "## Sequence sampling" in md.read_text()


def test_ring_fullness_quick() -> None:
    """A reader of a full ring that a writer fills flat out sees it full within 2 * guard rows."""
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "ring_fullness.py"), "--capacity", "1000",
                          "--seconds", "1.5", "--check"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "capacity     1,000: writer" in out.stdout and "0 sample errors" in out.stdout
