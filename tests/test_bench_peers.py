"""scripts/bench_peers.py runs end to end at --quick sizes and writes its table (timings are
printed, never asserted)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _have(mod: str) -> bool:
    return importlib.util.find_spec(mod) is not None


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_bench_peers_quick(tmp_path: Path) -> None:
    md = tmp_path / "benchmarks.md"
    md.write_text("# Benchmarks\n\n## Other section (scripts/other.py)\n\nkept\n")
    png = tmp_path / "peers.png"
    # 40 calls and 0.25 s per system and workload (--quick: 250 and 1 s): every row of the table is
    # still measured, and the sizes the rows below name are --quick's
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_peers.py"), "--quick", "--calls", "40",
                          "--budget", "0.25", "--out", str(md), "--png", str(png), "--dir", str(tmp_path)],
                         capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    text = md.read_text()
    assert "## Other section (scripts/other.py)\n\nkept" in text  # other scripts' sections stay
    assert text.count("<!-- bench_peers: begin -->") == 1 and "QUICK RUN" in text
    assert "Command: `python scripts/bench_peers.py --quick" in text and "Machine: " in text and "Versions: " in text
    assert png.stat().st_size > 0
    systems = ["trajstore raw", "trajstore lz4", "numpy memmap", "zarr-python"]
    systems += ["SB3"] if _have("stable_baselines3") else []
    systems += ["TorchRL"] if _have("torchrl") and _have("tensordict") else []
    systems += ["h5py"] if _have("h5py") else []
    for n in ("1,000", "10,000", "200"):
        for s in systems:
            assert f"| {n} | {s} |" in text, (n, s)
    for wl in ("append 17 f32, batch 1", "append 17 f32, batch 8", "append 84x84x4 u8, batch 1",
               "append 84x84x4 u8, batch 8"):
        for s in [s for s in systems if s != "zarr-python"]:
            assert f"| {wl} | {s} |" in text, (wl, s)
    for s in ["trajstore raw", "numpy memmap"] + (["TorchRL"] if "TorchRL" in systems else []):
        assert f"| 20,000 | {s} |" in text, s
    # a second run replaces the section instead of adding one
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_peers.py"), "--quick", "--out", str(md),
                          "--png", str(png), "--dir", str(tmp_path), "--skip", "append,sample,sequences"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert md.read_text().count("<!-- bench_peers: begin -->") == 1
