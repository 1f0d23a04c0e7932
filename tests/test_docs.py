"""Every fenced ```python block of README.md runs (issue 13: "every documented example runs").

The blocks of one README section (the text under one ``#``/``##``/``###`` heading up to the next
heading) run in order in one namespace, so a later block may use names from an earlier block of the
same section, but never names from another section: each section is self-contained. Each section
runs in a fresh interpreter (a subprocess, with a timeout) whose working directory is a fresh
``tmp_path``, so relative paths such as ``runs/buffer`` land in a temporary folder. Blocks are
compiled with their README line numbers, so a traceback points at the README line that failed; any
exception fails the test. Tests are parametrized by section heading.

Substitutions (the only changes made to the README code before it runs):

- ``.learn(<int>`` (e.g. ``model.learn(10_000)``) becomes ``.learn(300`` so training examples
  finish in seconds (SAC still passes its 100 ``learning_starts`` steps and trains).
- A block that contains an ``s3://`` URL is skipped with an explicit reason (it would need a
  real bucket; the remote code paths are tested against moto in tests/test_remote.py). No python
  block of README.md contains one today; the ``s3://`` commands are in ```bash blocks.

```bash blocks are not run (in particular not the two install commands at the top).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parent.parent / "README.md"
LEARN_STEPS = 300
TIMEOUT_S = 120
SLOW_SECTIONS = {"stable-baselines3"}  # trains SAC for a few hundred steps

_HEADING = re.compile(r"^#{1,6}\s+(.*\S)\s*$")
_FENCE = re.compile(r"^```(\S*)\s*$")
_LEARN = re.compile(r"\.learn\(\s*[0-9_]+")


def readme_sections(text: str) -> dict[str, list[tuple[int, str]]]:
    """Heading -> [(first code line number, code)] of its ```python blocks, in README order."""
    sections: dict[str, list[tuple[int, str]]] = {}
    heading = "(top)"
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        fence = _FENCE.match(lines[i])
        if fence:
            lang, start, body = fence.group(1).lower(), i + 2, []
            i += 1
            while i < len(lines) and not lines[i].startswith("```"):
                body.append(lines[i])
                i += 1
            if i == len(lines):
                raise AssertionError(f"README.md: unclosed code fence at line {start - 1}")
            if lang in ("python", "py"):
                sections.setdefault(heading, []).append((start, "\n".join(body) + "\n"))
        else:
            m = _HEADING.match(lines[i])
            if m:
                heading = m.group(1)
                assert heading not in sections, f"README.md: duplicate heading {heading!r}"
        i += 1
    return sections


SECTIONS = readme_sections(README.read_text(encoding="utf-8"))


def substitute(code: str) -> str:
    return _LEARN.sub(f".learn({LEARN_STEPS}", code)


_RUNNER = r"""
import json, sys
blocks = json.load(open(sys.argv[1]))
ns = {"__name__": "__main__"}
for line, code in blocks:
    # pad so the README line numbers appear in tracebacks
    exec(compile("\n" * (line - 1) + code, "README.md", "exec"), ns)
"""


def run_blocks(blocks: list[tuple[int, str]], cwd: Path) -> subprocess.CompletedProcess:
    """Run the blocks in order in one namespace, in a fresh interpreter whose working directory is cwd."""
    (cwd / "_blocks.json").write_text(json.dumps(blocks))
    (cwd / "_run.py").write_text(_RUNNER)
    return subprocess.run([sys.executable, "_run.py", "_blocks.json"], check=False, cwd=cwd,
                          capture_output=True, text=True, timeout=TIMEOUT_S)


def test_readme_has_python_examples() -> None:
    assert {"Quick start", "Offline RL datasets", "stable-baselines3"} <= set(SECTIONS)


@pytest.mark.parametrize("heading", [
    pytest.param(h, marks=[pytest.mark.slow] if h in SLOW_SECTIONS else [], id=h) for h in SECTIONS
])
def test_readme_section_runs(heading: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    blocks = SECTIONS[heading]
    for line, code in blocks:
        if "s3://" in code:
            pytest.skip(f"README.md line {line}: the block uses an s3:// URL (needs a real bucket; "
                        "remote stores are tested against moto in tests/test_remote.py)")
    monkeypatch.chdir(tmp_path)
    try:
        proc = run_blocks([(line, substitute(code)) for line, code in blocks], tmp_path)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"README section {heading!r} did not finish within {TIMEOUT_S} s\n{e.stderr or ''}")
    assert proc.returncode == 0, (
        f"README section {heading!r} failed (exit {proc.returncode}):\n{proc.stderr[-6000:]}")


def test_substitutions() -> None:
    assert substitute("model.learn(10_000)\nm.learn( 5000, progress_bar=True)") == (
        f"model.learn({LEARN_STEPS})\nm.learn({LEARN_STEPS}, progress_bar=True)")
    secs = readme_sections("# a\n```python\nx = 1\n```\n## b\n```bash\nls\n```\n```python\ny = 2\n```\n")
    assert secs == {"a": [(3, "x = 1\n")], "b": [(10, "y = 2\n")]}


def test_a_raising_block_fails(tmp_path: Path) -> None:
    """Names carry over between the blocks of a section, and an exception exits non-zero with the
    README line in the traceback."""
    ok = run_blocks([(3, "x = 41\n"), (7, "assert x + 1 == 42\n")], tmp_path)
    assert ok.returncode == 0, ok.stderr
    bad = run_blocks([(3, "x = 1\n"), (7, "y = x\nraise ValueError('boom')\n")], tmp_path)
    assert bad.returncode != 0
    assert 'File "README.md", line 8' in bad.stderr and "ValueError: boom" in bad.stderr
