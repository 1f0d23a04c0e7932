"""scripts/bench_peers.py's section runs end to end at --quick sizes through scripts/bench_all.py
(timings are printed, never asserted)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
from _bench import quick_section


def _have(mod: str) -> bool:
    return importlib.util.find_spec(mod) is not None


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_bench_peers_quick(tmp_path: Path) -> None:
    # bench_all's quick arguments: 40 calls and 0.25 s per system and workload; every row of the
    # table is still measured, and the sizes the rows below name are --quick's
    text = quick_section("peers", tmp_path)
    assert (tmp_path / "bench_peers.png").stat().st_size > 0  # the plot lands beside the file written
    assert "### Key ratios: trajstore raw `sample(256)`\n\n- vector (17,) f32, 1,000 rows:" in text
    systems = ["trajstore raw", "trajstore lz4", "numpy memmap", "zarr-python"]
    systems += ["SB3"] if _have("stable_baselines3") else []
    systems += ["TorchRL"] if _have("torchrl") and _have("tensordict") else []
    systems += ["h5py"] if _have("h5py") else []
    for n in ("1,000", "10,000", "200"):
        for s in systems:
            assert f"| {n} | {s} |" in text, (n, s)
    for wl in ("append one 17 f32 array (no other field), 1 row per call",
               "append one 17 f32 array (no other field), 8 rows per call",
               "append one 84x84x4 u8 array (no other field), 1 row per call",
               "append one 84x84x4 u8 array (no other field), 8 rows per call"):
        for s in [s for s in systems if s != "zarr-python"]:
            assert f"| {wl} | {s} |" in text, (wl, s)
    for s in ["trajstore raw", "numpy memmap"] + (["TorchRL"] if "TorchRL" in systems else []):
        assert f"| 20,000 | {s} |" in text, s
