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
    # one round of fresh opens per workload (--quick: 2): the table's every row is still measured
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_trajectory.py"), "--quick", "--rounds", "1",
                          "--markdown", str(md), "--dir", str(tmp_path)], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    assert "Ratio 100,000 rows / 10,000 rows" in out.stdout
    assert "## Sequence sampling" in md.read_text()


def test_ring_fullness_quick() -> None:
    """A reader of a full ring that a writer fills flat out sees it full within 2 * guard rows."""
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "ring_fullness.py"), "--capacity", "1000",
                          "--seconds", "1.5", "--check"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "capacity     1,000: writer" in out.stdout and "0 sample errors" in out.stdout


def test_bench_images_quick(tmp_path: Path) -> None:
    """Every image read path against the memmap, each read workload in its own interpreter."""
    md = tmp_path / "bench.md"
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_images.py"), "--quick", "--rows", "1000",
                          "--sb3-sizes", "300", "--markdown", str(md)], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    for what in ("sample(256), numpy", "sample(256), torch vs numpy backend", "rb[idx], 256 random rows",
                 "get_slice(:)[idx]", "get_column(['obs'])[idx]", "get_sequences(256 anchors", "sample_sequences(256, 4)",
                 "ZarrReplayBuffer.sample(256), 300 transitions", "ZarrReplayBuffer.add, 300 transitions"):
        assert out.stdout.count(f"| {what}") == 2, what  # cold and steady rows
    assert "## Image rows: every read path against the memmap limit" in md.read_text()


def test_bench_import_quick(tmp_path: Path) -> None:
    md = tmp_path / "bench.md"
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_import.py"), "--runs", "1", "--markdown",
                          str(md)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "| cached |" in out.stdout and "## Import time" in md.read_text()


def test_bench_codecs_quick(tmp_path: Path) -> None:
    """The codec benchmark's smoke run: every table of its section, and main() returns the section."""
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_codecs.py"), "--quick", "--codecs", "jpeg:90",
                          "--dir", str(tmp_path)], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    for what in ("| photos | 84x84x3 | jpeg:90 | cold |", "| photos | 480x640x3 | jpeg:90 | steady |",
                 "Disk, 128 frames of 480x640x3 as jpeg:90", "| default | 2 | ", "| 1 | 2 | "):
        assert what in out.stdout, what
    assert list(tmp_path.iterdir()) == []  # its stores removed
