"""Unused names, undefined names and import order (ruff's F and I rules) stay clean in the package,
the benchmark scripts and the tests.

``ruff`` is pinned in the ``test`` extra: a newer ruff may add checks to these rules.  Fix what it
reports with ``python -m ruff check --select F,I --fix trajstore scripts tests``.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_ruff_f_and_i_rules_pass() -> None:
    pytest.importorskip("ruff", reason="ruff comes with the test extra (pip install -e '.[test]')")
    run = subprocess.run([sys.executable, "-m", "ruff", "check", "--select", "F,I", "--no-cache", "--output-format",
                          "concise", "trajstore", "scripts", "tests"], cwd=ROOT, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, f"ruff found problems (fix with --fix where it offers):\n{run.stdout}{run.stderr}"
