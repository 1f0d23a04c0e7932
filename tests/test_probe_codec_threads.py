"""scripts/probe_codec_threads.py runs (its numbers are printed, never asserted): the codec's own
2-thread ceiling that docs/performance-notes.md cites for the image codecs' "2 vs 1 thread"."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_probe_codec_threads_quick() -> None:
    pytest.importorskip("imagecodecs")
    run = subprocess.run([sys.executable, str(ROOT / "scripts" / "probe_codec_threads.py"), "--quick"],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    lines = run.stdout.strip().splitlines()
    assert lines[0].startswith("64 frames of 84x84x3")
    for codec in ("jpeg:90", "png", "webp-lossless"):
        rows = [ln for ln in lines if ln.startswith(codec + " ")]
        assert len(rows) == 2 and all("2 vs 1 thread" in r for r in rows), lines
