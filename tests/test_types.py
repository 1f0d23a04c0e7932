"""The package type-checks (issue 18): ``python -m mypy`` with the configuration in pyproject.toml
(``[tool.mypy]``: every function annotated; the spaces, storage, core and sampling layers stricter)
finds no error.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_package_type_checks(tmp_path: Path) -> None:
    if importlib.util.find_spec("mypy") is None:
        pytest.fail("mypy is not installed: install the test extra (pip install -e '.[test]'), which CI installs")
    proc = subprocess.run([sys.executable, "-m", "mypy", "--cache-dir", str(tmp_path / "mypy")], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"mypy found errors (exit {proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
