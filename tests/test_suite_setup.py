"""The README's test command is what CI runs (issue 38): .ci/run sets up and tests exactly as the
README's second command says, and the options that command passes exist in the test extra."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def readme_test_command() -> list[str]:
    """The steps (split on ``&&``) of the README's command that installs the test extra."""
    block = re.search(r"```bash\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
    assert block, "README.md has no bash block at the top"
    lines = [line for line in block.group(1).splitlines() if '".[test]"' in line]
    assert len(lines) == 1, f"README.md's first bash block should have one test command: {lines}"
    return [step.strip() for step in lines[0].split("&&")]


def test_ci_runs_the_readme_test_command() -> None:
    steps = readme_test_command()
    ci = [line.strip() for line in (ROOT / ".ci/run").read_text().splitlines()
          if line.strip() and not line.lstrip().startswith("#")]
    # .ci/run: the same venv, the same install and the same pytest command, in that order
    assert [line for line in ci if line in steps] == steps, f".ci/run runs {ci}, the README {steps}"
    pytest_step = steps[-1]
    assert " -m pytest" in pytest_step


def test_the_readme_test_command_needs_only_the_test_extra() -> None:
    """``-n`` and ``--dist`` are pytest-xdist's: the test extra installs it."""
    pytest_step = readme_test_command()[-1]
    extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["test"]
    if " -n " in pytest_step or "--dist" in pytest_step:
        assert any(req.startswith("pytest-xdist") for req in extra), extra
        # test_kill_loops.py's total and test_docs.py's walkthroughs need each file in one worker
        assert "--dist loadfile" in pytest_step, pytest_step
    assert "--hypothesis-profile" not in pytest_step, "CI runs the default (derandomized) hypothesis profile"
