"""The benchmark scripts keep working (run small; timings are printed, never asserted).

bench_images.py, the longest (each read workload in an interpreter of its own), starts when this
module does, in the background, and runs beside the other scripts (one per core on 2 cores);
test_bench_images_quick then waits for it and checks its output.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Iterator

import pytest

ROOT = Path(__file__).resolve().parents[1]
IMAGES_TEST = "test_bench_images_quick"


@pytest.fixture(scope="module")
def images_run(request: pytest.FixtureRequest,
               tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[subprocess.Popen, Path] | None]:
    """bench_images.py --quick started at module setup when test_bench_images_quick is selected
    (its process and its folder: stdout, stderr, bench.md), else None; killed at teardown if still running."""
    if not any(getattr(i, "originalname", None) == IMAGES_TEST for i in request.session.items):
        yield None
        return
    work = tmp_path_factory.mktemp("bench_images")
    # output to files: a pipe nobody reads until the test runs could fill up and stall the script
    with open(work / "stdout", "w") as out, open(work / "stderr", "w") as err:
        proc = subprocess.Popen([sys.executable, str(ROOT / "scripts" / "bench_images.py"), "--quick", "--rows",
                                 "1000", "--sb3-sizes", "300", "--markdown", str(work / "bench.md")],
                                stdout=out, stderr=err, text=True)
    try:
        yield proc, work
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.fixture(autouse=True)
def _start_images_early(images_run: tuple[subprocess.Popen, Path] | None) -> None:
    """Every test of the module sets up images_run, so the run starts with the module's first test."""


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


def test_bench_images_quick(images_run: tuple[subprocess.Popen, Path] | None) -> None:
    """Every image read path against the memmap, each read workload in its own interpreter."""
    assert images_run is not None
    proc, work = images_run
    proc.wait(timeout=600)
    md = work / "bench.md"
    out = subprocess.CompletedProcess(proc.args, proc.returncode, (work / "stdout").read_text(),
                                      (work / "stderr").read_text())
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
