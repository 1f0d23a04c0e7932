"""Runs one section of docs/benchmarks.md at --quick sizes through scripts/bench_all.py (the
command that writes the real file) into a file under tmp_path, and returns that section's text.
Timings are printed, never asserted."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[1]


def bench_all() -> ModuleType:
    """scripts/bench_all.py as a module (scripts/ is not a package)."""
    if "bench_all" in sys.modules:
        return sys.modules["bench_all"]
    spec = importlib.util.spec_from_file_location("bench_all", ROOT / "scripts" / "bench_all.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules["bench_all"] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


def quick_section(name: str, tmp_path: Path, timeout: float = 900) -> str:
    """``python scripts/bench_all.py --quick --only NAME --out tmp_path/benchmarks.md`` (scratch
    stores under tmp_path); the section it wrote, checked to say what every section says."""
    md = tmp_path / "benchmarks.md"
    env = dict(os.environ, TMPDIR=str(tmp_path))
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_all.py"), "--quick", "--only", name,
                          "--out", str(md)], capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    ba = bench_all()
    text = ba.split(md.read_text())[name]
    assert text.startswith(f"## {ba.BY_NAME[name].title}\n") and "QUICK RUN" in text, text[:500]
    for what in ("Command: `python scripts/", "Machine: ", "Versions: Python ", "numpy ", "zarr ", "Runs: "):
        assert what in text, what
    return text
